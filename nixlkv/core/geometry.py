"""Facts about where KV bytes live: pages, regions, segments, and one rank's advertised geometry.

A *page* is the bytes one block occupies in one region, described as a row-major array of named
axes (outermost first, the innermost axis counted in bytes), e.g. ``head x token x byte`` for an
LBHNC attention page. A *region* is block-strided memory: block ``b``'s page starts at
``base + b * block_stride``. A *segment* says which bytes of a local page come from which bytes
of a remote rank's page, for every pair of blocks the request maps together.

These are plain frozen dataclasses with ``to_dict``/``from_dict`` so they can travel in a
handshake and be printed by ``nixlkv explain``. A rank's geometry travels columnar
(:meth:`RankGeometry.to_wire`: one description per distinct region geometry, the regions as
columns); :meth:`RankGeometry.from_dict` also reads the per-region form earlier peers send.
"""

from __future__ import annotations

import copy
import marshal
import operator
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate, chain, repeat
from operator import itemgetter
from typing import Any

import numpy as np

from .errors import HandshakeError, IncompatibleGeometry, PlanValidationError
from .memo import remember
from .topology import MAX_TP_SIZE

# RankGeometry.columns: the first five are a descriptor row's (address, length, device, stride, count)
COL_BASE, COL_PAGE, COL_DEVICE, COL_STRIDE, COL_BLOCKS, COL_GROUP, COL_END = range(7)
ADDRESS_LIMIT = 1 << 62  # addresses and spans beyond it are no memory an engine maps (and overflow int64 sums)


@dataclass(frozen=True)
class PagePart:
    """Bytes of a page that do not follow the page's own axis order: named axes with explicit
    byte strides (outermost first, the innermost counted in bytes), starting at ``offset``.

    Backends whose kernels write a block's interior in another order than the tensor view says
    (keys channel-major, values token-major) describe each such piece as a part; a copy then
    runs part by part, so a box of heads and tokens lands where the kernels read it.
    """

    offset: int
    axes: tuple[tuple[str, int, int], ...]  # (name, size, byte stride)

    def __post_init__(self) -> None:
        names = [n for n, _, _ in self.axes]
        if not self.axes or len(set(names)) != len(names):
            raise IncompatibleGeometry(f"page part axes must be non-empty and unique, got {self.axes}")
        for name, size, stride in self.axes:
            for what, value, low in (("size", size, 1), ("stride", stride, 1)):
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise IncompatibleGeometry(f"page part axis {name!r}: {what} must be an int >= {low}, got {value!r}")
        if not isinstance(self.offset, int) or isinstance(self.offset, bool) or self.offset < 0:
            raise IncompatibleGeometry(f"page part offset must be an int >= 0, got {self.offset!r}")

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _, _ in self.axes)

    @cached_property
    def nbytes(self) -> int:
        total = 1
        for _, size, _ in self.axes:
            total *= size
        return total

    @cached_property
    def end(self) -> int:
        """One past the last byte the part touches."""
        return self.offset + sum((size - 1) * stride for _, size, stride in self.axes) + 1

    def without(self, axis: str) -> PagePart:
        """The part inside one step of ``axis`` (e.g. one kernel page of a ``kblock`` axis)."""
        return PagePart(self.offset, tuple(a for a in self.axes if a[0] != axis))

    def describe(self) -> str:
        return f"@{self.offset}:" + "x".join(f"{n}{s}/{st}" for n, s, st in self.axes)


