"""Facts about where KV bytes live: pages, regions, segments, and one rank's advertised geometry.

A *page* is the bytes one block occupies in one region, described as a row-major array of named
axes (outermost first, the innermost axis counted in bytes), e.g. ``head x token x byte`` for an
LBHNC attention page. A *region* is block-strided memory: block ``b``'s page starts at
``base + b * block_stride``. A *segment* says which bytes of a local page come from which bytes
of a remote rank's page, for every pair of blocks the request maps together.

These are plain frozen dataclasses with ``to_dict``/``from_dict`` so they can travel in a
handshake and be printed by ``nixlkv explain``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from .errors import HandshakeError, IncompatibleGeometry

MAX_RUNS_PER_BOX = 1 << 16


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
    def _sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def size(self, axis: str) -> int:
        try:
            return self._sizes[axis]
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


def box_copy_runs(
    dst: PageLayout,
    dst_start: Mapping[str, int],
    src: PageLayout,
    src_start: Mapping[str, int],
    extent: Mapping[str, int],
) -> list[tuple[int, int, int]]:
    """Contiguous byte runs ``(dst_offset, src_offset, nbytes)`` that copy a box of elements.

    The box covers ``extent[a]`` elements of every axis ``a`` (the whole axis where not given,
    which must then be the same size on both sides), starting at ``dst_start``/``src_start``.
    Both pages must order their axes the same way: a copy between different axis orders is a
    permute, not a byte copy, and is refused. Pages with parts are copied part by part (the
    box's axes found in each part); both sides must then have the same parts. Runs are as long
    as both sides allow, sorted by destination offset.
    """
    if dst.names != src.names:
        raise IncompatibleGeometry(
            f"pages order their axes differently ({dst.describe()} vs {src.describe()}): "
            "bytes would need a permute, not a copy"
        )
    for name, dsize in dst.axes:
        ssize = src.size(name)
        n = extent.get(name)
        if n is None:
            if dsize != ssize:
                raise IncompatibleGeometry(
                    f"axis {name!r} has {dsize} on one side and {ssize} on the other "
                    "and no extent was given"
                )
            n = dsize
        d0, s0 = dst_start.get(name, 0), src_start.get(name, 0)
        if n < 1 or d0 < 0 or s0 < 0 or d0 + n > dsize or s0 + n > ssize:
            raise IncompatibleGeometry(
                f"box on axis {name!r} [{d0}, {d0 + n}) / [{s0}, {s0 + n}) exceeds the page "
                f"sizes {dsize} / {ssize}"
            )
    dparts, sparts = dst.memory_parts, src.memory_parts
    if len(dparts) != len(sparts) or any(d.names != s.names for d, s in zip(dparts, sparts)):
        raise IncompatibleGeometry(
            f"pages lay out their bytes differently ({dst.describe()} vs {src.describe()}): "
            "bytes would need a permute, not a copy"
        )
    boxed = {n for n in (*extent, *dst_start, *src_start)}
    chunks = []
    for dpart, spart in zip(dparts, sparts):
        missing = sorted(a for a in boxed if a not in dpart.names and (
            extent.get(a, dst.size(a)) != dst.size(a) or dst_start.get(a, 0) or src_start.get(a, 0)))
        if missing:
            raise IncompatibleGeometry(
                f"page part {dpart.describe()} has no axis {missing[0]!r} to take part of: "
                "its bytes would need a permute, not a copy"
            )
        chunks.append(_part_runs(dpart, dst_start, spart, src_start, extent))
    return _coalesce(np.concatenate(chunks) if len(chunks) > 1 else chunks[0])


def _part_runs(
    dst: PagePart, dst_start: Mapping[str, int], src: PagePart, src_start: Mapping[str, int], extent: Mapping[str, int]
) -> np.ndarray:
    """Runs ``[n, 3]`` (dst, src, nbytes) of one part pair: innermost axes merge into one run
    while they step exactly over what is already contiguous on both sides."""
    ext = []
    for (name, dsize, _), (_, ssize, _) in zip(dst.axes, src.axes):
        n = extent.get(name, dsize)
        if n > dsize or n > ssize or dst_start.get(name, 0) + n > dsize or src_start.get(name, 0) + n > ssize:
            raise IncompatibleGeometry(f"box on axis {name!r} exceeds page part sizes {dsize} / {ssize}")
        ext.append(n)
    run, k = 1, len(ext)
    while k > 0:
        i = k - 1
        (_, dsize, dstride), (_, ssize, sstride) = dst.axes[i], src.axes[i]
        if dstride != run or sstride != run:
            break
        run *= ext[i]
        k = i
        if ext[i] != dsize or ext[i] != ssize:
            break
    count = 1
    for n in ext[:k]:
        count *= n
    if count > MAX_RUNS_PER_BOX:
        raise IncompatibleGeometry(f"copy would need {count} runs per page (> {MAX_RUNS_PER_BOX})")
    d = np.full(count, dst.offset, dtype=np.int64)
    s = np.full(count, src.offset, dtype=np.int64)
    for i in range(len(ext)):
        name = dst.names[i]
        d0, s0 = dst_start.get(name, 0), src_start.get(name, 0)
        if i < k:
            inner = 1
            for n in ext[i + 1 : k]:
                inner *= n
            j = (np.arange(count, dtype=np.int64) // inner) % ext[i]
        else:
            j = 0
        d += (d0 + j) * dst.axes[i][2]
        s += (s0 + j) * src.axes[i][2]
    return np.stack([d, s, np.full(count, run, dtype=np.int64)], axis=1)


def _coalesce(runs: np.ndarray) -> list[tuple[int, int, int]]:
    """Sort runs by destination and merge those that continue each other on both sides."""
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    if len(runs) > 1:
        follows = (runs[:-1, 0] + runs[:-1, 2] == runs[1:, 0]) & (runs[:-1, 1] + runs[:-1, 2] == runs[1:, 1])
        starts = np.flatnonzero(np.concatenate([[True], ~follows]))
        ends = np.concatenate([starts[1:], [len(runs)]])
        runs = np.stack([runs[starts, 0], runs[starts, 1], runs[ends - 1, 0] + runs[ends - 1, 2] - runs[starts, 0]], axis=1)
    return [(int(d), int(s), int(n)) for d, s, n in runs]


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


@dataclass(frozen=True)
class RankGeometry:
    """What one rank advertises: who it is, its registered memory and its regions."""

    engine_id: str
    tp_size: int
    tp_rank: int
    regions: tuple[Region, ...]
    memory: tuple[tuple[int, int], ...]  # registered (address, nbytes) ranges
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise IncompatibleGeometry(f"engine {self.engine_id!r}: duplicate region names {dup}")

    def region(self, name: str) -> Region | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions}

    def iter_regions(self) -> Iterator[Region]:
        return iter(self.regions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "regions": [r.to_dict() for r in self.regions],
            "memory": [[a, n] for a, n in self.memory],
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankGeometry:
        try:
            tp_size, tp_rank = _int(d["tp_size"], "tp_size"), _int(d["tp_rank"], "tp_rank")
            if not 0 <= tp_rank < tp_size:
                raise HandshakeError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
            return cls(
                engine_id=_str(d["engine_id"], "engine_id"),
                tp_size=tp_size,
                tp_rank=tp_rank,
                regions=tuple(Region.from_dict(r) for r in d["regions"]),
                memory=tuple((_int(a, "memory address"), _int(n, "memory size")) for a, n in d["memory"]),
                device_id=_int(d.get("device_id", 0), "device_id"),
                mem_type=_str(d.get("mem_type", "DRAM"), "mem_type"),
            )
        except (KeyError, TypeError, ValueError, IncompatibleGeometry) as exc:
            raise HandshakeError(f"malformed rank geometry: {exc}") from None


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HandshakeError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise HandshakeError(f"{what} must be a non-empty string, got {value!r}")
    return value
