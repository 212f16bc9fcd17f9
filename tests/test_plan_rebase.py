"""Plans rebased for another engine of the same layout, and geometries whose regions stay columns.

A decode rank that planned with one prefill engine gets, for another engine laid out the same
(the same model and configuration, at other addresses: another prefill engine, or the same one
restarted), that plan with its remote rows moved: the same plan a dispatcher that never saw the
first engine makes, and the same refusals. Real bytes through a rebased plan:
tests/test_connector_restart.py (a restarted prefill engine, every decode byte checked).
"""

from __future__ import annotations

import copy
import dataclasses
import marshal

import numpy as np
import pytest

from nixlkv.bench.hybrid import NEMOTRON_H_8B, hybrid_setup
from nixlkv.bench.run import fewer_blocks as rank_with_fewer_blocks, other_engine
from nixlkv.bench.shapes import DEEPSEEK_MLA, LLAMA_8B, Case, block_ids, fabricate_rank
from nixlkv.core import Dispatcher, IncompatibleGeometry, PlanError, PlanValidationError, RankGeometry
from nixlkv.core import dispatcher as dispatcher_module
from nixlkv.core.wire import ColumnRegions
from test_faults import dispatcher_with
from test_plan_by_geometry import SMALL, Counting, CountingPerLayer, parsed, ranks
from test_plan_memo import columnar, same_plan

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def engine(wire: dict[int, dict], k: int) -> dict[int, RankGeometry]:
    """Engine ``k`` of the layout ``wire`` describes, as a decode rank parses its reply."""
    return parsed({r: other_engine(w, k) for r, w in wire.items()})


def same_moves_on_other_addresses(a, b, shift: int) -> None:
    """``b`` reads what ``a`` reads, from remote addresses ``shift`` bytes higher."""
    ids = block_ids("fragmented", 20, 40, np.random.default_rng(3))
    ma, mb = a.byte_moves(a.resolve([ids], [ids])), b.byte_moves(b.resolve([ids], [ids]))
    assert [(la, r, ra + shift, n) for la, r, ra, n in ma] == mb


def first_engine_counted(p_tp: int, d_tp: int):
    """A dispatcher whose strategy counts its segments calls (from 0), a decode rank, the wire of
    the prefill ranks it reads, and its plan with the layout's first engine."""
    Counting.calls = 0
    d = dispatcher_with(Counting())
    local, remote = ranks(d, SMALL, p_tp, d_tp)
    wire = columnar(remote)
    return d, local, wire, d.plan(local, engine(wire, 1))


@pytest.mark.parametrize("p_tp,d_tp", [(4, 2), (2, 4), (1, 1), (8, 1)])
def test_another_engine_of_the_layout_gets_the_plan_a_fresh_dispatcher_makes(p_tp: int, d_tp: int) -> None:
    d, local, wire, first = first_engine_counted(p_tp, d_tp)
    again = d.plan(local, engine(wire, 2))
    assert Counting.calls == 1 and again._table is first._table  # rebased, not planned again
    assert again.origin == "rebased"
    assert all(g.engine_id.endswith("-2") for g in again.remote.values())
    fresh = dispatcher_with(Counting()).plan(local, engine(wire, 2))
    assert again._table is not fresh._table
    same_plan(again, fresh)
    same_moves_on_other_addresses(first, again, (2 - 1) << 12)
    # negative control: the first engine's plan is not a plan for the second
    assert not all(np.array_equal(first.remote_descs[p], fresh.remote_descs[p]) for p in fresh.remote_descs)


def test_mla_and_the_bench_shapes_rebase_like_fresh_plans() -> None:
    for shape, p_tp, d_tp in ((DEEPSEEK_MLA, 8, 2), (LLAMA_8B, 4, 8)):
        d = Dispatcher.from_plugins()
        local, remote = ranks(d, shape, p_tp, d_tp)
        wire = columnar(remote)
        first = d.plan(local, engine(wire, 1))
        again = d.plan(local, engine(wire, 5))
        assert again._table is first._table
        same_plan(again, Dispatcher.from_plugins().plan(local, engine(wire, 5)))