@dataclass(frozen=True)
class PageLayout:
    """Row-major named axes of one page, outermost first; sizes of the innermost axis are bytes.

    ``parts``, where given, say where the bytes really are when the backend's kernels do not
    write the page in its axes' order (see :class:`PagePart`); they must cover the page exactly.
    """

    axes: tuple[tuple[str, int], ...]
    parts: tuple[PagePart, ...] = ()

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        if not self.axes or len(set(names)) != len(names):
            raise IncompatibleGeometry(f"page axes must be non-empty and unique, got {self.axes}")
        if any(int(s) < 1 for _, s in self.axes):
            raise IncompatibleGeometry(f"page axis sizes must be >= 1, got {self.axes}")
        if self.parts:
            if sum(p.nbytes for p in self.parts) != self.nbytes or any(p.end > self.nbytes for p in self.parts):
                raise IncompatibleGeometry(
                    f"page parts {[p.describe() for p in self.parts]} do not cover the page "
                    f"{self.describe()} ({self.nbytes} B) exactly"
                )

    def __hash__(self) -> int:
        """Hashed once: pages key the memoised copy runs and geometry classes."""
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.axes, self.parts))

    # Pages are immutable and asked about per layer and per peer at handshake: computed once.
    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @cached_property
    def nbytes(self) -> int:
        total = 1
        for _, size in self.axes:
            total *= size
        return total

    @cached_property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def size(self, axis: str) -> int:
        try:
            return self.axis_sizes[axis]
        except KeyError:
            raise IncompatibleGeometry(f"page {self.describe()} has no axis {axis!r}") from None

    def strides(self) -> dict[str, int]:
        """Byte stride of each axis."""
        out: dict[str, int] = {}
        step = 1
        for name, size in reversed(self.axes):
            out[name] = step
            step *= size
        return out

    @cached_property
    def memory_parts(self) -> tuple[PagePart, ...]:
        """Where the bytes are: the declared parts, else the row-major axes as one part."""
        if self.parts:
            return self.parts
        strides = self.strides()
        return (PagePart(0, tuple((n, s, strides[n]) for n, s in self.axes)),)

    def inner(self, axis: str) -> PageLayout:
        """The page inside one step of its outermost ``axis`` (one kernel page of ``kblock``)."""
        if self.names[0] != axis:
            raise IncompatibleGeometry(f"page {self.describe()} is not outermost in {axis!r}")
        return PageLayout(self.axes[1:], tuple(p.without(axis) for p in self.parts))

    def describe(self) -> str:
        text = "x".join(f"{n}{s}" for n, s in self.axes)
        return text + (" [" + ", ".join(p.describe() for p in self.parts) + "]" if self.parts else "")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"page": [[n, s] for n, s in self.axes]}
        if self.parts:
            out["page_parts"] = [[p.offset, [[n, s, st] for n, s, st in p.axes]] for p in self.parts]
        return out


