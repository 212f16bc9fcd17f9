"""The in-serving byte check's judge (``nixlkv.serving.bytecheck``) and the dumps it reads.

Pages are built here from a model's per-token, per-head KV, with nothing of nixlkv's geometry or
plans: the judge must accept D pages that hold what P's held where each layer's spec needs it,
and name every way a plan could have put the wrong bytes there."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nixlkv.serving.bytecheck import (
    Dump, element_size, held_heads, judge_dir, judge_load, needed_from, read_dir, run_control, token_rows,
)
from nixlkv.vllm.kvdump import dump_request, load_dump

C = 8  # bytes per token and head: K 4 then V 4 (bfloat16, head size 2)
ES = 2


def model_kv(tokens: int, heads: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(tokens, heads, C), dtype=np.uint8)


def page_rows(kv: np.ndarray, first_token: int, rows: int, block: int, heads: list[int], interior: str | None) -> np.ndarray:
    """``rows`` pages of ``block`` tokens from ``first_token`` on, holding ``heads`` of ``kv``."""
    out = np.zeros((rows, len(heads), block, C), dtype=np.uint8)
    for r in range(rows):
        for j, h in enumerate(heads):
            for s in range(block):
                t = first_token + r * block + s
                if t < kv.shape[0]:
                    out[r, j, s] = kv[t, h]
    if interior == "k_channel_major":  # per head: keys as [channel, token, element], then values [token, C/2]
        keys = out[..., : C // 2].reshape(rows, len(heads), block, C // 2 // ES, ES).transpose(0, 1, 3, 2, 4)
        values = out[..., C // 2:]
        flat = np.concatenate([keys.reshape(rows, len(heads), -1), values.reshape(rows, len(heads), -1)], axis=2)
        out = flat.reshape(rows, len(heads), block, C)
    return out


def dump(role: str, rank: int, tp: int, kv: np.ndarray, ids: list[int], block: int, num_tokens: int, total: int,
         facts: dict | None = None, interior: str | None = None, name: str = "l0", local_hit: int = 0) -> Dump:
    """One rank's dump: ``ids`` is the request's block list from token 0, as vLLM's KV manager holds it."""
    local = total // tp if total >= tp else 1
    heads = held_heads(rank, tp, local, total).tolist()
    raw = page_rows(kv, 0, len(ids), block, heads, interior)
    for i, b in enumerate(ids):
        if b == 0:
            raw[i] = 0xEE  # the null block holds anything
    meta = {"role": role, "engine_id": role[0].upper(), "tp_rank": rank, "tp_size": tp, "num_tokens": num_tokens,
            "prefill_request_id": "r", "request_id": "r", "local_hit": local_hit,
            "groups": [{"block_ids": ids, "block_size": block, "transfer": True}],
            "layers": {name: {"group": 0, "kernel_blocks_per_block": 1}}}
    record = {"layers": {name: {"spec": "SlidingWindowSpec" if (facts or {}).get("sliding_window") else "FullAttentionSpec",
                                "facts": facts or {}, "hints": {"total_kv_heads": total, "page_interior": interior},
                                "view": {"shape": [64, len(heads), block, C // ES]}}}}
    return Dump(meta, {name: raw}, record)


def test_token_rows_reads_k_channel_major_pages_back_per_token() -> None:
    kv = model_kv(12, 2)
    for interior in (None, "k_channel_major"):
        raw = page_rows(kv, 0, 3, 4, [0, 1], interior)
        assert np.array_equal(token_rows(raw, interior, ES), kv)
    raw = page_rows(kv, 0, 3, 4, [0, 1], "k_channel_major")
    assert not np.array_equal(token_rows(raw, None, ES), kv)  # read as plain, the same page is other bytes
    with pytest.raises(ValueError, match="page interior"):
        token_rows(raw, "sideways", ES)


def test_heads_by_tp_sharding_and_the_tokens_each_spec_needs() -> None:
    assert held_heads(1, 2, 4, 8).tolist() == [4, 5, 6, 7]
    assert held_heads(3, 4, 1, 2).tolist() == [1]  # replicated: ranks 2 and 3 hold head 1
    assert held_heads(0, 2, 1, 1).tolist() == [0]  # MLA's one latent on every rank
    assert held_heads(0, 2, 3, 8) is None
    assert needed_from({"facts": {}}, 100) == 0
    assert needed_from({"facts": {"sliding_window": 64}}, 100) == 37
    assert needed_from({"facts": {"attention_chunk_size": 64}}, 100) == 64


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("interior", [None, "k_channel_major"])
def test_a_faithful_load_passes_across_tp_and_block_sizes(p_tp: int, d_tp: int, interior: str | None) -> None:
    kv = model_kv(70, 4)
    q = 69  # D loads all but the last prompt token
    p = [dump("prefill", r, p_tp, kv, [5, 9, 3, 20, 21], 16, 70, 4, interior=interior) for r in range(p_tp)]
    d = [dump("decode", r, d_tp, kv, [7, 2, 8, 11, 12, 13, 30, 31, 32], 8, q, 4, interior=interior)
         for r in range(d_tp)]
    v = judge_load("r", p, d)
    assert v.ok, v.shown
    assert v.tokens == q * 4 and v.layers == d_tp


def _fails(p: list[Dump], d: list[Dump], text: str) -> None:
    v = judge_load("r", p, d)
    assert not v.ok and any(text in s for s in v.shown), v.shown


def test_every_kind_of_wrong_load_is_named() -> None:
    kv = model_kv(40, 2)
    p = [dump("prefill", r, 2, kv, [5, 9, 3], 16, 40, 2) for r in range(2)]
    good = dump("decode", 0, 1, kv, [7, 2, 8], 16, 39, 2)
    assert judge_load("r", p, [good]).ok
    # the heads the other way round (a plan that pairs P rank 0 with D's second head)
    swapped = dump("decode", 0, 1, kv, [7, 2, 8], 16, 39, 2)
    swapped.layers["l0"] = swapped.layers["l0"][:, ::-1].copy()
    _fails(p, [swapped], "head 0")
    # the blocks the other way round
    shifted = dump("decode", 0, 1, kv, [7, 2, 8], 16, 39, 2)
    shifted.layers["l0"] = shifted.layers["l0"][[1, 0, 2]].copy()
    _fails(p, [shifted], "needed tokens differ")
    # one byte of the last loaded token
    flipped = dump("decode", 0, 1, kv, [7, 2, 8], 16, 39, 2)
    flipped.layers["l0"][2, 1, 38 - 32, C - 1] ^= 1
    _fails(p, [flipped], "head 1: 1 of 39 needed tokens differ")
    # D's block for a needed token is the null block; P's is
    _fails(p, [dump("decode", 0, 1, kv, [7, 0, 8], 16, 39, 2)], "in null blocks")
    nulled = [dump("prefill", r, 2, kv, [5, 0, 3], 16, 40, 2) for r in range(2)]
    _fails(nulled, [good], "no longer held tokens")
    # a load whose token count D did not know is not judged, and fails
    unknown = dump("decode", 0, 1, kv, [7, 2, 8], 16, 39, 2)
    unknown.meta["num_tokens"] = -1
    v = judge_load("r", p, [unknown])
    assert not v.ok and v.layers == 0 and v.unjudged == {"l0": "D's token count unknown"}
    # D claims more tokens than P computed
    _fails(p, [dump("decode", 0, 1, model_kv(48, 2), [7, 2, 8], 16, 41, 2)], "no longer held tokens [40]")


def test_a_window_needs_only_its_last_tokens_and_a_prefix_hit_is_not_judged() -> None:
    kv, window = model_kv(100, 2), {"sliding_window": 16}
    p = [dump("prefill", 0, 1, kv, [0, 0, 0, 0, 0, 6, 7], 16, 100, 2, facts=window)]  # P freed blocks out of the window
    d = dump("decode", 0, 1, kv, [0, 0, 0, 0, 0, 9, 10], 16, 99, 2, facts=window)
    v = judge_load("r", p, [d])
    assert v.ok and v.tokens == 15 * 2, v.shown
    d.layers["l0"][5, :, 3] ^= 0xFF  # token 83: out of the window of token 99 (84..99), never read
    assert judge_load("r", p, [d]).ok
    d.layers["l0"][5, :, 4] ^= 0xFF  # token 84: inside it
    _fails(p, [d], "first at [84]")
    # D hit 64 tokens in its own prefix cache and loaded the rest: its own blocks are not P's to judge
    full = [dump("prefill", 0, 1, kv, [1, 2, 3, 4, 5, 6, 7], 16, 100, 2)]
    mine = dump("decode", 0, 1, kv, [17, 18, 19, 20, 21, 22, 23], 16, 99, 2, local_hit=64)
    mine.layers["l0"][:4] ^= 0x3C  # D computed these itself: bits of its own
    v = judge_load("r", full, [mine])
    assert v.ok and v.tokens == (99 - 64) * 2
    mine.layers["l0"][4, 0, 0] ^= 0x3C  # token 64, the first one loaded
    _fails(full, [mine], "first at [64]")
    # a table longer than the tokens (D's block for the token it computes itself) is no shift
    longer = dump("decode", 0, 1, kv, [17, 18, 19, 20, 21, 22, 23, 24], 16, 99, 2)
    assert judge_load("r", full, [longer]).ok


def _config(block: int, num_blocks: int, layers: list[str]) -> SimpleNamespace:
    group = SimpleNamespace(layer_names=layers, kv_cache_spec=SimpleNamespace(block_size=block))
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[group])


def _write(tmp: Path, role: str, rank: int, tp: int, kv: np.ndarray, ids: list[int], tokens: int,
           extra: dict | None = None) -> None:
    """One worker's capture record and its dump of one request, from a real torch view (kernel
    blocks of 8 tokens, two per 16-token block)."""
    heads = held_heads(rank, tp, 2 // tp, 2).tolist()
    view = torch.zeros((2 * 32, len(heads), 8, C // ES), dtype=torch.bfloat16)
    raw = view.view(torch.uint8)
    for i, b in enumerate(ids):
        rows = torch.from_numpy(page_rows(kv, 16 * i, 2, 8, heads, None))
        raw[2 * b: 2 * b + 2] = rows
    engine = role[0].upper()
    record = {"engine_id": engine, "tp_rank": rank, "tp_size": tp,
              "layers": {"l0": {"spec": "FullAttentionSpec", "facts": {}, "hints": {"total_kv_heads": 2},
                                "view": {"shape": list(view.shape)}}}}
    (tmp / f"{engine}-tp{rank}.json").write_text(json.dumps(record))
    dump_request(tmp, role=role, engine_id=engine, tp_rank=rank, tp_size=tp, prefill_request_id="cmpl-1/x",
                 request_id="d-1" if role == "decode" else "cmpl-1/x", num_tokens=tokens, block_ids=[ids],
                 kv_cache_config=_config(16, 32, ["l0"]), kv_caches={"l0": view}, extra=extra)


def test_dumps_of_kernel_blocks_are_judged_from_a_directory_with_controls(tmp_path: Path) -> None:
    kv = model_kv(40, 2)
    for r in range(2):
        _write(tmp_path, "prefill", r, 2, kv, [4, 9, 3], 40)
    _write(tmp_path, "decode", 0, 1, kv, [7, 2, 8], 39)
    files = sorted(p.name for p in (tmp_path / "requests" / "cmpl-1_x").iterdir())
    assert files == ["decode-D-tp0.npz", "prefill-P-tp0.npz", "prefill-P-tp1.npz"]
    meta, layers = load_dump(tmp_path / "requests" / "cmpl-1_x" / "decode-D-tp0.npz")
    assert meta["layers"]["l0"]["kernel_blocks_per_block"] == 2 and layers["l0"].shape == (6, 2, 8, C)
    v = judge_dir(tmp_path)
    s = v.summary()
    assert v.ok and s["token_heads"] == 39 * 2 and s["control"] == {"request": "cmpl-1/x", "flip byte": True,
                                                                     "swap blocks": True, "bites": True}, s
    # D read P's blocks in the wrong order: the same directory, judged, fails
    _write(tmp_path, "decode", 0, 1, kv, [2, 7, 8], 39)
    kv_wrong = np.concatenate([kv[16:32], kv[:16], kv[32:]])
    _write(tmp_path, "decode", 0, 1, kv_wrong, [7, 2, 8], 39)
    assert not judge_dir(tmp_path).ok
    # a decode dump whose prefill ranks did not all dump is not judged as passed
    _write(tmp_path, "decode", 0, 1, kv, [7, 2, 8], 39)
    (tmp_path / "requests" / "cmpl-1_x" / "prefill-P-tp1.npz").unlink()
    v = judge_dir(tmp_path)
    assert not v.ok and v.missing == ["cmpl-1/x"]


def _pair(tmp: Path, kv: np.ndarray) -> None:
    for r in range(2):
        _write(tmp, "prefill", r, 2, kv, [4, 9, 3], 40)


def test_nothing_passes_by_absence(tmp_path: Path) -> None:
    """A load D claimed is judged from every decode rank's dump: one without a dump, one whose dump
    could not be written, one that failed, each fails the verdict by name."""
    from nixlkv.vllm.kvdump import write_expectation, write_failure

    kv = model_kv(40, 2)
    _pair(tmp_path, kv)
    write_expectation(tmp_path, "cmpl-1/x", "D", "d-1", 1)
    v = judge_dir(tmp_path)
    assert not v.ok and v.missing == ["cmpl-1/x (decode D: dumps of ranks [] of 1)"], v.summary()
    _write(tmp_path, "decode", 0, 1, kv, [7, 2, 8], 39)
    assert judge_dir(tmp_path).ok  # the control: the dump there, the same claim passes
    write_expectation(tmp_path, "cmpl-1/x", "D", "d-1", 2)  # D at TP 2: rank 1's dump is missing
    assert judge_dir(tmp_path).missing == ["cmpl-1/x (decode D: dumps of ranks [0] of 2)"]
    write_failure(tmp_path, "cmpl-1/x", "decode", "D", 1, "d-1", "the dump could not be written: OSError: full")
    v = judge_dir(tmp_path)
    assert not v.ok and not v.missing and v.failed == [
        "cmpl-1/x (decode D rank 1): the dump could not be written: OSError: full"]
    assert not judge_dir(tmp_path, allow_failed=True).ok  # a dump that could not be written is never allowed
    write_failure(tmp_path, "cmpl-1/x", "decode", "D", 1, "d-1", "the load failed: READ error")
    assert not judge_dir(tmp_path).ok and judge_dir(tmp_path, allow_failed=True).ok
    # a layer the judge cannot read fails the load
    unreadable = dump("decode", 0, 1, kv, [7, 2, 8], 16, 39, 2)
    unreadable.record["layers"]["l0"]["hints"]["total_kv_heads"] = 3
    v = judge_load("r", [dump("prefill", 0, 1, kv, [5, 9, 3], 16, 40, 2)], [unreadable])
    assert not v.ok and v.unjudged == {"l0": "heads not a TP sharding of the model's"}


def test_graded_controls_must_each_be_rejected(tmp_path: Path) -> None:
    """A load D damaged on purpose (its dump says what) is a control: the verdict passes only if the
    judge rejects it; a control that damaged nothing, or that the judge passes, fails the verdict."""
    kv = model_kv(40, 2)
    _pair(tmp_path, kv)
    damaged = kv.copy()
    damaged[20, 1] = 0  # one token of one head
    _write(tmp_path, "decode", 0, 1, damaged, [7, 2, 8], 39, extra={"damage": {"kind": "token", "tokens": [20, 21]}})
    v = judge_dir(tmp_path)
    assert not v.loads and len(v.controls) == 1 and v.controls_ok
    s = v.summary()
    assert s["graded_controls"][0]["rejected"] and s["graded_controls"][0]["kind"] == "token", s
    assert "first at [20]" in s["graded_controls"][0]["why"]
    assert not v.ok  # controls alone judge no plain load
    _write(tmp_path, "decode", 0, 1, kv, [7, 2, 8], 39, extra={"damage": {"kind": "token", "tokens": [20, 21]}})
    assert not judge_dir(tmp_path).controls_ok  # the control did not change a needed byte: the check is blind
    _write(tmp_path, "decode", 0, 1, kv, [7, 2, 8], 39, extra={"damage": {"kind": "head", "skipped": "no heads"}})
    assert not judge_dir(tmp_path).controls_ok


# ---------------------------------------------------------------- real connectors (pd_harness)
RUNS = {
    "gemma4 P2->D4: windows, per-layer heads, replicated full-layer heads": (("gemma4", 2, 4), {}),
    "llama P4->D2, blocks 32 -> 16, D's own prefix hit of 48 tokens": (("llama", 4, 2, 32, 16), {0: 48}),
    "MLA P2->D1: the latent from one rank": (("deepseek-mla", 2, 1), {}),
}


@pytest.mark.nixl
@pytest.mark.vllm
@pytest.mark.parametrize("name", RUNS)
def test_the_judge_passes_what_the_connector_loads_through_vllms_scheduler(name: str, tmp_path: Path) -> None:
    """Both engines dump through the connector (``dump_kv_dir``) while vLLM's real scheduler runs
    them; ``run_pd`` checks every D byte with the oracle, and the judge, knowing nothing of the
    oracle or the plan, must pass every load, and reject its damaged copies (its control)."""
    from pd_harness import PDCase, run_pd

    case, warm = RUNS[name]
    prompts = {"a-0": 100, "b-1": 40, "c-2": 17}
    run = run_pd(PDCase(*case), prompts, d_warm=warm, extra={"dump_kv_dir": str(tmp_path)})
    v = judge_dir(tmp_path)
    s = v.summary()
    assert v.ok and s["loads"] == len(prompts) and not s["unjudged"], s
    assert s["control"]["bites"], s
    d_tp, total = case[2], 0
    for load in v.loads:
        assert load.tokens > 0 and load.layers >= d_tp, load
        total += load.tokens
    assert total == s["token_heads"] and set(run.loaded_tokens) == set(prompts)


@pytest.mark.nixl
@pytest.mark.vllm
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1)])
def test_mamba_states_are_judged_per_channel_and_unit(p_tp: int, d_tp: int, tmp_path: Path) -> None:
    """Nemotron-H-like (Mamba2, one B/C group held whole by every rank): every conv channel and SSM
    head of D's running state must be P's for the same global one, after the same tokens; a state
    whose B and C columns trade places (what reading them at TP-scaled offsets does) is rejected,
    as is a P whose state is one token further on."""
    from pd_harness import PDCase, run_pd

    run_pd(PDCase("nemotron-h", p_tp, d_tp), {"a-0": 100, "b-1": 40}, extra={"dump_kv_dir": str(tmp_path)})
    prefill, decode = read_dir(tmp_path)
    v = judge_dir(tmp_path)
    s = v.summary()
    assert v.ok and not s["unjudged"] and s["token_heads"] > 0, s
    # per request and layer, over the decode ranks: x's 128 conv channels and 8 SSM heads split,
    # B's and C's 16 channels each held whole by every rank
    assert s["state_units"] == 2 * 2 * (128 + 32 * d_tp + 8), s
    ds = decode["a-0"]["D"]
    name = next(n for n in ds[0].layers if "Mamba" in ds[0].record["layers"][n]["spec"])
    assert judge_load("a-0", prefill["a-0"], ds).ok
    facts = ds[0].record["layers"][name]["facts"]
    (channels, cols), dt = facts["shapes"][0], element_size(facts["dtypes"][0])
    x = 128 // d_tp  # this rank's x channels; B then C follow, 16 each
    page = ds[0].layers[name].copy()
    row = page.reshape(page.shape[0], -1)[-1]
    conv = row[: channels * cols * dt].reshape(channels, cols * dt)
    b, c = conv[x: x + 16].copy(), conv[x + 16: x + 32].copy()
    conv[x: x + 16], conv[x + 16: x + 32] = c, b
    swapped = [Dump(ds[0].meta, {**ds[0].layers, name: page}, ds[0].record), *ds[1:]]
    bad = judge_load("a-0", prefill["a-0"], swapped)
    assert not bad.ok and any("32 of" in t and "conv channels differ" in t for t in bad.shown), bad.shown
    later = [Dump({**p.meta, "num_tokens": p.meta["num_tokens"] + 1}, p.layers, p.record) for p in prefill["a-0"]]
    bad = judge_load("a-0", later, ds)
    assert not bad.ok and any("P's state is after 100 tokens, D goes on from 99" in t for t in bad.shown), bad.shown

    def states(dumps: list[Dump]) -> list[Dump]:  # a model of state layers only (tiny-mamba2's kind)
        return [Dump(x.meta, {n: a for n, a in x.layers.items() if "Mamba" in x.record["layers"][n]["spec"]}, x.record)
                for x in dumps]

    p_only = {r: states(v) for r, v in prefill.items()}
    d_only = {r: {e: states(v) for e, v in engines.items()} for r, engines in decode.items()}
    loads = [judge_load(r, p_only[r], d_only[r]["D"]) for r in d_only]
    assert all(x.ok and x.state_units and not x.tokens for x in loads)
    assert run_control(p_only, d_only, loads) == {"request": "a-0", "flip byte": True, "swap blocks": None, "bites": True}


@pytest.mark.nixl
def test_a_dump_that_cannot_be_written_never_fails_the_request(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ``dump_kv_dir`` that cannot be written at registration stops the engine naming the key;
    one that fails later (here: ``requests`` became a file) is logged by every worker, and the
    request is read and freed as without it, byte-exact."""
    import logging

    from nixlkv.testing import oracle
    from nixlkv.vllm.config import ConfigError, ConnectorConfig
    from nixlkv.vllm.kvdump import DumpOrder
    from nixlkv.vllm.metadata import NixlkvMetadata

    from connector_helpers import Engine, blocks, fa_scenario
    from test_connector_worker import drive, recv

    sc = fa_scenario(2, 1, num_tokens=40)
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ConfigError, match="dump_kv_dir .*a-file/kv' cannot be written"):
        Engine(sc, "decode", "D", config=ConnectorConfig(dump_kv_dir=str(tmp_path / "a-file" / "kv")))
    config = ConnectorConfig(dump_kv_dir=str(tmp_path / "kv"))
    p = Engine(sc, "prefill", "P", serve=True, config=config)
    d = Engine(sc, "decode", "D", config=config)
    (tmp_path / "kv" / "requests").write_text("now a file")
    try:
        p_ids, d_ids = [5, 9, 3], [7, 2, 8]
        for r in p.ranks:
            oracle.fill_prefill(r, blocks(r, p_ids), seed=3)
        for r in d.ranks:
            oracle.fill_decode(r)
        with caplog.at_level(logging.WARNING, logger="nixlkv"):
            for w in p.workers:
                w.start_load_kv(NixlkvMetadata(reqs_to_send={"req-1": 30.0},
                                               reqs_to_dump={"req-1": DumpOrder("prefill", "req-1", (p_ids,), 40)}))
            req = recv(p, "req-1", d_ids, p_ids)
            req.num_tokens = 40
            d.workers[0].start_load_kv(NixlkvMetadata(reqs_to_recv={"req-1": req}, reqs_to_dump={
                "req-1": DumpOrder("decode", "req-1", (d_ids,), 40)}))
            done_recv, failed, done_send = drive(p, d, {"req-1"})
        assert done_recv[0] == {"req-1"} and not any(failed.values()) and all(v == {"req-1"} for v in done_send.values())
        assert oracle.compare(d.ranks[0], oracle.expected_decode(d.ranks[0], blocks(d.ranks[0], d_ids), seed=3)) is None
        dumps = [r for r in caplog.records if "could not dump the KV blocks of req=req-1" in r.getMessage()]
        assert len(dumps) == 3, [r.getMessage() for r in caplog.records]  # two prefill ranks, one decode rank
    finally:
        p.close()
        d.close()


def test_the_summary_line_says_what_failed_and_what_was_not_judged() -> None:
    from nixlkv.serving.check import format_bytes
    from nixlkv.serving.drills import format_drills

    good = {"ok": True, "loads": 3, "layers": 6, "token_heads": 120, "state_units": 0, "bytes": 960, "mismatches": 0,
            "shown": [], "missing": [], "unjudged": [], "control": {"bites": True}}
    assert format_bytes(good).startswith("bytes (D's loaded KV vs P's, per token and head or state unit): ok (3 loads")
    assert "damaged copies rejected" in format_bytes(good) and "Mamba" not in format_bytes(good)
    bad = {**good, "ok": False, "mismatches": 1, "shown": ["l0: D rank 0 head 1: 1 of 39 needed tokens differ"],
           "unjudged": ["l3: heads not a TP sharding of the model's"], "control": {"bites": False, "flip byte": False}}
    line = format_bytes(bad)
    assert "FAIL" in line and "first: l0: D rank 0 head 1" in line and 'NOT JUDGED: ["l3' in line
    assert "NOT REJECTED" in line
    out = {"case": "c", "ok": False, "policies": {"recompute": [
        {"name": "bytes D loaded vs P's", "ok": False, "why": line, "facts": {"bytes": bad}}]}}
    assert format_drills(out).count("first: l0: D rank 0 head 1") == 2  # the reason, then the summary
