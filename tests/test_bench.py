"""The benchmark harness on tiny shapes: the figures it reports must be the right figures.

No timing is asserted here (the machines are shared); what is checked is what the numbers mean:
the descriptor count computed after NIXL's merge equals NIXL's own telemetry, the vLLM baseline
moves the same bytes as nixlkv through vLLM's own code, and the headline keys are complete.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nixlkv import cli
from nixlkv.bench import run as bench_run
from nixlkv.bench.dram import run_transfer
from nixlkv.bench.measure import interleaved, posted_after_merge
from nixlkv.bench.shapes import Case, Shape, block_ids, fabricate_rank
from nixlkv.bench.vllm_baseline import VllmPlanner
from nixlkv.core import Dispatcher
from nixlkv.core.staging import TransferCosts

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

TINY = Shape("tiny-gqa", "full_attention", 3, {"num_kv_heads": 4, "head_size": 32, "dtype": "bfloat16", "head_size_v": None}, 16)
TINY_MLA = Shape("tiny-mla", "mla", 2, {"kv_lora_rank": 64, "qk_rope_head_dim": 32, "cache_dtype": "auto", "dtype": "bfloat16"}, 16)


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    return Dispatcher.from_plugins()


def test_merge_model_on_hand_made_rows() -> None:
    dense = np.array([[0, 64, 0, 64, 10], [10_000, 64, 0, 64, 10]], dtype=np.uint64)
    sliced = np.array([[0, 32, 0, 64, 20]], dtype=np.uint64)
    ids = np.arange(20)
    assert posted_after_merge(dense, ids, dense, ids) == 2  # one per row: never across rows
    assert posted_after_merge(dense, [0, 1, 2, 5, 6], dense, [0, 1, 2, 5, 6]) == 2
    assert posted_after_merge(dense, [0, 1, 2], dense, [0, 1, 3]) == 2  # remote side breaks the run
    assert posted_after_merge(sliced, ids, dense, ids) == 20  # a head slice never merges
    with pytest.raises(ValueError, match="outside"):
        posted_after_merge(dense, [20], dense, [0])


def test_fragmented_ids_are_distinct_mixed_runs() -> None:
    rng = np.random.default_rng(1)
    ids = block_ids("fragmented", 200, 500, rng)
    assert len(ids) == len(set(ids)) == 200 and 0 not in ids
    runs = 1 + int(np.sum(np.diff(ids) != 1))
    assert 20 < runs < 200  # neither one run nor all singletons
    assert block_ids("contiguous", 5, 10, rng) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="pool"):
        block_ids("contiguous", 10, 10, rng)


@pytest.mark.parametrize(
    ("shape", "p_tp", "d_tp", "reads"),
    [(TINY, 1, 1, 1), (TINY, 4, 2, 2), (TINY, 2, 4, 1), (TINY_MLA, 4, 2, 1)],
)
def test_vllm_baseline_moves_the_same_bytes_as_nixlkv(dispatcher, shape, p_tp, d_tp, reads) -> None:
    """Same geometry, same block ids: vLLM's own code and nixlkv's plan must address the same
    (local, remote) byte ranges, or the comparison compares different work."""
    case = Case(shape, p_tp, d_tp, 200, "fragmented")
    nb = case.num_blocks
    local = fabricate_rank(dispatcher, shape, "decode", d_tp, 0, nb)
    covered = range(p_tp // d_tp if p_tp > d_tp else 1)
    remote = {r: fabricate_rank(dispatcher, shape, "prefill", p_tp, r, nb) for r in covered}
    plan = dispatcher.plan(local, remote)
    vllm = VllmPlanner(shape, p_tp, d_tp, 0, nb, [r.base for r in local.regions],
                       {r: [x.base for x in g.regions] for r, g in remote.items()})
    vllm.handshake()
    rng = np.random.default_rng(3)
    p_ids = block_ids("fragmented", case.num_request_blocks, nb, rng)
    d_ids = block_ids("fragmented", case.num_request_blocks, nb, rng)
    ours = set(plan.byte_moves(plan.resolve([d_ids], [p_ids], case.num_tokens)))
    from nixlkv.core.plan import expand_ids

    theirs = set()
    for read in vllm.reads([d_ids], [p_ids]):
        la, ln = expand_ids(read.local_rows, read.local_ids)
        ra, _ = expand_ids(vllm.remote_rows[read.remote_rank], read.remote_ids)
        theirs |= set(zip(la.tolist(), [read.remote_rank] * la.size, ra.tolist(), ln.tolist()))
    assert len(vllm.source_ranks) == reads
    assert ours == theirs


@pytest.mark.nixl
@pytest.mark.parametrize(("p_tp", "d_tp", "pattern"), [
    (1, 1, "contiguous"), (1, 1, "fragmented"), (4, 2, "fragmented"), (4, 2, "contiguous"), (2, 4, "contiguous"),
])
def test_computed_merge_equals_nixl_telemetry(dispatcher, p_tp, d_tp, pattern) -> None:
    """The descriptor counts in the tables are computed; NIXL's own count must agree, in the
    descriptor mode auto picked (staged: summed over every round)."""
    cheap_copy = TransferCosts(copy_bytes_per_s=1e12)  # auto then stages wherever staging merges more
    result = run_transfer(Case(TINY, p_tp, d_tp, 500, pattern), num_layers=2, reps=1, dispatcher=dispatcher, costs=cheap_copy)
    assert result.descs_posted_ours_nixl == result.descs_posted_ours_computed > 0
    assert result.descs_posted_staged_nixl == result.descs_posted_staged_computed > 0
    assert result.descs_posted_ours_computed <= result.descs_posted_direct
    if p_tp > d_tp:  # head slices on D: staging merges whole P pages
        assert result.modes == ["staged"]
        if pattern == "contiguous":  # one descriptor per (layer, P rank) run: 2 x 2 here
            assert result.descs_posted_ours_nixl == 4 and result.descs_posted_direct == 2 * 2 * 32
    else:
        assert result.modes == ["direct"]
    assert result.descs_posted_vllm_nixl == result.descs_posted_vllm_computed > 0
    assert result.spot_checked_bytes > 0
    if (p_tp, d_tp, pattern) == (1, 1, "contiguous"):
        assert result.descs_posted_ours_nixl == 2  # one per layer: whole pages, consecutive ids
    d = result.to_dict()
    assert d["ours_gbps"] > 0 and d["memcpy_gbps"] > 0 and "scaled down to 2 of 3 layers" in d["notes"][0]


def test_interleaved_times_every_function_alike() -> None:
    calls = {"a": 0, "b": 0}

    def bump(k):
        return lambda: calls.__setitem__(k, calls[k] + 1)

    ta, tb = interleaved([bump("a"), bump("b")], reps=7, warmup=1)
    assert calls == {"a": 8, "b": 8} and ta.reps == tb.reps == 7 and ta.p50 <= ta.p99


def test_headline_ok_names_bad_values() -> None:
    good = {"plan_time_ratio_vs_vllm": 0.9, "descs_ratio_vs_vllm_hetero": 1.0, "descs_ratio_vs_vllm_fragmented": 1.0}
    assert bench_run.headline_ok(good) == []
    assert bench_run.headline_ok({**good, "plan_time_ratio_vs_vllm": math.nan}) == ["plan_time_ratio_vs_vllm=nan"]
    assert bench_run.headline_ok({**good, "transfers": [{}]}) == ["nixl_vs_memcpy=None", "nixl_vs_memcpy_hetero=None"]


@pytest.mark.nixl
def test_cli_bench_quick_json_has_every_headline_key(monkeypatch, capsys, tmp_path) -> None:
    """``nixlkv bench --quick --json`` end to end, with the cases swapped for tiny ones so it runs
    in seconds: one JSON object, every key the issue names, finite positive ratios, a table, a PNG."""
    tiny = Shape("llama-8b-like", "full_attention", 2, TINY.params, 16)  # named like the headline shape
    monkeypatch.setattr(bench_run, "LLAMA_8B", tiny)
    monkeypatch.setattr(bench_run, "quick_cases", lambda: [
        Case(tiny, 4, 2, 8192, "contiguous"), Case(tiny, 4, 2, 1024, "contiguous"),
        Case(tiny, 4, 2, 8192, "fragmented"), Case(tiny, 1, 1, 8192, "contiguous"),
    ])
    monkeypatch.setattr(bench_run, "transfer_cases", lambda: [Case(tiny, 1, 1, 8192, "contiguous"), Case(tiny, 4, 2, 8192, "contiguous")])
    monkeypatch.setattr(bench_run, "TRANSFER_LAYERS", 2)
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    rc = cli.main(["bench", "--quick", "--json", "--transfer-reps", "1", "--markdown", str(md), "--plot", str(png)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("plan_time_ratio_vs_vllm", "descs_ratio_vs_vllm_hetero", "descs_ratio_vs_vllm_fragmented",
                "nixl_vs_memcpy", "nixl_vs_memcpy_hetero", "plan_us_ours_p50", "plan_us_vllm_p50",
                "nixl_gbps", "memcpy_gbps", "nixl_gbps_hetero", "memcpy_gbps_hetero"):
        assert isinstance(out[key], float) and math.isfinite(out[key]) and out[key] > 0, key
    assert out["merge_count_checked"] is True and out["merge_count_checked_hetero"] is True
    # P4->D2: head slices never merge, so the plan's own descriptors are vLLM's count; auto
    # stages whole pages instead, and NIXL's telemetry agrees with the staged count
    assert out["descs_posted_direct_hetero"] == out["descs_posted_vllm_hetero"]
    assert out["descs_ratio_vs_vllm_hetero_staged"] <= 1 / 8
    # auto reports what it picked, from the costs it measured on this machine now
    assert out["descriptor_mode_hetero"] in ("staged", "direct")
    expected = out["descs_ratio_vs_vllm_hetero_staged"] if out["descriptor_mode_hetero"] == "staged" else 1.0
    assert out["descs_ratio_vs_vllm_hetero"] == expected
    assert out["auto_costs"]["copy_gbps_measured"] > 0
    assert out["nixl_staged_vs_memcpy_hetero"] > 0 and out["nixl_direct_vs_memcpy_hetero"] > 0
    assert out["transfer_mode"] == "direct" and out["descs_ratio_vs_vllm_equal_tp"] == 1.0
    assert out["transfer_layers"] == "2 of 2"
    assert "llama-8b-like P4->D2 8k contiguous" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_planner_needs_its_handshake_first() -> None:
    vllm = VllmPlanner(TINY, 1, 1, 0, 20, [0, 1000, 2000], {0: [0, 1000, 2000]})
    with pytest.raises(RuntimeError, match="handshake"):
        vllm.desc_ids([[1, 2]], [[1, 2]])
