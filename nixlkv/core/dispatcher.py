"""The dispatcher: strategies per layer in, one validated TransferPlan per remote engine out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pluggy

from .errors import IncompatibleGeometry, MalformedRemoteFact, PlanError
from .geometry import LayerCache, RankGeometry, Region, Segment
from .plan import GroupPairing, TransferPlan
from .registry import StrategyRegistry, plugin_manager
from .strategy import Strategy
from .topology import Topology, consumers_per_remote_rank, covered_remote_ranks

Unwrap = Callable[[Any, str], Any]
MAX_UNWRAP_DEPTH = 8


class Dispatcher:
    """Asks the strategy of every layer for its region, and of every region for its segments."""

    def __init__(self, registry: StrategyRegistry, unwrap: Unwrap | None = None) -> None:
        self.registry = registry
        self._unwrap = unwrap

    @classmethod
    def from_plugins(cls, pm: pluggy.PluginManager | None = None, **registry_options: Any) -> Dispatcher:
        pm = pm or plugin_manager()
        registry = StrategyRegistry.from_plugins(pm, **registry_options)
        return cls(registry, unwrap=lambda spec, name: pm.hook.nixlkv_unwrap_spec(spec=spec, layer_name=name))

    # ---------------------------------------------------------------- local side
    def layer_spec(self, spec: Any, layer_name: str) -> Any:
        """The layer's own spec, with group-level wrappers removed."""
        for _ in range(MAX_UNWRAP_DEPTH):
            inner = self._unwrap(spec, layer_name) if self._unwrap else None
            if inner is None:
                return spec
            spec = inner
        raise PlanError(f"layer {layer_name!r}: spec wrappers nest deeper than {MAX_UNWRAP_DEPTH}")

    def strategy_for(self, spec: Any, layer_name: str) -> Strategy:
        return self.registry.for_type(type(self.layer_spec(spec, layer_name)))

    def decode_recomputes(self, layers: Iterable[tuple[Any, str]]) -> int:
        """Trailing prompt tokens a decode engine must compute itself for a model whose layers
        are ``(spec, layer name)``: the most any layer's strategy declares
        (:meth:`Strategy.decode_recomputes`). One number per model, because a prefill engine
        stops the whole request (every KV group) that many tokens short."""
        most = 0
        for spec, name in layers:
            inner = self.layer_spec(spec, name)
            strategy = self.registry.for_type(type(inner))
            n = strategy.decode_recomputes(inner)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise PlanError(
                    f"strategy {strategy.name!r} declared {n!r} trailing tokens for the decode engine to compute "
                    f"(layer {name!r}); it must be an integer >= 0"
                )
            most = max(most, n)
        return most

    def local_geometry(
        self,
        engine_id: str,
        topology: Topology,
        layers: Iterable[LayerCache],
        memory: Sequence[tuple[int, int]],
        device_id: int = 0,
        mem_type: str = "DRAM",
    ) -> RankGeometry:
        """This rank's regions (one or more per layer), as its strategies describe them."""
        regions = []
        for layer in layers:
            spec = self.layer_spec(layer.spec, layer.name)
            strategy = self.registry.for_type(type(spec))
            produced = strategy.local_regions(_with_spec(layer, spec), topology)
            if not produced:
                raise PlanError(f"strategy {strategy.name!r} described layer {layer.name!r} with no region")
            for region in produced:
                if region.strategy != strategy.name:
                    raise PlanError(
                        f"strategy {strategy.name!r} described layer {layer.name!r} as served by {region.strategy!r}"
                    )
                if region.group != layer.group:
                    raise PlanError(
                        f"strategy {strategy.name!r} put a region of layer {layer.name!r} in KV group "
                        f"{region.group}, but the layer is in group {layer.group}"
                    )
                regions.append(region)
        return RankGeometry(
            engine_id=engine_id,
            tp_size=topology.tp_size,
            tp_rank=topology.tp_rank,
            regions=tuple(regions),
            memory=tuple((int(a), int(n)) for a, n in memory),
            device_id=device_id,
            mem_type=mem_type,
        )

    # ---------------------------------------------------------------- pairing with a remote
    def plan(self, local: RankGeometry, remote: Mapping[int, RankGeometry]) -> TransferPlan:
        """One plan for ``local`` reading from the remote engine whose ranks are ``remote``.

        ``remote`` must hold at least every remote rank this local rank covers.
        """
        if not remote:
            raise PlanError("no remote rank geometry given")
        engines = {g.engine_id for g in remote.values()}
        sizes = {g.tp_size for g in remote.values()}
        if len(engines) != 1 or len(sizes) != 1:
            raise IncompatibleGeometry(f"remote ranks disagree on engine id / tp size: {engines} / {sizes}")
        remote_tp = sizes.pop()
        for rank, g in remote.items():
            if g.tp_rank != rank:
                raise IncompatibleGeometry(f"remote geometry keyed as rank {rank} says it is rank {g.tp_rank}")
        topology = Topology(local.tp_size, local.tp_rank)
        covered = covered_remote_ranks(local.tp_rank, local.tp_size, remote_tp)
        missing = [p for p in covered if p not in remote]
        if missing:
            raise PlanError(f"geometry of remote ranks {missing} is needed by local rank {local.tp_rank}")
        _check_same_layers(local, {p: remote[p] for p in covered})

        segments: list[tuple[Segment, int]] = []
        keys: dict[tuple[int, int, str], int] = {}  # (local group, remote group, strategy) -> key
        bounds: list[list[int]] = []  # per key: smallest local / remote num_blocks
        representatives: list[tuple[Region, Region]] = []
        group_map: dict[int, int] = {}
        for region in local.regions:
            strategy = self.registry.by_name(region.strategy)
            peers = {p: _peer(remote[p], region) for p in covered}
            remote_groups = {peer.group for peer in peers.values()}
            if len(remote_groups) != 1:
                raise IncompatibleGeometry(
                    f"layer {region.name!r} sits in different KV groups on different remote ranks {sorted(remote_groups)}"
                )
            remote_group = remote_groups.pop()
            if group_map.setdefault(region.group, remote_group) != remote_group:
                raise IncompatibleGeometry(
                    f"local KV group {region.group} holds layers of remote groups "
                    f"{group_map[region.group]} and {remote_group} (e.g. {region.name!r}): "
                    "both engines must group layers the same way"
                )
            key = keys.setdefault((region.group, remote_group, strategy.name), len(keys))
            if key == len(bounds):
                bounds.append([region.num_blocks, min(r.num_blocks for r in peers.values())])
                representatives.append((region, peers[covered[0]]))
            bounds[key][0] = min(bounds[key][0], region.num_blocks)
            bounds[key][1] = min([bounds[key][1], *(r.num_blocks for r in peers.values())])
            segments.extend((seg, key) for seg in strategy.segments(region, peers, topology, remote_tp))
        if len(set(group_map.values())) != len(group_map):
            raise IncompatibleGeometry(
                f"several local KV groups read the same remote group (local -> remote: {group_map}): "
                "both engines must group layers the same way"
            )
        pairings = [
            GroupPairing(lg, rg, self.registry.by_name(name), *bounds[key], *representatives[key])
            for (lg, rg, name), key in keys.items()
        ]
        return TransferPlan(
            local=local,
            remote={p: remote[p] for p in covered},
            covered=covered,
            consumers=consumers_per_remote_rank(local.tp_size, remote_tp),
            segments=segments,
            pairings=pairings,
        )