def test_a_rebased_plan_still_checks_registered_memory() -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 2, 1)
    wire = columnar(remote)
    d.plan(local, engine(wire, 1))
    bad = copy.deepcopy({r: other_engine(w, 2) for r, w in wire.items()})
    bad[1]["memory"][0][1] -= 1  # its last region now ends one byte past what rank 1 registered
    with pytest.raises(PlanValidationError, match="outside every registered memory range"):
        d.plan(local, parsed(bad))
    with pytest.raises(PlanValidationError, match="outside every registered memory range"):
        Dispatcher.from_plugins().plan(local, parsed(bad))  # the same refusal, cold


def fewer_blocks(wire: dict[int, dict], k: int) -> dict[int, dict]:
    """Engine ``k`` of the layout ``wire`` describes, whose caches hold fewer blocks: ``k + rank``
    fewer on each rank (its memory as it was: the regions end lower); a copy tests may edit."""
    return copy.deepcopy({r: rank_with_fewer_blocks(other_engine(w, k), k + r) for r, w in wire.items()})


@pytest.mark.parametrize("p_tp,d_tp", [(4, 2), (2, 4), (1, 1), (8, 1)])
def test_an_engine_with_other_block_counts_gets_the_layouts_segments_and_its_own_rows(p_tp: int, d_tp: int) -> None:
    d, local, wire, first = first_engine_counted(p_tp, d_tp)
    again = d.plan(local, parsed(fewer_blocks(wire, 2)))
    assert Counting.calls == 1 and again._table is first._table  # recounted: the strategy is not asked again
    assert (first.origin, again.origin) == ("planned", "recounted")
    fresh = dispatcher_with(Counting()).plan(local, parsed(fewer_blocks(wire, 2)))
    assert Counting.calls == 2 and fresh._table is not first._table
    same_plan(again, fresh, nb=30)
    same_entries(again, fresh)
    assert [g.remote_num_blocks for g in again.pairings] == [40 - 2 - max(again.sources)]
    # only the remote side is made anew: the local rows and their ID starts are the first plan's
    assert again.local_descs is first.local_descs and again._local_start is first._local_start
    # negative controls: the first engine's rows and bounds are not the second's, and a plan of
    # one shape is not recounted for ranks of another
    assert [g.remote_num_blocks for g in first.pairings] != [g.remote_num_blocks for g in fresh.pairings]
    assert not all(np.array_equal(first.remote_descs[p], fresh.remote_descs[p]) for p in fresh.remote_descs)
    with pytest.raises(PlanError, match="laid out unlike"):
        first.rebased(parsed(fewer_blocks(wire, 2)))
    renamed = fewer_blocks(wire, 3)
    renamed[min(renamed)]["region_columns"]["name"][0] = "renamed"
    with pytest.raises(PlanError, match="shaped unlike"):
        first.recounted(parsed(renamed))


@pytest.mark.parametrize("shape,p_tp,d_tp", [(DEEPSEEK_MLA, 8, 2), (LLAMA_8B, 4, 8), (LLAMA_8B, 8, 2)])
def test_mla_and_the_bench_shapes_with_other_block_counts_plan_like_fresh(shape, p_tp: int, d_tp: int) -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, shape, p_tp, d_tp)
    wire = columnar(remote)
    first = d.plan(local, engine(wire, 1))
    again = d.plan(local, parsed(fewer_blocks(wire, 4)))
    assert again._table is first._table
    same_plan(again, Dispatcher.from_plugins().plan(local, parsed(fewer_blocks(wire, 4))), nb=30)


def test_a_layout_that_differs_in_more_than_block_counts_is_planned_anew_and_refused_alike() -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 4, 2)
    wire = columnar(remote)
    first = d.plan(local, engine(wire, 1))
    other = copy.deepcopy({r: other_engine(w, 2) for r, w in wire.items()})
    other[1]["region_classes"][0]["num_blocks"] = 39  # fewer blocks: recounted
    again = d.plan(local, parsed(other))
    assert again._table is first._table and again.pairings[0].remote_num_blocks == 39
    other[1]["region_classes"][0]["block_stride"] += 64  # another stride: another shape, planned anew
    other[1]["memory"][0][1] += 64 * 40
    anew = d.plan(local, parsed(other))
    assert anew._table is not first._table
    same_plan(anew, Dispatcher.from_plugins().plan(local, parsed(other)), nb=39)
    bad = copy.deepcopy(other)
    bad[0]["region_classes"][0]["facts"]["head_size"] = 128
    with pytest.raises(IncompatibleGeometry) as warm:
        d.plan(local, parsed(bad))
    with pytest.raises(IncompatibleGeometry) as cold:
        Dispatcher.from_plugins().plan(local, parsed(bad))
    assert str(warm.value) == str(cold.value)


