"""Byte runs: where the bytes of a box of elements lie in two pages.

A strategy says which elements of a remote page a local page takes (a box: these heads, these
tokens); :func:`box_copy_runs` turns that box into the contiguous byte runs
``(local offset, remote offset, nbytes)`` a copy moves, offsets within one block's page. The plan
adds the block (``region.base + block * block_stride + offset``, :mod:`nixlkv.core.plan`).

Pages are row-major named axes (:class:`~nixlkv.core.regions.PageLayout`), or declared parts of
them where a kernel writes bytes in its own order (:class:`~nixlkv.core.regions.PagePart`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

from .errors import IncompatibleGeometry
from .regions import PageLayout, PagePart

MAX_RUNS_PER_BOX = 1 << 16
SMALL_BOX = 256  # runs per part below which a box is computed without numpy


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

    Memoised: a pure function of two immutable pages and a few integers, asked the same
    questions by every handshake with engines of one model (as :func:`head_sources` is).
    """
    slab = _slab_run(dst, dst_start, src, src_start, extent)
    if slab is not None:
        return [slab]
    try:
        key = (dst, tuple(dst_start.items()), src, tuple(src_start.items()), tuple(extent.items()))
        hash(key)
    except TypeError:  # unhashable arguments: computed, not remembered
        return _box_copy_runs(dst, dst_start, src, src_start, extent)
    return list(_box_copy_runs_cached(*key))


def _slab_run(
    dst: PageLayout, dst_start: Mapping[str, int], src: PageLayout, src_start: Mapping[str, int], extent: Mapping[str, int],
) -> tuple[int, int, int] | None:
    """The one run of a box that takes a range of the outermost axis and the whole of every
    other, between pages without parts whose inner axes are the same (row-major: such a box is
    contiguous on both sides): a whole page, or a head slice of a head-outer page. None for any
    other box, which the general path copies or refuses."""
    if dst.parts or src.parts:
        return None
    (outer, dsize), *inner = dst.axes
    (souter, ssize), *sinner = src.axes
    if outer != souter or inner != sinner or not {*extent, *dst_start, *src_start} <= dst.axis_sizes.keys():
        return None
    for name, size in inner:
        if extent.get(name, size) != size or dst_start.get(name, 0) or src_start.get(name, 0):
            return None
    n = extent.get(outer, dsize if dsize == ssize else None)
    d0, s0 = dst_start.get(outer, 0), src_start.get(outer, 0)
    if n is None or n < 1 or d0 < 0 or s0 < 0 or d0 + n > dsize or s0 + n > ssize:
        return None
    step = dst.nbytes // dsize  # bytes per step of the outer axis, the same on both sides
    return (d0 * step, s0 * step, n * step)


def forget_copy_runs() -> None:
    """Empty the memo of copy runs between pages (a process that never planned: benches)."""
    _box_copy_runs_cached.cache_clear()


@functools.lru_cache(maxsize=4096)
def _box_copy_runs_cached(
    dst: PageLayout, dst_start: tuple[tuple[str, int], ...], src: PageLayout, src_start: tuple[tuple[str, int], ...],
    extent: tuple[tuple[str, int], ...],
) -> tuple[tuple[int, int, int], ...]:
    return tuple(_box_copy_runs(dst, dict(dst_start), src, dict(src_start), dict(extent)))


