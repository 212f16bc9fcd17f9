"""Seeded fuzzing of what a peer or a caller hands nixlkv: a prefill rank's geometry (both wire
forms), a request's block ids and the connector's configuration. Each input is planned and
resolved, or refused with nixlkv's own error (NixlkvError, ConfigError): never another exception,
never an id outside its list. It found the TP size that sized the dispatcher's allocations, the
float block id resolve truncated, and the endless timeouts the config accepted.

The control breaks one check (ids converted by ``int``, which rounds 1.5 to block 1) and shows
that the same fuzzing then sees it: the fuzzing can fail.
"""

from __future__ import annotations

import copy
import math
import operator
import random
import types
from typing import Any

import numpy as np
import pytest

from nixlkv.core import Dispatcher, RankGeometry, covered_remote_ranks
from nixlkv.core import request_ids
from nixlkv.core.dispatcher import forget_handshakes
from nixlkv.core.errors import NixlkvError
from nixlkv.vllm.config import ConfigError, ConnectorConfig
from test_campaign import _at, _paths

# values of every kind a broken or hostile peer may put anywhere
JUNK: list[Any] = [
    None, -1, 0, 1, 2, 3, 7, 2**31, 2**62, 2**63, 2**64, 2**100, -(2**63), True, False, 1.5, float("nan"),
    float("inf"), "", "x", "head", "byte", "token", "kblock", "full_attention", "mamba", [], {}, [1], [[1, 2]],
    {"a": 1}, [["head", 0]], [["byte", -1]],
]


@pytest.fixture(scope="module")
def setups() -> list[tuple[str, Any, dict[int, RankGeometry]]]:
    """(name, decode rank, the prefill ranks it covers) for dense P>D and P<D, MLA and a hybrid."""
    from nixlkv.bench.hybrid import NEMOTRON_H_8B, hybrid_setup
    from nixlkv.bench.shapes import DEEPSEEK_MLA, LLAMA_8B, Case, fabricate_rank

    disp = Dispatcher.from_plugins()
    out = []
    for shape, p, d in [(LLAMA_8B, 4, 2), (LLAMA_8B, 1, 2), (DEEPSEEK_MLA, 8, 2)]:
        local = fabricate_rank(disp, shape, "decode", d, 0, 64)
        remote = {r: fabricate_rank(disp, shape, "prefill", p, r, 64) for r in covered_remote_ranks(0, d, p)}
        out.append((f"{shape.name} P{p}->D{d}", local, remote))
    local, remote, _ = hybrid_setup(Case(NEMOTRON_H_8B, 4, 2, 8192, "contiguous"), disp)
    out.append(("hybrid P4->D2", local, remote))
    return out


def _mutate(wire: dict[str, Any], rng: random.Random) -> None:
    """One change anywhere: a key or element dropped or repeated, an integer nudged, a fact
    added, or any value replaced by junk."""
    path = rng.choice([p for p in _paths(wire) if p])
    parent, key = _at(wire, path[:-1]), path[-1]
    value = parent[key]
    op = rng.random()
    if op < 0.12 and isinstance(parent, dict):
        del parent[key]
    elif op < 0.2 and isinstance(parent, list):
        parent.pop(key)
    elif op < 0.26 and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(value))
    elif op < 0.55 and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = value + rng.choice([-1, 1, -2, 2, 16, -16, 64, 4096, 1 << 20, value, -value])
    elif op < 0.62 and isinstance(parent, dict):
        parent[rng.choice(["extra", "head_start", "num_speculative_blocks", "tokens_per_block", "interior"])] = rng.choice(JUNK)
    else:
        parent[key] = copy.deepcopy(rng.choice(JUNK))


def _junk_ids(rng: random.Random, n: int, num_blocks: int) -> Any:
    kind = rng.random()
    if kind < 0.3:
        return [rng.randrange(1, num_blocks) for _ in range(n)]
    if kind < 0.4:
        return [rng.choice([0, -1, num_blocks, 2**31, 2**63 - 1, 2**64, 1.5, 2.0, "2", None]) for _ in range(n)]
    if kind < 0.5:
        return np.arange(1, n + 1).astype(rng.choice([np.int8, np.uint64, np.float64, np.bool_, np.uint32, object]))
    if kind < 0.6:
        return [rng.randrange(1, num_blocks) for _ in range(rng.randrange(0, 3 * n + 1))]
    if kind < 0.7:
        return rng.choice(["abc", np.ones((2, n), dtype=np.int64), [[1, 2]], 5])
    return list(range(1, n + 1))


def _not_integers(ids: Any) -> bool:
    """Ids that name no block: a list holding a float, a string or None, or an array of floats or
    booleans (a request of them must be refused, never rounded to some block)."""
    if isinstance(ids, np.ndarray):
        return ids.dtype.kind in "fb"
    return isinstance(ids, list) and any(isinstance(v, (float, str)) or v is None for v in ids)