def test_rebased_refuses_a_rank_laid_out_otherwise() -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 2, 1)
    wire = columnar(remote)
    plan = d.plan(local, engine(wire, 1))
    other = copy.deepcopy(wire)
    other[0]["region_columns"]["name"][0] = "renamed"
    with pytest.raises(PlanError, match="remote rank 0 is laid out unlike"):
        plan.rebased(parsed(other))


def test_plans_whose_segments_may_read_addresses_are_never_rebased() -> None:
    CountingPerLayer.calls = 0
    d = dispatcher_with(CountingPerLayer())
    local, remote = ranks(d, SMALL, 2, 1)
    wire = columnar(remote)
    first = d.plan(local, engine(wire, 1))
    assert not first.rebasable
    with pytest.raises(PlanError, match="plan anew"):
        first.rebased(engine(wire, 2))
    calls = CountingPerLayer.calls
    again = d.plan(local, engine(wire, 2))
    assert CountingPerLayer.calls == calls + len(local.regions) and again._table is not first._table


def same_rows(a, b) -> None:
    assert np.array_equal(a.local_descs, b.local_descs) and a.to_dict() == b.to_dict()
    assert list(a.remote_descs) == list(b.remote_descs)
    assert all(np.array_equal(a.remote_descs[p], b.remote_descs[p]) for p in b.remote_descs)


def same_entries(a, b) -> None:
    """What resolve() reads of two plans is equal: per READ, each entry's pairing, phase, both
    sides' row starts and bytes per block; the ranks sharing remote IDs; the pairings' lanes."""
    assert [p for p, _ in a._rank_entries] == [p for p, _ in b._rank_entries]
    for (_, x), (_, y) in zip(a._rank_entries, b._rank_entries):
        assert len(x) == len(y)
        assert all(e[:2] == f[:2] and e[4] == f[4] and e[2].dtype == f[2].dtype == a._np_dtype
                   and np.array_equal(e[2], f[2]) and np.array_equal(e[3], f[3]) for e, f in zip(x, y))
    assert a._same_remote_ids == b._same_remote_ids and a._tail_facts == b._tail_facts and a._declared == b._declared
    assert (a._one_tail_reads is None) == (b._one_tail_reads is None)


def hybrid_first_engine():
    """A dispatcher, the Nemotron-H-like decode rank (P4->D2), the wire of the prefill ranks it
    reads, and its plan with the layout's first engine."""
    d = Dispatcher.from_plugins()
    local, remote, _ = hybrid_setup(Case(NEMOTRON_H_8B, 4, 2, 8192, "contiguous"), d)
    wire = columnar(remote)
    return d, local, wire, d.plan(local, engine(wire, 1))


def test_a_hybrid_whose_groups_alias_is_rebased_where_the_engine_aliases_alike() -> None:
    d, local, wire, first = hybrid_first_engine()
    assert first._aliased and first.rebasable  # groups share one tensor on both sides
    again = d.plan(local, engine(wire, 2))
    assert again._table is first._table  # rebased: the other engine shares rows between the same layers
    fresh = Dispatcher.from_plugins().plan(local, engine(wire, 2))
    same_rows(again, fresh)
    # each pairing's representative remote region is the new engine's
    assert len(again.pairings) == len(fresh.pairings) > 1
    assert [(g.local_group, g.remote_group, g.local_region, g.remote_region) for g in again.pairings] == \
        [(g.local_group, g.remote_group, g.local_region, g.remote_region) for g in fresh.pairings]
    assert [g.remote_region.base for g in again.pairings] != [g.remote_region.base for g in first.pairings]  # control
    # An engine whose layers share memory otherwise is planned anew (rebasing would read wrong rows).
    apart = copy.deepcopy({r: other_engine(w, 3) for r, w in wire.items()})
    for w in apart.values():
        bases = w["region_columns"]["base"]
        i = next(i for i in range(len(bases)) if bases[i] in bases[:i])  # a layer on a tensor an earlier one uses
        w["memory"][0][1] += 1 << 30
        bases[i] = w["memory"][0][0] + w["memory"][0][1] - (1 << 30)  # moved to memory of its own
    with pytest.raises(PlanError, match="share memory unlike"):
        first.rebased(parsed(apart))
    planned = d.plan(local, parsed(apart))  # the same segments; its rows made anew (recounted), sharing where it shares
    fresh = Dispatcher.from_plugins().plan(local, parsed(apart))
    assert planned._table is first._table and fresh._table is not first._table
    same_rows(planned, fresh)
    assert sum(planned.registered_descriptors().values()) > sum(first.registered_descriptors().values())


