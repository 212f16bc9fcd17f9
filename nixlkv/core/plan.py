"""The transfer plan: segments turned into NIXL descriptor lists, validated once, resolved per request.

Every segment becomes one strided descriptor row on each side, ``(address, nbytes, device,
block_stride, num_blocks)``; the descriptor ID of block ``b`` in that row is
``row_start + b``. A request's block IDs therefore resolve to descriptor IDs with one broadcast
add per (remote rank, group): no Python loop per block. Rows are segment-major, so consecutive
blocks of a whole-page segment are adjacent on both sides and NIXL merges them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import PlanValidationError, RequestError
from .geometry import RankGeometry, Region, Segment
from .strategy import Strategy


@dataclass(frozen=True)
class GroupPairing:
    """Local KV group ``local_group`` is read from remote group ``remote_group`` by ``strategy``."""

    local_group: int
    remote_group: int
    strategy: Strategy
    local_num_blocks: int  # smallest num_blocks over its local regions: the valid id bound
    remote_num_blocks: int  # same over its remote regions on every rank read
    local_region: Region  # a representative region of the group on each side, for pair_blocks
    remote_region: Region


@dataclass(frozen=True)
class ReadOp:
    """One NIXL READ: these local descriptor IDs from these descriptor IDs of one remote rank."""

    remote_rank: int
    local_ids: np.ndarray
    remote_ids: np.ndarray
    nbytes: int | None = None  # bytes moved, when the planner knows it without expanding the ids

    @property
    def num_descriptors(self) -> int:
        return int(self.local_ids.size)


@dataclass(frozen=True)
class ResolvedRequest:
    """What one request needs: READs, ranks that only need telling, and the consumer count
    every notified remote rank waits for before it frees the request's blocks."""

    reads: tuple[ReadOp, ...]
    notify_only: tuple[int, ...]
    consumers: int

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
        self._buf: dict[np.dtype, np.ndarray] = {}
        self._at: dict[np.dtype, int] = {}

    def reset(self) -> None:
        """Start a new request: earlier views will be overwritten."""
        self._at.clear()

    def take(self, n: int, dtype: Any) -> np.ndarray:
        """One array of ``n`` IDs that stays valid until :meth:`reset`."""
        dtype = np.dtype(dtype)
        buf = self._buf.setdefault(dtype, np.empty(0, dtype))
        at = self._at.get(dtype, 0)
        if at + n > buf.size:
            # earlier views keep the old buffer alive; this request continues in a new one
            self._buf[dtype] = buf = np.empty(max(n, 2 * buf.size), dtype)
            at = 0
        self._at[dtype] = at + n
        return buf[at : at + n]