def _ids_in_lists(plan: Any, resolved: Any) -> bool:
    """Every id of every READ names a descriptor of its own list."""
    local_total = int(plan.local_descs[:, 4].sum())
    for read in resolved.reads:
        remote_total = int(plan.remote_descs[read.remote_rank][:, 4].sum())
        for ids, total in ((read.local_ids, local_total), (read.remote_ids, remote_total)):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= total):
                return False
    return True


def fuzz_peers(setups: list[Any], seed: int, cases: int) -> tuple[dict[str, int], list[str]]:
    """Plan and resolve ``cases`` mutated peers; (outcome counts, what escaped that should not)."""
    rng = random.Random(seed)
    disp = Dispatcher.from_plugins()
    counts = {"planned": 0, "refused": 0, "resolved": 0, "request refused": 0}
    escaped: list[str] = []
    for i in range(cases):
        name, local, remote = setups[i % len(setups)]
        form = "wire" if rng.random() < 0.7 else "dict"
        wires = {r: (g.to_wire() if form == "wire" else g.to_dict()) for r, g in remote.items()}
        target = rng.choice(list(wires))
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            _mutate(wires[target], rng)
        if rng.random() < 0.3:
            forget_handshakes()  # as a worker that never parsed this layout
        try:
            plan = disp.plan(local, {r: RankGeometry.from_dict(w) for r, w in wires.items()})
        except NixlkvError:
            counts["refused"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 - what this test looks for
            escaped.append(f"{name} {form} case {i}: {type(exc).__name__}: {exc}"[:300])
            continue
        counts["planned"] += 1
        groups_l = max(g.local_group for g in plan.pairings) + 1
        groups_r = max(g.remote_group for g in plan.pairings) + 1
        bound = min(g.local_num_blocks for g in plan.pairings)
        for _ in range(3):
            k = rng.randrange(1, 9)
            local_ids = [_junk_ids(rng, k, bound) for _ in range(groups_l)]
            remote_ids = [_junk_ids(rng, k, bound) for _ in range(groups_r)]
            try:
                resolved = plan.resolve(local_ids, remote_ids, rng.choice([None, 16 * k, 1, 0, -5]))
            except NixlkvError:
                counts["request refused"] += 1
                continue
            except Exception as exc:  # noqa: BLE001
                escaped.append(f"{name} resolve case {i}: {type(exc).__name__}: {exc}"[:300])
                continue
            counts["resolved"] += 1
            if any(map(_not_integers, (*local_ids, *remote_ids))):
                escaped.append(f"{name} resolve case {i}: resolved ids that are no integers: {local_ids} {remote_ids}"[:300])
            if not _ids_in_lists(plan, resolved):
                escaped.append(f"{name} resolve case {i}: an id outside its descriptor list")
    return counts, escaped


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_peers_and_requests_are_planned_or_refused_never_crash(setups, seed: int) -> None:
    counts, escaped = fuzz_peers(setups, seed, 240)
    assert not escaped, escaped[:5]
    # both outcomes were met at each step: the fuzzing reached planning and resolving
    assert min(counts.values()) >= 20, counts


def test_the_fuzzing_can_fail(setups, monkeypatch) -> None:
    """Negative control: resolve converting ids with ``int`` (as np.fromiter did: 1.5 is block 1)
    resolves a request of floats, and the same fuzzing sees it."""
    monkeypatch.setattr(request_ids, "operator", types.SimpleNamespace(index=int, sub=operator.sub))
    _, escaped = fuzz_peers(setups, 0, 240)
    assert any("no integers" in e for e in escaped), escaped[:3]


def test_junk_configuration_is_refused_naming_the_key_or_parsed_to_its_type() -> None:
    rng = random.Random(0)
    keys = ConnectorConfig.known_keys()
    junk = [*JUNK, "true", "auto", "direct", "staged", "0", "1", "-1", "/tmp", {"FullAttentionSpec": "full_attention"}]
    defaults = ConnectorConfig.parse({}, env={})
    parsed = refused = 0
    for _ in range(3000):
        extra = {rng.choice(keys): rng.choice(junk) for _ in range(rng.choice([1, 1, 2, 3]))}
        try:
            config = ConnectorConfig.parse(extra, env={})
        except ConfigError as exc:
            refused += 1
            assert any(k in str(exc) for k in extra), (extra, str(exc))
            continue
        parsed += 1
        for key in extra:  # what parsed is of the default's type, and finite where a number
            value, default = getattr(config, key), getattr(defaults, key)
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                assert isinstance(value, type(default)) and not isinstance(value, bool), (key, value)
                assert value >= 0 and (isinstance(value, int) or math.isfinite(value)), (key, value)
    assert parsed > 100 and refused > 1000