def test_a_hybrid_engine_with_other_block_counts_is_recounted_like_a_fresh_plan() -> None:
    d, local, wire, first = hybrid_first_engine()
    again = d.plan(local, parsed(fewer_blocks(wire, 3)))
    fresh = Dispatcher.from_plugins().plan(local, parsed(fewer_blocks(wire, 3)))
    assert again._table is first._table and fresh._table is not first._table
    same_rows(again, fresh)
    bounds = lambda plan: [(g.local_group, g.remote_group, g.remote_num_blocks, g.declared, g.remote_region) for g in plan.pairings]  # noqa: E731
    assert bounds(again) == bounds(fresh) != bounds(first)  # control: the first engine's bounds differ
    assert again._declared == fresh._declared and again._declared is not None
    same_entries(again, fresh)
    assert again.local_descs is first.local_descs  # aliasing alike: the local rows stand
    with pytest.raises(AssertionError):  # control: the first engine's remote row starts are not the new engine's
        same_entries(first, fresh)


def test_a_hybrid_engine_with_other_block_counts_that_aliases_otherwise_finds_its_own_shared_rows() -> None:
    """A recount keeps the plan's shared rows only where the new engine's layers share memory
    between the same layers; elsewhere it finds them anew (as a fresh plan does)."""
    d, local, wire, first = hybrid_first_engine()
    apart = copy.deepcopy({r: rank_with_fewer_blocks(other_engine(w, 3), 2) for r, w in wire.items()})
    for w in apart.values():
        bases = w["region_columns"]["base"]
        i = next(i for i in range(len(bases)) if bases[i] in bases[:i])  # a layer on a tensor an earlier one uses
        w["memory"][0][1] += 1 << 30
        bases[i] = w["memory"][0][0] + w["memory"][0][1] - (1 << 30)  # moved to memory of its own
    planned = d.plan(local, parsed(apart))
    fresh = Dispatcher.from_plugins().plan(local, parsed(apart))
    assert planned.origin == "recounted" and planned._table is first._table
    same_rows(planned, fresh)
    same_entries(planned, fresh)
    assert planned.local_descs is not first.local_descs  # its local rows are made anew
    assert not np.array_equal(planned._shared, first._shared)  # control: the first engine's sharing would be wrong here
    alike_wire = {r: rank_with_fewer_blocks(other_engine(w, 4), 1) for r, w in wire.items()}
    alike = d.plan(local, parsed(alike_wire))
    assert alike.origin == "recounted" and alike._shared is first._shared  # aliasing alike: kept
    fresh_alike = Dispatcher.from_plugins().plan(local, parsed(alike_wire))
    same_rows(alike, fresh_alike)
    same_entries(alike, fresh_alike)


def test_recounted_bounds_are_each_pairings_least_count_where_the_peer_lists_layers_in_another_order() -> None:
    """Each pairing's remote bound is the least block count over its own layers' regions on every
    rank read, found where the remote ranks list the layers in another order than this rank."""
    d = Dispatcher.from_plugins()
    local, remote, _ = hybrid_setup(Case(NEMOTRON_H_8B, 4, 2, 8192, "contiguous"), d)
    wire = columnar(remote)
    n = len(local.regions)
    order = [(7 * i + 3) % n for i in range(n)]  # 7 is prime to the layer count: a permutation
    assert sorted(order) == list(range(n))

    def reordered(w: dict, k: int) -> dict:
        w = copy.deepcopy(other_engine(w, k))
        w["region_columns"] = {c: [v[i] for i in order] for c, v in w["region_columns"].items()}
        return w

    first = d.plan(local, parsed({r: reordered(w, 1) for r, w in wire.items()}))
    counted = {r: reordered(w, 2) for r, w in wire.items()}
    attention = next(c for c, cd in enumerate(counted[max(counted)]["region_classes"]) if cd["strategy"] == "full_attention")
    counted[max(counted)]["region_classes"][attention]["num_blocks"] -= 3  # one class, on one rank
    again = d.plan(local, parsed(counted))
    fresh = Dispatcher.from_plugins().plan(local, parsed(counted))
    assert again.origin == "recounted" and fresh.origin == "planned"
    same_rows(again, fresh)
    bounds = lambda plan: [(g.local_group, g.remote_group, g.remote_num_blocks, g.remote_region) for g in plan.pairings]  # noqa: E731
    assert bounds(again) == bounds(fresh)
    assert [g.remote_num_blocks for g in again.pairings] != [g.remote_num_blocks for g in first.pairings]  # control
    assert len({g.remote_num_blocks for g in again.pairings}) == 2  # the attention group's bound alone moved