def _with_spec(layer: LayerCache, spec: Any) -> LayerCache:
    if spec is layer.spec:
        return layer
    return dataclasses.replace(layer, spec=spec)


def _peer(geometry: RankGeometry, region: Region) -> Region:
    peer = geometry.region(region.name)
    if peer is None:  # _check_same_layers ran first; this guards direct callers
        raise IncompatibleGeometry(f"layer {region.name!r} missing on remote rank {geometry.tp_rank}")
    if peer.strategy != region.strategy:
        raise IncompatibleGeometry(
            f"layer {region.name!r} is a {region.strategy!r} cache here but a {peer.strategy!r} cache on "
            f"remote rank {geometry.tp_rank}: both engines must run the same model with the same KV-cache kinds"
        )
    ours, theirs_axes = set(region.page.names) - {"kblock"}, set(peer.page.names) - {"kblock"}
    if ours != theirs_axes:  # the same cache names the same axes (in any order, kernel blocks apart)
        raise MalformedRemoteFact(
            f"layer {region.name!r}: remote rank {geometry.tp_rank} describes its page with axes "
            f"{sorted(theirs_axes)}, where this cache's page has {sorted(ours)}"
        )
    for key, mine in region.facts.items():  # a fact the strategy reads must be of the kind it wrote
        if key not in peer.facts or mine is None:
            continue  # not advertised: the strategy derives it or does without
        theirs = peer.facts[key]
        if _kind(theirs) != _kind(mine) or (_kind(mine) == "integer" and not 0 <= theirs < MAX_FACT_INT):
            raise MalformedRemoteFact(
                f"layer {region.name!r}: remote rank {geometry.tp_rank} advertises {key}={_short(theirs)} "
                f"({_kind(theirs)}), where this strategy's facts hold a {_kind(mine)}"
                + (f" in [0, {MAX_FACT_INT})" if _kind(mine) == "integer" else "")
            )
    return peer


# An integer fact (a count, a size, an offset) beyond this is no geometry any engine builds.
MAX_FACT_INT = 1 << 40


def _kind(value: Any) -> str:
    """A fact's kind for comparison across engines (bool apart from int, any number of a list alike)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, (list, tuple)) else "map" if isinstance(value, dict) else type(value).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_same_layers(local: RankGeometry, remote: Mapping[int, RankGeometry]) -> None:
    mine = {r.name for r in local.regions}
    for rank, g in remote.items():
        theirs = {r.name for r in g.regions}
        if mine != theirs:
            only_here = sorted(mine - theirs)[:3]
            only_there = sorted(theirs - mine)[:3]
            raise IncompatibleGeometry(
                f"local rank {local.tp_rank} and remote rank {rank} hold different layers "
                f"(only here: {only_here}, only there: {only_there}): P and D must serve the same model"
            )
