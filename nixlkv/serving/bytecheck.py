"""The in-serving byte check: D's loaded KV against P's, per token and KV head, from real engines.

Both engines run with ``dump_kv_dir`` (:mod:`nixlkv.vllm.kvdump`): P writes each request's blocks
when it starts holding them, D the request's whole block table, as vLLM's KV manager holds it,
once its READs complete and before any forward pass; D's scheduler notes every load it claims; each worker writes its capture record (every layer's own spec, head count, page interior,
view). This judge knows nothing of nixlkv's plans or of the connector's block ids. From each
layer's spec alone it says which tokens D needs to go on from where its load ends (``q``, the
tokens D holds after the load):

- full attention and MLA: every token before ``q``;
- a sliding window of ``w`` tokens: the last ``w - 1`` before ``q``;
- chunked local attention of ``c``: the tokens of ``q``'s chunk before ``q``;

and, from TP sharding alone, which KV head each rank's page holds (``total >= tp``: rank ``r``
holds ``r*H .. r*H+H-1``; fewer heads than ranks: rank ``r`` holds head ``r * total // tp``; an
MLA spec's one latent is held by every rank). Every needed (token, head) D loaded (past its own
prefix hit) must equal P's bytes for it; a needed token that D holds in a null block, or that P
no longer held, fails too.

Mamba state layers are judged per conv channel and SSM unit: the running state (the last entry of
the request's state list before its speculative scratch) must be P's state after exactly the
tokens D goes on from, each channel and unit D holds equal to P's for the same global one (global
coordinates from vLLM's weight sharding: :func:`mamba_state_coordinates`); the conv state's
scratch columns for speculative tokens are not compared.

Nothing passes by absence: a layer the judge cannot read, a claimed load without a dump (or a
failure note) from every decode rank, a dump a worker could not write, a load that failed each fail
the verdict. Loads a test damaged on purpose (:mod:`nixlkv.vllm.damage`) are graded controls: each
must be rejected.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..vllm.kvdump import (EXPECT_PREFIX, FAILED_SUFFIX, K_CHANNEL_MAJOR, as_pages, element_size, is_state, load_dump,
                           needed_from, running_row, token_rows)

__all__ = ["ByteVerdict", "Dump", "K_CHANNEL_MAJOR", "LoadVerdict", "element_size", "judge_dir", "judge_load",
           "needed_from", "read_dir", "run_control", "token_rows"]

NULL_BLOCK = 0  # vLLM's block pool hands block 0 out as the null block (out of a window, skipped)
SHOWN = 5  # mismatches named per load


@dataclass
class Dump:
    """One worker's file for one request."""

    meta: dict[str, Any]
    layers: dict[str, np.ndarray]  # name -> uint8 [rows, H, N, C bytes]
    record: dict[str, Any]  # the worker's capture record

    @property
    def engine(self) -> str:
        return self.meta["engine_id"]


@dataclass
class LoadVerdict:
    """One decode engine's load of one prefill request, every rank of it."""

    request: str
    decode_engine: str
    layers: int = 0
    tokens: int = 0  # (token, head) pairs compared, summed over layers
    state_units: int = 0  # Mamba conv channels and SSM units compared (a replicated state counts once)
    bytes: int = 0
    mismatches: int = 0
    shown: list[str] = field(default_factory=list)
    unjudged: dict[str, str] = field(default_factory=dict)  # layer -> why
    control: dict[str, Any] | None = None  # a graded control D applied on purpose: what it damaged

    def fail(self, text: str) -> None:
        self.mismatches += 1
        if len(self.shown) < SHOWN:
            self.shown.append(text)

    @property
    def ok(self) -> bool:
        """Every needed byte equal to P's, and every layer judged."""
        return self.mismatches == 0 and not self.unjudged