class PairsByCount(Counting):
    """Full attention that declares its pairing only where the remote region holds at least 38
    blocks (a declaration that reads the block count: nothing forbids it)."""

    name = "pairs_by_count"
    overrides = ("full_attention", "counting")

    def block_pairing(self, local, remote):
        return super().block_pairing(local, remote) if remote.num_blocks >= 38 else None


def test_a_recount_asks_the_strategy_for_its_declared_pairing_again() -> None:
    d = dispatcher_with(PairsByCount())
    local, remote = ranks(d, SMALL, 4, 2)
    wire = columnar(remote)
    first = d.plan(local, engine(wire, 1))
    again = d.plan(local, parsed(fewer_blocks(wire, 5)))
    fresh = dispatcher_with(PairsByCount()).plan(local, parsed(fewer_blocks(wire, 5)))
    assert again.origin == "recounted" and again._table is first._table
    assert first.pairings[0].declared is not None  # control: the first engine's 40 blocks declare it
    assert [g.declared for g in again.pairings] == [g.declared for g in fresh.pairings] == [None]
    same_plan(again, fresh, nb=34)


def test_what_a_decode_rank_covers_and_reads_is_remembered_per_geometry_and_tp_size() -> None:
    d = Dispatcher.from_plugins()
    local, _ = ranks(d, SMALL, 4, 2)
    topology, covered, sources = d._reading(local, 4)
    assert (tuple(covered), sources) == ((0, 1), (0, 1)) and d.read_ranks(local, 4) == (0, 1)
    again = d._reading(local, 4)
    assert again[0] is topology and again[1] is covered  # remembered
    assert tuple(d._reading(local, 8)[1]) == (0, 1, 2, 3)  # another TP size: its own answer
    twin = dataclasses.replace(local)  # an equal geometry, another object: its own entry
    assert d._reading(twin, 4)[0] is not topology
    assert d._readers[(id(local), 4)][0] is local  # the entry holds its geometry: its id stays taken


def test_same_partition_means_equal_bases_in_the_same_places() -> None:
    from nixlkv.core.plan_reuse import _same_partition

    class Cols:
        def __init__(self, bases):
            self.base_list = list(bases)

    assert _same_partition(Cols([10, 10, 30]), Cols([70, 70, 90]))
    assert not _same_partition(Cols([10, 10, 30]), Cols([70, 80, 90]))  # split
    assert not _same_partition(Cols([10, 20, 30]), Cols([70, 70, 90]))  # merged
    assert not _same_partition(Cols([10, 10, 30, 30]), Cols([70, 80, 70, 80]))  # as many, elsewhere
    assert not _same_partition(Cols([10, 20]), Cols([10, 20, 30]))
    assert _same_partition(Cols([10, 10, 30]), Cols([15, 15, 35]))  # one shift
    assert not _same_partition(Cols([10, 20, 30]), Cols([15, 15, 35]))  # not one shift: merged
    rng = np.random.default_rng(0)  # against the definition: the first region at each region's base
    first_at = lambda bases: [bases.index(b) for b in bases]  # noqa: E731
    for _ in range(500):
        n = int(rng.integers(1, 7))
        a, b = rng.integers(0, 4, n).tolist(), rng.integers(0, 4, n).tolist()
        assert _same_partition(Cols(a), Cols(b)) == (first_at(a) == first_at(b)), (a, b)


def test_the_plan_memo_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(dispatcher_module, "MEMO_PLANS", 2)
    d = Dispatcher.from_plugins()
    locals_ = []
    for nb in (40, 41, 42):
        local, remote = ranks(d, SMALL, 2, 1, nb=nb)
        locals_.append(local)
        d.plan(local, parsed(columnar(remote)))
        assert 1 <= len(d._plans) <= 2


