"""Registry dispatch, pluggy registration, spec unwrapping, and transfer plans over fake memory.

Everything here uses TOY spec classes and TOY strategies: no engine is involved. Addresses are
plain integers; planning never touches memory, so none is allocated.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pluggy
import pytest

import nixlkv.core.hookspecs as hookspecs
from nixlkv.core import (
    Dispatcher,
    IdScratch,
    IncompatibleGeometry,
    IncompatibleTopology,
    LayerCache,
    NoStrategyError,
    PageLayout,
    PlanError,
    PlanValidationError,
    RankGeometry,
    Region,
    RegistryError,
    RequestError,
    Segment,
    Strategy,
    StrategyConflict,
    StrategyRegistry,
    Topology,
    TransferPlan,
    box_copy_runs,
    head_sources,
    heads_held,
    hookimpl,
)
from nixlkv.core.request_ids import expand_ids
from nixlkv.core.registry import Registered

# ============================================================================ toy specs


class ToySpec:
    def __init__(self, tag: str = "") -> None:
        self.tag = tag


class ToyFull(ToySpec):
    pass


class ToyMLA(ToyFull):
    pass


class ToySliding(ToyFull):  # no strategy of its own: falls back to ToyFull's
    pass


class Alien:  # served by nobody
    pass


class Wrapper:
    """A group-level spec holding one spec per layer (like vLLM's UniformTypeKVCacheSpecs)."""

    def __init__(self, specs: Mapping[str, Any]) -> None:
        self.specs = dict(specs)


# ============================================================================ toy strategies


class WholePage(Strategy):
    """Equal TP only: each local page is the same-named page of the local rank's twin."""

    name = "toy_base"
    spec_types = (ToySpec,)

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        return Region(
            name=layer.name,
            group=layer.group,
            strategy=self.name,
            base=layer.base,
            num_blocks=layer.num_blocks,
            block_stride=layer.block_stride,
            page=layer.page,
            facts={"spec": type(layer.spec).__name__, "tag": getattr(layer.spec, "tag", "")},
        )

    def segments(self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int) -> list[Segment]:
        out = []
        for rank, peer in sorted(remote.items()):
            out.extend(
                Segment(local.name, d, rank, peer.name, s, n)
                for d, s, n in box_copy_runs(local.page, {}, peer.page, {}, {})
            )
        return out


class ToyFullStrategy(WholePage):
    name = "toy_full"
    spec_types = (ToyFull,)


class ToyMLAStrategy(WholePage):
    name = "toy_mla"
    spec_types = (ToyMLA,)


class HeadSliced(Strategy):
    """Head-outer pages, heads split over TP: one segment per head run (core.topology)."""

    name = "toy_heads"
    spec_types = (ToyFull,)

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        total = layer.hints["total_kv_heads"]
        held = heads_held(topology.tp_rank, topology.tp_size, total)
        return Region(
            layer.name, layer.group, self.name, layer.base, layer.num_blocks, layer.block_stride, layer.page,
            facts={"total_kv_heads": total, "head_start": held.start},
        )

    def segments(self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int) -> list[Segment]:
        out = []
        for run in head_sources(local_topology.tp_rank, local_topology.tp_size, remote_tp, local.fact("total_kv_heads")):
            peer = remote[run.remote_rank]
            (d, s, n), = box_copy_runs(local.page, {"head": run.local_slot}, peer.page, {"head": run.remote_slot}, {"head": run.count})
            out.append(Segment(local.name, d, run.remote_rank, peer.name, s, n))
        return out


class Scripted(WholePage):
    """Returns whatever segments a test scripts, to exercise plan validation."""

    name = "toy_scripted"
    spec_types = (ToyFull,)

    def __init__(self, script: Callable[[Region, Mapping[int, Region]], list[Segment]]) -> None:
        self.script = script

    def segments(self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int) -> list[Segment]:
        return self.script(local, remote)


def make_strategy(name: str, types_: tuple[type, ...], overrides: tuple[str, ...] = (), base: type = WholePage) -> Strategy:
    cls = type(f"S_{name}", (base,), {"name": name, "spec_types": types_, "overrides": overrides})
    return cls()


def registry(*strategies: Strategy, **options: Any) -> StrategyRegistry:
    return StrategyRegistry([Registered(s, f"origin-of-{s.name}") for s in strategies], **options)


def standard() -> list[Strategy]:
    return [WholePage(), ToyFullStrategy(), ToyMLAStrategy()]


def new_pm() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("nixlkv")
    pm.add_hookspecs(hookspecs)
    return pm


# ============================================================================ registry dispatch


def test_mro_dispatch_most_specific_wins() -> None:
    reg = registry(*standard())
    assert reg.for_type(ToySpec).name == "toy_base"
    assert reg.for_type(ToyFull).name == "toy_full"
    assert reg.for_type(ToyMLA).name == "toy_mla"
    # no strategy of its own: the parent's
    assert reg.for_type(ToySliding).name == "toy_full"


def test_dispatch_independent_of_registration_order() -> None:
    reg = registry(*reversed(standard()))
    assert [reg.for_type(t).name for t in (ToySpec, ToyFull, ToyMLA, ToySliding)] == [
        "toy_base", "toy_full", "toy_mla", "toy_full",
    ]


def test_same_exact_type_conflict_names_both() -> None:
    a = make_strategy("alpha", (ToyFull,))
    b = make_strategy("beta", (ToyFull,))
    with pytest.raises(StrategyConflict) as info:
        registry(WholePage(), a, b)
    msg = str(info.value)
    assert "alpha" in msg and "beta" in msg and "ToyFull" in msg
    assert "origin-of-alpha" in msg and "origin-of-beta" in msg


@pytest.mark.parametrize("order", ["overrider_first", "overrider_last"])
def test_override_resolves_conflict(order: str) -> None:
    a = make_strategy("alpha", (ToyFull,))
    b = make_strategy("beta", (ToyFull,), overrides=("alpha",))
    reg = registry(b, a) if order == "overrider_first" else registry(a, b)
    assert reg.for_type(ToyFull).name == "beta"
    assert reg.for_type(ToySliding).name == "beta"
    # the overridden one is still registered and reachable by name
    assert reg.by_name("alpha") is a


def test_mutual_override_is_a_conflict() -> None:
    a = make_strategy("alpha", (ToyFull,), overrides=("beta",))
    b = make_strategy("beta", (ToyFull,), overrides=("alpha",))
    with pytest.raises(StrategyConflict):
        registry(a, b)


def test_override_of_another_type_does_not_matter() -> None:
    # overriding is per claimed type: claims on different types never conflict
    a = make_strategy("alpha", (ToyFull,))
    b = make_strategy("beta", (ToyMLA,), overrides=("alpha",))
    reg = registry(a, b)
    assert reg.for_type(ToyFull).name == "alpha"
    assert reg.for_type(ToyMLA).name == "beta"


def test_duplicate_names_raise() -> None:
    a = make_strategy("same", (ToyFull,))
    b = make_strategy("same", (ToyMLA,))
    with pytest.raises(RegistryError) as info:
        registry(a, b)
    assert "same" in str(info.value)


def test_empty_name_raises() -> None:
    with pytest.raises(RegistryError):
        registry(make_strategy("", (ToyFull,)))


def test_disabled_removes_strategy_and_resolves_conflict() -> None:
    a = make_strategy("alpha", (ToyFull,))
    b = make_strategy("beta", (ToyFull,))
    reg = registry(WholePage(), a, b, disabled=["alpha"])
    assert reg.for_type(ToyFull).name == "beta"
    assert [r.strategy.name for r in reg.registered()] == ["toy_base", "beta"]
    with pytest.raises(RegistryError):
        reg.by_name("alpha")


def test_disabled_falls_back_along_mro() -> None:
    reg = registry(*standard(), disabled=["toy_full"])
    assert reg.for_type(ToyFull).name == "toy_base"
    assert reg.for_type(ToySliding).name == "toy_base"
    assert reg.for_type(ToyMLA).name == "toy_mla"


def test_disable_unknown_raises() -> None:
    with pytest.raises(RegistryError, match="nope"):
        registry(*standard(), disabled=["nope"])


def test_pin_forces_a_base_strategy_for_exact_class_name() -> None:
    reg = registry(*standard(), pins={"ToyFull": "toy_base"})
    assert reg.for_type(ToyFull).name == "toy_base"
    # pins are per class name: subclasses still dispatch by MRO
    assert reg.for_type(ToyMLA).name == "toy_mla"
    assert reg.for_type(ToySliding).name == "toy_full"


def test_pin_to_unknown_strategy_raises_at_construction() -> None:
    with pytest.raises(RegistryError, match="ghost"):
        registry(*standard(), pins={"ToyFull": "ghost"})


def test_pin_to_strategy_not_serving_the_type_raises() -> None:
    reg = registry(*standard(), pins={"ToyFull": "toy_mla"})  # toy_mla serves only the subclass ToyMLA
    with pytest.raises(RegistryError) as info:
        reg.for_type(ToyFull)
    assert not isinstance(info.value, NoStrategyError)
    assert "toy_mla" in str(info.value) and "ToyFull" in str(info.value)


def test_unknown_type_names_type_and_installed_strategies() -> None:
    reg = registry(*standard())
    with pytest.raises(NoStrategyError) as info:
        reg.for_type(Alien)
    msg = str(info.value)
    assert "Alien" in msg
    for name in ("toy_base", "toy_full", "toy_mla"):
        assert name in msg
    assert isinstance(info.value, RegistryError)


def test_no_strategies_at_all() -> None:
    with pytest.raises(NoStrategyError, match="ToySpec"):
        registry().for_type(ToySpec)


# ============================================================================ pluggy registration


class ToyPlugin:
    @hookimpl
    def nixlkv_strategies(self) -> list[Strategy]:
        return standard()

    @hookimpl
    def nixlkv_unwrap_spec(self, spec: Any, layer_name: str) -> Any:
        if isinstance(spec, Wrapper):
            return spec.specs[layer_name]
        return None


def _module_plugin(name: str, strategies: Callable[[], list[Any]]) -> types.ModuleType:
    mod = types.ModuleType(name)

    @hookimpl
    def nixlkv_strategies() -> list[Any]:
        return strategies()

    mod.nixlkv_strategies = nixlkv_strategies
    return mod


def test_from_plugins_with_object_plugin() -> None:
    pm = new_pm()
    pm.register(ToyPlugin(), name="toys")
    reg = StrategyRegistry.from_plugins(pm)
    assert sorted(r.strategy.name for r in reg.registered()) == ["toy_base", "toy_full", "toy_mla"]
    assert {r.origin for r in reg.registered()} == {"toys"}
    assert reg.for_type(ToySliding).name == "toy_full"


def test_from_plugins_with_module_plugins_conflict_names_plugins() -> None:
    pm = new_pm()
    pm.register(ToyPlugin(), name="toys")
    pm.register(_module_plugin("third_party", lambda: [make_strategy("rival", (ToyMLA,))]), name="rival_plugin")
    with pytest.raises(StrategyConflict) as info:
        StrategyRegistry.from_plugins(pm)
    msg = str(info.value)
    assert "toy_mla" in msg and "rival" in msg and "rival_plugin" in msg and "toys" in msg


def test_from_plugins_override_and_options() -> None:
    pm = new_pm()
    pm.register(ToyPlugin(), name="toys")
    pm.register(
        _module_plugin("better", lambda: [make_strategy("better_mla", (ToyMLA,), overrides=("toy_mla",))]),
        name="better",
    )
    reg = StrategyRegistry.from_plugins(pm)
    assert reg.for_type(ToyMLA).name == "better_mla"
    # the same plugins, with the override disabled, or pinned away
    assert StrategyRegistry.from_plugins(pm, disabled=["better_mla"]).for_type(ToyMLA).name == "toy_mla"
    assert StrategyRegistry.from_plugins(pm, pins={"ToyMLA": "toy_full"}).for_type(ToyMLA).name == "toy_full"
    # allow keeps only listed plugins
    assert StrategyRegistry.from_plugins(pm, allow=["toys"]).for_type(ToyMLA).name == "toy_mla"


def test_from_plugins_rejects_non_strategy() -> None:
    pm = new_pm()
    pm.register(_module_plugin("bad", lambda: [object()]), name="bad")
    with pytest.raises(RegistryError, match="bad"):
        StrategyRegistry.from_plugins(pm)


def test_unwrap_hook_used_per_layer_name() -> None:
    pm = new_pm()
    pm.register(ToyPlugin(), name="toys")
    disp = Dispatcher.from_plugins(pm)
    wrapper = Wrapper({"L0": ToyFull(), "L1": ToyMLA(), "L2": ToySpec()})
    assert disp.strategy_for(wrapper, "L0").name == "toy_full"
    assert disp.strategy_for(wrapper, "L1").name == "toy_mla"
    assert disp.strategy_for(wrapper, "L2").name == "toy_base"
    nested = Wrapper({"L0": Wrapper({"L0": ToyMLA()})})
    assert disp.strategy_for(nested, "L0").name == "toy_mla"
    # strategies see the unwrapped spec in local_region
    layers = [_layer("L0", 0, 0x1000, spec=wrapper), _layer("L1", 0, 0x9000, spec=wrapper)]
    g = disp.local_geometry("d", Topology(1, 0), layers, _memory(layers))
    assert [(r.strategy, r.facts["spec"]) for r in g.regions] == [("toy_full", "ToyFull"), ("toy_mla", "ToyMLA")]


def test_unwrap_first_non_none_answer_wins() -> None:
    class Decline:
        @hookimpl
        def nixlkv_unwrap_spec(self, spec: Any, layer_name: str) -> Any:
            return None

    pm = new_pm()
    pm.register(ToyPlugin(), name="toys")
    pm.register(Decline(), name="decline")
    assert Dispatcher.from_plugins(pm).strategy_for(Wrapper({"x": ToyMLA()}), "x").name == "toy_mla"


def test_without_unwrap_hook_the_wrapper_is_unknown() -> None:
    disp = Dispatcher(registry(*standard()))
    with pytest.raises(NoStrategyError, match="Wrapper"):
        disp.strategy_for(Wrapper({"L0": ToyFull()}), "L0")


def test_unwrap_that_never_ends_raises_plan_error() -> None:
    class Loop:
        @hookimpl
        def nixlkv_unwrap_spec(self, spec: Any, layer_name: str) -> Any:
            return spec  # a wrapper that always "unwraps" to itself

    pm = new_pm()
    pm.register(ToyPlugin(), name="toys")
    pm.register(Loop(), name="loop")
    with pytest.raises(PlanError, match="L7"):
        Dispatcher.from_plugins(pm).strategy_for(Wrapper({}), "L7")


def test_region_claiming_another_strategy_raises() -> None:
    class Liar(WholePage):
        name = "liar"
        spec_types = (ToyMLA,)

        def local_region(self, layer: LayerCache, topology: Topology) -> Region:
            r = super().local_region(layer, topology)
            return Region(r.name, r.group, "toy_full", r.base, r.num_blocks, r.block_stride, r.page)

    disp = Dispatcher(registry(WholePage(), ToyFullStrategy(), Liar()))
    layers = [_layer("L0", 0, 0x1000, spec=ToyMLA())]
    with pytest.raises(PlanError, match="liar"):
        disp.local_geometry("d", Topology(1, 0), layers, _memory(layers))



class TwoParts(WholePage):
    """A layer whose page is two differently-planned parts (like Mamba's [conv | ssm]): one region each."""

    name = "toy_parts"
    spec_types = (ToyMLA,)
    group_shift = 0

    def local_regions(self, layer: LayerCache, topology: Topology) -> list[Region]:
        half = PageLayout((("byte", layer.page.nbytes // 2),))
        return [
            Region(f"{layer.name}:{part}", layer.group + self.group_shift, self.name, layer.base + i * half.nbytes,
                   layer.num_blocks, layer.block_stride, half)
            for i, part in enumerate(("a", "b"))
        ]


def test_a_layer_may_be_several_regions_planned_and_resolved_together() -> None:
    disp = Dispatcher(registry(WholePage(), TwoParts()))
    page = PageLayout((("byte", 64),))
    loc = [_layer("S0", 0, 0x1000, ToyMLA(), num_blocks=4, stride=64, page=page)]
    rem = [_layer("S0", 0, 0x9000, ToyMLA(), num_blocks=6, stride=128, page=page)]
    local = disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    assert [r.name for r in local.regions] == ["S0:a", "S0:b"]
    plan = disp.plan(local, {0: disp.local_geometry("p", Topology(1, 0), rem, _memory(rem))})
    moves = plan.byte_moves(plan.resolve([[3]], [[5]]))
    assert sorted(moves) == [(0x1000 + 3 * 64, 0, 0x9000 + 5 * 128, 32), (0x1000 + 3 * 64 + 32, 0, 0x9000 + 5 * 128 + 32, 32)]


def test_a_region_outside_its_layers_group_raises() -> None:
    class Stray(TwoParts):
        group_shift = 1

    layers = [_layer("S0", 0, 0x1000, ToyMLA(), num_blocks=4, stride=64, page=PageLayout((("byte", 64),)))]
    with pytest.raises(PlanError, match=r"KV group 1, but the layer is in group 0"):
        Dispatcher(registry(WholePage(), Stray())).local_geometry("d", Topology(1, 0), layers, _memory(layers))


# ============================================================================ plans over fake memory

PAGE = PageLayout((("head", 2), ("token", 4), ("byte", 16)))  # 128 B


def _layer(
    name: str,
    group: int,
    base: int,
    spec: Any = None,
    num_blocks: int = 8,
    stride: int = 256,
    page: PageLayout = PAGE,
    hints: Mapping[str, Any] | None = None,
) -> LayerCache:
    return LayerCache(name, group, spec if spec is not None else ToyFull(), base, num_blocks, stride, page, dict(hints or {}))


def _memory(layers: Sequence[LayerCache]) -> list[tuple[int, int]]:
    return [(l.base, l.num_blocks * l.block_stride) for l in layers]


def _local_layers() -> list[LayerCache]:
    # interleaved groups: rows L0(g0), M0(g1), L1(g0); L0/L1 share one allocation, interleaved
    return [
        _layer("L0", 0, 0x10000, ToyFull("a")),
        _layer("M0", 1, 0x40000, ToyMLA(), num_blocks=6, stride=64, page=PageLayout((("token", 4), ("byte", 16)))),
        _layer("L1", 0, 0x10000 + 128, ToyFull("b")),
    ]


def _remote_layers() -> list[LayerCache]:
    return [
        _layer("L0", 0, 0x800000, ToyFull("a"), num_blocks=10, stride=512),
        _layer("M0", 1, 0x900000, ToyMLA(), num_blocks=12, stride=64, page=PageLayout((("token", 4), ("byte", 16)))),
        _layer("L1", 0, 0xA00000, ToyFull("b"), num_blocks=10, stride=128),
    ]


def _equal_tp_plan(disp: Dispatcher | None = None) -> TransferPlan:
    disp = disp or Dispatcher(registry(*standard()))
    loc = _local_layers()
    rem = _remote_layers()
    local = disp.local_geometry("decode", Topology(1, 0), loc, [(0x10000, 8 * 256), (0x40000, 6 * 64)], device_id=1)
    remote = disp.local_geometry("prefill", Topology(1, 0), rem, _memory(rem), device_id=5)
    return disp.plan(local, {0: remote})


def test_a_remote_tp_size_beyond_any_engine_is_refused_before_anything_is_sized_by_it() -> None:
    """A peer built by hand (no parse refused it) saying it runs 2**40 ranks: the ranks a decode
    rank covers are sized by that, and planning made sets and tuples of them (out of memory).
    It is refused as a topology, naming the remote TP size."""
    disp = Dispatcher(registry(*standard()))
    loc, rem = _local_layers(), _remote_layers()
    local = disp.local_geometry("decode", Topology(1, 0), loc, [(0x10000, 8 * 256), (0x40000, 6 * 64)], device_id=1)
    huge = disp.local_geometry("prefill", Topology(2**40, 0), rem, _memory(rem), device_id=5)
    with pytest.raises(IncompatibleTopology, match="remote tp=1099511627776"):
        disp.plan(local, {0: huge})
    with pytest.raises(IncompatibleTopology, match="remote tp="):
        disp.read_ranks(local, 2**40)
    # control: the same peer at TP 1 plans
    assert disp.plan(local, {0: disp.local_geometry("prefill", Topology(1, 0), rem, _memory(rem), device_id=5)}).segments


def test_plan_descriptor_rows() -> None:
    plan = _equal_tp_plan()
    assert [s.local_region for s in plan.segments] == ["L0", "M0", "L1"]
    expected_local = np.array(
        [
            [0x10000, 128, 1, 256, 8],
            [0x40000, 64, 1, 64, 6],
            [0x10000 + 128, 128, 1, 256, 8],
        ],
        dtype=np.uint64,
    )
    expected_remote = np.array(
        [
            [0x800000, 128, 5, 512, 10],
            [0x900000, 64, 5, 64, 12],
            [0xA00000, 128, 5, 128, 10],
        ],
        dtype=np.uint64,
    )
    assert plan.local_descs.dtype == np.uint64 and plan.local_descs.shape == (3, 5)
    assert np.array_equal(plan.local_descs, expected_local)
    assert set(plan.remote_descs) == {0}
    assert plan.remote_descs[0].dtype == np.uint64
    assert np.array_equal(plan.remote_descs[0], expected_remote)
    assert plan.covered == (0,) and plan.read_ranks == (0,) and plan.consumers == 1
    groups = [(g.local_group, g.remote_group, g.strategy.name, g.local_num_blocks, g.remote_num_blocks) for g in plan.pairings]
    assert groups == [(0, 0, "toy_full", 8, 10), (1, 1, "toy_mla", 6, 12)]


def test_resolve_descriptor_id_math() -> None:
    plan = _equal_tp_plan()
    local_ids = [[1, 5, 7], [0, 2]]
    remote_ids = [[9, 0, 3], [11, 4]]
    res = plan.resolve(local_ids, remote_ids)
    assert len(res.reads) == 1 and res.reads[0].remote_rank == 0
    # row starts: local rows L0 (8 blocks), M0 (6), L1 (8) -> 0, 8, 14; remote 0, 10, 22
    # ids are grouped by KV group (g0: L0 then L1, then g1: M0)
    exp_local = [0 + b for b in (1, 5, 7)] + [14 + b for b in (1, 5, 7)] + [8 + b for b in (0, 2)]
    exp_remote = [0 + b for b in (9, 0, 3)] + [22 + b for b in (9, 0, 3)] + [10 + b for b in (11, 4)]
    assert res.reads[0].local_ids.tolist() == exp_local
    assert res.reads[0].remote_ids.tolist() == exp_remote
    assert res.num_descriptors == 8
    assert res.notify_only == () and res.consumers == 1 and res.notified_ranks == (0,)


def _expected_moves(
    pairs: Mapping[str, list[tuple[int, int]]],
    local: Mapping[str, tuple[int, int, int]],
    remote: Mapping[str, tuple[int, int]],
    rank: int = 0,
) -> list[tuple[int, int, int, int]]:
    """(local addr, rank, remote addr, nbytes): base + block * stride + offset, by hand."""
    out = []
    for name, blocks in pairs.items():
        lbase, lstride, nbytes = local[name]
        rbase, rstride = remote[name]
        for lb, rb in blocks:
            out.append((lbase + lb * lstride, rank, rbase + rb * rstride, nbytes))
    return sorted(out)


LOCAL_PHYS = {"L0": (0x10000, 256, 128), "L1": (0x10000 + 128, 256, 128), "M0": (0x40000, 64, 64)}
REMOTE_PHYS = {"L0": (0x800000, 512), "L1": (0xA00000, 128), "M0": (0x900000, 64)}


def test_byte_moves_match_physical_addresses() -> None:
    plan = _equal_tp_plan()
    res = plan.resolve([[1, 5, 7], [0, 2]], [[9, 0, 3], [11, 4]])
    moves = plan.byte_moves(res)
    g0 = [(1, 9), (5, 0), (7, 3)]
    expected = _expected_moves({"L0": g0, "L1": g0, "M0": [(0, 11), (2, 4)]}, LOCAL_PHYS, REMOTE_PHYS)
    assert sorted(moves) == expected
    assert len(moves) == len(set(moves)) == 8


@pytest.mark.parametrize("as_array", [False, True])
def test_ids_are_int32_and_scratch_gives_the_same_answer(as_array: bool) -> None:
    """NIXL takes int32 indices; a reused scratch buffer must not change what a request reads,
    and each READ knows its byte count without expanding its ids."""
    plan = _equal_tp_plan()
    local, remote = [[1, 5, 7], [0, 2]], [[9, 0, 3], [11, 4]]
    if as_array:
        local = [np.array(g, dtype=np.int64) for g in local]
        remote = [np.array(g, dtype=np.uint32) for g in remote]
    fresh = plan.resolve(local, remote)
    scratch = IdScratch()
    plan.resolve([[2], [1]], [[3], [5]], scratch=scratch)  # an earlier request in the same buffer
    reused = plan.resolve(local, remote, scratch=scratch)
    assert sorted(plan.byte_moves(reused)) == sorted(plan.byte_moves(fresh))
    for a, b in zip(fresh.reads, reused.reads):
        assert a.local_ids.dtype == np.int32 and b.remote_ids.dtype == np.int32
        assert np.array_equal(a.local_ids, b.local_ids) and np.array_equal(a.remote_ids, b.remote_ids)
        assert b.nbytes == int(expand_ids(plan.local_descs, b.local_ids)[1].sum()) > 0


def test_scratch_grows_without_corrupting_earlier_reads_of_the_request() -> None:
    plan = _equal_tp_plan()
    scratch = IdScratch()
    plan.resolve([[1], [1]], [[1], [1]], scratch=scratch)  # leaves a tiny buffer
    res = plan.resolve([[1, 5, 7], [0, 2]], [[9, 0, 3], [11, 4]], scratch=scratch)
    assert sorted(plan.byte_moves(res)) == sorted(plan.byte_moves(plan.resolve([[1, 5, 7], [0, 2]], [[9, 0, 3], [11, 4]])))


def test_scratch_keeps_earlier_views_when_the_id_type_changes() -> None:
    """One buffer per ID type at a time: a take in another type starts a new buffer, and what an
    earlier take handed out keeps its values (a worker posts a request's READs from those views)."""
    scratch = IdScratch()
    first = scratch.take(4, np.dtype(np.int32))
    first[:] = [1, 2, 3, 4]
    wide = scratch.take(3, np.dtype(np.int64))
    wide[:] = -1
    again = scratch.take(2, np.dtype(np.int32))
    again[:] = 9
    assert first.tolist() == [1, 2, 3, 4] and first.dtype == np.int32
    assert wide.tolist() == [-1, -1, -1] and again.dtype == np.int32
    scratch.reset()
    assert scratch.take(2, np.dtype(np.int32)).size == 2


def test_prefix_hit_tail_alignment() -> None:
    plan = _equal_tp_plan()
    # local already holds the first remote blocks: last len(local) remote blocks are paired
    res = plan.resolve([[3, 4], [5]], [[7, 8, 9], [1, 2, 3]])
    expected = _expected_moves(
        {"L0": [(3, 8), (4, 9)], "L1": [(3, 8), (4, 9)], "M0": [(5, 3)]}, LOCAL_PHYS, REMOTE_PHYS
    )
    assert sorted(plan.byte_moves(res)) == expected


def test_everything_cached_locally_means_notify_only() -> None:
    plan = _equal_tp_plan()
    res = plan.resolve([[], []], [[1, 2], [3]])
    assert res.reads == () and res.notify_only == (0,) and res.notified_ranks == (0,)
    assert plan.byte_moves(res) == []


def test_longer_local_list_is_a_request_error() -> None:
    plan = _equal_tp_plan()
    with pytest.raises(RequestError):
        plan.resolve([[1, 2, 3], [0]], [[1, 2], [0]])


@pytest.mark.parametrize(
    "local_ids,remote_ids,what",
    [
        ([[8], [0]], [[0], [0]], "local group 0"),  # local group 0 has 8 blocks
        ([[0], [6]], [[0], [0]], "local group 1"),  # M0 has 6 local blocks
        ([[-1], [0]], [[0], [0]], "local group 0"),
        ([[0], [0]], [[10], [0]], "remote group 0"),  # remote L0/L1 have 10 blocks
        ([[0], [0]], [[0], [12]], "remote group 1"),
    ],
)
def test_block_id_out_of_range_is_a_request_error(local_ids: list, remote_ids: list, what: str) -> None:
    plan = _equal_tp_plan()
    with pytest.raises(RequestError, match=what):
        plan.resolve(local_ids, remote_ids)


def test_group_bound_is_smallest_region_of_the_group() -> None:
    disp = Dispatcher(registry(*standard()))
    loc = [_layer("L0", 0, 0x1000, num_blocks=8), _layer("L1", 0, 0x9000, num_blocks=5)]
    rem = [_layer("L0", 0, 0x100000, num_blocks=9), _layer("L1", 0, 0x200000, num_blocks=20)]
    plan = disp.plan(
        disp.local_geometry("d", Topology(1, 0), loc, _memory(loc)),
        {0: disp.local_geometry("p", Topology(1, 0), rem, _memory(rem))},
    )
    assert len(plan.resolve([[4]], [[8]]).reads) == 1
    with pytest.raises(RequestError):
        plan.resolve([[5]], [[0]])
    with pytest.raises(RequestError):
        plan.resolve([[0]], [[9]])


@pytest.mark.parametrize("side", ["local", "remote"])
def test_missing_group_is_a_request_error(side: str) -> None:
    plan = _equal_tp_plan()
    ids = ([[1], [1]], [[1], [1]])
    short = ([[1]], ids[1]) if side == "local" else (ids[0], [[1]])
    with pytest.raises(RequestError, match=side):
        plan.resolve(*short)


def test_non_flat_ids_are_a_request_error() -> None:
    plan = _equal_tp_plan()
    with pytest.raises(RequestError):
        plan.resolve([[[1, 2]], [1]], [[1, 2], [1]])


# ---------------------------------------------------------------------------- validation


def _scripted_plan(
    script: Callable[[Region, Mapping[int, Region]], list[Segment]],
    local_layers: Sequence[LayerCache] | None = None,
    local_memory: Sequence[tuple[int, int]] | None = None,
    remote_memory: Sequence[tuple[int, int]] | None = None,
    local_tp: int = 1,
    remote_tp: int = 1,
) -> TransferPlan:
    disp = Dispatcher(registry(WholePage(), Scripted(script)))
    loc = list(local_layers or [_layer("L0", 0, 0x1000)])
    rem = [_layer(l.name, l.group, 0x100000 * (i + 1)) for i, l in enumerate(loc)]
    local = disp.local_geometry("d", Topology(local_tp, 0), loc, local_memory if local_memory is not None else _memory(loc))
    remotes = {
        p: disp.local_geometry("p", Topology(remote_tp, p), rem, remote_memory if remote_memory is not None else _memory(rem))
        for p in range(remote_tp)
    }
    return disp.plan(local, remotes)


def whole(local: Region, remote: Mapping[int, Region]) -> list[Segment]:
    (rank, peer), = remote.items()
    return [Segment(local.name, 0, rank, peer.name, 0, local.page.nbytes)]


def test_scripted_baseline_is_valid() -> None:
    plan = _scripted_plan(whole)
    assert len(plan.segments) == 1 and plan.local_descs.shape == (1, 5)


@pytest.mark.parametrize(
    "segment",
    [
        lambda l, p: Segment(l.name, 120, 0, p.name, 0, 16),  # leaves local page (128 B)
        lambda l, p: Segment(l.name, 0, 0, p.name, 120, 16),  # leaves remote page
        lambda l, p: Segment(l.name, -8, 0, p.name, 0, 16),  # negative offset
        lambda l, p: Segment(l.name, 0, 0, p.name, 0, 0),  # moves nothing
        lambda l, p: Segment("ghost", 0, 0, p.name, 0, 16),  # unknown local region
        lambda l, p: Segment(l.name, 0, 0, "ghost", 0, 16),  # unknown remote region
    ],
)
def test_segment_leaving_the_page_is_rejected(segment: Callable[[Region, Region], Segment]) -> None:
    with pytest.raises(PlanValidationError):
        _scripted_plan(lambda local, remote: [segment(local, remote[0])])


# What a plugin's segments() may hand back that is no list of Segment, or a Segment of other kinds
# of values (found by fuzzing a scripted strategy: each escaped as an AttributeError or TypeError
# from the dispatcher, or, for a float offset, was truncated to another byte).
MALFORMED_SEGMENTS: dict[str, tuple[Callable[[Region, Region], Any], str]] = {
    "None": (lambda l, p: None, "must return a list of Segment"),
    "a string": (lambda l, p: "L0", "must return a list of Segment"),
    "a number in the list": (lambda l, p: [5], "not a Segment"),
    "a dict in the list": (lambda l, p: [{"local_region": l.name}], "not a Segment"),
    "a float offset": (lambda l, p: [Segment(l.name, 1.5, 0, p.name, 0, 16)], "local_offset=1.5"),
    "a bool size": (lambda l, p: [Segment(l.name, 0, 0, p.name, 0, True)], "nbytes=True"),
    "a list as the rank": (lambda l, p: [Segment(l.name, 0, [0], p.name, 0, 16)], "remote_rank=[0]"),
    "a list as a region": (lambda l, p: [Segment([l.name], 0, 0, p.name, 0, 16)], "local_region=['L0']"),
    "a float phase": (lambda l, p: [Segment(l.name, 0, 0, p.name, 0, 16, 0.0)], "phase=0.0"),
    "a size beyond 64 bits": (lambda l, p: [Segment(l.name, 0, 0, p.name, 0, 2**64)], "beyond 64 bits"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_SEGMENTS))
def test_malformed_segments_are_refused_naming_the_strategy_and_the_field(case: str) -> None:
    make, what = MALFORMED_SEGMENTS[case]
    with pytest.raises(PlanValidationError, match=re.escape(what)) as info:
        _scripted_plan(lambda local, remote: make(local, remote[0]))
    assert "L0" in str(info.value)
    # controls: a generator of good segments is taken as its list, numpy's integers as integers
    assert _scripted_plan(lambda local, remote: (s for s in whole(local, remote))).segments
    as_numpy = _scripted_plan(lambda local, remote: [Segment(local.name, np.int64(0), np.int32(0), remote[0].name,
                                                             np.uint16(0), np.int64(local.page.nbytes))])
    assert as_numpy.local_descs.tolist() == _scripted_plan(whole).local_descs.tolist()


@pytest.mark.parametrize("answer", [[None], [5], [{"name": "L0"}]])
def test_a_layer_described_with_no_region_is_refused_naming_the_strategy(answer: list) -> None:
    class Odd(WholePage):
        name = "toy_odd"
        spec_types = (ToyFull,)

        def local_regions(self, layer: LayerCache, topology: Topology) -> Any:
            return answer

    disp = Dispatcher(registry(WholePage(), Odd()))
    loc = [_layer("L0", 0, 0x1000)]
    with pytest.raises(PlanError, match="toy_odd.*layer 'L0'.*not a Region"):
        disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))


@pytest.mark.parametrize("answer", ["0", 0, [0.0], [[0]], [True], object()])
def test_source_ranks_of_other_kinds_are_refused_naming_the_strategy(answer: Any) -> None:
    class Picky(WholePage):
        name = "toy_picky"
        spec_types = (ToyFull,)

        def source_ranks(self, region: Region, topology: Topology, remote_tp: int) -> Any:
            return answer

    disp = Dispatcher(registry(WholePage(), Picky()))
    loc = [_layer("L0", 0, 0x1000)]
    local = disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    with pytest.raises(PlanError, match="toy_picky.*source_ranks must return remote rank numbers"):
        disp.read_ranks(local, 1)
    Picky.source_ranks = lambda self, region, topology, remote_tp: [0]  # controls: a list of ints, numpy's too
    assert disp.read_ranks(local, 2) == (0,)
    Picky.source_ranks = lambda self, region, topology, remote_tp: np.array([1])
    assert disp.read_ranks(local, 4) == (1,)


def test_overlapping_segments_in_one_region_are_rejected() -> None:
    def script(local: Region, remote: Mapping[int, Region]) -> list[Segment]:
        return [Segment(local.name, 0, 0, local.name, 0, 64), Segment(local.name, 32, 0, local.name, 64, 64)]

    with pytest.raises(PlanValidationError, match="same bytes"):
        _scripted_plan(script)

    def one_byte(local: Region, remote: Mapping[int, Region]) -> list[Segment]:
        return [Segment(local.name, 64, 0, local.name, 0, 64), Segment(local.name, 0, 0, local.name, 32, 65)]

    with pytest.raises(PlanValidationError, match="same bytes"):
        _scripted_plan(one_byte)


def test_adjacent_segments_are_fine() -> None:
    def script(local: Region, remote: Mapping[int, Region]) -> list[Segment]:
        return [Segment(local.name, 0, 0, local.name, 64, 64), Segment(local.name, 64, 0, local.name, 0, 64)]

    plan = _scripted_plan(script)
    assert plan.local_descs[:, 0].tolist() == [0x1000, 0x1000 + 64]
    assert plan.remote_descs[0][:, 0].tolist() == [0x100000 + 64, 0x100000]


@pytest.mark.parametrize("side", ["local", "remote"])
def test_region_outside_registered_memory_is_rejected(side: str) -> None:
    short = [(0x1000, 7 * 256 + 127)] if side == "local" else [(0x100000, 100)]
    kwargs = {"local_memory": short} if side == "local" else {"remote_memory": short}
    with pytest.raises(PlanValidationError, match="registered"):
        _scripted_plan(whole, **kwargs)


def test_region_exactly_at_memory_end_is_fine() -> None:
    # last block's page ends at base + 7 * 256 + 128: the rest of the stride need not be registered
    plan = _scripted_plan(whole, local_memory=[(0x1000, 7 * 256 + 128)])
    assert len(plan.segments) == 1


def test_overlapping_regions_of_one_group_are_rejected() -> None:
    layers = [_layer("L0", 0, 0x1000), _layer("L1", 0, 0x1000 + 64)]
    with pytest.raises(PlanValidationError, match="overlap"):
        _scripted_plan(whole, local_layers=layers, local_memory=[(0x1000, 8 * 256 + 64)])


def test_interleaved_regions_of_one_group_are_fine_and_other_groups_may_alias() -> None:
    layers = [_layer("L0", 0, 0x1000), _layer("L1", 0, 0x1000 + 128)]
    plan = _scripted_plan(whole, local_layers=layers, local_memory=[(0x1000, 8 * 256)])
    assert len(plan.segments) == 2
    # different groups never hold the same block id at the same time, so they may share memory
    layers = [_layer("L0", 0, 0x1000), _layer("L1", 1, 0x1000)]
    plan = _scripted_plan(whole, local_layers=layers, local_memory=[(0x1000, 8 * 256)])
    assert [g.local_group for g in plan.pairings] == [0, 1]


def test_segment_reading_an_uncovered_remote_rank_is_rejected() -> None:
    def script(local: Region, remote: Mapping[int, Region]) -> list[Segment]:
        return [Segment(local.name, 0, 1, local.name, 0, local.page.nbytes)]  # local rank 0 covers only rank 0

    with pytest.raises(PlanValidationError, match="outside"):
        _scripted_plan(script, local_tp=2, remote_tp=2)


def test_different_layer_sets_are_incompatible() -> None:
    disp = Dispatcher(registry(*standard()))
    loc = [_layer("L0", 0, 0x1000), _layer("L1", 0, 0x9000)]
    rem = [_layer("L0", 0, 0x100000), _layer("L2", 0, 0x200000)]
    local = disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    remote = disp.local_geometry("p", Topology(1, 0), rem, _memory(rem))
    with pytest.raises(IncompatibleGeometry) as info:
        disp.plan(local, {0: remote})
    assert "L1" in str(info.value) and "L2" in str(info.value)


def test_layer_served_by_different_strategies_is_incompatible() -> None:
    loc = [_layer("L0", 0, 0x1000)]
    rem = [_layer("L0", 0, 0x100000)]
    here = Dispatcher(registry(*standard()))
    there = Dispatcher(registry(*standard(), pins={"ToyFull": "toy_base"}))
    local = here.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    remote = there.local_geometry("p", Topology(1, 0), rem, _memory(rem))
    assert remote.regions[0].strategy == "toy_base"
    with pytest.raises(IncompatibleGeometry) as info:
        here.plan(local, {0: remote})
    assert "toy_full" in str(info.value) and "toy_base" in str(info.value)


def test_layer_in_different_groups_on_the_two_sides_is_incompatible() -> None:
    disp = Dispatcher(registry(*standard()))
    loc = [_layer("L0", 0, 0x1000), _layer("L1", 0, 0x9000)]
    rem = [_layer("L0", 0, 0x100000), _layer("L1", 1, 0x200000)]
    local = disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    remote = disp.local_geometry("p", Topology(1, 0), rem, _memory(rem))
    with pytest.raises(IncompatibleGeometry):
        disp.plan(local, {0: remote})


def test_missing_covered_remote_rank_is_a_plan_error() -> None:
    disp = Dispatcher(registry(*standard()))
    loc = [_layer("L0", 0, 0x1000)]
    local = disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    remote1 = disp.local_geometry("p", Topology(2, 1), loc, _memory(loc))
    with pytest.raises(PlanError, match=r"\[0\]"):
        disp.plan(local, {1: remote1})
    with pytest.raises(PlanError):
        disp.plan(local, {})


def test_remote_rank_key_must_match_geometry() -> None:
    disp = Dispatcher(registry(*standard()))
    loc = [_layer("L0", 0, 0x1000)]
    local = disp.local_geometry("d", Topology(1, 0), loc, _memory(loc))
    remote = disp.local_geometry("p", Topology(2, 1), loc, _memory(loc))
    with pytest.raises(IncompatibleGeometry):
        disp.plan(local, {0: remote})


# ---------------------------------------------------------------------------- heterogeneous TP


HEAD_PAGE_BYTES = 4 * 16  # one head: token 4 x byte 16


def _head_page(heads: int) -> PageLayout:
    return PageLayout((("head", heads), ("token", 4), ("byte", 16)))


def _tp_geometries(total: int, local_tp: int, local_rank: int, remote_tp: int) -> tuple[Dispatcher, RankGeometry, dict[int, RankGeometry]]:
    disp = Dispatcher(registry(HeadSliced()))
    lheads = max(1, total // local_tp)
    rheads = max(1, total // remote_tp)
    loc = [_layer("L0", 0, 0x1000, page=_head_page(lheads), stride=lheads * HEAD_PAGE_BYTES, hints={"total_kv_heads": total})]
    local = disp.local_geometry("decode", Topology(local_tp, local_rank), loc, _memory(loc))
    remotes = {}
    for p in range(remote_tp):
        rem = [
            _layer("L0", 0, 0x100000 * (p + 1), page=_head_page(rheads), stride=rheads * HEAD_PAGE_BYTES,
                   num_blocks=10, hints={"total_kv_heads": total})
        ]
        remotes[p] = disp.local_geometry("prefill", Topology(remote_tp, p), rem, _memory(rem))
    return disp, local, remotes


def test_replicated_heads_read_once_rest_notify_only() -> None:
    # H=2, P tp 4 -> D tp 1: D0 covers P0..P3, reads head 0 from P0 and head 1 from P2
    disp, local, remotes = _tp_geometries(total=2, local_tp=1, local_rank=0, remote_tp=4)
    plan = disp.plan(local, remotes)
    assert plan.covered == (0, 1, 2, 3)
    assert plan.read_ranks == (0, 2)
    assert plan.consumers == 1
    res = plan.resolve([[2, 3]], [[5, 6, 7]])
    assert res.notify_only == (1, 3)
    assert res.notified_ranks == (0, 1, 2, 3)
    assert res.consumers == 1
    moves = sorted(plan.byte_moves(res))
    lstride = 2 * HEAD_PAGE_BYTES
    expected = sorted(
        (0x1000 + lb * lstride + head * HEAD_PAGE_BYTES, p, 0x100000 * (p + 1) + rb * HEAD_PAGE_BYTES, HEAD_PAGE_BYTES)
        for head, p in ((0, 0), (1, 2))
        for lb, rb in ((2, 6), (3, 7))
    )
    assert moves == expected


def test_many_readers_per_remote_rank_consumers() -> None:
    # H=2, P tp 1 -> D tp 4: D2 reads head 1 = P0 slot 1; P0 waits for 4 consumers
    disp, local, remotes = _tp_geometries(total=2, local_tp=4, local_rank=2, remote_tp=1)
    plan = disp.plan(local, remotes)
    assert plan.covered == (0,) and plan.read_ranks == (0,) and plan.consumers == 4
    res = plan.resolve([[1]], [[4]])
    assert res.consumers == 4 and res.notify_only == ()
    assert plan.byte_moves(res) == [(0x1000 + 1 * HEAD_PAGE_BYTES, 0, 0x100000 + 4 * 2 * HEAD_PAGE_BYTES + HEAD_PAGE_BYTES, HEAD_PAGE_BYTES)]


def test_one_local_rank_reads_two_remote_ranks() -> None:
    # H=8, P tp 4 -> D tp 2: D1 holds heads 4..7 = P2 (4,5) and P3 (6,7)
    disp, local, remotes = _tp_geometries(total=8, local_tp=2, local_rank=1, remote_tp=4)
    plan = disp.plan(local, remotes)
    assert plan.covered == (2, 3) and plan.read_ranks == (2, 3)
    assert set(plan.remote) == {2, 3}  # only covered ranks are kept
    rs = 2 * HEAD_PAGE_BYTES  # two heads per remote rank
    assert plan.local_descs.tolist() == [
        [0x1000, 2 * HEAD_PAGE_BYTES, 0, 4 * HEAD_PAGE_BYTES, 8],
        [0x1000 + 2 * HEAD_PAGE_BYTES, 2 * HEAD_PAGE_BYTES, 0, 4 * HEAD_PAGE_BYTES, 8],
    ]
    assert plan.remote_descs[2].tolist() == [[0x300000, 2 * HEAD_PAGE_BYTES, 0, rs, 10]]
    assert plan.remote_descs[3].tolist() == [[0x400000, 2 * HEAD_PAGE_BYTES, 0, rs, 10]]
    res = plan.resolve([[0, 7]], [[9, 3]])
    ops = {r.remote_rank: (r.local_ids.tolist(), r.remote_ids.tolist()) for r in res.reads}
    assert ops == {2: ([0, 7], [9, 3]), 3: ([8, 15], [9, 3])}
    assert res.notify_only == ()
    # plans for the other local rank of the same pair: plans do not interfere
    disp0, local0, _ = _tp_geometries(total=8, local_tp=2, local_rank=0, remote_tp=4)
    assert disp0.plan(local0, remotes).read_ranks == (0, 1)


# ---------------------------------------------------------------------------- determinism


def test_plans_are_deterministic_and_json_serialisable() -> None:
    a = _equal_tp_plan().to_dict()
    b = _equal_tp_plan(Dispatcher(registry(*reversed(standard())))).to_dict()
    assert a == b
    text = json.dumps(a, sort_keys=True)
    assert json.loads(text) == a
    assert a["covered_remote_ranks"] == [0] and a["read_ranks"] == [0]
    assert a["consumers_per_remote_rank"] == 1
    assert [s["strategy"] for s in a["segments"]] == ["toy_full", "toy_mla", "toy_full"]
    assert a["registered_descriptors"] == {"local": 8 + 6 + 8, "remote_rank_0": 10 + 12 + 10}

    disp, local, remotes = _tp_geometries(total=2, local_tp=1, local_rank=0, remote_tp=4)
    hetero = [disp.plan(local, remotes).to_dict() for _ in range(2)]
    assert hetero[0] == hetero[1]
    assert json.loads(json.dumps(hetero[0])) == hetero[0]


def test_plan_survives_handshake_round_trip() -> None:
    disp = Dispatcher(registry(*standard()))
    loc, rem = _local_layers(), _remote_layers()
    local = disp.local_geometry("decode", Topology(1, 0), loc, [(0x10000, 8 * 256), (0x40000, 6 * 64)], device_id=1)
    remote = disp.local_geometry("prefill", Topology(1, 0), rem, _memory(rem), device_id=5)
    wired = RankGeometry.from_dict(json.loads(json.dumps(remote.to_dict())))
    direct, via_wire = disp.plan(local, {0: remote}), disp.plan(local, {0: wired})
    assert direct.to_dict() == via_wire.to_dict()
    assert np.array_equal(direct.remote_descs[0], via_wire.remote_descs[0])


def test_a_local_geometry_is_checked_when_registered_and_a_failed_check_is_left_to_every_plan() -> None:
    """local_geometry() makes what every plan reads and checks of the rank alone (prepare_local),
    so a worker's first handshake does not; a check that fails is not remembered as passed."""
    disp = Dispatcher(registry(WholePage()))
    good = [_layer("L0", 0, 0x1000), _layer("L1", 0, 0x1000 + 128)]
    g = disp.local_geometry("d", Topology(1, 0), good, [(0x1000, 8 * 256)])
    assert {"_registered_ok", "_overlap", "_disjoint_ok", "column_lists", "class_regions"} <= g.__dict__.keys()
    bad = [_layer("L0", 0, 0x1000), _layer("L1", 0, 0x1000 + 64)]  # one group's pages overlap
    g = disp.local_geometry("d", Topology(1, 0), bad, [(0x1000, 8 * 256 + 64)])
    assert "_disjoint_ok" not in g.__dict__
    short = disp.local_geometry("d", Topology(1, 0), good, [(0x1000, 100)])  # outside its registered memory
    assert "_registered_ok" not in short.__dict__
    with pytest.raises(PlanValidationError, match="outside every registered memory range"):
        disp.plan(short, {0: disp.local_geometry("p", Topology(1, 0), good, [(0x1000, 8 * 256)])})


def test_core_finds_the_builtin_strategies_where_the_distribution_declares_them(monkeypatch) -> None:
    # core names no strategy module: nixlkv's own strategies are an entry point like a third party's
    import importlib.metadata
    import pathlib

    import nixlkv.strategies
    from nixlkv.core import registry
    from nixlkv.core.errors import RegistryError

    assert registry.builtin_plugin() is nixlkv.strategies
    core = pathlib.Path(registry.__file__).parent
    code = [line for f in core.glob("*.py") for line in f.read_text().splitlines()
            if "nixlkv.strategies" in line and not line.lstrip().startswith(("#", "The ", "``"))]
    assert code == [], code

    class Dist:
        entry_points = [importlib.metadata.EntryPoint("other", "x.y", "nixlkv")]

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist())
    with pytest.raises(RegistryError, match="declares no 'nixlkv' entry point 'builtin'.*reinstall"):
        registry.builtin_plugin()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RegistryError, match="not installed in this environment: install it"):
        registry.plugin_manager(load_entry_points=False)