def _box_copy_runs(
    dst: PageLayout,
    dst_start: Mapping[str, int],
    src: PageLayout,
    src_start: Mapping[str, int],
    extent: Mapping[str, int],
) -> list[tuple[int, int, int]]:
    """:func:`box_copy_runs`, computed."""
    if dst.names != src.names:
        raise IncompatibleGeometry(
            f"pages order their axes differently ({dst.describe()} vs {src.describe()}): "
            "bytes would need a permute, not a copy"
        )
    ssizes = src.axis_sizes  # the same names (checked above): each is there
    for name, dsize in dst.axes:
        ssize = ssizes[name]
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
    boxed = {*extent, *dst_start, *src_start}
    chunks = []
    for dpart, spart in zip(dparts, sparts):
        missing = [] if boxed.issubset(dpart.names) else sorted(a for a in boxed if a not in dpart.names and (
            extent.get(a, dst.size(a)) != dst.size(a) or dst_start.get(a, 0) or src_start.get(a, 0)))
        if missing:
            raise IncompatibleGeometry(
                f"page part {dpart.describe()} has no axis {missing[0]!r} to take part of: "
                "its bytes would need a permute, not a copy"
            )
        chunks.append(_part_runs(dpart, dst_start, spart, src_start, extent))
    if all(isinstance(c, list) for c in chunks):
        return _coalesce_small([r for c in chunks for r in c])
    return _coalesce(np.concatenate([np.asarray(c, dtype=np.int64).reshape(-1, 3) for c in chunks]))


def _part_runs(
    dst: PagePart, dst_start: Mapping[str, int], src: PagePart, src_start: Mapping[str, int], extent: Mapping[str, int]
) -> np.ndarray:
    """Runs ``[n, 3]`` (dst, src, nbytes) of one part pair: innermost axes merge into one run
    while they step exactly over what is already contiguous on both sides."""
    names = dst.names
    d0s = [dst_start.get(name, 0) for name in names]
    s0s = [src_start.get(name, 0) for name in names]
    ext = []
    for (name, dsize, _), (_, ssize, _), d0, s0 in zip(dst.axes, src.axes, d0s, s0s):
        n = extent.get(name, dsize)
        if n > dsize or n > ssize or d0 + n > dsize or s0 + n > ssize:
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
    if count <= SMALL_BOX:  # a head slice is a few runs: plain Python beats numpy's per-call cost
        # the merged inner axes (from k) only move the start; each outer axis repeats the runs
        ds = [dst.offset + sum(d0 * axis[2] for d0, axis in zip(d0s[k:], dst.axes[k:]))]
        ss = [src.offset + sum(s0 * axis[2] for s0, axis in zip(s0s[k:], src.axes[k:]))]
        for i in range(k):
            d0, s0, dstep, sstep = d0s[i], s0s[i], dst.axes[i][2], src.axes[i][2]
            ds = [d + (d0 + j) * dstep for d in ds for j in range(ext[i])]
            ss = [x + (s0 + j) * sstep for x in ss for j in range(ext[i])]
        return [(d, x, run) for d, x in zip(ds, ss)]
    d = np.full(count, dst.offset, dtype=np.int64)
    s = np.full(count, src.offset, dtype=np.int64)
    for i in range(len(ext)):
        d0, s0 = d0s[i], s0s[i]
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


def _coalesce_small(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """:func:`_coalesce` for a few runs, in Python."""
    runs = sorted(runs, key=lambda r: r[0])
    out: list[tuple[int, int, int]] = []
    for d, s, n in runs:
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            pd, ps, pn = out[-1]
            out[-1] = (pd, ps, pn + n)
        else:
            out.append((d, s, n))
    return out


def _coalesce(runs: np.ndarray) -> list[tuple[int, int, int]]:
    """Sort runs by destination and merge those that continue each other on both sides."""
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    if len(runs) > 1:
        follows = (runs[:-1, 0] + runs[:-1, 2] == runs[1:, 0]) & (runs[:-1, 1] + runs[:-1, 2] == runs[1:, 1])
        starts = np.flatnonzero(np.concatenate([[True], ~follows]))
        ends = np.concatenate([starts[1:], [len(runs)]])
        runs = np.stack([runs[starts, 0], runs[starts, 1], runs[ends - 1, 0] + runs[ends - 1, 2] - runs[starts, 0]], axis=1)
    return [(int(d), int(s), int(n)) for d, s, n in runs]