def test_a_columnar_geometry_makes_only_the_regions_it_is_asked_for() -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 2, 1)
    wire = columnar(remote)
    g = RankGeometry.from_dict(wire[0])
    assert isinstance(g.regions, ColumnRegions)
    # at most its one class's first region, for the columns (none where the layout was seen before)
    assert g.regions._made is None or sum(r is not None for r in g.regions._made) == 1
    d.plan(local, {0: g, 1: RankGeometry.from_dict(wire[1])})
    made = [r for r in g.regions._made if r is not None]
    assert 1 <= len(made) < len(local.regions)  # the planner read one region per class
    eager = remote[0]
    assert g == eager and eager == g  # the same geometry as the per-region form's
    assert g.regions == eager.regions and list(g.regions) == list(eager.regions)
    assert g.regions[-1] == eager.regions[-1] and g.regions[1:3] == eager.regions[1:3]
    assert g.names == eager.names and len(g.regions) == len(eager.regions)
    assert repr(g.regions) == repr(eager.regions)
    moved = RankGeometry.from_dict(other_engine(wire[0], 1))
    assert moved != g and moved.regions != g.regions  # negative control: other bases differ
    assert moved.layout_key == g.layout_key  # ... and the layout does not


class LyingInt(int):
    """An int subclass whose repr reads like another number: the parse memo must not trust it
    (marshal, which keys it, refuses subclasses)."""

    def __repr__(self) -> str:
        return "40"


def test_a_remembered_class_description_is_matched_with_its_types() -> None:
    from nixlkv.core import HandshakeError
    from nixlkv.core import wire as geometry_module  # the parse memos, in the wire codec's module

    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 1, 1)
    wire = columnar(remote)[0]
    RankGeometry.from_dict(wire)  # remembered now
    assert marshal.dumps(wire["region_classes"][0], 2) in geometry_module._DESCRIBED
    for field, value in (("num_blocks", 40.0), ("num_blocks", True), ("block_stride", str(wire["region_classes"][0]["block_stride"]))):
        bad = copy.deepcopy(wire)
        bad["region_classes"][0][field] = value  # equal (or alike) to a remembered value, not the same type
        with pytest.raises(HandshakeError, match=field):
            RankGeometry.from_dict(bad)
    odd = copy.deepcopy(wire)
    odd["region_classes"][0]["num_blocks"] = LyingInt(39)  # repr "40": the remembered description's
    g = RankGeometry.from_dict(odd)
    assert g.regions[0].num_blocks == 39  # parsed, not taken from the memo
    fine = copy.deepcopy(wire)
    fine["region_classes"][0]["facts"]["head_size"] = 80  # another description: parsed, then remembered
    assert RankGeometry.from_dict(fine).regions[0].facts["head_size"] == 80
    assert RankGeometry.from_dict(wire).regions[0].facts["head_size"] == 64


@pytest.mark.parametrize("num_classes", [3, 12])  # a handful (scanned per class), and many (one pass)
def test_class_firsts_name_each_class_first_region(num_classes: int) -> None:
    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 1, 1)
    wire = copy.deepcopy(columnar(remote)[0])
    n = len(wire["region_columns"]["name"])
    proto = wire["region_classes"][0]
    wire["region_classes"] = [dict(copy.deepcopy(proto), facts={**proto["facts"], "tag": k}) for k in range(num_classes)]
    order = [(7 * i + 3) % num_classes for i in range(n)]  # classes first met out of numeric order
    wire["region_columns"]["class"] = order
    g = RankGeometry.from_dict(wire)
    expected = {}
    for i, c in enumerate(order):
        expected.setdefault(c, i)
    assert g.class_firsts == expected and list(g.class_firsts) == list(expected)
    assert [r.facts["tag"] for r in g.class_regions] == list(expected)


