"""The dispatcher: strategies per layer in, one validated TransferPlan per remote engine out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import pluggy

from .byte_runs import forget_copy_runs
from .errors import IncompatibleGeometry, IncompatibleTopology, MalformedRemoteFact, PlanError, PlanValidationError
from .geometry import RankGeometry
from .memo import remember
from .plan import GroupPairing, TransferPlan, prepare_local
from .plan_reuse import PairingLayers
from .regions import COL_BLOCKS, COL_GROUP, LayerCache, Region, Segment, counted_out
from .registry import StrategyRegistry, plugin_manager
from .segment_table import SegmentTable
from .strategy import Strategy, declared_pairing
from .stages import StagePlans
from .topology import Stage, Topology, consumers_per_remote_rank, covered_remote_ranks, head_sources, stage_sources
from .wire import forget_parsed

Unwrap = Callable[[Any, str], Any]
MAX_UNWRAP_DEPTH = 8
MEMO_CLASSES = 256  # class templates a dispatcher remembers (a deployment serves a handful of models)
MEMO_PLANS = 64  # plans a dispatcher remembers, to rebase for other engines of the same layout


def forget_handshakes() -> None:
    """Empty every process-wide memo that parsing and planning a handshake fill (class
    descriptions, column layouts, copy runs between pages, head sources): with a fresh
    :class:`Dispatcher`, a process that never met a remote engine, as the bench times a
    layout's first handshake."""
    forget_parsed()
    forget_copy_runs()
    head_sources.cache_clear()


