"""Planning once per distinct layer geometry: identical layers are described and paired once,
every layer is still checked, and hybrids register each shared tensor's rows once.

Geometry is fabricated from integers (the bench's shapes); no memory is allocated.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from nixlkv.bench import run as bench_run
from nixlkv.bench.hybrid import NEMOTRON_H_8B, hybrid_request_ids, hybrid_setup
from nixlkv.bench.shapes import LLAMA_8B, Case, Shape, block_ids, fabricate_rank
from nixlkv.core import (
    Dispatcher,
    HandshakeError,
    IncompatibleGeometry,
    MalformedRemoteFact,
    PlanValidationError,
    RankGeometry,
    covered_remote_ranks,
)
from nixlkv.core import plan as plan_module
from nixlkv.strategies.full_attention import FullAttentionStrategy
from test_faults import dispatcher_with  # the builtin strategies plus one under test

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SMALL = Shape("small-gqa", "full_attention", 12, {"num_kv_heads": 8, "head_size": 64, "dtype": "bfloat16", "head_size_v": None}, 16)


class Counting(FullAttentionStrategy):
    """Full attention that counts how often it is asked for segments."""

    name = "counting"
    overrides = ("full_attention",)
    calls = 0

    def segments(self, local, remote, local_topology, remote_tp):
        type(self).calls += 1
        return super().segments(local, remote, local_topology, remote_tp)


class CountingPerLayer(Counting):
    """The same, declared as depending on names or bases: asked per layer."""

    name = "counting_per_layer"
    overrides = ("full_attention", "counting")
    segments_by_geometry = False



def ranks(dispatcher: Dispatcher, shape: Shape, p_tp: int, d_tp: int, nb: int = 40):
    local = fabricate_rank(dispatcher, shape, "decode", d_tp, 0, nb)
    remote = {r: fabricate_rank(dispatcher, shape, "prefill", p_tp, r, nb) for r in covered_remote_ranks(0, d_tp, p_tp)}
    return local, remote


def wire_of(remote: dict[int, RankGeometry]) -> dict[int, dict]:
    return {r: copy.deepcopy(g.to_dict()) for r, g in remote.items()}


def parsed(wire: dict[int, dict]) -> dict[int, RankGeometry]:
    return {r: RankGeometry.from_dict(w) for r, w in wire.items()}


@pytest.mark.parametrize("p_tp,d_tp", [(4, 2), (2, 4), (1, 1)])
def test_identical_layers_are_described_once(p_tp: int, d_tp: int) -> None:
    Counting.calls = 0
    d = dispatcher_with(Counting())
    local, remote = ranks(d, SMALL, p_tp, d_tp)
    d.plan(local, parsed(wire_of(remote)))
    assert Counting.calls == 1  # 12 layers, one geometry
    assert len(set(local.geometry_classes)) == 1


def test_a_strategy_not_by_geometry_is_asked_per_layer_and_plans_the_same() -> None:
    CountingPerLayer.calls = 0
    per_layer = dispatcher_with(CountingPerLayer())
    local, remote = ranks(per_layer, SMALL, 4, 2)
    slow = per_layer.plan(local, remote)
    assert CountingPerLayer.calls == SMALL.num_layers
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 4, 2)
    fast = d.plan(local, parsed(wire_of(remote)))
    assert np.array_equal(fast.local_descs, slow.local_descs)
    assert all(np.array_equal(fast.remote_descs[p], slow.remote_descs[p]) for p in slow.remote_descs)
    rng = np.random.default_rng(3)
    ids = block_ids("fragmented", 20, 40, rng)
    assert fast.byte_moves(fast.resolve([ids], [ids])) == slow.byte_moves(slow.resolve([ids], [ids]))
    assert [s.to_dict() for s in fast.layer_segments] == [s.to_dict() for s in slow.layer_segments]


def test_a_layer_whose_facts_differ_is_still_refused() -> None:
    """One layer of twelve advertises another head size: it is its own class, checked, refused."""
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 4, 2)
    wire = wire_of(remote)
    wire[1]["regions"][7]["facts"]["head_size"] = 128
    with pytest.raises(IncompatibleGeometry, match="model.layers.7"):
        d.plan(local, parsed(wire))


def test_a_layer_whose_page_differs_is_still_refused() -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 4, 2)
    wire = wire_of(remote)
    page = wire[0]["regions"][9]["page"]
    page[-1][1] //= 2  # half the bytes per head and token on the remote page
    with pytest.raises(IncompatibleGeometry, match="model.layers.9"):
        d.plan(local, parsed(wire))


@pytest.mark.parametrize("where,value", [("fact", 1.0), ("fact", True), ("page", True), ("num_blocks", 40.0)])
def test_a_copy_with_equal_values_of_another_type_is_parsed_on_its_own(where: str, value: object) -> None:
    """``1.0 == 1`` and ``True == 1`` in Python, not on the wire: such a layer is not taken for a
    copy of the others, so it meets every check a lone region meets."""
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 8, 8)  # one head per rank: sizes of 1 on the page
    wire = wire_of(remote)
    region = wire[0]["regions"][5]
    if where == "fact":
        key = "num_heads"
        assert region["facts"][key] == value
        region["facts"][key] = value
        with pytest.raises(MalformedRemoteFact, match="model.layers.5"):
            d.plan(local, parsed(wire))
    elif where == "page":
        assert region["page"][0][1] == value
        region["page"][0][1] = value
        with pytest.raises(HandshakeError):
            parsed(wire)
    else:
        region["num_blocks"] = value
        with pytest.raises(HandshakeError):
            parsed(wire)


def test_parsed_copies_equal_a_region_by_region_parse() -> None:
    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 4, 2)
    for w in wire_of(remote).values():
        shared = RankGeometry.from_dict(w)
        alone = [type(r).from_dict(rd) for r, rd in zip(shared.regions, w["regions"])]
        assert list(shared.regions) == alone
        assert len(set(shared.geometry_classes)) == 1


def test_a_copy_with_a_bad_name_or_base_is_refused() -> None:
    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 1, 1)
    for field, value in (("name", ""), ("name", 3), ("base", -1), ("base", True), ("group", -2)):
        w = copy.deepcopy(remote[0].to_dict())
        w["regions"][4][field] = value
        with pytest.raises(HandshakeError):
            RankGeometry.from_dict(w)


def test_overlapping_segments_of_one_class_are_refused() -> None:
    from faulty_strategies import OverlappingSegments

    d = dispatcher_with(OverlappingSegments())
    local, remote = ranks(d, SMALL, 2, 2)
    with pytest.raises(PlanValidationError, match="write the same bytes"):
        d.plan(local, remote)


@pytest.mark.parametrize("p_tp,d_tp", [(4, 2), (2, 4), (1, 1)])
def test_hybrid_registers_no_more_than_vllm_and_moves_the_same_bytes(monkeypatch, p_tp: int, d_tp: int) -> None:
    """Nemotron-H-like (the bench's shape): layers of several groups alias one KV tensor; their
    rows are registered once, as vLLM registers per shared tensor, and the same bytes move."""
    d = Dispatcher.from_plugins()
    case = Case(NEMOTRON_H_8B, p_tp, d_tp, 8192, "fragmented")
    local, remote, vllm = hybrid_setup(case, d)
    plan = d.plan(local, remote)
    vllm.handshake()
    ours = sum(plan.registered_descriptors().values())
    assert ours <= vllm.registered_descriptors()
    assert len(plan.segments) < len(plan.layer_segments)  # rows shared
    p_ids, d_ids = hybrid_request_ids(case, vllm.local_layout, np.random.default_rng(1))
    moves = sorted(plan.byte_moves(plan.resolve(d_ids, p_ids, case.num_tokens)))
    monkeypatch.setattr(plan_module, "_regions_overlap", lambda geometry: False)  # one row per segment
    unshared = Dispatcher.from_plugins().plan(local, remote)  # planned anew (d would rebase its plan)
    assert sum(unshared.registered_descriptors().values()) > ours
    assert sorted(unshared.byte_moves(unshared.resolve(d_ids, p_ids, case.num_tokens))) == moves


def test_group_floor_writes_one_id_per_descriptor_and_checks_when_asked() -> None:
    local, remote = [[3, 4, 5], [7]], [[1, 2, 6], [9]]
    reads = [[(0, 0, 2), (1, 1, 3)], [(0, 0, 1)]]
    floor = bench_run.group_id_floor(local, remote, reads)
    floor()
    (lo, ro), (lo2, ro2) = floor.out
    stride = 10
    assert lo.tolist() == [3, 4, 5, 3 + stride, 4 + stride, 5 + stride, 7, 7 + stride, 7 + 2 * stride]
    assert ro.tolist() == [1, 2, 6, 1 + stride, 2 + stride, 6 + stride, 9, 9 + stride, 9 + 2 * stride]
    assert lo2.tolist() == [3, 4, 5] and ro2.tolist() == [1, 2, 6]
    checked = bench_run.group_id_floor(local, remote, reads, checked_limits=(8, 10))
    checked()
    with pytest.raises(ValueError, match="out of bounds"):
        bench_run.group_id_floor(local, remote, reads, checked_limits=(6, 10))()
    with pytest.raises(ValueError, match="out of bounds"):
        bench_run.group_id_floor(local, remote, reads, checked_limits=(8, 9))()
    with pytest.raises(ValueError, match="null"):
        bench_run.group_id_floor([[3, 0, 5], [7]], remote, reads, checked_limits=(8, 10))()
    assert bench_run.group_id_floor([[1, 2]], [[1]], [[(0, 0, 1)]]) is None


def test_bench_reports_the_parse_and_the_checked_floor() -> None:
    d = Dispatcher.from_plugins()
    row = bench_run.plan_case(Case(SMALL, 4, 2, 512, "contiguous"), d, budget=0.01)
    assert row["plan_floor_ratio"] is not None and row["plan_floor_checked_ratio"] is not None
    assert 0 < row["handshake_ms_parse_ours"] <= row["handshake_ms_ours"] * 2
    # the first handshake of a layout (planned from scratch) is reported beside the rebased ones
    assert row["handshake_ms_first_ours"] > 0 and row["handshake_first_ratio"] > 0
    hybrid = bench_run.plan_case(Case(NEMOTRON_H_8B, 4, 2, 1024, "contiguous"), d, budget=0.01)
    assert hybrid["plan_floor_ratio"] is not None  # hybrids have a floor too
    assert hybrid["registered_ours"] <= hybrid["registered_vllm"]
