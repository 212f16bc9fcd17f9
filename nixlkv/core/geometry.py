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
from itertools import product
from typing import Any

from .errors import HandshakeError, IncompatibleGeometry

MAX_RUNS_PER_BOX = 1 << 16


@dataclass(frozen=True)
class PageLayout:
    """Row-major named axes of one page, outermost first; sizes of the innermost axis are bytes."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        if not self.axes or len(set(names)) != len(names):
            raise IncompatibleGeometry(f"page axes must be non-empty and unique, got {self.axes}")
        if any(int(s) < 1 for _, s in self.axes):
            raise IncompatibleGeometry(f"page axis sizes must be >= 1, got {self.axes}")

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

    def describe(self) -> str:
        return "x".join(f"{n}{s}" for n, s in self.axes)


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
    permute, not a byte copy, and is refused. Runs are as long as both sides allow.
    """
    if dst.names != src.names:
        raise IncompatibleGeometry(
            f"pages order their axes differently ({dst.describe()} vs {src.describe()}): "
            "bytes would need a permute, not a copy"
        )
    ext: list[int] = []
    for (name, dsize), (_, ssize) in zip(dst.axes, src.axes):
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
        ext.append(n)
    # The innermost axis that is partial on either side bounds what one run can hold.
    k = 0
    for i, ((_, dsize), (_, ssize), n) in enumerate(zip(dst.axes, src.axes, ext)):
        if n != dsize or n != ssize:
            k = i
    run = ext[k]
    for _, size in dst.axes[k + 1 :]:
        run *= size
    dstr, sstr = dst.strides(), src.strides()
    outer = [range(n) for n in ext[:k]]
    count = 1
    for r in outer:
        count *= len(r)
    if count > MAX_RUNS_PER_BOX:
        raise IncompatibleGeometry(f"copy would need {count} runs per page (> {MAX_RUNS_PER_BOX})")
    runs = []
    names = dst.names
    for idx in product(*outer):
        d = sum((dst_start.get(names[i], 0) + j) * dstr[names[i]] for i, j in enumerate(idx))
        s = sum((src_start.get(names[i], 0) + j) * sstr[names[i]] for i, j in enumerate(idx))
        d += dst_start.get(names[k], 0) * dstr[names[k]]
        s += src_start.get(names[k], 0) * sstr[names[k]]
        runs.append((d, s, run))
    return runs


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
            "page": [[n, s] for n, s in self.page.axes],
            "facts": dict(self.facts),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Region:
        try:
            page = PageLayout(tuple((str(n), _int(s, "page axis")) for n, s in d["page"]))
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
        except (KeyError, TypeError, ValueError, IncompatibleGeometry) as exc:
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