@dataclass
class ByteVerdict:
    loads: list[LoadVerdict]  # the plain loads: each must pass
    missing: list[str]  # a claimed load without every rank's dump (D's or P's), named
    control: dict[str, Any] | None = None  # the judge's own control: damaged copies of the largest load
    controls: list[LoadVerdict] = field(default_factory=list)  # graded controls applied in the engine: each rejected
    failed: list[str] = field(default_factory=list)  # loads that failed, dumps that could not be written

    @property
    def controls_ok(self) -> bool:
        return all(not v.ok and not (v.control or {}).get("skipped") for v in self.controls)

    @property
    def ok(self) -> bool:
        judged = any(v.layers for v in self.loads)
        control_ok = self.control is None or self.control.get("bites", False)
        return (judged and not self.missing and not self.failed
                and all(v.ok for v in self.loads) and control_ok and self.controls_ok)

    def summary(self) -> dict[str, Any]:
        unjudged = sorted({f"{k}: {w}" for v in self.loads for k, w in v.unjudged.items()})
        return {
            "ok": self.ok, "loads": len(self.loads), "layers": sum(v.layers for v in self.loads),
            "token_heads": sum(v.tokens for v in self.loads), "state_units": sum(v.state_units for v in self.loads),
            "bytes": sum(v.bytes for v in self.loads),
            "mismatches": sum(v.mismatches for v in self.loads),
            "shown": [s for v in self.loads for s in v.shown][:SHOWN], "missing": self.missing,
            "failed": self.failed,
            "unjudged": unjudged, "control": self.control,
            "graded_controls": [{"request": v.request, **(v.control or {}), "rejected": not v.ok,
                                 "why": (v.shown or [""])[0]} for v in self.controls],
        }


