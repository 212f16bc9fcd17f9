"""One rank's advertised geometry: who it is, its registered memory and its regions.

A :class:`RankGeometry` is what a rank sends in a handshake and what a plan is made from: its
regions (:mod:`nixlkv.core.regions`: pages, regions, segments), and derived once from them the
int64 columns a plan checks and lays out descriptors with, and the geometry classes (regions alike
but for name, base and KV group) a plan describes once each. It travels columnar
(:meth:`RankGeometry.to_wire`; parsed by :mod:`nixlkv.core.wire`); :meth:`RankGeometry.from_dict`
also reads the per-region form earlier peers send. Here too are the checks of a geometry against
itself: regions inside registered memory, a KV group's pages apart.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate
from typing import Any

import numpy as np

from .errors import HandshakeError, IncompatibleGeometry, IncompatibleTopology, PlanValidationError
from .regions import (ADDRESS_LIMIT, COL_BASE, COL_BLOCKS, COL_DEVICE, COL_END, COL_GROUP, COL_PAGE, COL_STRIDE,
                      LayerCache, PageLayout, PagePart, Region, Segment, counted_in, counted_out, geometry_key,
                      non_empty_str, non_negative_int)
from .topology import MAX_PP_SIZE, MAX_TP_SIZE, Stage, layer_of
from .wire import ColumnLayout, ColumnRegions, ParsedRegions, parse_columnar, parse_regions, shape_of_tail

__all__ = [  # the regions' names too: where a geometry's parts were always imported from
    "ADDRESS_LIMIT", "COL_BASE", "COL_BLOCKS", "COL_DEVICE", "COL_END", "COL_GROUP", "COL_PAGE", "COL_STRIDE",
    "LayerCache", "PageLayout", "PagePart", "RankGeometry", "Region", "Segment", "check_groups_disjoint",
    "check_registered", "counted_in", "counted_out", "first_outside_memory", "geometry_key",
]


@dataclass(frozen=True)
class RankGeometry:
    """What one rank advertises: who it is, its registered memory and its regions."""

    engine_id: str
    tp_size: int
    tp_rank: int
    # a tuple, or as a handshake was parsed: the columns a columnar one carried, or (per region) with their classes
    regions: tuple[Region, ...] | ColumnRegions | ParsedRegions
    memory: tuple[tuple[int, int], ...]  # registered (address, nbytes) ranges
    device_id: int = 0
    mem_type: str = "DRAM"
    # the rank's pipeline stage (topology.Stage): with pipeline parallelism a stage holds some of
    # the model's layers, which its regions name (:attr:`layers`)
    pp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if self.pp_size != 1 or self.pp_rank != 0:
            Stage(self.pp_size, self.pp_rank)  # checked: IncompatibleTopology naming the field
        columnar = isinstance(self.regions, ColumnRegions)  # whose names were checked unique when parsed
        names = self.names
        if not columnar and len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise IncompatibleGeometry(f"engine {self.engine_id!r}: duplicate region names {dup}")

    def region(self, name: str) -> Region | None:
        return self._by_name.get(name)

    @cached_property
    def layers(self) -> tuple[str, ...]:
        """The model layers this rank holds, in region order (:func:`layer_of` of each region):
        what a handshake says a pipeline stage holds."""
        return tuple(dict.fromkeys(map(layer_of, self.names)))

    def restricted(self, layers: Collection[str]) -> RankGeometry:
        """This rank with only the regions of ``layers`` (a plan with one remote pipeline stage
        reads those layers alone); itself where it holds no others."""
        wanted = set(layers)
        keep = [r for r in self.regions if layer_of(r.name) in wanted]
        if len(keep) == len(self.regions):
            return self
        return replace(self, regions=tuple(keep))

    @cached_property
    def _by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions}

    @cached_property
    def index(self) -> dict[str, int]:
        """Region name -> position in :attr:`regions` (for columnar planning)."""
        return dict(zip(self.names, range(len(self.regions))))

    @cached_property
    def names(self) -> list[str]:
        """The regions' names in order (a decode rank's are compared at every handshake), listed
        once at construction. Read-only."""
        regions = self.regions
        return regions.names if isinstance(regions, ColumnRegions) else [r.name for r in regions]

    @cached_property
    def class_firsts(self) -> dict[int, int]:
        """Geometry class -> index of its first region, classes in order of first appearance."""
        regions = self.regions
        if isinstance(regions, ColumnRegions) and regions.layout.firsts is not None:
            return regions.layout.firsts  # the layout's first geometry found them
        classes = self.geometry_classes
        distinct = dict.fromkeys(classes)
        if len(distinct) <= 8:  # a handful of classes (a model's usual): a C-level scan each
            return {c: classes.index(c) for c in distinct}
        first = dict(zip(reversed(classes), range(len(classes) - 1, -1, -1)))  # the last write is the first index
        return {c: first[c] for c in distinct}

    @cached_property
    def class_regions(self) -> list[Region]:
        """The first region of each geometry class, in class order. Read-only."""
        regions = self.regions
        return [regions[i] for i in self.class_firsts.values()]

    @cached_property
    def class_keys(self) -> dict[int, tuple[Any, ...]]:
        """Geometry class -> :func:`geometry_key` of its regions (what a plan memo is keyed by)."""
        if isinstance(self.regions, ColumnRegions):  # known from parsing
            return {c: self.regions.class_key(c) for c in self.class_firsts}
        return dict(zip(self.class_firsts, map(geometry_key, self.class_regions)))

    @cached_property
    def layout_key(self) -> tuple[Any, ...]:
        """Everything a plan reads of this rank but where it lies (region bases, device,
        registered memory) and whose it is (engine id): equal for the ranks of every engine that
        serves one model with one configuration, so a plan made with one engine's rank is
        rebased for another's (:meth:`TransferPlan.rebased`)."""
        return (self.tp_size, self.tp_rank, *self._layout_tail)

    @cached_property
    def shape_key(self) -> tuple[Any, ...]:
        """:attr:`layout_key` less the regions' block counts: equal for the ranks of every engine
        of one model and configuration, however many blocks each engine's memory holds. Such an
        engine has the same segments as one planned before (:func:`counted_out`); only what the
        counts decide (descriptor rows and IDs, pairing bounds) is made for it."""
        return (self.tp_size, self.tp_rank, *self._shape_tail)

    @cached_property
    def _shape_tail(self) -> tuple[Any, ...]:
        """:attr:`shape_key` but TP size and rank: once a layout was recounted, the same object for
        every rank parsed with it or with a recount of it (the column layout holds it)."""
        regions = self.regions
        if isinstance(regions, ColumnRegions) and regions.layout.shape is not None:
            return regions.layout.shape
        return shape_of_tail(self._layout_tail)

    @cached_property
    def _layout_tail(self) -> tuple[Any, ...]:
        """:attr:`layout_key` but TP size and rank: the same object for every rank parsed with one
        remembered column layout (so comparing two such keys is mostly identity)."""
        layout = self.regions.layout if isinstance(self.regions, ColumnRegions) else None
        if layout is not None and layout.tail is not None:
            return layout.tail
        groups = layout.groups if layout is not None else self.columns[:, COL_GROUP].tolist()
        return (tuple(self.names), tuple(groups), self.geometry_classes, tuple(self.class_keys.items()))

    @cached_property
    def base_list(self) -> list[int]:
        """The regions' bases as a Python list (a columnar handshake carried it so). Read-only."""
        regions = self.regions
        return regions.bases if isinstance(regions, ColumnRegions) else self.columns[:, COL_BASE].tolist()

    @cached_property
    def column_lists(self) -> list[list[int]]:
        """:attr:`columns` as Python lists, one per ``COL_*`` index (cheaper than numpy at tens of
        layers). Read-only."""
        return self.columns.T.tolist()

    @cached_property
    def geometry_classes(self) -> tuple[int, ...]:
        """Per region, a small id shared by the regions that differ only in name, base and group.

        A strategy that plans by geometry (:attr:`Strategy.segments_by_geometry`) answers such
        regions alike, so a plan describes and pairs each class once: an 80-layer model has a
        handful. A parsed handshake's regions carry them; otherwise they are computed here.
        """
        if isinstance(self.regions, (ColumnRegions, ParsedRegions)):
            return self.regions.class_ids
        ids: dict[tuple[Any, ...], int] = {}
        return tuple(ids.setdefault(geometry_key(r), len(ids)) for r in self.regions)

    @cached_property
    def columns(self) -> np.ndarray:
        """Per region, int64 ``(base, page bytes, device, block_stride, num_blocks, group, end)``
        (the ``COL_*`` indices): checks and descriptor rows without a Python loop per layer. Built
        per geometry class (:attr:`geometry_classes`), so a parsed handshake pays per layer only
        for its base."""
        regions = self.regions
        if isinstance(regions, ColumnRegions):
            return self._columns_from(regions.layout, regions.bases)
        return self._columns_of([r.base for r in regions], [r.group for r in regions])

    def _columns_of(self, bases: list[int] | tuple[int, ...], groups: list[int] | tuple[int, ...]) -> np.ndarray:
        """:attr:`columns` from the regions' bases and KV groups, given as the lists a columnar
        handshake carries (so parsing one builds them without a pass over the regions)."""
        classes = self.geometry_classes
        n = len(bases)
        if n and max(bases) >= ADDRESS_LIMIT:
            raise IncompatibleGeometry(
                f"engine {self.engine_id!r} rank {self.tp_rank}: a region base lies beyond 2**62; no engine maps memory there"
            )
        try:  # struct packs Python ints in C, several times faster than np.array at tens of layers
            own = np.frombuffer(struct.pack(f"{2 * n}q", *bases, *groups), dtype=np.int64).reshape(2, n)
        except struct.error:
            try:
                own = np.array((bases, groups), dtype=np.int64).reshape(2, n)
            except OverflowError:
                raise IncompatibleGeometry(f"engine {self.engine_id!r} rank {self.tp_rank}: a KV group id beyond 2**63") from None
        if not n:
            return np.zeros((0, 7), dtype=np.int64)
        reps = dict(zip(self.class_firsts, self.class_regions))  # class -> a region of it
        rows = [(0, 0, 0, 0, 0, 0, 0)] * (max(reps, default=-1) + 1)
        for c, r in reps.items():
            span = r.end - r.base
            if span >= ADDRESS_LIMIT or self.device_id >= ADDRESS_LIMIT:
                raise IncompatibleGeometry(f"region {r.name!r} spans {span} B: no engine maps that much")
            rows[c] = (0, r.page.nbytes, self.device_id, r.block_stride, r.num_blocks, 0, span)
        if len(rows) == 1:
            out = np.empty((n, 7), dtype=np.int64)
            out[:] = rows[0]
        else:
            out = np.array(rows, dtype=np.int64)[np.array(classes, dtype=np.int64)]
        out[:, COL_BASE] = own[0]
        out[:, COL_GROUP] = own[1]
        out[:, COL_END] += own[0]
        return out

    def _columns_from(self, layout: ColumnLayout, bases: list[int]) -> np.ndarray:
        """:attr:`columns` of a parsed columnar geometry: the first of its layout builds them
        (:meth:`_columns_of`) and leaves in the layout a template of columns at base 0, its
        :attr:`class_firsts` and its layout tail (which a recount of the layout carries over); a later
        one copies the template and adds its bases and device."""
        if layout.template is None or self.device_id >= ADDRESS_LIMIT:
            columns = self._columns_of(bases, layout.groups)
            if layout.template is None:
                template = columns.copy()
                template[:, COL_END] -= template[:, COL_BASE]
                template[:, COL_BASE] = 0
                layout.template, layout.firsts, layout.tail = template, self.class_firsts, self._layout_tail
        else:
            columns = layout.template.copy()
            own = np.frombuffer(struct.pack(f"{len(bases)}q", *bases), dtype=np.int64)  # checked ints below 2**62
            columns[:, COL_BASE] = own
            columns[:, COL_END] += own
            columns[:, COL_DEVICE] = self.device_id
        return columns

    @cached_property
    def _registered_ok(self) -> bool:
        """True where every region lies inside one registered memory range; raises
        :class:`_OutsideMemory` otherwise, which is not remembered (:func:`first_outside_memory`)."""
        outside = _first_outside(self)
        if outside is not None:
            raise _OutsideMemory(outside)
        return True

    @property
    def regions_overlap(self) -> bool:
        """Whether any two regions share bytes (a hybrid's groups alias one tensor); computed once."""
        return self._overlap

    @property
    def groups_disjoint(self) -> bool:
        """True: no two regions of one KV group share a byte of their pages; PlanValidationError
        naming two that do otherwise (:func:`check_groups_disjoint`). A pass is remembered, a
        failure is checked again by every plan that asks."""
        return self._disjoint_ok

    @cached_property
    def _disjoint_ok(self) -> bool:
        check_groups_disjoint(self, None)
        return True

    @cached_property
    def _overlap(self) -> bool:
        col = self.columns
        order = np.argsort(col[:, COL_BASE], kind="stable")
        base, end = col[order, COL_BASE], col[order, COL_END]
        return bool(base.size > 1 and (base[1:] < np.maximum.accumulate(end)[:-1]).any())

    def iter_regions(self) -> Iterator[Region]:
        return iter(self.regions)

    def to_dict(self) -> dict[str, Any]:
        """The per-region form: every region a full description (readable; what peers before
        the columnar wire send, and still accepted by :meth:`from_dict`)."""
        return {
            "engine_id": self.engine_id,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            **self._stage_fields(),
            "regions": [r.to_dict() for r in self.regions],
            "memory": [[a, n] for a, n in self.memory],
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    def to_wire(self) -> dict[str, Any]:
        """The columnar form a handshake sends: one description per distinct region geometry
        (``region_classes``: all but name, base and KV group) and the regions as parallel columns
        (``region_columns``: name, base, group, class index). A model's layers are a handful of
        geometries, so a peer parses each once and checks the per-layer fields in bulk."""
        ids: dict[int, int] = {}
        reps: list[Region] = []
        column = []
        for region, c in zip(self.regions, self.geometry_classes):
            k = ids.get(c)
            if k is None:
                k = ids[c] = len(reps)
                reps.append(region)
            column.append(k)
        return {
            "engine_id": self.engine_id,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            **self._stage_fields(),
            "region_classes": [r.class_dict() for r in reps],
            "region_columns": {
                "name": [r.name for r in self.regions],
                "base": [r.base for r in self.regions],
                "group": [r.group for r in self.regions],
                "class": column,
            },
            "memory": [[a, n] for a, n in self.memory],
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    def _stage_fields(self) -> dict[str, Any]:
        """The stage a handshake names, where the engine runs pipeline parallelism (a TP-only
        engine's geometry stays as peers before pipeline stages read it)."""
        if self.pp_size == 1:
            return {}
        return {"pp_size": self.pp_size, "pp_rank": self.pp_rank, "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankGeometry:
        """Parse and check a peer's geometry, in the columnar form (:meth:`to_wire`) or the
        per-region form (:meth:`to_dict`); HandshakeError naming the field otherwise."""
        try:
            tp_size, tp_rank = non_negative_int(d["tp_size"], "tp_size"), non_negative_int(d["tp_rank"], "tp_rank")
            if not 1 <= tp_size <= MAX_TP_SIZE:
                raise HandshakeError(f"tp_size must be in [1, {MAX_TP_SIZE}] (no engine runs a larger TP group), got {tp_size}")
            if not 0 <= tp_rank < tp_size:
                raise HandshakeError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
            pp_size, pp_rank = non_negative_int(d.get("pp_size", 1), "pp_size"), non_negative_int(d.get("pp_rank", 0), "pp_rank")
            if not 1 <= pp_size <= MAX_PP_SIZE or not 0 <= pp_rank < pp_size:
                raise HandshakeError(f"pp_size must be in [1, {MAX_PP_SIZE}] and pp_rank in [0, pp_size), got "
                                     f"pp_size={pp_size}, pp_rank={pp_rank}")
            if "region_classes" in d or "region_columns" in d:
                if "regions" in d:
                    raise HandshakeError("geometry holds both 'regions' and 'region_classes'/'region_columns': send one form")
                regions = parse_columnar(d)
            else:
                regions = parse_regions(d["regions"])
            geometry = cls(
                engine_id=non_empty_str(d["engine_id"], "engine_id"),
                tp_size=tp_size,
                tp_rank=tp_rank,
                regions=regions,
                memory=tuple((non_negative_int(a, "memory address"), non_negative_int(n, "memory size")) for a, n in d["memory"]),
                device_id=non_negative_int(d.get("device_id", 0), "device_id"),
                mem_type=non_empty_str(d.get("mem_type", "DRAM"), "mem_type"),
                pp_size=pp_size,
                pp_rank=pp_rank,
            )
            if "layers" in d and list(d["layers"]) != list(geometry.layers):
                raise HandshakeError(
                    f"'layers' {list(d['layers'])[:3]}... names other layers than the stage's regions "
                    f"{list(geometry.layers)[:3]}...: a stage's handshake must name the layers it holds"
                )
            # every region's base and span checked now (a columnar geometry's from its columns as they came)
            geometry.columns
        except (KeyError, TypeError, ValueError, IncompatibleGeometry, IncompatibleTopology) as exc:
            raise HandshakeError(f"malformed rank geometry: {exc}") from None
        return geometry


SMALL_REDUCE = 256  # regions up to which a min or max over a column is cheaper in Python than a numpy call


def first_outside_memory(geometry: RankGeometry) -> int | None:
    """The index of the first region of ``geometry`` that lies inside none of its registered
    memory ranges, or None; a RankGeometry remembers a pass (it is immutable)."""
    if not isinstance(geometry, RankGeometry):  # anything with memory, columns and regions
        return _first_outside(geometry)
    try:
        geometry._registered_ok
    except _OutsideMemory as outside:
        return outside.index
    return None


def check_registered(geometry: RankGeometry) -> None:
    """Every region of ``geometry`` lies inside one of its registered memory ranges (checked once
    per geometry: a geometry is immutable; a handshake's check counts); PlanValidationError naming
    the first that does not."""
    i = first_outside_memory(geometry)
    if i is not None:
        region = geometry.regions[i]
        raise PlanValidationError(
            f"region {region.name!r} of engine {geometry.engine_id!r} rank {geometry.tp_rank} spans "
            f"[{region.base:#x}, {region.end:#x}), outside every registered memory range"
        )


def _first_outside(geometry: RankGeometry) -> int | None:
    """:func:`first_outside_memory`, computed. One range (the usual) is one min and max; many are
    O((regions + ranges) log ranges) over the columns, so that a peer with many of both cannot
    stall a handshake: a range holding ``[base, end)`` exists iff, among the ranges starting at or
    before ``base``, the furthest end reaches ``end``. (Region ends lie below 2**63, the
    geometry's own checks; range bounds are clipped there, which keeps every comparison.)"""
    if not len(geometry.regions):
        return None
    cap = (1 << 63) - 1
    col = geometry.columns
    base, end = col[:, COL_BASE], col[:, COL_END]
    if len(geometry.memory) == 1:
        addr, nbytes = geometry.memory[0]
        small = base.size <= SMALL_REDUCE
        lo, hi = (min(base.tolist()), max(end.tolist())) if small else (int(base.min()), int(end.max()))
        if lo >= min(addr, cap) and hi <= min(addr + nbytes, cap):
            return None
    ranges = sorted(geometry.memory)
    starts = np.array([min(a, cap) for a, _ in ranges], dtype=np.int64)
    reach = np.array([min(x, cap) for x in accumulate((a + n for a, n in ranges), max)], dtype=np.int64)
    i = np.searchsorted(starts, base, side="right") - 1
    bad = (i < 0) | (reach[np.maximum(i, 0)] < end) if reach.size else np.ones(base.size, dtype=bool)
    if bad.any():
        return int(np.argmax(bad))
    return None


class _OutsideMemory(Exception):
    """Region ``index`` lies outside every registered range (a failed check, never remembered)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def check_groups_disjoint(geometry: RankGeometry, written: np.ndarray | None) -> None:
    """Pages of two regions of one KV group (among ``written``, or all) never share a byte
    (block IDs are shared): PlanValidationError naming two that do. For all regions, read
    :attr:`RankGeometry.groups_disjoint`, which remembers a pass."""
    col = geometry.columns if written is None else geometry.columns[written]
    idx = np.arange(len(geometry.regions)) if written is None else written
    order = np.lexsort((col[:, COL_BASE], col[:, COL_GROUP]))
    group, base, end, idx = col[order, COL_GROUP], col[order, COL_BASE], col[order, COL_END], idx[order]
    if idx.size > 1 and (base[1:] < np.maximum.accumulate(end)[:-1]).any():  # some overlap: look per group
        for g in np.unique(group).tolist():
            m = group == g
            b, e = base[m], end[m]
            if b.size > 1 and (b[1:] < np.maximum.accumulate(e)[:-1]).any():
                regions = [geometry.regions[int(i)] for i in idx[m]]
                for i, a in enumerate(regions):
                    for other in regions[i + 1 :]:
                        if other.base >= a.end:
                            break
                        _check_disjoint(a, other)


def _check_disjoint(a: Region, b: Region) -> None:
    """Pages of two regions of one KV group must never share a byte (block IDs are shared)."""
    if a.block_stride == b.block_stride and a.num_blocks > 1 and b.num_blocks > 1:
        d = (b.base - a.base) % a.block_stride
        if d >= a.page.nbytes and d + b.page.nbytes <= a.block_stride:
            return
    raise PlanValidationError(
        f"regions {a.name!r} and {b.name!r} of KV group {a.group} overlap in memory: one block's "
        "write would clobber the other layer"
    )