def test_a_remembered_layout_parses_as_a_first_one_and_still_checks_what_differs() -> None:
    from nixlkv.core import HandshakeError
    from nixlkv.core import wire as geometry_module  # the parse memos, in the wire codec's module

    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 2, 1)
    wire = columnar(remote)[0]
    geometry_module._LAYOUTS.clear()
    first = RankGeometry.from_dict(other_engine(wire, 1))
    (remembered,) = geometry_module._LAYOUTS.values()
    assert remembered.template is not None
    moved = other_engine(wire, 2)
    moved["device_id"] = 3
    hit = RankGeometry.from_dict(moved)
    assert hit.regions._protos is remembered.protos  # the remembered layout served it
    cold_layouts = dict(geometry_module._LAYOUTS)
    geometry_module._LAYOUTS.clear()
    cold = RankGeometry.from_dict(moved)  # the same reply, parsed as a first
    assert cold.regions._protos is not remembered.protos
    geometry_module._LAYOUTS.update(cold_layouts)
    assert hit == cold and np.array_equal(hit.columns, cold.columns) and hit.columns.dtype == cold.columns.dtype
    assert hit.class_firsts == cold.class_firsts and hit.layout_key == cold.layout_key == first.layout_key
    assert not np.array_equal(hit.columns, first.columns)  # negative control: other bases and device
    assert (hit.columns[:, 2] == 3).all()
    for column, value, match in (("base", 1 << 62, "beyond 2"), ("base", -1, "non-negative"), ("base", True, "non-negative"),
                                 ("group", True, "non-negative"), ("class", 1.0, "non-negative"), ("name", 7, "non-empty string")):
        bad = copy.deepcopy(moved)
        bad["region_columns"][column][1] = value  # otherwise the remembered layout
        with pytest.raises(HandshakeError, match=match):
            RankGeometry.from_dict(bad)
    dup = copy.deepcopy(moved)
    dup["region_columns"]["name"][1] = dup["region_columns"]["name"][0]
    with pytest.raises(HandshakeError, match="repeats region names"):
        RankGeometry.from_dict(dup)
    # A layout is remembered by the exact bytes of its descriptions and columns: a value equal in
    # Python but of another type (16.0 == 16, True == 1) is a layout of its own, parsed and refused.
    for column, value in (("num_blocks", float(wire["region_classes"][0]["num_blocks"])), ("block_stride", True)):
        retyped = copy.deepcopy(moved)
        retyped["region_classes"][0][column] = value
        assert retyped["region_classes"][0][column] == value  # equal in Python to a remembered value's kind
        with pytest.raises(HandshakeError, match=column):
            RankGeometry.from_dict(retyped)
    assert RankGeometry.from_dict(copy.deepcopy(moved)).regions._protos is remembered.protos  # the control: a hit


def test_an_engine_with_other_block_counts_parses_from_the_remembered_shape_as_a_first_one() -> None:
    """An engine of a layout met before whose memory holds other block counts sends the same
    shape: its layout is the remembered one recounted, and parses exactly as a cold parse would."""
    from nixlkv.core import wire as geometry_module  # the parse memos, in the wire codec's module

    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 2, 1)
    wire = columnar(remote)[0]
    geometry_module.forget_parsed()
    first = RankGeometry.from_dict(other_engine(wire, 1))
    (shaped,) = geometry_module._SHAPED.values()
    fewer = rank_with_fewer_blocks(other_engine(wire, 2), 5)
    hit = RankGeometry.from_dict(fewer)
    assert len(geometry_module._LAYOUTS) == 2 and len(geometry_module._SHAPED) == 1
    assert hit.regions._names is shaped.names and hit.regions._protos is not shaped.protos  # recounted from the shape
    geometry_module.forget_parsed()
    cold = RankGeometry.from_dict(copy.deepcopy(fewer))  # the same reply, parsed as a first
    assert hit == cold and np.array_equal(hit.columns, cold.columns) and hit.columns.dtype == cold.columns.dtype
    assert hit.layout_key == cold.layout_key and hit.shape_key == cold.shape_key == first.shape_key
    assert hit.class_keys == cold.class_keys and hit.class_firsts == cold.class_firsts
    assert [r.num_blocks for r in hit.regions] == [r.num_blocks - 5 for r in first.regions]
    assert hit.layout_key != first.layout_key  # negative control: the counts are part of the layout
    assert hit._shape_tail is shaped.shape  # the shape's own key, not made again per engine