class TransferPlan:
    """Immutable plan for one local rank reading from one remote engine."""

    def __init__(
        self,
        local: RankGeometry,
        remote: Mapping[int, RankGeometry],
        covered: Sequence[int],
        consumers: int,
        segments: Sequence[tuple[Segment, int]],
        pairings: Sequence[GroupPairing],
    ) -> None:
        self.local = local
        self.remote = dict(remote)
        self.covered = tuple(covered)
        self.consumers = consumers
        self.pairings = tuple(pairings)
        self.segments = tuple(s for s, _ in segments)
        self._seg_key = np.array([k for _, k in segments], dtype=np.int64)
        self._validate()
        self._build_rows()

    # ---------------------------------------------------------------- construction
    def _local_region(self, seg: Segment) -> Region:
        region = self.local.region(seg.local_region)
        if region is None:
            raise PlanValidationError(f"segment names unknown local region {seg.local_region!r}")
        return region

    def _remote_region(self, seg: Segment) -> Region:
        if seg.remote_rank not in self.covered:
            raise PlanValidationError(
                f"segment of {seg.local_region!r} reads remote rank {seg.remote_rank}, outside the "
                f"ranks this local rank covers {list(self.covered)}: that rank could free the "
                "blocks before the read"
            )
        region = self.remote[seg.remote_rank].region(seg.remote_region)
        if region is None:
            raise PlanValidationError(
                f"segment reads unknown region {seg.remote_region!r} on remote rank {seg.remote_rank}"
            )
        return region

    def _validate(self) -> None:
        by_region: dict[str, list[Segment]] = {}
        for seg in self.segments:
            local, remote = self._local_region(seg), self._remote_region(seg)
            if seg.nbytes <= 0:
                raise PlanValidationError(f"segment {seg} moves no bytes")
            if seg.local_offset < 0 or seg.local_offset + seg.nbytes > local.page.nbytes:
                raise PlanValidationError(
                    f"segment {seg} leaves local page of {local.name!r} ({local.page.nbytes} B)"
                )
            if seg.remote_offset < 0 or seg.remote_offset + seg.nbytes > remote.page.nbytes:
                raise PlanValidationError(
                    f"segment {seg} leaves the page of {remote.name!r} on remote rank "
                    f"{seg.remote_rank} ({remote.page.nbytes} B)"
                )
            if seg.phase < 0:
                raise PlanValidationError(f"segment {seg} has a negative phase")
            by_region.setdefault((seg.local_region, seg.phase), []).append(seg)
        for geometry in (self.local, *(self.remote[p] for p in self.covered)):
            for region in geometry.regions:
                _check_registered(region, geometry)
        for (name, _phase), segs in by_region.items():
            segs = sorted(segs, key=lambda s: s.local_offset)
            for a, b in zip(segs, segs[1:]):
                if a.local_offset + a.nbytes > b.local_offset:
                    raise PlanValidationError(
                        f"two segments write the same bytes of local region {name!r}: {a} and {b}"
                    )
        written = {name for name, _ in by_region}
        by_group: dict[int, list[Region]] = {}
        for region in (r for r in self.local.regions if r.name in written):
            by_group.setdefault(region.group, []).append(region)
        for regions in by_group.values():
            regions.sort(key=lambda r: r.base)
            for i, a in enumerate(regions):
                for b in regions[i + 1 :]:
                    if b.base >= a.end:
                        break
                    _check_disjoint(a, b)

    def _build_rows(self) -> None:
        n = len(self.segments)
        local_rows = np.zeros((n, 5), dtype=np.uint64)
        self._local_start = np.zeros(n, dtype=np.int64)
        self._remote_start = np.zeros(n, dtype=np.int64)
        self._seg_rank = np.array([s.remote_rank for s in self.segments], dtype=np.int64)
        remote_rows: dict[int, list[tuple[int, int, int, int, int]]] = {p: [] for p in self.covered}
        remote_next = {p: 0 for p in self.covered}
        local_next = 0
        for i, seg in enumerate(self.segments):
            loc, rem = self._local_region(seg), self._remote_region(seg)
            local_rows[i] = (loc.base + seg.local_offset, seg.nbytes, self.local.device_id, loc.block_stride, loc.num_blocks)
            self._local_start[i] = local_next
            local_next += loc.num_blocks
            p = seg.remote_rank
            remote_rows[p].append(
                (rem.base + seg.remote_offset, seg.nbytes, self.remote[p].device_id, rem.block_stride, rem.num_blocks)
            )
            self._remote_start[i] = remote_next[p]
            remote_next[p] += rem.num_blocks
        self.local_descs = local_rows
        self.remote_descs = {
            p: np.array(rows, dtype=np.uint64).reshape(-1, 5) for p, rows in remote_rows.items() if rows
        }
        self.read_ranks = tuple(sorted(self.remote_descs))
        # Descriptor IDs fit NIXL's int32 indices unless a list holds 2**31 descriptors; int32
        # halves the memory every request writes.
        largest = max([local_next, *remote_next.values()])
        self._id_dtype = np.int32 if largest < 2**31 else np.int64
        # remote rank -> [(pairing key, phase or None, local row starts, remote row starts)],
        # precomputed so resolve() is one broadcast add per entry into a preallocated array.
        seg_phase = np.array([s.phase for s in self.segments], dtype=np.int64)
        seg_bytes = np.array([s.nbytes for s in self.segments], dtype=np.int64)
        self._rank_keys: dict[int, list[tuple[int, int, np.ndarray, np.ndarray, int]]] = {}
        for p in self.read_ranks:
            entries = []
            for key in range(len(self.pairings)):
                phases = np.unique(seg_phase[self._seg_key == key]).tolist()
                for phase in phases:
                    idx = np.nonzero((self._seg_rank == p) & (self._seg_key == key) & (seg_phase == phase))[0]
                    if idx.size:
                        entries.append((key, phase, self._local_start[idx].astype(self._id_dtype),
                                        self._remote_start[idx].astype(self._id_dtype), int(seg_bytes[idx].sum())))
            self._rank_keys[p] = entries
        # A remote rank whose entries start at the same row IDs as an earlier one's reads the same
        # remote IDs (P>D: every prefill rank's list has the same shape), so resolve writes them once.
        self._remote_twin: dict[int, int] = {}
        for i, p in enumerate(self.read_ranks):
            for q in self.read_ranks[:i]:
                if q not in self._remote_twin and _same_remote_rows(self._rank_keys[p], self._rank_keys[q]):
                    self._remote_twin[p] = q
                    break

    # ---------------------------------------------------------------- per request
    def resolve(
        self,
        local_block_ids: Sequence[Sequence[int] | np.ndarray],
        remote_block_ids: Sequence[Sequence[int] | np.ndarray],
        num_tokens: int | None = None,
        scratch: IdScratch | None = None,
    ) -> ResolvedRequest:
        """Descriptor IDs for one request, given its block IDs per KV group on each side.

        Each list is the tail of that engine's block list for the request (see
        :mod:`nixlkv.core.token_blocks`); ``num_tokens`` is needed where P and D hold a
        different number of tokens per block. With ``scratch`` the IDs are views into its
        buffer, valid until the next resolve with it (NIXL copies IDs when a READ is made).
        """
        if scratch is not None:
            scratch.reset()
        pairs = [self._pair(pairing, local_block_ids, remote_block_ids, num_tokens) for pairing in self.pairings]
        reads = []
        remote_of: dict[int, np.ndarray] = {}  # remote IDs written this request, by rank
        dtype = self._id_dtype
        for p in self.read_ranks:
            jobs = []
            total = nbytes = 0
            for key, ph, lstarts, rstarts, block_bytes in self._rank_keys[p]:
                lp, rp, phase = pairs[key]
                if phase is None:
                    if ph != 0:
                        continue  # every pair is in phase 0
                else:
                    in_phase = phase == ph
                    lp, rp = lp[in_phase], rp[in_phase]
                if lp.size:
                    jobs.append((lstarts, rstarts, lp, rp))
                    total += lstarts.size * lp.size
                    nbytes += block_bytes * lp.size
            if not total:
                continue
            twin = remote_of.get(self._remote_twin.get(p, -1))
            local_ids = np.empty(total, dtype) if scratch is None else scratch.take(total, dtype)
            remote_ids = twin if twin is not None else (np.empty(total, dtype) if scratch is None else scratch.take(total, dtype))
            at = 0
            for lstarts, rstarts, lp, rp in jobs:
                end = at + lstarts.size * lp.size
                np.add(lstarts[:, None], lp, out=local_ids[at:end].reshape(lstarts.size, lp.size))
                if twin is None:
                    np.add(rstarts[:, None], rp, out=remote_ids[at:end].reshape(rstarts.size, rp.size))
                at = end
            remote_of[p] = remote_ids
            reads.append(ReadOp(p, local_ids, remote_ids, nbytes))
        read = {r.remote_rank for r in reads}
        return ResolvedRequest(
            reads=tuple(reads),
            notify_only=tuple(p for p in self.covered if p not in read),
            consumers=self.consumers,
        )

    def _pair(
        self, pairing: GroupPairing, local_block_ids: Sequence[Any], remote_block_ids: Sequence[Any], num_tokens: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The strategy's block pairs of one group as descriptor-id dtype arrays, bounds checked;
        phases only where some pair is not in phase 0."""
        lids = _ids(local_block_ids, pairing.local_group, "local", self._id_dtype)
        rids = _ids(remote_block_ids, pairing.remote_group, "remote", self._id_dtype)
        paired = pairing.strategy.pair_blocks(lids, rids, pairing.local_region, pairing.remote_region, num_tokens=num_tokens)
        lp, rp = np.asarray(paired[0]), np.asarray(paired[1])
        phase = np.asarray(paired[2]) if len(paired) > 2 else None
        if lp.shape != rp.shape or lp.ndim != 1 or (phase is not None and phase.shape != lp.shape):
            raise RequestError(
                f"strategy {pairing.strategy.name!r} paired {lp.shape} local with {rp.shape} remote blocks"
            )
        if lp.size:
            _check_bounds(lp, pairing.local_num_blocks, "local", pairing.local_group)
            _check_bounds(rp, pairing.remote_num_blocks, "remote", pairing.remote_group)
        if phase is not None and not np.count_nonzero(phase):
            phase = None
        return lp.astype(self._id_dtype, copy=False), rp.astype(self._id_dtype, copy=False), phase

    def read_bytes(self, read: ReadOp) -> int:
        """Bytes one READ moves: what the planner recorded, else summed over its local descriptors."""
        if read.nbytes is not None:
            return int(read.nbytes)
        return int(self.local_descs[row_index(self.local_descs, read.local_ids), 1].astype(np.int64).sum())

    def byte_moves(self, resolved: ResolvedRequest) -> list[tuple[int, int, int, int]]:
        """``(local_address, remote_rank, remote_address, nbytes)`` for every descriptor of a
        resolved request: what ``explain`` prints and what tests check against the physics."""
        out: list[tuple[int, int, int, int]] = []
        for read in resolved.reads:
            la, ln = expand_ids(self.local_descs, read.local_ids)
            ra, rn = expand_ids(self.remote_descs[read.remote_rank], read.remote_ids)
            if not np.array_equal(ln, rn):
                raise PlanValidationError(f"descriptor lengths differ between sides for remote rank {read.remote_rank}")
            out.extend(zip(la.tolist(), [read.remote_rank] * len(la), ra.tolist(), ln.tolist()))
        return out

    # ---------------------------------------------------------------- reporting
    def to_dict(self) -> dict[str, Any]:
        return {
            "local_engine": self.local.engine_id,
            "local_rank": self.local.tp_rank,
            "local_tp": self.local.tp_size,
            "remote_engine": next(iter(self.remote.values())).engine_id if self.remote else None,
            "remote_tp": next(iter(self.remote.values())).tp_size if self.remote else None,
            "covered_remote_ranks": list(self.covered),
            "read_ranks": list(self.read_ranks),
            "consumers_per_remote_rank": self.consumers,
            "groups": [
                {"local_group": g.local_group, "remote_group": g.remote_group, "strategy": g.strategy.name}
                for g in self.pairings
            ],
            "segments": [
                {**s.to_dict(), "strategy": self.pairings[int(k)].strategy.name}
                for s, k in zip(self.segments, self._seg_key)
            ],
            "registered_descriptors": self.registered_descriptors(),
        }

    def registered_descriptors(self) -> dict[str, int]:
        """Descriptors of the prepared lists, local and per remote rank (cheap: for log lines)."""
        return {
            "local": int(self.local_descs[:, 4].sum()) if len(self.local_descs) else 0,
            **{f"remote_rank_{p}": int(d[:, 4].sum()) for p, d in self.remote_descs.items()},
        }


def _same_remote_rows(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Two ranks' resolve entries name the same (pairing, phase, remote row starts) in order."""
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and np.array_equal(x[3], y[3]) for x, y in zip(a, b)
    )