@dataclass(frozen=True)
class LayerCache:
    """One layer's KV cache as an engine laid it out: the input strategies build regions from.

    ``spec`` is the engine's own spec object (opaque to core); ``page`` was read off the real
    tensor strides, so it is what the memory holds, not what a model flag claims. ``hints`` are
    engine facts a per-rank spec cannot tell (e.g. ``total_kv_heads``: with replicated heads
    every rank holds one head whatever the model has).
    """

    name: str
    group: int
    spec: Any
    base: int
    num_blocks: int
    block_stride: int
    page: PageLayout
    hints: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Region:
    """Block-strided memory on one rank, plus the strategy-specific facts a peer needs.

    ``facts`` is self-describing geometry (heads held, tokens per block, content bytes...),
    advertised in the handshake and compared by the strategy against the peer's.
    """

    name: str
    group: int
    strategy: str
    base: int
    num_blocks: int
    block_stride: int
    page: PageLayout
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("base", "num_blocks", "block_stride"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise IncompatibleGeometry(f"region {self.name!r}: {attr} must be an int >= 0, got {value!r}")
        if self.num_blocks < 1:
            raise IncompatibleGeometry(f"region {self.name!r}: num_blocks must be >= 1")
        if self.num_blocks > 1 and self.page.nbytes > self.block_stride:
            raise IncompatibleGeometry(
                f"region {self.name!r}: page of {self.page.nbytes} B exceeds the block stride "
                f"{self.block_stride} B, so blocks would overlap"
            )

    @classmethod
    def of_layer(
        cls, layer: LayerCache, strategy: str, facts: Mapping[str, Any], *, page: PageLayout | None = None,
        part: str | None = None, offset: int = 0,
    ) -> Region:
        """The region a strategy describes for ``layer``: the layer's group, block count and block
        stride, ``page`` (the layer's own where not given) starting ``offset`` bytes into each of its
        blocks, and the strategy's ``facts``. ``part`` names one of several regions a layer's blocks
        hold (``<layer>:<part>``: a Mamba layer's conv and SSM states)."""
        return cls(
            name=layer.name if part is None else f"{layer.name}:{part}",
            group=layer.group,
            strategy=strategy,
            base=layer.base + offset,
            num_blocks=layer.num_blocks,
            block_stride=layer.block_stride,
            page=layer.page if page is None else page,
            facts=facts,
        )

    @property
    def end(self) -> int:
        """One past the last byte any block of this region touches."""
        return self.base + (self.num_blocks - 1) * self.block_stride + self.page.nbytes

    def fact(self, key: str) -> Any:
        try:
            return self.facts[key]
        except KeyError:
            raise IncompatibleGeometry(
                f"region {self.name!r} (strategy {self.strategy!r}) does not advertise {key!r}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "strategy": self.strategy,
            "base": self.base,
            "num_blocks": self.num_blocks,
            "block_stride": self.block_stride,
            **self.page.to_wire(),
            "facts": dict(self.facts),
        }

    def class_dict(self) -> dict[str, Any]:
        """The description less name, base and KV group: what the regions of one geometry class
        share, sent once per class by the columnar wire (``region_classes``)."""
        return {
            "strategy": self.strategy,
            "num_blocks": self.num_blocks,
            "block_stride": self.block_stride,
            **self.page.to_wire(),
            "facts": dict(self.facts),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Region:
        try:
            parts = tuple(
                PagePart(_int(off, "page part offset"),
                         tuple((_str(n, "page part axis"), _int(z, "page part size"), _int(st, "page part stride"))
                               for n, z, st in axes))
                for off, axes in d.get("page_parts", ())
            )
            page = PageLayout(tuple((_str(n, "page axis"), _int(s, "page axis")) for n, s in d["page"]), parts)
            return cls(
                name=_str(d["name"], "name"),
                group=_int(d["group"], "group"),
                strategy=_str(d["strategy"], "strategy"),
                base=_int(d["base"], "base"),
                num_blocks=_int(d["num_blocks"], "num_blocks"),
                block_stride=_int(d["block_stride"], "block_stride"),
                page=page,
                facts=dict(d.get("facts", {})),
            )
        except (AttributeError, KeyError, TypeError, ValueError, IncompatibleGeometry) as exc:
            raise HandshakeError(f"malformed region description: {exc}") from None


@dataclass(frozen=True)
class Segment:
    """Bytes ``[local_offset, +nbytes)`` of a local page come from ``[remote_offset, +nbytes)``
    of ``remote_region``'s page on ``remote_rank``, for every block pair of the request whose
    phase is ``phase`` (see :mod:`nixlkv.core.token_blocks`; 0 when block sizes match)."""

    local_region: str
    local_offset: int
    remote_rank: int
    remote_region: str
    remote_offset: int
    nbytes: int
    phase: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_region": self.local_region,
            "local_offset": self.local_offset,
            "remote_rank": self.remote_rank,
            "remote_region": self.remote_region,
            "remote_offset": self.remote_offset,
            "nbytes": self.nbytes,
            "phase": self.phase,
        }


class ColumnRegions(Sequence[Region]):
    """The regions of a geometry parsed from the columnar wire: one validated description per
    class plus each region's name, base and group, each :class:`Region` made on first access.

    Planning reads the columns (:attr:`RankGeometry.columns`) and one region per class, so a
    handshake does not build an object per layer it never looks at.
    """

    __slots__ = ("_protos", "_names", "_bases", "_groups", "_classes", "_keys", "_made")

    def __init__(
        self, protos: list[dict[str, Any]], names: list[str], bases: list[int], groups: list[int], classes: list[int],
        keys: list[tuple[Any, ...]],
    ) -> None:
        self._protos, self._names, self._bases, self._groups, self._classes = protos, names, bases, groups, classes
        self._keys = keys  # per class: geometry_key of its regions
        self._made: list[Region | None] | None = None

    def class_key(self, c: int) -> tuple[Any, ...]:
        """:func:`geometry_key` of class ``c``'s regions, known from parsing."""
        return self._keys[c]

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> list[str]:
        """The regions' names in order, as the columns carried them (checked: unique, non-empty)."""
        return self._names

    @property
    def bases(self) -> list[int]:
        """The regions' bases in order, as the columns carried them (checked). Read-only."""
        return self._bases

    def _make(self, i: int) -> Region:
        """Region ``i``: its class's validated description with its own name, base and group."""
        return Region(**{**self._protos[self._classes[i]], "name": self._names[i], "base": self._bases[i], "group": self._groups[i]})

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        made = self._made
        if made is None:
            made = self._made = [None] * len(self._names)
        region = made[i]
        if region is None:
            region = made[i] = self._make(range(len(made))[i])
        return region

    def __iter__(self) -> Iterator[Region]:
        made = self._made
        if made is None or None in made:
            made = self._made = [r if r is not None else self._make(i) for i, r in enumerate(made or [None] * len(self))]
        return iter(made)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (tuple, ColumnRegions)) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # like the regions' facts: not hashable

    def __repr__(self) -> str:
        return repr(tuple(self))


_new = object.__new__