class Dispatcher:
    """Asks the strategy of every layer for its region, and of every region for its segments."""

    def __init__(self, registry: StrategyRegistry, unwrap: Unwrap | None = None) -> None:
        self.registry = registry
        self._unwrap = unwrap
        # (strategy, geometry key less the block count (counted_out) of the local region and
        # of its peer on each covered rank, covered ranks, topology, remote TP) -> the class's
        # template rows: a function of those alone for a segments_by_geometry strategy (a
        # segment maps bytes of one page pair, whatever the number of pages), so a later
        # handshake with peers of a geometry already planned (another prefill engine of the
        # model, even one whose caches hold another number of blocks) skips the strategy call.
        self._templates: dict[tuple[Any, ...], np.ndarray] = {}
        # (local geometry's id, layout key of every covered remote rank) -> a plan made with
        # them: another engine of that layout (another prefill engine of the model, or one
        # restarted) gets it rebased to its addresses. Only plans whose strategies are all
        # segments_by_geometry (addresses never change their segments). The plan holds its local
        # geometry, so the id is not reused while the entry lives; a hit checks it is the same object.
        self._plans: dict[tuple[Any, ...], TransferPlan] = {}
        # (local geometry's id, shape key of every source rank: the layout less block counts)
        # -> a plan made with such ranks: an engine of that layout with other block counts
        # gets its segment table and pairings (the strategies are not asked for segments again),
        # its pairings' bounds and its rows anew.
        self._shapes: dict[tuple[Any, ...], TransferPlan] = {}
        # (local geometry's id, remote TP size) -> (the geometry, its topology, the remote ranks
        # it covers, those it reads): what every handshake with such an engine asks first.
        self._readers: dict[tuple[int, int], tuple[RankGeometry, Topology, range, tuple[int, ...]]] = {}
        # (geometry's id, layers) -> (the geometry, it holding only those layers): a pipeline
        # stage's share of a rank, one object per share (see plan_stages)
        self._parts: dict[tuple[int, tuple[str, ...]], tuple[RankGeometry, RankGeometry]] = {}

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
        stage: Stage | None = None,
    ) -> RankGeometry:
        """This rank's regions (one or more per layer), as its strategies describe them;
        ``stage``: its pipeline stage, whose layers ``layers`` are."""
        regions = []
        for layer in layers:
            spec = self.layer_spec(layer.spec, layer.name)
            strategy = self.registry.for_type(type(spec))
            produced = strategy.local_regions(_with_spec(layer, spec), topology)
            if not produced:
                raise PlanError(f"strategy {strategy.name!r} described layer {layer.name!r} with no region")
            for region in produced:
                if not isinstance(region, Region):
                    raise PlanError(f"strategy {strategy.name!r} described layer {layer.name!r} with {_short(region)}, not a Region")
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
        geometry = RankGeometry(
            engine_id=engine_id,
            tp_size=topology.tp_size,
            tp_rank=topology.tp_rank,
            regions=tuple(regions),
            memory=tuple((int(a), int(n)) for a, n in memory),
            device_id=device_id,
            mem_type=mem_type,
            pp_size=1 if stage is None else stage.pp_size,
            pp_rank=0 if stage is None else stage.pp_rank,
        )
        return prepare_local(geometry)  # what every handshake reads and checks of this rank alone, made now

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
        topology, covered, sources = self._reading(local, remote_tp)
        missing = [p for p in sources if p not in remote]
        if missing:
            raise PlanError(f"geometry of remote ranks {missing} is needed by local rank {local.tp_rank}")
        key = (id(local), *(remote[p].layout_key for p in sources))
        known = self._plans.get(key)
        if known is not None and known.local is local:
            try:
                return known.rebased(remote)
            except PlanError:
                pass  # its layers share memory otherwise (a hybrid's aliasing groups): planned anew below
        names = local.names
        in_order = {p: remote[p].names == names for p in sources}
        if not all(in_order.values()):  # the same names in the same order are the same layers: others compared as sets
            _check_same_layers(local, {p: remote[p] for p in sources if not in_order[p]})
        peers_geo = [remote[p] for p in sources]
        same_order = all(in_order.values())
        shape = (id(local), *(g.shape_key for g in peers_geo))
        alike = self._shapes.get(shape)
        if alike is not None and alike.local is local:
            # An engine of the layout whose caches hold other block counts: the same segments and
            # pairings (every page, fact and group the strategies read is in the shape key); the
            # pairings' remote bounds and the rows anew.
            plan = alike.recounted(remote)
        else:
            table, pairings, layers = self._segment_table(local, peers_geo, sources, topology, remote_tp, same_order)
            plan = TransferPlan(
                local=local,
                remote={p: remote[p] for p in sources},
                covered=covered,
                consumers=consumers_per_remote_rank(local.tp_size, remote_tp, local.pp_size),
                segments=table,
                pairings=pairings,
                sources=sources,
                pairing_layers=layers,
            )
        if plan.rebasable:
            if len(self._plans) >= MEMO_PLANS:  # bounded; clear() is one atomic step for threads
                self._plans.clear()
                self._shapes.clear()
            self._plans[key] = plan
            self._shapes.setdefault(shape, plan)
        return plan

    def plan_stages(self, local: RankGeometry, remote: Mapping[int, Mapping[int, RankGeometry]]) -> StagePlans:
        """Plans for ``local`` reading a remote engine of one or more pipeline stages:
        ``remote[stage][tp_rank]`` is each stage's ranks' geometry (at least the ranks ``local``
        covers). Each local layer is read from the stage that holds it
        (:func:`stage_sources`), with one ordinary plan per such stage for those layers alone;
        the other stages are only told."""
        if not remote:
            raise PlanError("no remote pipeline stage given")
        sizes = {g.pp_size for ranks in remote.values() for g in ranks.values()}
        if len(sizes) != 1:
            raise IncompatibleTopology(f"remote ranks disagree on the pipeline size: {sorted(sizes)}")
        pp = sizes.pop()
        for stage, ranks in remote.items():
            if not ranks:
                raise PlanError(f"no rank geometry given for remote pipeline stage {stage}")
            wrong = sorted({g.pp_rank for g in ranks.values()} - {stage})
            if wrong:
                raise IncompatibleTopology(f"remote geometry given as pipeline stage {stage} says it is stage {wrong[0]}")
        if sorted(remote) != list(range(pp)):
            raise IncompatibleTopology(
                f"remote engine runs {pp} pipeline stages but geometry was given for stages {sorted(remote)}: "
                "a decode rank needs every stage's handshake"
            )
        held = {s: next(iter(ranks.values())).layers for s, ranks in remote.items()}
        for s, ranks in remote.items():
            for rank, g in ranks.items():
                if g.layers != held[s]:
                    raise IncompatibleGeometry(
                        f"remote stage {s}: rank {rank} holds other layers than the stage's first rank "
                        "(the TP ranks of one stage hold the same layers)"
                    )
        sources = stage_sources(local.layers, held)
        plans = {}
        for s, layers in sources.items():
            part = self._part(local, layers)
            plans[s] = self.plan(part, {p: self._part(g, layers) for p, g in remote[s].items()})
        remote_tp = next(iter(remote[0].values())).tp_size
        covered = tuple(covered_remote_ranks(local.tp_rank, local.tp_size, remote_tp))
        return StagePlans(
            plans=plans,
            told=tuple(s for s in range(pp) if s not in plans),
            covered=covered,
            consumers=consumers_per_remote_rank(local.tp_size, remote_tp, local.pp_size),
            layers=sources,
        )

    def _part(self, geometry: RankGeometry, layers: tuple[str, ...]) -> RankGeometry:
        """``geometry`` holding only ``layers``, the same object every time it is asked (plans
        are remembered per local geometry object)."""
        key = (id(geometry), layers)
        known = self._parts.get(key)
        if known is not None and known[0] is geometry:
            return known[1]
        part = geometry.restricted(layers)
        if part is not geometry:
            part = prepare_local(part)
        remember(self._parts, key, (geometry, part), MEMO_PLANS)
        return part

    def read_ranks(self, local: RankGeometry, remote_tp: int) -> tuple[int, ...]:
        """The remote ranks whose geometry a plan for ``local`` needs, reading an engine of
        ``remote_tp`` ranks (:meth:`source_ranks` among the ranks it covers): a handshake parses
        only theirs."""
        return self._reading(local, remote_tp)[2]

    def _reading(self, local: RankGeometry, remote_tp: int) -> tuple[Topology, range, tuple[int, ...]]:
        """``local``'s topology, the ranks it covers of an engine of ``remote_tp`` ranks and those
        it reads (:meth:`source_ranks`): facts of the local geometry alone, remembered per
        geometry (a worker's is registered once); the entry holds the geometry, so its id is not
        reused while the entry lives."""
        known = self._readers.get((id(local), remote_tp))
        if known is not None and known[0] is local:
            return known[1:]
        topology = Topology(local.tp_size, local.tp_rank)
        covered = covered_remote_ranks(local.tp_rank, local.tp_size, remote_tp)
        sources = self.source_ranks(local, topology, remote_tp, covered)
        remember(self._readers, (id(local), remote_tp), (local, topology, covered, sources), MEMO_PLANS)
        return topology, covered, sources

    def source_ranks(self, local: RankGeometry, topology: Topology, remote_tp: int, covered: Sequence[int]) -> tuple[int, ...]:
        """The covered remote ranks whose geometry a plan for ``local`` needs: those the
        strategies read from (:meth:`Strategy.source_ranks`, asked per geometry class), in
        covered order; every covered rank where a strategy does not say."""
        wanted: set[int] = set()
        for region in local.class_regions:
            strategy = self.registry.by_name(region.strategy)
            ask = getattr(strategy, "source_ranks", None)
            answer = ask(region, topology, remote_tp) if ask is not None else None
            if answer is None:
                return tuple(covered)
            listed = _listed(answer)
            if listed is None or not all(map(_is_integer, listed)):
                raise PlanError(f"strategy {strategy.name!r} named the ranks to read layer {region.name!r} from as "
                                f"{_short(answer)}: source_ranks must return remote rank numbers (int) or None")
            ranks = set(map(int, listed))
            if not ranks or not ranks <= set(covered):
                raise PlanError(
                    f"strategy {strategy.name!r} names remote ranks {sorted(ranks)} to read layer {region.name!r} from; "
                    f"they must be some of the ranks local rank {topology.tp_rank} covers {list(covered)}"
                )
            wanted |= ranks
        return tuple(p for p in covered if p in wanted) or tuple(covered)

    def _segment_table(
        self, local: RankGeometry, peers_geo: list[RankGeometry], covered: Sequence[int], topology: Topology, remote_tp: int,
        same_order: bool | None = None,
    ) -> tuple[SegmentTable, list[GroupPairing], PairingLayers]:
        """Every layer's segments as columns, asking strategies once per distinct layer geometry;
        the pairings, and where their layers' regions lie.

        Layers whose local region and peer regions differ only in name, base and KV group (same
        :attr:`RankGeometry.geometry_classes` on every side) form one class; each class's peers
        are checked and its strategy asked once, on its first layer, and every layer of the class
        gets those segments with its own regions. Groups are checked for every layer, as arrays.
        Where a strategy is not :attr:`Strategy.segments_by_geometry`, every layer is its own class.
        """
        regions = local.regions
        n = len(regions)
        names = local.names
        # peer region index per rank
        if same_order is None:
            same_order = all(g.names == names for g in peers_geo)
        pidx = _peer_index(local, peers_geo, same_order)
        lclass = local.geometry_classes
        if same_order:
            per_rank = [g.geometry_classes for g in peers_geo]
        else:
            per_rank = [[cls[i] for i in idx] for cls, idx in zip((g.geometry_classes for g in peers_geo), pidx)]
        keys = list(zip(lclass, *per_rank))
        pure = {r.strategy: self._by_geometry(r.strategy) for r in local.class_regions}
        if not all(pure.values()):
            keys = [k if pure[regions[i].strategy] else (*k, -1 - i) for i, k in enumerate(keys)]
        if len(set(keys)) == 1:  # one geometry on every side (a dense model)
            layer_class, first = [0] * n, {0: 0}
        else:
            class_of: dict[tuple[int, ...], int] = {}
            layer_class = [class_of.setdefault(k, len(class_of)) for k in keys]
            first = {}  # class -> its first layer, classes in order of first appearance (ids are given so)
            for i, c in enumerate(layer_class):
                first.setdefault(c, i)

        def describe(i: int) -> tuple[np.ndarray, bool]:
            """Layer ``i``'s peers checked and its strategy asked: its segment rows (see _template)."""
            region = regions[i]
            peer_regions = [g.regions[pidx[j][i]] for j, g in enumerate(peers_geo)]
            memo = None
            if pure[region.strategy]:
                theirs = (counted_out(g.class_keys[g.geometry_classes[pidx[j][i]]]) for j, g in enumerate(peers_geo))
                memo = (region.strategy, counted_out(local.class_keys[lclass[i]]), *theirs,
                        tuple(covered), topology.tp_size, topology.tp_rank, remote_tp)
                rows = self._templates.get(memo)
                if rows is not None:
                    # _check_peer and segments() read only what the key holds (strategy, page,
                    # facts, block stride: no block count), so for equal keys they pass and give
                    # these rows again: another engine of the model, whatever its block count.
                    return rows, True
            peers = {p: _check_peer(g, region, peer) for p, g, peer in zip(covered, peers_geo, peer_regions)}
            segs = self.registry.by_name(region.strategy).segments(region, peers, topology, remote_tp)
            rows, own = _template(segs, local, peers_geo, covered, region, peers)
            if memo is not None and own:  # rows naming other regions hold this geometry's indices: not kept
                rows.flags.writeable = False
                remember(self._templates, memo, rows, MEMO_CLASSES)
            return rows, own

        # per class: rows (local idx or -1, rank pos, remote idx or -1, loff, roff, nbytes, phase), and
        # whether its segments name only its own layer's regions
        described = [describe(i) for i in first.values()]
        # after the peers are checked: a pairing's declaration (block_pairing) reads their facts
        layer_key, pairings, layers = self._pairings(local, peers_geo, pidx, same_order, covered)
        templates: list[np.ndarray] = [rows for rows, _ in described]
        own = [o for _, o in described]
        # A class whose segments name regions other than its own layer's (never a built-in
        # strategy) cannot be shared: its other layers are asked one by one.
        for c, i in first.items():
            if not described[c][1]:
                for j in [j for j in range(n) if layer_class[j] == c and j != i]:
                    layer_class[j] = len(templates)
                    rows, o = describe(j)
                    templates.append(rows)
                    own.append(o)
        table = SegmentTable.assemble(layer_class, templates, layer_key, None if same_order else pidx, covered, own)
        return table, pairings, layers

    def _by_geometry(self, strategy: str) -> bool:
        """Whether the strategy's segments are a function of geometry and facts alone
        (:attr:`Strategy.segments_by_geometry`): not of region names or addresses."""
        return bool(getattr(self.registry.by_name(strategy), "segments_by_geometry", False))

    def _pairings(
        self, local: RankGeometry, peers_geo: list[RankGeometry], pidx: list[list[int]], same_order: bool, covered: Sequence[int]
    ) -> tuple[list[int], list[GroupPairing], PairingLayers]:
        """Per layer, its pairing (local group, remote group, strategy); the pairings; and where
        each pairing's layers' regions lie on each rank (its remote bound is read there). Every
        layer's groups are checked: one remote group on every remote rank, and the same
        one-to-one map of local to remote groups for all layers."""
        regions = local.regions
        # Python lists: a model has tens of layers, where each numpy call costs as much as a pass
        rcols = [g.columns if same_order else g.columns[idx] for g, idx in zip(peers_geo, pidx)]
        lgroup = local.column_lists[COL_GROUP]
        rgroups = [c[:, COL_GROUP].tolist() for c in rcols]
        for rg in rgroups[1:]:
            if rg != rgroups[0]:
                i = next(i for i, (a, b) in enumerate(zip(rg, rgroups[0])) if a != b)
                found = sorted({x[i] for x in rgroups})
                raise IncompatibleGeometry(f"layer {regions[i].name!r} sits in different KV groups on different remote ranks {found}")
        strategies = {r.strategy for r in local.class_regions}  # a region's strategy is part of its class
        pkeys: dict[tuple[int, int, str], int] = {}  # (local group, remote group, strategy) -> pairing key
        members: dict[int, list[int]] = {}  # pairing key -> its layers, where there are several pairings
        if len(strategies) == 1 and len(set(lgroup)) == 1 and len(set(rgroups[0])) == 1:  # one pairing (no KV groups)
            triples = [(lgroup[0], rgroups[0][0], strategies.pop())] if regions else []
            pkeys = dict.fromkeys(triples, 0)
            layer_key = [0] * len(regions)
        else:
            triples = list(zip(lgroup, rgroups[0], [r.strategy for r in regions]))
            layer_key = [pkeys.setdefault(t, len(pkeys)) for t in triples]
            for j, k in enumerate(layer_key):
                members.setdefault(k, []).append(j)
        group_map: dict[int, int] = {}
        for (lg, rg, _), k in pkeys.items():
            i = members[k][0] if members else 0
            if group_map.setdefault(lg, rg) != rg:
                raise IncompatibleGeometry(
                    f"local KV group {lg} holds layers of remote groups {group_map[lg]} and {rg} "
                    f"(e.g. {regions[i].name!r}): both engines must group layers the same way"
                )
        if len(set(group_map.values())) != len(group_map):
            raise IncompatibleGeometry(
                f"several local KV groups read the same remote group (local -> remote: {group_map}): "
                "both engines must group layers the same way"
            )
        if len(pkeys) <= 1:  # every layer: regions in the ranks' own order
            starts = np.zeros(len(pkeys), dtype=np.int64)
            peers: tuple[np.ndarray | slice, ...] = tuple(
                slice(None) if same_order else np.asarray(idx, dtype=np.int64) for idx in pidx)
        else:
            order = [j for k in range(len(pkeys)) for j in members[k]]
            starts = np.cumsum([0, *(len(members[k]) for k in range(len(pkeys) - 1))], dtype=np.int64)
            peers = tuple(np.asarray(order if same_order else [idx[j] for j in order], dtype=np.int64) for idx in pidx)
        layers = PairingLayers(peers, starts)
        lblocks = local.column_lists[COL_BLOCKS]
        pairings = []
        for (lg, rg, name), k, rmin in zip(pkeys, pkeys.values(), layers.remote_bounds(peers_geo)):
            if len(pkeys) == 1:
                i, lmin = 0, min(lblocks)
            else:
                mine = members[k]
                i, lmin = mine[0], min([lblocks[j] for j in mine])
            rep_peer = peers_geo[0].regions[pidx[0][i]]
            strategy = self.registry.by_name(name)
            pairings.append(GroupPairing(lg, rg, strategy, lmin, rmin, regions[i], rep_peer,
                                         declared_pairing(strategy, regions[i], rep_peer)))
        return layer_key, pairings, layers


