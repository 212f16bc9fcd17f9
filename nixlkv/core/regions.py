"""Where KV bytes live: pages, regions and segments.

A *page* is the bytes one block occupies in one region, described as a row-major array of named
axes (outermost first, the innermost axis counted in bytes), e.g. ``head x token x byte`` for an
LBHNC attention page. A *region* is block-strided memory: block ``b``'s page starts at
``base + b * block_stride``. A *segment* says which bytes of a local page come from which bytes
of a remote rank's page, for every pair of blocks the request maps together.

These are plain frozen dataclasses with ``to_dict``/``from_dict`` so they can travel in a
handshake and be printed by ``nixlkv explain``. One rank's regions together are its
:class:`~nixlkv.core.geometry.RankGeometry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .errors import HandshakeError, IncompatibleGeometry

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
                PagePart(non_negative_int(off, "page part offset"),
                         tuple((non_empty_str(n, "page part axis"), non_negative_int(z, "page part size"),
                                non_negative_int(st, "page part stride"))
                               for n, z, st in axes))
                for off, axes in d.get("page_parts", ())
            )
            page = PageLayout(tuple((non_empty_str(n, "page axis"), non_negative_int(s, "page axis")) for n, s in d["page"]), parts)
            return cls(
                name=non_empty_str(d["name"], "name"),
                group=non_negative_int(d["group"], "group"),
                strategy=non_empty_str(d["strategy"], "strategy"),
                base=non_negative_int(d["base"], "base"),
                num_blocks=non_negative_int(d["num_blocks"], "num_blocks"),
                block_stride=non_negative_int(d["block_stride"], "block_stride"),
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


def geometry_key(region: Region) -> tuple[Any, ...]:
    """Everything about a region but its name, base and KV group, hashable, types included."""
    return (region.strategy, region.num_blocks, region.block_stride, region.page, _freeze(region.facts))


def counted_out(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A :func:`geometry_key` less the block count: what a segments_by_geometry strategy's
    segments depend on (they map bytes of one page pair, however many pages a region holds)."""
    return (key[0], *key[2:])


def counted_in(key: tuple[Any, ...], count: int) -> tuple[Any, ...]:
    """A :func:`geometry_key` with ``count`` blocks: the key of a region alike but for its count."""
    return (key[0], count, *key[2:])


SCALAR_TYPES = (int, str, float, bool, type(None))  # a fact's usual types, frozen without ABC checks


def _freeze(value: Any) -> Any:
    if type(value) in SCALAR_TYPES:  # the usual fact: no ABC isinstance checks (the same result, faster)
        return (type(value), value)
    if isinstance(value, Mapping):
        return ("map", tuple((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_freeze(v) for v in value))
    return (type(value), value)


def non_negative_int(value: Any, what: str) -> int:
    """``value`` where it is an int (not a bool) >= 0; HandshakeError naming ``what`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HandshakeError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def non_empty_str(value: Any, what: str) -> str:
    """``value`` where it is a non-empty str; HandshakeError naming ``what`` otherwise."""
    if not isinstance(value, str) or not value:
        raise HandshakeError(f"{what} must be a non-empty string, got {value!r}")
    return value