def _ids(ids: Sequence[Any], group: int, side: str, dtype: Any = np.int64) -> np.ndarray:
    if group >= len(ids):
        raise RequestError(f"{side} block ids cover {len(ids)} KV groups; group {group} is missing")
    raw = ids[group]
    try:
        if isinstance(raw, np.ndarray):
            if raw.dtype.kind not in "iu":
                raise TypeError(f"dtype {raw.dtype}")
            if raw.dtype != dtype and raw.size and (int(raw.min()) < 0 or int(raw.max()) > np.iinfo(dtype).max):
                raise OverflowError(f"ids span [{int(raw.min())}, {int(raw.max())}]")
            arr = raw.astype(dtype, copy=False)
        else:  # vLLM hands Python lists; fromiter converts them fastest
            arr = np.fromiter(raw, dtype=dtype, count=len(raw))
    except (TypeError, ValueError, OverflowError) as e:
        raise RequestError(f"{side} block ids of group {group} must be a flat list of integers: {e}") from None
    if arr.ndim != 1:
        raise RequestError(f"{side} block ids of group {group} must be a flat list")
    return arr


def _check_bounds(ids: np.ndarray, limit: int, side: str, group: int) -> None:
    # one unsigned comparison catches negative ids too (they wrap to huge values)
    if np.maximum.reduce(ids.view(np.uint32 if ids.dtype == np.int32 else np.uint64)) >= limit:
        bad = ids[(ids < 0) | (ids >= limit)][0]
        raise RequestError(f"{side} group {group}: block id {int(bad)} outside [0, {limit})")


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


def _check_registered(region: Region, geometry: RankGeometry) -> None:
    for addr, nbytes in geometry.memory:
        if addr <= region.base and region.end <= addr + nbytes:
            return
    raise PlanValidationError(
        f"region {region.name!r} of engine {geometry.engine_id!r} rank {geometry.tp_rank} spans "
        f"[{region.base:#x}, {region.end:#x}), outside every registered memory range"
    )


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