def _peer_index(local: RankGeometry, peers_geo: Sequence[RankGeometry], same_order: bool) -> list[list[int]]:
    """Per remote rank, the index of each local region's peer (the same name) in its regions."""
    if same_order:  # every rank lists the layers in this rank's order
        return [list(range(len(local.regions)))] * len(peers_geo)
    return [[g.index[name] for name in local.names] for g in peers_geo]


def _template(
    segs: Sequence[Segment], local: RankGeometry, peers_geo: Sequence[RankGeometry], covered: Sequence[int],
    region: Region, peers: Mapping[int, Region],
) -> tuple[np.ndarray, bool]:
    """One class's segments as rows ``(local idx, rank position, remote idx, local offset, remote
    offset, nbytes, phase)``, an index -1 where the segment names the layer's own region; and
    whether every segment does (then other layers of the class can take the same rows)."""
    rows = []
    pos = {p: j for j, p in enumerate(covered)}
    listed = _listed(segs)
    if listed is None:
        raise PlanValidationError(
            f"strategy {region.strategy!r} answered the segments of layer {region.name!r} with {_short(segs)}: "
            "segments() must return a list of Segment"
        )
    segs = listed
    try:
        _template_rows(segs, rows, pos, local, peers_geo, covered, region, peers)
    except (AttributeError, TypeError):  # not a Segment, or a field of no kind a lookup takes
        for seg in segs:
            _check_segment_types(seg, region)
        raise
    if rows and set(map(type, chain.from_iterable(rows))) != {int}:  # a float, a bool, ... as an offset
        for seg in segs:
            _check_segment_types(seg, region)
    try:
        return np.array(rows, dtype=np.int64).reshape(-1, 7), all(r[0] == -1 and r[2] == -1 for r in rows)
    except OverflowError as exc:
        raise PlanValidationError(f"segments of {region.name!r} hold an offset or size beyond 64 bits: {exc}") from None


