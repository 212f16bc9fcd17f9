"""A request's ids: the block ids an engine hands in, the descriptor IDs a plan hands NIXL.

A block id is an index into a KV group's blocks; a descriptor ID is ``row start + block id`` in a
prepared descriptor list (:mod:`nixlkv.core.plan`). Here: what one request resolves to
(:class:`ReadOp`, :class:`ResolvedRequest`), the memory its IDs are written to
(:class:`IdScratch`), and the conversions and bounds checks of the ids themselves.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .errors import RequestError


@dataclass(frozen=True, slots=True)
class ReadOp:
    """One NIXL READ: these local descriptor IDs from these descriptor IDs of one remote rank."""

    remote_rank: int
    local_ids: np.ndarray
    remote_ids: np.ndarray
    nbytes: int | None = None  # bytes moved, when the planner knows it without expanding the ids

    @property
    def num_descriptors(self) -> int:
        return int(self.local_ids.size)


@dataclass(frozen=True, slots=True)
class ResolvedRequest:
    """What one request needs: READs, ranks that only need telling, and the consumer count
    every notified remote rank waits for before it frees the request's blocks."""

    reads: tuple[ReadOp, ...]
    notify_only: tuple[int, ...]
    consumers: int
    # Per pairing of the plan, the block pairs its READs were written from: ``(local, remote,
    # phase or None)``. What a descriptor mode is chosen on (``core.staging``: counts from
    # blocks, not from descriptor IDs); None where the request was not resolved by a plan (a
    # request whose READs are changed afterwards should drop them; counts refuse READs of other sizes).
    pairs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]] | None = None

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for r in self.reads)

    @property
    def notified_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r.remote_rank for r in self.reads} | set(self.notify_only)))


class IdScratch:
    """Reusable memory for descriptor IDs: a worker posts one request's READs before it resolves
    the next, so it need not allocate (and page-fault in) fresh arrays for every request."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.int64)
        self._at = 0

    def reset(self) -> None:
        """Start a new request: earlier views will be overwritten."""
        self._at = 0

    def take(self, n: int, dtype: Any) -> np.ndarray:
        """One array of ``n`` IDs that stays valid until :meth:`reset`."""
        buf, at = self._buf, self._at
        if buf.dtype is not dtype and buf.dtype != dtype:  # another plan's ID type: a buffer of its own
            buf = self._buf = np.empty(max(n, buf.size), dtype)
            at = 0
        elif at + n > buf.size:
            # earlier views keep the old buffer alive; this request continues in a new one
            buf = self._buf = np.empty(max(n, 2 * buf.size), dtype)
            at = 0
        self._at = at + n
        return buf[at : at + n]


def group_ids(ids: Sequence[Any], group: int, side: str, dtype: Any = np.int64) -> np.ndarray:
    if group >= len(ids):
        raise RequestError(f"{side} block ids cover {len(ids)} KV groups; group {group} is missing")
    raw = ids[group]
    if type(raw) is list:  # what vLLM hands
        try:
            return list_ids(raw, dtype)
        except struct.error:
            pass  # a negative, huge or non-integer id: converted below, where the checks name it
    try:
        if isinstance(raw, np.ndarray):
            if raw.dtype.kind not in "iu":
                raise TypeError(f"dtype {raw.dtype}")
            if raw.dtype != dtype and raw.size and (int(raw.min()) < 0 or int(raw.max()) > np.iinfo(dtype).max):
                raise OverflowError(f"ids span [{int(raw.min())}, {int(raw.max())}]")
            arr = raw.astype(dtype, copy=False)
        else:  # each id an integer (operator.index): fromiter alone would truncate 1.5 to block 1
            arr = np.fromiter(map(operator.index, raw), dtype=dtype, count=len(raw))
    except (TypeError, ValueError, OverflowError) as e:
        raise RequestError(f"{side} block ids of group {group} must be a flat list of integers: {e}") from None
    if arr.ndim != 1:
        raise RequestError(f"{side} block ids of group {group} must be a flat list")
    return arr


@lru_cache(maxsize=4096)
def packer(n: int, code: str) -> Callable[..., bytes]:
    return struct.Struct(f"{n}{code}").pack


def list_ids(raw: list[Any], dtype: Any) -> np.ndarray:
    """A Python list of block ids as a read-only array of ``dtype`` (int32 or int64), packed by
    ``struct`` in C: about 2.5x faster than ``np.fromiter``, and this conversion is the
    per-request path's largest cost. Raises ``struct.error`` for an id that is not an integer
    or does not fit ``dtype``; bounds are the caller's to check, as for any ids.
    """
    packed = packer(len(raw), "i" if dtype == np.int32 else "q")(*raw)
    return np.frombuffer(packed, dtype=dtype)


def as_ids(ids: np.ndarray, dtype: np.dtype, limit: int, side: str, group: int) -> np.ndarray:
    """A strategy's paired ids (in another integer dtype) bounds checked, in the descriptor-id dtype."""
    if ids.dtype.kind not in "iu":
        raise RequestError(f"{side} group {group}: paired block ids of dtype {ids.dtype} are not integers")
    if ids.size:
        check_bounds(ids.astype(np.int64), limit, side, group)
    return ids.astype(dtype)


def check_bounds(ids: np.ndarray, limit: int, side: str, group: int) -> None:
    # one unsigned comparison catches negative ids too (they wrap to huge values)
    if largest(ids.view(np.uint32 if ids.dtype == np.int32 else np.uint64)) >= limit:
        bad = ids[(ids < 0) | (ids >= limit)][0]
        raise RequestError(f"{side} group {group}: block id {int(bad)} outside [0, {limit})")


def largest(ids: np.ndarray) -> Any:
    """The largest of non-empty ``ids``. ``argmax`` runs a SIMD loop without the ufunc reduce's
    setup: about 3x faster than ``np.maximum.reduce`` for a request's ids, slower past ~32k."""
    return ids[ids.argmax()] if ids.size < LARGEST_BY_ARGMAX else np.maximum.reduce(ids)


LARGEST_BY_ARGMAX = 1 << 15


def row_starts(rows: np.ndarray) -> np.ndarray:
    """First descriptor ID of each strided row ``(addr, len, dev, stride, count)``, plus the total."""
    return np.concatenate([[0], np.cumsum(rows[:, 4].astype(np.int64))])


def row_index(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which strided row each descriptor ID falls in (ValueError for an ID outside the list)."""
    starts = row_starts(rows)
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= starts[-1]):
        raise ValueError(f"descriptor id outside the {starts[-1]} descriptors of the list")
    counts = rows[:, 4]
    if counts.size and counts[0] and (counts == counts[0]).all():  # rows of one length: a division
        return ids // int(counts[0])
    return np.searchsorted(starts, ids, side="right") - 1


def expand_ids(rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, lengths) of descriptor IDs in a list of strided rows ``(addr, len, dev, stride, count)``."""
    starts = row_starts(rows)
    row = np.searchsorted(starts, ids, side="right") - 1
    block = ids - starts[row]
    addr = rows[row, 0].astype(np.int64) + block * rows[row, 3].astype(np.int64)
    return addr, rows[row, 1].astype(np.int64)