def test_a_recounted_layout_keys_every_class_with_its_new_count_as_a_cold_parse_does() -> None:
    """The hybrid's three classes (two Mamba, one attention): a recounted layout's layout key
    (each class's key with its own new count) and shape key equal a cold parse's."""
    from nixlkv.core import wire as geometry_module  # the parse memos, in the wire codec's module

    d = Dispatcher.from_plugins()
    _, remote, _ = hybrid_setup(Case(NEMOTRON_H_8B, 4, 2, 8192, "contiguous"), d)
    wire = columnar(remote)[min(remote)]
    wire["region_classes"][1]["num_blocks"] += 7  # classes with counts of their own
    geometry_module.forget_parsed()
    first = RankGeometry.from_dict(other_engine(wire, 1))
    assert len(first.class_keys) == 3
    fewer = rank_with_fewer_blocks(other_engine(wire, 2), 3)
    fewer["region_classes"][2]["num_blocks"] -= 2
    hit = RankGeometry.from_dict(fewer)
    geometry_module.forget_parsed()
    cold = RankGeometry.from_dict(copy.deepcopy(fewer))
    assert hit.layout_key == cold.layout_key != first.layout_key  # control: the first engine's counts differ
    assert np.array_equal(hit.columns, cold.columns) and not np.array_equal(hit.columns[:, 4], first.columns[:, 4])
    assert hit.shape_key == cold.shape_key == first.shape_key
    assert [k[1] for k in hit.class_keys.values()] == [c["num_blocks"] for c in fewer["region_classes"]]
    assert not np.array_equal(hit.columns[:, 4], first.columns[:, 4])


def test_a_remembered_shape_refuses_the_block_counts_a_first_parse_refuses() -> None:
    """A count the remembered shape cannot take is parsed as a first, and refused naming it:
    none, a bool or a float, a span past any address, pages wider than the stride they step by."""
    from nixlkv.core import HandshakeError
    from nixlkv.core import wire as geometry_module  # the parse memos, in the wire codec's module

    d = Dispatcher.from_plugins()
    _, remote = ranks(d, SMALL, 1, 1)
    wire = copy.deepcopy(columnar(remote)[0])
    one = copy.deepcopy(wire)
    page = RankGeometry.from_dict(wire).regions[0].page.nbytes
    one["region_classes"][0].update(num_blocks=1, block_stride=page // 2)  # one block: a stride shorter than its page is fine
    stride = wire["region_classes"][0]["block_stride"]
    cases = {0: ((0, "num_blocks"), (True, "num_blocks"), (2.0, "num_blocks"), ((1 << 62) // stride + 2, "spans")),
             1: ((2, "exceeds the block stride"), (0, "num_blocks"))}
    for k, remembered in enumerate((wire, one)):
        geometry_module.forget_parsed()
        RankGeometry.from_dict(remembered)
        assert len(geometry_module._SHAPED) == 1
        for count, match in cases[k]:
            bad = copy.deepcopy(remembered)
            bad["region_classes"][0]["num_blocks"] = count
            with pytest.raises(HandshakeError, match=match):
                RankGeometry.from_dict(bad)
        fine = copy.deepcopy(remembered)  # the control: a count the shape takes, recounted from it
        fine["region_classes"][0]["num_blocks"] = 3 if k == 0 else 1
        fine["region_columns"]["base"] = [b + 4096 for b in fine["region_columns"]["base"]]
        parsed_fine = RankGeometry.from_dict(fine)
        assert parsed_fine.regions[0].num_blocks == fine["region_classes"][0]["num_blocks"]
        assert parsed_fine.regions._names is next(iter(geometry_module._SHAPED.values())).names


def test_forget_handshakes_empties_every_process_wide_memo_a_handshake_fills() -> None:
    """The bench times a layout's first handshake after forget_handshakes(): every memo a parse
    or a plan fills in the process (not only the dispatcher's) must be empty then, or the
    first handshake it reports would be a warm one."""
    from nixlkv.core import byte_runs, topology
    from nixlkv.core import wire as geometry  # the parse memos, in the wire codec's module
    from nixlkv.core.dispatcher import forget_handshakes

    memos = lambda: (len(geometry._DESCRIBED), len(geometry._LAYOUTS), len(geometry._SHAPED),  # noqa: E731
                     byte_runs._box_copy_runs_cached.cache_info().currsize, topology.head_sources.cache_info().currsize)
    d = Dispatcher.from_plugins()
    # D at twice P's block size: each block pair copies half of D's tokens, runs per head that
    # box_copy_runs computes and remembers (a whole page or a head slice is one run, not remembered)
    local = fabricate_rank(d, dataclasses.replace(SMALL, block_size=32), "decode", 2, 0, 20)
    remote = {r: fabricate_rank(d, SMALL, "prefill", 4, r, 40) for r in (0, 1)}
    forget_handshakes()
    wire = {r: g.to_wire() for r, g in remote.items()}
    Dispatcher(d.registry, unwrap=d._unwrap).plan(local, {r: RankGeometry.from_dict(w) for r, w in wire.items()})
    assert all(memos())  # negative control: one handshake fills each of them
    forget_handshakes()
    assert memos() == (0, 0, 0, 0, 0)