def _template_rows(
    segs: Sequence[Segment], rows: list[tuple[int, ...]], pos: Mapping[int, int], local: RankGeometry,
    peers_geo: Sequence[RankGeometry], covered: Sequence[int], region: Region, peers: Mapping[int, Region],
) -> None:
    """:func:`_template`'s rows, appended to ``rows``: each segment's regions looked up."""
    for seg in segs:
        if seg.local_region == region.name:
            li = -1
        else:
            li = local.index.get(seg.local_region)
            if li is None:
                raise PlanValidationError(f"segment names unknown local region {seg.local_region!r}")
        j = pos.get(seg.remote_rank)
        if j is None:
            raise PlanValidationError(
                f"segment of {seg.local_region!r} reads remote rank {seg.remote_rank}, outside the "
                f"ranks this local rank reads {list(covered)} (the ranks it covers, or those its strategies' "
                "source_ranks name): another rank could free the blocks before the read"
            )
        if seg.remote_region == peers[seg.remote_rank].name:
            ri = -1
        else:
            ri = peers_geo[j].index.get(seg.remote_region)
            if ri is None:
                raise PlanValidationError(
                    f"segment reads unknown region {seg.remote_region!r} on remote rank {seg.remote_rank}"
                )
        rows.append((li, j, ri, seg.local_offset, seg.remote_offset, seg.nbytes, seg.phase))