@dataclass(frozen=True)
class RankGeometry:
    """What one rank advertises: who it is, its registered memory and its regions."""

    engine_id: str
    tp_size: int
    tp_rank: int
    regions: tuple[Region, ...] | ColumnRegions  # a tuple, or the columns a columnar handshake carried
    memory: tuple[tuple[int, int], ...]  # registered (address, nbytes) ranges
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        columnar = isinstance(self.regions, ColumnRegions)  # whose names were checked unique when parsed
        names = self.names
        if not columnar and len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise IncompatibleGeometry(f"engine {self.engine_id!r}: duplicate region names {dup}")

    def region(self, name: str) -> Region | None:
        return self._by_name.get(name)

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
        return _shape_of(self._layout_tail)

    @cached_property
    def _layout_tail(self) -> tuple[Any, ...]:
        """:attr:`layout_key` but TP size and rank: the same object for every rank parsed with one
        remembered column layout (so comparing two such keys is mostly identity)."""
        return (tuple(self.names), tuple(self.columns[:, COL_GROUP].tolist()), self.geometry_classes,
                tuple(self.class_keys.items()))

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
        handful. :meth:`from_dict` fills this in while parsing; otherwise it is computed here.
        """
        ids: dict[tuple[Any, ...], int] = {}
        return tuple(ids.setdefault(geometry_key(r), len(ids)) for r in self.regions)

    @cached_property
    def columns(self) -> np.ndarray:
        """Per region, int64 ``(base, page bytes, device, block_stride, num_blocks, group, end)``
        (the ``COL_*`` indices): checks and descriptor rows without a Python loop per layer. Built
        per geometry class (:attr:`geometry_classes`), so a parsed handshake pays per layer only
        for its base."""
        return self._columns_of([r.base for r in self.regions], [r.group for r in self.regions])

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

    def _columns_from(self, layout: _ColumnLayout, bases: list[int]) -> None:
        """:attr:`columns` and :attr:`class_firsts` of a parsed columnar geometry: the first of its
        layout builds them (:meth:`_columns_of`) and leaves a template of columns at base 0; a
        later one copies the template and adds its bases and device."""
        if layout.template is None or self.device_id >= ADDRESS_LIMIT:
            columns = self._columns_of(bases, layout.groups)
            if layout.template is None:
                template = columns.copy()
                template[:, COL_END] -= template[:, COL_BASE]
                template[:, COL_BASE] = 0
                layout.template, layout.firsts = template, self.class_firsts
        else:
            columns = layout.template.copy()
            own = np.frombuffer(struct.pack(f"{len(bases)}q", *bases), dtype=np.int64)  # checked ints below 2**62
            columns[:, COL_BASE] = own
            columns[:, COL_END] += own
            columns[:, COL_DEVICE] = self.device_id
            self.__dict__["class_firsts"] = layout.firsts
        self.__dict__["columns"] = columns
        if layout.tail is None:
            layout.tail = self._layout_tail
        self.__dict__["_layout_tail"] = layout.tail
        if layout.shape is not None:
            self.__dict__["_shape_tail"] = layout.shape

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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankGeometry:
        """Parse and check a peer's geometry, in the columnar form (:meth:`to_wire`) or the
        per-region form (:meth:`to_dict`); HandshakeError naming the field otherwise."""
        try:
            tp_size, tp_rank = _int(d["tp_size"], "tp_size"), _int(d["tp_rank"], "tp_rank")
            if not 1 <= tp_size <= MAX_TP_SIZE:
                raise HandshakeError(f"tp_size must be in [1, {MAX_TP_SIZE}] (no engine runs a larger TP group), got {tp_size}")
            if not 0 <= tp_rank < tp_size:
                raise HandshakeError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
            columnar = "region_classes" in d or "region_columns" in d
            layout = None
            if columnar:
                if "regions" in d:
                    raise HandshakeError("geometry holds both 'regions' and 'region_classes'/'region_columns': send one form")
                regions, classes, layout = _parse_columnar(d)
            else:
                regions, classes = _parse_regions(d["regions"])
            geometry = cls(
                engine_id=_str(d["engine_id"], "engine_id"),
                tp_size=tp_size,
                tp_rank=tp_rank,
                regions=regions,
                memory=tuple((_int(a, "memory address"), _int(n, "memory size")) for a, n in d["memory"]),
                device_id=_int(d.get("device_id", 0), "device_id"),
                mem_type=_str(d.get("mem_type", "DRAM"), "mem_type"),
            )
            if classes is not None:
                geometry.__dict__["geometry_classes"] = classes  # what parsing found (cached_property slot)
            if layout is not None:  # the columns as they came, checked: no pass over the regions for them
                geometry._columns_from(layout, d["region_columns"]["base"])
            else:  # every region's base and span checked now, as the columnar form's are
                geometry.columns
        except (KeyError, TypeError, ValueError, IncompatibleGeometry) as exc:
            raise HandshakeError(f"malformed rank geometry: {exc}") from None
        return geometry


def _parse_regions(items: Any, share: bool = True) -> tuple[tuple[Region, ...], tuple[int, ...] | None]:
    """Regions of a handshake, each region that repeats an earlier one's description (all but its
    name, base and KV group, values and their types alike) made as a copy of it: a model's
    layers are a handful of distinct geometries, so the wire is parsed (and later planned) once
    per distinct one.

    Equality is found with C-level passes over all descriptions per distinct geometry; that
    equal values also have equal types (``True == 1`` and ``16.0 == 16`` in Python, not on the
    wire) is checked for all copies at once; where anything is not plain, every region is parsed
    on its own, with every check and its own message.
    """
    if share:
        try:
            return _parse_shared(list(items))
        except _NotPlain:
            pass
    # classes left to RankGeometry.geometry_classes (by value and type), so that such a peer is
    # planned per geometry class like any other (and aliasing groups share registered rows)
    return tuple(Region.from_dict(rd) for rd in items), None


REGION_COLUMNS = ("name", "base", "group", "class")  # the columnar wire's per-region fields
_REGION_OWN = frozenset(("name", "base", "group"))


def _parse_columnar(d: Mapping[str, Any]) -> tuple[ColumnRegions | tuple[Region, ...], tuple[int, ...]]:
    """Regions of a columnar handshake (:meth:`RankGeometry.to_wire`): each class description
    parsed and checked once as a region, the columns checked in bulk (lengths, exact types, ranges,
    unique names); a region is a copy of its class with its own name, base and group, made when
    first read (:class:`ColumnRegions`). A layout parsed before (everything but the bases, the
    same bytes) is taken as it was: only the bases are checked."""
    described, columns = d["region_classes"], d["region_columns"]
    key = _layout_key(described, columns)
    layout = _LAYOUTS.get(key) if key is not None else None
    if layout is None and key is not None:  # an engine of a layout met before, with other block counts?
        shaped = _SHAPED.get(key[0])
        layout = shaped.recounted(key[1]) if shaped is not None else None
        if layout is not None:
            remember(_LAYOUTS, key, layout, MEMO_LAYOUTS)
    bases = columns.get("base") if layout is not None else None
    if isinstance(bases, (list, tuple)) and len(bases) == len(layout.names):
        _check_int_column("base", bases, ADDRESS_LIMIT)
        regions = ColumnRegions(layout.protos, layout.names, list(bases), layout.groups, layout.classes, layout.keys)
        return regions, layout.class_ids, layout
    if not isinstance(described, list):
        raise HandshakeError(f"region_classes must be a list of region descriptions, got {type(described).__name__}")
    if not isinstance(columns, Mapping):
        raise HandshakeError(f"region_columns must be a map of the columns {list(REGION_COLUMNS)}, got {type(columns).__name__}")
    described_bytes = [_description_bytes(cd) for cd in described]
    known = [_described_class(k, cd, b) for k, (cd, b) in enumerate(zip(described, described_bytes))]
    # every description remembered (marshal wrote it): then so may the layout be
    plain = key is not None and all(b is not None and _DESCRIBED.get(b) is entry for b, entry in zip(described_bytes, known))
    missing = [c for c in REGION_COLUMNS if c not in columns]
    if missing:
        raise HandshakeError(f"region_columns lacks the columns {missing}")
    cols = [columns[c] for c in REGION_COLUMNS]
    for name, col in zip(REGION_COLUMNS, cols):
        if not isinstance(col, (list, tuple)):
            raise HandshakeError(f"region_columns[{name!r}] must be a list, got {type(col).__name__}")
    names, bases, groups, classes = cols
    n = len(names)
    if any(len(col) != n for col in cols):
        sizes = ", ".join(f"{name} {len(col)}" for name, col in zip(REGION_COLUMNS, cols))
        raise HandshakeError(f"region_columns must be lists of one length, got {sizes}")
    if not n:
        return (), (), None
    names_str = set(map(type, names)) == {str}
    every_int = set(map(type, chain(bases, groups, classes))) == {int}  # one pass over the types of all three
    if not names_str or "" in names:
        i = next(i for i, v in enumerate(names) if type(v) is not str or not v)
        raise HandshakeError(f"region_columns['name'][{i}] must be a non-empty string, got {names[i]!r}")
    if len(set(names)) != n:
        seen: set[str] = set()
        dup = sorted({v for v in names if v in seen or seen.add(v)})
        raise HandshakeError(f"region_columns['name'] repeats region names {dup[:8]}")
    for name, col, limit in (("base", bases, ADDRESS_LIMIT), ("group", groups, ADDRESS_LIMIT), ("class", classes, len(known))):
        _check_int_column(name, col, limit, every_int)
    layout = _ColumnLayout(known, list(names), list(groups), list(classes))
    if plain:  # every description remembered, every column exact str / int: the bytes say it all
        remember(_LAYOUTS, key, layout, MEMO_LAYOUTS)
        remember(_SHAPED, key[0], layout, MEMO_LAYOUTS)
    regions = ColumnRegions(layout.protos, layout.names, list(bases), layout.groups, layout.classes, layout.keys)
    return regions, layout.class_ids, layout


def _layout_key(described: Any, columns: Any) -> tuple[bytes, tuple[int, ...]] | None:
    """A columnar geometry's layout, exactly: the ``marshal`` bytes (version 2) of its class
    descriptions with their block counts zeroed and of every column but the bases, and the block
    counts apart. Exact, as for one description (:func:`_described_class`): the bytes name every
    value's type, marshal refuses subclasses, and the counts are exact ints. The bytes alone are
    the layout's shape: every engine of one model and configuration sends the same, whatever its
    memory holds. None where a description is no plain map with an int count, or marshal cannot
    write it (then the layout is never remembered)."""
    if type(columns) is not dict or type(described) is not list:
        return None
    counts, shapes = [], []
    for cd in described:
        count = cd.get("num_blocks") if type(cd) is dict else None
        if type(count) is not int:
            return None
        counts.append(count)
        shapes.append({**cd, "num_blocks": 0})
    try:
        shape = marshal.dumps((shapes, columns.get("name"), columns.get("group"), columns.get("class")), 2)
    except (ValueError, TypeError):
        return None
    return shape, tuple(counts)


class _ColumnLayout:
    """A columnar geometry's per-region columns but its bases, checked (names unique and
    non-empty, groups and class ids in range), with what the geometry derives from them alone:
    every engine of one model sends the same, so a later rank of it skips those checks."""

    __slots__ = ("protos", "keys", "names", "groups", "classes", "class_ids", "firsts", "template", "tail", "shape")

    def __init__(self, known: list[Any], names: list[str], groups: list[int], classes: list[int]) -> None:
        """``known``: per class description, (its validated region's fields, its geometry_key)."""
        self.names, self.groups, self.classes = names, groups, classes
        self.protos = [fields for fields, _ in known]  # per class: its validated region's fields
        self.keys = [key for _, key in known]  # per class: its geometry_key
        self.class_ids = tuple(classes)
        self.firsts: dict[int, int] | None = None  # RankGeometry.class_firsts, once made
        self.template: np.ndarray | None = None  # columns with bases 0 (ends are spans), once made
        self.tail: tuple[Any, ...] | None = None  # RankGeometry._layout_tail, once made
        self.shape: tuple[Any, ...] | None = None  # RankGeometry._shape_tail, once a recount made it

    def recounted(self, counts: tuple[int, ...]) -> _ColumnLayout | None:
        """This layout with ``counts`` blocks per class (exact ints): what parsing the same shape
        with those counts makes, its per-region columns checked already. None where a count is
        one a region refuses (parsed then, for the error naming it)."""
        protos, keys, spans = [], [], []
        for proto, key, count in zip(self.protos, self.keys, counts):
            page, stride = proto["page"].nbytes, proto["block_stride"]
            span = (count - 1) * stride + page
            if count < 1 or (count > 1 and page > stride) or span >= ADDRESS_LIMIT:
                return None
            protos.append({**proto, "num_blocks": count})
            keys.append(counted_in(key, count))
            spans.append(span)
        layout = copy.copy(self)  # the same names, groups, classes and first regions per class
        layout.protos, layout.keys, layout.tail, layout.shape, layout.template = protos, keys, None, None, None
        if self.tail is not None:  # the tail with the new counts in its class keys; the shape is the same
            names, groups, class_ids, old = self.tail
            if self.shape is None:
                self.shape = _shape_of(self.tail)
            layout.tail, layout.shape = (names, groups, class_ids, tuple((c, keys[c]) for c, _ in old)), self.shape
        if self.template is not None:
            template = self.template.copy()
            if len(counts) == 1:  # one class (a dense model): every region's count and span
                template[:, COL_BLOCKS], template[:, COL_END] = counts[0], spans[0]
            else:
                of = np.array(self.class_ids, dtype=np.int64)
                template[:, COL_BLOCKS] = np.array(counts, dtype=np.int64)[of]
                template[:, COL_END] = np.array(spans, dtype=np.int64)[of]
            layout.template = template
        return layout


MEMO_LAYOUTS = 16  # column layouts remembered: a decode rank meets a handful
# a layout (_layout_key: its shape's bytes and its block counts) -> the layout, parsed and
# checked: the ranks of every engine of a model send the same, but for their bases.
_LAYOUTS: dict[tuple[bytes, tuple[int, ...]], _ColumnLayout] = {}
# a layout's shape bytes -> the first layout parsed with them: an engine of the model whose
# memory holds other block counts sends the same shape (its layout is recounted from this one).
_SHAPED: dict[bytes, _ColumnLayout] = {}


MEMO_DESCRIPTIONS = 1024  # class descriptions remembered (a deployment's models have a handful each)
# marshal bytes of a class description -> (its validated region's fields, its geometry_key):
# the ranks of every engine of a model send the same few descriptions.
_DESCRIBED: dict[bytes, tuple[dict[str, Any], tuple[Any, ...]]] = {}


def forget_parsed() -> None:
    """Empty the memos of class descriptions and column layouts (a process that never parsed a
    handshake: benches)."""
    _DESCRIBED.clear()
    _LAYOUTS.clear()
    _SHAPED.clear()


def _description_bytes(cd: Any) -> bytes | None:
    """A class description's ``marshal`` bytes (version 2: no references), or None where marshal
    cannot write it (never a remembered description)."""
    try:
        return marshal.dumps(cd, 2)
    except (ValueError, TypeError):
        return None


def _described_class(k: int, cd: Any, key: bytes | None) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """``region_classes[k]`` parsed and checked as a region (its name, base and group left to the
    columns): the region's fields and its :func:`geometry_key`. A description is remembered by its
    ``marshal`` bytes ``key`` (:func:`_description_bytes`), which are exact: they name every
    value's type (``True``, ``1`` and ``1.0`` differ), and marshal writes only the built-in types
    themselves (it refuses subclasses and every other object). Equal bytes are an equal
    description, which parses alike, so one seen before is not parsed again."""
    known = _DESCRIBED.get(key) if key is not None else None
    if known is not None:
        return known
    if not isinstance(cd, Mapping):
        raise HandshakeError(f"region_classes[{k}] must be a map, got {type(cd).__name__}")
    own = sorted(_REGION_OWN & cd.keys())
    if own:
        raise HandshakeError(f"region_classes[{k}] holds {own}: a region's own fields belong in region_columns")
    try:
        region = Region.from_dict({**cd, "name": f"region_classes[{k}]", "base": 0, "group": 0})
    except HandshakeError as exc:
        raise HandshakeError(f"region_classes[{k}]: {exc}") from None
    known = (region.__dict__, geometry_key(region))
    if key is not None:
        remember(_DESCRIBED, key, known, MEMO_DESCRIPTIONS)
    return known


def _check_int_column(key: str, col: list[Any] | tuple[Any, ...], limit: int, every_int: bool = False) -> None:
    """Every entry an int (not a bool, not a float) in ``[0, limit)``: one pass over the types
    (skipped where the caller saw ``every_int``) and one min and max, all in C (cheaper than
    numpy's per-call cost for a model's layers, as fast beyond), the first bad entry named."""
    if not every_int and set(map(type, col)) != {int}:
        i = next(i for i, v in enumerate(col) if type(v) is not int)
        raise HandshakeError(f"region_columns[{key!r}][{i}] must be a non-negative integer, got {col[i]!r}")
    low, high = min(col), max(col)
    if low < 0:
        i = col.index(low)
        raise HandshakeError(f"region_columns[{key!r}][{i}] must be a non-negative integer, got {low!r}")
    if high >= limit:
        i = col.index(high)
        if key == "class":
            raise HandshakeError(f"region_columns['class'][{i}] = {high} is out of range: the geometry lists {limit} region_classes")
        raise HandshakeError(f"region_columns[{key!r}][{i}] = {high} lies beyond 2**62: no engine has one")


class _NotPlain(Exception):
    """A handshake's regions are not all plain descriptions: parse them one by one."""


_TEMPLATE = itemgetter("strategy", "num_blocks", "block_stride", "page", "facts")
_HEAD = itemgetter("group", "num_blocks", "block_stride", "base")
_SIGNED = itemgetter("group", "base")  # the fields a copy does not share with its template
_OWN = itemgetter("name", "base", "group")


def _parse_shared(items: list[Any]) -> tuple[tuple[Region, ...], tuple[int, ...]]:
    """:func:`_parse_regions` with copies; raises :class:`_NotPlain` where that cannot be exact."""
    if not items:
        return (), ()
    if set(map(type, items)) != {dict} or any(map(operator.contains, items, repeat("page_parts"))):
        raise _NotPlain
    try:
        described = list(map(_TEMPLATE, items))
        own = list(map(_OWN, items))
    except KeyError:
        raise _NotPlain from None
    if set(map(type, map(itemgetter(3), described))) != {list} or set(map(type, map(itemgetter(4), described))) != {dict}:
        raise _NotPlain
    classes = [-1] * len(items)
    protos: list[Region] = []
    todo = list(range(len(items)))
    while todo:  # one C-level pass per distinct geometry over the descriptions not yet placed
        first = todo[0]
        proto = Region.from_dict(items[first])
        cid = len(protos)
        protos.append(proto)
        same = list(map(operator.eq, [described[i] for i in todo], repeat(described[first])))
        for i, hit in zip(todo, same):
            if hit:
                classes[i] = cid
        todo = [i for i, hit in zip(todo, same) if not hit]
    if not _copies_exact(items, classes):
        raise _NotPlain
    # each region a copy of its class's validated region: name, base and group its own
    regions = tuple(replace(protos[cid], name=name, base=base, group=group) for (name, base, group), cid in zip(own, classes))
    return regions, tuple(classes)


def _copies_exact(items: list[Mapping[str, Any]], classes: list[int]) -> bool:
    """Every description has a valid name, base and group, and values of the same types as its
    class's first (one pass in C over all of them, not a check per field per layer)."""
    names = list(map(itemgetter("name"), items))
    if set(map(type, names)) != {str} or "" in names:
        return False
    if set(map(type, chain.from_iterable(map(_HEAD, items)))) != {int} or min(chain.from_iterable(map(_SIGNED, items))) < 0:
        return False
    firsts: dict[int, Mapping[str, Any]] = {}
    members: dict[int, list[Mapping[str, Any]]] = {}
    for rd, cid in zip(items, classes):
        if cid in firsts:
            members[cid].append(rd)
        else:
            firsts[cid], members[cid] = rd, []
    for cid, copies in members.items():
        if not copies:
            continue
        t = firsts[cid]
        fact_types = list(map(type, t["facts"].values()))
        page_types = list(map(type, chain.from_iterable(t["page"])))
        k = len(copies)
        if list(map(type, chain.from_iterable(rd["facts"].values() for rd in copies))) != fact_types * k:
            return False
        if list(map(type, chain.from_iterable(chain.from_iterable(rd["page"] for rd in copies)))) != page_types * k:
            return False
        if set(map(type, map(itemgetter("strategy"), copies))) != {str}:
            return False
        if any(not isinstance(v, _SCALARS) for v in t["facts"].values()) and not all(_same_types(rd["facts"], t["facts"]) for rd in copies):
            return False
    return True


_SCALARS = (int, str, float, bool, type(None))


def _same_types(a: Any, b: Any) -> bool:
    """Equal values (already compared) hold values of the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return all(_same_types(v, b[k]) for k, v in a.items())
    return True


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


def geometry_key(region: Region) -> tuple[Any, ...]:
    """Everything about a region but its name, base and KV group, hashable, types included."""
    return (region.strategy, region.num_blocks, region.block_stride, region.page, _freeze(region.facts))


def _shape_of(layout_tail: tuple[Any, ...]) -> tuple[Any, ...]:
    """A :attr:`RankGeometry._layout_tail` less its block counts."""
    names, groups, classes, keys = layout_tail
    return (names, groups, classes, tuple((c, counted_out(k)) for c, k in keys))


def counted_out(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A :func:`geometry_key` less the block count: what a segments_by_geometry strategy's
    segments depend on (they map bytes of one page pair, however many pages a region holds)."""
    return (key[0], *key[2:])


def counted_in(key: tuple[Any, ...], count: int) -> tuple[Any, ...]:
    """A :func:`geometry_key` with ``count`` blocks: the key of a region alike but for its count."""
    return (key[0], count, *key[2:])


def _freeze(value: Any) -> Any:
    if type(value) in _SCALARS:  # the usual fact: no ABC isinstance checks (the same result, faster)
        return (type(value), value)
    if isinstance(value, Mapping):
        return ("map", tuple((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_freeze(v) for v in value))
    return (type(value), value)


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HandshakeError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise HandshakeError(f"{what} must be a non-empty string, got {value!r}")
    return value