def held_heads(rank: int, tp: int, local: int, total: int) -> np.ndarray | None:
    """The global KV heads a rank's page holds, by TP sharding alone (None: not a sharding of ``total``)."""
    if total >= tp:
        if local * tp != total:
            return None
        return np.arange(rank * local, rank * local + local)
    if local != 1:
        return None
    return np.array([rank * total // tp])


@dataclass
class _Side:
    """One rank's rows of one layer, per token: which tokens it holds and which heads."""

    tokens: np.ndarray  # [T, H, C]
    first: int  # token position of row-token 0
    held: np.ndarray  # bool [T]
    heads: np.ndarray | None


def _side(dump: Dump, name: str, num_tokens: int) -> _Side:
    """One rank's rows of a layer; its block ids are the request's list from token 0 (vLLM's block
    table: P's held blocks, D's whole table with its prefix hit), null blocks in their places."""
    record = dump.record["layers"][name]
    raw = as_pages(dump.layers[name])
    lay = dump.meta["layers"][name]
    group = dump.meta["groups"][lay["group"]]
    ids = np.asarray(group["block_ids"], dtype=np.int64)
    element = raw.shape[-1] // int(record["view"]["shape"][-1])
    tokens = token_rows(raw, (record.get("hints") or {}).get("page_interior"), element)
    per_block = tokens.shape[0] // max(len(ids), 1)
    positions = np.arange(tokens.shape[0])
    held = (np.repeat(ids, per_block) != NULL_BLOCK) & (positions < num_tokens)
    # MLA keeps one latent per token for every head, on every rank: the model's head count is not the page's
    mla = "MLA" in record.get("spec", "")
    total = 1 if mla else int((record.get("hints") or {}).get("total_kv_heads", raw.shape[1]))
    heads = held_heads(dump.meta["tp_rank"], dump.meta["tp_size"], raw.shape[1], total)
    return _Side(tokens, 0, held, heads)


def judge_load(request: str, prefill: list[Dump], decode: list[Dump]) -> LoadVerdict:
    """Every needed (token, head) of every layer each decode rank loaded, against the prefill ranks."""
    verdict = LoadVerdict(request, decode[0].engine)
    p_tokens = int(prefill[0].meta["num_tokens"])

    @functools.cache
    def p_heads(name: str) -> dict[int, tuple[Dump, _Side, int]] | None:
        """P's rows of a layer by global head (the first rank holding it); None: not a TP sharding."""
        sources: dict[int, tuple[Dump, _Side, int]] = {}
        for p in prefill:
            if name in p.layers:
                pside = _side(p, name, p_tokens)
                if pside.heads is None:
                    return None
                for i, h in enumerate(pside.heads):
                    sources.setdefault(int(h), (p, pside, i))
        return sources

    @functools.cache
    def p_states(name: str) -> list[tuple[Dump, _State | str]]:
        return [(p, _state(p, name)) for p in prefill if name in p.layers]

    for d in decode:
        q, hit = int(d.meta["num_tokens"]), int(d.meta.get("local_hit", 0))
        if q < 0:  # the request did not say how many tokens the blocks hold: nothing to place them by
            verdict.unjudged.update(dict.fromkeys(d.layers, "D's token count unknown"))
            continue
        if d.meta.get("damage"):
            verdict.control = d.meta["damage"]
        for name in d.layers:
            record = d.record["layers"][name]
            if is_state(record):
                _judge_state(verdict, name, d, p_states(name), q, p_tokens)
                continue
            dside = _side(d, name, q)
            sources = p_heads(name)
            if dside.heads is None or sources is None:
                verdict.unjudged[name] = "heads not a TP sharding of the model's"
                continue
            lo = max(needed_from(record, q), dside.first)
            need = np.arange(lo, q)
            rows = need - dside.first
            lost = need[~dside.held[rows]]
            if lost.size:
                verdict.fail(f"{name}: D rank {d.meta['tp_rank']} holds needed tokens {lost[:4].tolist()} in null blocks")
            verdict.layers += 1
            need = need[need >= hit]  # D's own prefix hit was computed by D, not loaded: not P's to judge
            rows = need - dside.first
            for i, h in enumerate(dside.heads):
                if int(h) not in sources:
                    if need.size:
                        verdict.fail(f"{name}: no prefill rank sent head {int(h)}, which D needs")
                    continue
                p, pside, j = sources[int(h)]
                prow = need - pside.first
                gone = (prow >= len(pside.held)) | ~pside.held[np.minimum(prow, len(pside.held) - 1)]
                if gone.any():
                    verdict.fail(f"{name}: P rank {p.meta['tp_rank']} no longer held tokens {need[gone][:4].tolist()} "
                                 f"(head {int(h)}) that D needs")
                ok = ~gone & dside.held[rows]
                mine = dside.tokens[rows[ok], i]
                theirs = pside.tokens[prow[ok], j]
                bad = np.flatnonzero((mine != theirs).any(axis=1))
                verdict.tokens += int(ok.sum())
                verdict.bytes += int(mine.size)
                if bad.size:
                    where = need[ok][bad]
                    verdict.fail(f"{name}: D rank {d.meta['tp_rank']} head {int(h)}: {bad.size} of {int(ok.sum())} "
                                 f"needed tokens differ from P rank {p.meta['tp_rank']}'s, first at {where[:4].tolist()}")
    return verdict


MAMBA_KINDS = {"MAMBA2": "mamba2", "MAMBA1": "mamba1", "GDN_ATTN": "gdn"}


@dataclass
class _State:
    """One rank's running state of one Mamba layer, by global coordinate."""

    conv: dict[int, bytes]  # global conv channel -> its first kernel - 1 columns
    ssm: dict[int, bytes]  # global SSM unit -> its bytes
    whole: bytes | None  # a tp_replicated state: the conv and SSM bytes as one


def _running_row(dump: Dump, name: str) -> int:
    ids = dump.meta["groups"][dump.meta["layers"][name]["group"]]["block_ids"]
    return running_row(dump.record["layers"][name], len(ids))


def _state(dump: Dump, name: str) -> _State | str:
    """The rank's running state, or why it cannot be read."""
    from ..testing.oracle import mamba_state_coordinates  # the weight sharding's coordinates (vLLM's rule)

    record = dump.record["layers"][name]
    facts, model = record.get("facts", {}), (record.get("hints") or {}).get("mamba")
    kind = MAMBA_KINDS.get(str(facts.get("mamba_type")))
    if model is None or kind is None or len(facts.get("shapes") or ()) != 2:
        return f"Mamba state without the model facts to read it (type {facts.get('mamba_type')!r})"
    lay = dump.meta["layers"][name]
    ids = dump.meta["groups"][lay["group"]]["block_ids"]
    row = _running_row(dump, name)
    if ids[row] == NULL_BLOCK:
        return "the running state is the null block"
    ratio = lay["kernel_blocks_per_block"]
    page = dump.layers[name][row * ratio: (row + 1) * ratio].reshape(-1)
    (conv_shape, ssm_shape), (conv_dt, ssm_dt) = facts["shapes"], facts["dtypes"]
    conv_n = int(np.prod(conv_shape)) * element_size(conv_dt)
    ssm_n = int(np.prod(ssm_shape)) * element_size(ssm_dt)
    if facts.get("tp_replicated"):
        return _State({}, {}, page[: conv_n + ssm_n].tobytes())
    p = {"mamba_type": kind, "tp_replicated": False, **model}
    channels, units = mamba_state_coordinates(p, dump.meta["tp_size"], dump.meta["tp_rank"])
    conv = page[:conv_n].reshape(conv_shape + [element_size(conv_dt)])
    if model.get("conv_state_layout", "DS") == "SD":  # [columns, channels] -> [channels, columns]
        conv = conv.transpose(1, 0, 2)
    keep = int(model["conv_kernel"]) - 1
    if conv.shape[0] != len(channels):
        return f"conv state of {conv.shape[0]} channels where sharding gives {len(channels)}"
    ssm = page[conv_n: conv_n + ssm_n].reshape(len(units), -1) if units else np.zeros((0, 0), np.uint8)
    return _State({c: conv[i, :keep].tobytes() for i, c in enumerate(channels)},
                  {u: ssm[i].tobytes() for i, u in enumerate(units)}, None)


def _judge_state(verdict: LoadVerdict, name: str, d: Dump, theirs: list[tuple[Dump, _State | str]], q: int,
                 p_tokens: int) -> None:
    """D's running state of a Mamba layer against P's (``theirs``, per prefill rank), channel by
    channel and unit by unit."""
    mine = _state(d, name)
    why = mine if isinstance(mine, str) else next((s for _, s in theirs if isinstance(s, str)), None)
    if why is not None or not theirs:
        verdict.unjudged[name] = why or "P sent no state"
        return
    verdict.layers += 1
    where = f"{name}: D rank {d.meta['tp_rank']}"
    if p_tokens != q:
        verdict.fail(f"{where}: P's state is after {p_tokens} tokens, D goes on from {q}")
    if mine.whole is not None:
        p0 = theirs[0][1]
        verdict.state_units += 1
        verdict.bytes += len(mine.whole)
        if mine.whole != p0.whole:
            verdict.fail(f"{where}: the replicated state differs from P rank {theirs[0][0].meta['tp_rank']}'s")
        return
    for part, got, held in (("conv channel", mine.conv, [st.conv for _, st in theirs]),
                            ("SSM unit", mine.ssm, [st.ssm for _, st in theirs])):
        source: dict[int, bytes] = {}
        for by_coordinate in held:
            for k, v in by_coordinate.items():
                source.setdefault(k, v)
        bad = [k for k, v in got.items() if source.get(k) != v]
        verdict.state_units += len(got)
        verdict.bytes += sum(len(v) for v in got.values())
        if bad:
            verdict.fail(f"{where}: {len(bad)} of {len(got)} {part}s differ from P's (or P held none), first {bad[:4]}")


def read_dir(directory: Path) -> tuple[dict[str, list[Dump]], dict[str, dict[str, list[Dump]]]]:
    """(prefill dumps per request, {request: {decode engine: dumps}}) with their capture records."""
    records = {}
    for path in directory.glob("*.json"):
        rec = json.loads(path.read_text())
        records[(rec["engine_id"], int(rec["tp_rank"]))] = rec
    prefill: dict[str, list[Dump]] = {}
    decode: dict[str, dict[str, list[Dump]]] = {}
    for path in sorted((directory / "requests").glob("*/*.npz")):
        meta, layers = load_dump(path)
        dump = Dump(meta, layers, records[(meta["engine_id"], int(meta["tp_rank"]))])
        request = meta["prefill_request_id"]
        if meta["role"] == "prefill":
            prefill.setdefault(request, []).append(dump)
        else:
            decode.setdefault(request, {}).setdefault(dump.engine, []).append(dump)
    return prefill, decode


def read_notes(directory: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(D's notes of the loads it claimed, the workers' notes of failed loads and dumps)."""
    expected = [json.loads(p.read_text()) for p in sorted((directory / "requests").glob(f"*/{EXPECT_PREFIX}*.json"))]
    failed = [json.loads(p.read_text()) for p in sorted((directory / "requests").glob(f"*/*{FAILED_SUFFIX}"))]
    return expected, failed


def judge_dir(directory: Path | str, control: bool = True, allow_failed: bool = False) -> ByteVerdict:
    """Every load the decode engines claimed under ``directory``: each judged from every rank's dump,
    graded controls (loads damaged on purpose) each rejected, and (``control``) two corrupted copies
    of the largest plain load, each of which must be rejected. ``allow_failed``: loads that failed
    are listed but do not fail the verdict (a drill that fails them on purpose); a dump that could
    not be written always does."""
    directory = Path(directory)
    prefill, decode = read_dir(directory)
    expected, failures = read_notes(directory)
    loads, controls, missing = [], [], []
    for request, engines in sorted(decode.items()):
        ps = prefill.get(request, [])
        tp = ps[0].meta["tp_size"] if ps else 0
        if len({p.meta["tp_rank"] for p in ps}) != tp or not tp:
            missing.append(request)
            continue
        for engine, ds in sorted(engines.items()):
            verdict = judge_load(request, ps, ds)
            (controls if verdict.control is not None else loads).append(verdict)
    failed = [f"{n['prefill_request_id']} ({n['role']} {n['engine_id']} rank {n['tp_rank']}): {n['why']}"
              for n in failures if not (allow_failed and n["why"].startswith("the load failed"))]
    failed_ranks = {(n["prefill_request_id"], n["engine_id"], int(n["tp_rank"])) for n in failures}
    for note in expected:
        request, engine = note["prefill_request_id"], note["engine_id"]
        dumped = {int(d.meta["tp_rank"]) for d in decode.get(request, {}).get(engine, [])}
        dumped |= {rank for (r, e, rank) in failed_ranks if (r, e) == (request, engine)}
        if dumped != set(range(int(note["tp_size"]))):
            missing.append(f"{request} (decode {engine}: dumps of ranks {sorted(dumped)} of {note['tp_size']})")
    verdict = ByteVerdict(loads, missing, controls=controls, failed=failed)
    if control and loads:
        verdict.control = run_control(prefill, decode, loads)
    return verdict


def _corrupted(decode: list[Dump], how: str) -> list[Dump] | None:
    """A copy of ``decode`` with one layer damaged as a plan bug would: in an attention layer that
    needs every loaded token, its last loaded block's first row flipped or its first two loaded
    blocks swapped; in a model of state layers only, the running state's first bytes flipped
    (it has no blocks to swap)."""
    for state in (False, True):
        for k, d in enumerate(decode):
            for name, raw in d.layers.items():
                record = d.record["layers"][name]
                if is_state(record) != state:
                    continue
                ids = d.meta["groups"][d.meta["layers"][name]["group"]]["block_ids"]
                per = raw.shape[0] // len(ids)
                tokens = per * as_pages(raw).shape[2]  # per block
                q, hit = int(d.meta["num_tokens"]), int(d.meta.get("local_hit", 0))
                # the blocks holding loaded tokens (past D's own prefix hit, before q)
                live = [i for i, b in enumerate(ids) if b != NULL_BLOCK and hit <= i * tokens < q]
                if not state and not live:
                    continue
                bad = raw.copy()
                if state:
                    if how != "flip byte":
                        continue
                    bad[_running_row(d, name) * per].reshape(-1)[:8] ^= 0xFF
                elif needed_from(record, int(d.meta["num_tokens"])):
                    continue
                elif how == "flip byte":
                    bad[live[-1] * per] ^= 0xFF
                elif len(live) >= 2:
                    a, b = live[0] * per, live[1] * per
                    bad[a:a + per], bad[b:b + per] = raw[b:b + per].copy(), raw[a:a + per].copy()
                else:
                    continue
                out = list(decode)
                out[k] = Dump(d.meta, {**d.layers, name: bad}, d.record)
                return out
    return None


def run_control(prefill: Mapping[str, list[Dump]], decode: Mapping[str, Mapping[str, list[Dump]]],
                loads: Iterable[LoadVerdict]) -> dict[str, Any]:
    """The judge on corrupted copies of the largest load: both must be rejected."""
    best = max(loads, key=lambda v: v.tokens + v.state_units)
    ds = decode[best.request][best.decode_engine]
    out: dict[str, Any] = {"request": best.request}
    for how in ("flip byte", "swap blocks"):
        bad = _corrupted(ds, how)
        out[how] = None if bad is None else not judge_load(best.request, prefill[best.request], bad).ok
    out["bites"] = out["flip byte"] is True and out["swap blocks"] is not False
    return out