_SEGMENT_NAMES = ("local_region", "remote_region")
_SEGMENT_INTS = ("local_offset", "remote_rank", "remote_offset", "nbytes", "phase")


def _check_segment_types(seg: Any, region: Region) -> None:
    """A strategy's segment is a :class:`Segment` of region names and integers (Python's or
    numpy's): a float offset would be truncated to another byte, a bool read as 0 or 1, a list
    fail a lookup."""
    if not isinstance(seg, Segment):
        raise PlanValidationError(
            f"strategy {region.strategy!r} answered the segments of layer {region.name!r} with {_short(seg)}, "
            "not a Segment"
        )
    kinds = [isinstance(getattr(seg, f), str) for f in _SEGMENT_NAMES]
    kinds += map(_is_integer, map(seg.__getattribute__, _SEGMENT_INTS))
    if all(kinds):
        return
    bad = (*_SEGMENT_NAMES, *_SEGMENT_INTS)[kinds.index(False)]
    raise PlanValidationError(
        f"strategy {region.strategy!r}: a segment of layer {region.name!r} has {bad}={_short(getattr(seg, bad))}, "
        f"which must be {'a region name (str)' if bad in _SEGMENT_NAMES else 'an integer'}"
    )


def _listed(answer: Any) -> list[Any] | None:
    """A plugin's answer that should be a collection, as a list (any iterable but text); None
    where it is not one."""
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Iterable):
        return None
    return list(answer)


def _is_integer(value: Any) -> bool:
    """Python's or numpy's integer, not a bool (which would be read as 0 or 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _with_spec(layer: LayerCache, spec: Any) -> LayerCache:
    if spec is layer.spec:
        return layer
    return dataclasses.replace(layer, spec=spec)


def _peer(geometry: RankGeometry, region: Region) -> Region:
    peer = geometry.region(region.name)
    if peer is None:  # _check_same_layers ran first; this guards direct callers
        raise IncompatibleGeometry(f"layer {region.name!r} missing on remote rank {geometry.tp_rank}")
    return _check_peer(geometry, region, peer)


def _check_peer(geometry: RankGeometry, region: Region, peer: Region) -> Region:
    """``peer`` (the same-named region on a remote rank) is the same kind of cache with facts of
    the kinds this side's strategy writes."""
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
        t = type(mine)
        if type(theirs) is t and (t is int and 0 <= theirs < MAX_FACT_INT or t is str or t is bool or t is float):
            continue  # the same plain type is the same kind (_kind reads only the type): the usual fact
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
