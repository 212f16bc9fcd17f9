"""The oracle must catch a wrong plan: faults injected into a resolved request or a strategy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pluggy
import pytest

from nixlkv.core import Dispatcher, ReadOp, ResolvedRequest, StrategyRegistry, hookimpl, hookspecs
from nixlkv.core.registry import builtin_plugin
from nixlkv.strategies.full_attention import FullAttentionStrategy
from nixlkv.testing.rehearsal import rehearse
from nixlkv.testing.scenario import parse

from faulty_strategies import OffByOneHead, OverlappingSegments

pytestmark = pytest.mark.nixl


def scenario(p_tp: int = 4, d_tp: int = 2):
    return parse({
        "name": f"fault-p{p_tp}-d{d_tp}",
        "model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 8, "head_size": 64}]},
        "prefill": {"tp": p_tp, "block_size": 16, "layout": "LBHNC"},
        "decode": {"tp": d_tp, "block_size": 16, "layout": "LBHNC"},
        "request": {"num_tokens": 300, "seed": 5},
    })


def _map_first_read(fn):
    def fault(rank: int, resolved: ResolvedRequest) -> ResolvedRequest:
        if rank != 0:
            return resolved
        first, *rest = resolved.reads
        return dataclasses.replace(resolved, reads=(fn(first), *rest))
    return fault


def test_clean_run_is_byte_exact() -> None:
    assert rehearse(scenario()).outcome == "byte-exact"


def test_swapped_remote_blocks_are_caught() -> None:
    def swap(read: ReadOp) -> ReadOp:
        ids = read.remote_ids.copy()
        ids[[0, 1]] = ids[[1, 0]]
        return ReadOp(read.remote_rank, read.local_ids, ids)

    result = rehearse(scenario(), fault=_map_first_read(swap))
    assert result.outcome == "mismatch"
    assert "decode rank 0" in result.message and "layer model.layers.0" in result.message


def test_dropped_descriptor_is_caught() -> None:
    def drop(read: ReadOp) -> ReadOp:
        return ReadOp(read.remote_rank, read.local_ids[:-1], read.remote_ids[:-1])

    result = rehearse(scenario(), fault=_map_first_read(drop))
    assert result.outcome == "mismatch"
    assert "expected" in result.message


class SwappedSources(FullAttentionStrategy):
    """Test-only fault: P>D reads each head run from the wrong source rank's slice."""

    name = "swapped_sources"
    overrides = ("full_attention",)

    def segments(self, local, remote, local_topology, remote_tp):
        segs = super().segments(local, remote, local_topology, remote_tp)
        ranks = [s.remote_rank for s in segs][::-1]
        return [dataclasses.replace(s, remote_rank=r) for s, r in zip(segs, ranks)]


def dispatcher_with(strategy) -> Dispatcher:
    class Plugin:
        @hookimpl
        def nixlkv_strategies(self):
            return [strategy]

    pm = pluggy.PluginManager("nixlkv")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin_plugin(), name="builtin")
    pm.register(Plugin(), name="faulty")
    return Dispatcher(StrategyRegistry.from_plugins(pm), unwrap=lambda s, n: pm.hook.nixlkv_unwrap_spec(spec=s, layer_name=n))


def test_strategy_reading_the_wrong_rank_is_caught() -> None:
    result = rehearse(scenario(), dispatcher=dispatcher_with(SwappedSources()))
    assert result.outcome == "mismatch"
    assert "global head" in result.message


def test_off_by_one_head_slot_is_caught() -> None:
    result = rehearse(scenario(1, 2), dispatcher=dispatcher_with(OffByOneHead()))
    assert result.outcome == "mismatch"
    assert "global head" in result.message


def test_plan_validation_rejects_overlapping_segments() -> None:
    result = rehearse(scenario(4, 2), dispatcher=dispatcher_with(OverlappingSegments()))
    assert result.outcome == "failed"
    assert "two segments write the same bytes" in result.message


def test_write_into_a_block_outside_the_request_is_caught() -> None:
    """Moving one descriptor to a neighbouring block must be seen through the sentinel check."""
    def stray(read: ReadOp) -> ReadOp:
        ids = read.local_ids.copy()
        taken = set(ids.tolist())
        ids[0] = ids[0] + 1 if ids[0] + 1 not in taken else ids[0] - 1
        return ReadOp(read.remote_rank, ids, read.remote_ids)

    result = rehearse(scenario(), fault=_map_first_read(stray))
    assert result.outcome == "mismatch"
    assert np.isfinite(result.transfer_seconds)
