"""Descriptor modes: post the plan's READs as they are (``direct``), or gather whole remote pages
through a staging buffer and scatter them locally (``staged``); ``auto`` picks per request.

Why staging: NIXL merges neighbouring descriptors only where both sides are one dense strided row
(``stride == len``). When a decode page is assembled from several prefill ranks (P>D TP with
head-outermost pages) every local descriptor is a sub-page slice and never merges, although each
prefill rank's pages of consecutive blocks are contiguous. Reading those whole pages into
consecutive slots of a staging buffer merges them into one descriptor per run; one vectorised copy
per segment then puts each slice in place.

This module computes only the layout (numpy, engine-agnostic): the staged remote rows (one strided
row per remote *span*: the bytes of one remote region's page that the plan reads), the staging
rows (one dense row per span length over the whole buffer), and per request the rounds of READs
and the scatter program. The executor (``nixlkv.transport.reader``) owns the buffer and does the copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import NixlkvError, RequestError
from .plan import TransferPlan
from .request_ids import ReadOp, ResolvedRequest, row_index, row_starts

DESCRIPTOR_MODES = ("auto", "direct", "staged")


# Staging buffer of a decode worker (two halves); measured best with paused NIXL progress threads
# (docs/performance.md, "Descriptor modes").
DEFAULT_STAGING_BYTES = 16 << 20


class StagingError(NixlkvError):
    """The staged mode cannot serve this plan or request (the message says why and what works)."""


def check_mode(mode: str, where: str = "descriptor_mode") -> str:
    if mode not in DESCRIPTOR_MODES:
        raise StagingError(f"{where} must be one of {list(DESCRIPTOR_MODES)}, got {mode!r}")
    return mode


def descriptors_after_merge(
    local_rows: np.ndarray, local_ids: np.ndarray, remote_rows: np.ndarray, remote_ids: np.ndarray
) -> int:
    """Descriptors NIXL 1.5.1's ``make_prepped_xfer`` posts for one READ, computed.

    NIXL joins neighbouring entries when both sides continue in the same dense strided row
    (``stride == len``) with the next id; rows adjacent in memory are not joined across, and a
    row with ``len < stride`` never merges (probed with NIXL telemetry; the bench and tests check
    this computation against ``get_xfer_telemetry().descCount`` in real transfers).
    """
    lids = np.asarray(local_ids, dtype=np.int64)
    rids = np.asarray(remote_ids, dtype=np.int64)
    if lids.shape != rids.shape:
        raise ValueError(f"{lids.size} local ids but {rids.size} remote ids")
    lrow, rrow = row_index(local_rows, lids), row_index(remote_rows, rids)
    if lids.size < 2:
        return int(lids.size)
    ldense = (local_rows[:, 1] == local_rows[:, 3])[lrow]
    rdense = (remote_rows[:, 1] == remote_rows[:, 3])[rrow]
    joins = (
        (lrow[1:] == lrow[:-1])
        & (rrow[1:] == rrow[:-1])
        & (np.diff(lids) == 1)
        & (np.diff(rids) == 1)
        & ldense[1:]
        & rdense[1:]
    )
    return int(lids.size - joins.sum())


@dataclass(frozen=True)
class Span:
    """Bytes ``[offset, +nbytes)`` of every page of ``remote_region`` on ``remote_rank``: what the
    staged mode reads per remote block (the union of the plan's segments reading that region)."""

    remote_rank: int
    remote_region: str
    offset: int
    nbytes: int
    dense: bool  # the span is the whole page and pages are back to back: NIXL merges its runs


@dataclass(frozen=True)
class Scatter:
    """One segment's share of a round: staging slots of ``slot_len`` bytes -> local blocks.

    Local block ``local_blocks[i]`` of the segment's local row (``local_address`` +
    block * ``local_stride``) receives ``nbytes`` bytes from staging offset
    ``slots[i] * slot_len + delta``.
    """

    segment: int
    local_address: int
    local_stride: int
    local_blocks: np.ndarray
    slot_len: int
    slots: np.ndarray
    delta: int
    nbytes: int

    @property
    def total_bytes(self) -> int:
        return int(self.local_blocks.size) * self.nbytes


@dataclass(frozen=True)
class Round:
    """READs into the staging buffer (staging ids, staged remote ids), then the scatters."""

    reads: tuple[ReadOp, ...]
    scatters: tuple[Scatter, ...]
    staged_bytes: int  # bytes the READs of this round move


@dataclass(frozen=True)
class StagedRequest:
    rounds: tuple[Round, ...]
    notify_only: tuple[int, ...]
    consumers: int
    last_round: Mapping[int, int]  # remote rank -> the round whose READ carries its notification
    posted: int = 0  # descriptors NIXL posts for it after merging (StagedPlan.posted recomputes it)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for rnd in self.rounds for r in rnd.reads)

    @property
    def scatter_bytes(self) -> int:
        return sum(s.total_bytes for rnd in self.rounds for s in rnd.scatters)

    @property
    def staged_bytes(self) -> int:
        return sum(rnd.staged_bytes for rnd in self.rounds)

    def counts(self) -> StagedCounts:
        return StagedCounts(self.posted, self.staged_bytes, self.scatter_bytes,
                            sum(len(r.scatters) for r in self.rounds), len(self.rounds))


@dataclass(frozen=True)
class StagedCounts:
    """What posting one request staged costs, in the units ``descriptor_mode.TransferCosts`` prices: the
    same figures its staged program has (:meth:`StagedRequest.counts`), and what posting it
    directly would post (``posted_direct``, where known)."""

    posted: int  # descriptors NIXL posts for the staged READs, after its merge
    staged_bytes: int  # bytes the staged READs move (whole remote spans)
    scatter_bytes: int  # bytes the local copies move
    scatters: int
    rounds: int
    posted_direct: int | None = None


class StagedPlan:
    """A TransferPlan's READs gathered through a staging buffer of ``staging_bytes``.

    Built once per plan (handshake time). Addresses of the staging rows are offsets from the
    buffer's start; :meth:`staging_rows` places them at the executor's buffer.
    """

    def __init__(self, plan: TransferPlan, staging_bytes: int) -> None:
        if staging_bytes < 1:
            raise StagingError(f"staging_bytes must be a positive number of bytes, got {staging_bytes}")
        self.plan = plan
        self.staging_bytes = int(staging_bytes)
        segs = plan.segments
        keys: dict[tuple[int, str], list[int]] = {}
        for i, s in enumerate(segs):
            keys.setdefault((s.remote_rank, s.remote_region), []).append(i)
        spans: list[Span] = []
        self._seg_span = np.zeros(len(segs), dtype=np.int64)
        self._seg_delta = np.zeros(len(segs), dtype=np.int64)
        remote_rows: dict[int, list[tuple[int, int, int, int, int]]] = {}
        self._span_row_start = np.zeros(len(keys), dtype=np.int64)
        for j, ((rank, name), idx) in enumerate(keys.items()):
            lo = min(segs[i].remote_offset for i in idx)
            hi = max(segs[i].remote_offset + segs[i].nbytes for i in idx)
            region = plan.remote[rank].region(name)
            if region is None:  # TransferPlan validated this; kept for a clear message
                raise StagingError(f"remote rank {rank} has no region {name!r}")
            dense = lo == 0 and hi == region.page.nbytes == region.block_stride
            if hi - lo > self.staging_bytes:
                raise StagingError(
                    f"staging_bytes={self.staging_bytes} is smaller than one remote page span of "
                    f"{hi - lo} B (remote rank {rank}, {name!r}); raise staging_bytes or use descriptor_mode 'direct'"
                )
            spans.append(Span(rank, name, lo, hi - lo, dense))
            rows = remote_rows.setdefault(rank, [])
            self._span_row_start[j] = sum(r[4] for r in rows)
            rows.append((region.base + lo, hi - lo, plan.remote[rank].device_id, region.block_stride, region.num_blocks))
            for i in idx:
                self._seg_span[i] = j
                self._seg_delta[i] = segs[i].remote_offset - lo
        self.spans = tuple(spans)
        self.remote_descs = {p: np.array(r, dtype=np.uint64).reshape(-1, 5) for p, r in remote_rows.items()}
        self._span_len = np.array([s.nbytes for s in spans], dtype=np.int64)
        self._span_dense = np.array([s.dense for s in spans], dtype=bool)
        self.slot_lengths = tuple(sorted({s.nbytes for s in spans}))
        self._len_row_start = {}
        at = 0
        for length in self.slot_lengths:
            self._len_row_start[length] = at
            at += self.staging_bytes // length
        self._span_slot_row = np.array([self._len_row_start[s.nbytes] for s in spans], dtype=np.int64)
        # The program's IDs, slots and local blocks in int32 where every list fits (as the plan's
        # own IDs): half the bytes a 128k request's program writes.
        largest_id = max([at, *(sum(r[4] for r in rows) for rows in remote_rows.values()),
                          *plan.local_descs[:, 4].tolist()])
        self._id_dtype = np.dtype(np.int32 if largest_id < 2**31 else np.int64)
        self._span_row_start_ids = self._span_row_start.astype(self._id_dtype)
        self._max_blocks = max((plan.remote[s.remote_rank].region(s.remote_region).num_blocks for s in spans), default=1)
        # Local rows: one per segment, in segment order; remote rows: per rank, in segment order.
        self._local_starts = row_starts(plan.local_descs)
        self._remote_seg = {p: np.array([i for i, s in enumerate(segs) if s.remote_rank == p], dtype=np.int64) for p in plan.remote_descs}
        self._remote_starts = {p: row_starts(rows) for p, rows in plan.remote_descs.items()}
        local_dense = plan.local_descs[:, 1] == plan.local_descs[:, 3]
        shared = np.bincount(self._seg_span, minlength=len(spans)) > 1 if len(segs) else np.zeros(0, bool)
        # Staging can merge what direct cannot: a dense remote span that direct reads in slices
        # or into slices (a local sub-page row, or several segments sharing one remote page).
        self._shared_spans = bool(shared.any())
        self._span_rank = np.array([s.remote_rank for s in spans], dtype=np.int64)
        self._local_addr = plan.local_descs[:, 0].astype(np.int64)
        self._local_len = plan.local_descs[:, 1].astype(np.int64)
        self._local_stride = plan.local_descs[:, 3].astype(np.int64)
        helps = self._span_dense[self._seg_span] & (shared[self._seg_span] | ~local_dense) if len(segs) else np.zeros(0, bool)
        self.can_help = bool(helps.any())
        # The smallest descriptor a direct READ posts where staging would merge more (sliced rows
        # never merge, runs only grow): with it, auto decides from counts, per plan, not per request.
        self.min_direct_bytes = int(self._local_len[helps].min()) if self.can_help else 0
        self._remote_dense = {p: rows[:, 1] == rows[:, 3] for p, rows in plan.remote_descs.items()}
        self._local_dense = local_dense
        # What counts() reads of every entry of every READ the plan makes (TransferPlan's entries:
        # one per pairing and phase), so that a request is counted from its block pairs alone.
        self._entries = {p: [self._entry(p, e) for e in entries] for p, entries in plan._rank_entries}

    def _entry(self, p: int, entry: tuple) -> _Entry:
        key, phase, lstarts, rstarts, _ = entry
        lrow = np.searchsorted(self._local_starts, lstarts.ravel().astype(np.int64), side="right") - 1
        rrow = np.searchsorted(self._remote_starts[p], rstarts.ravel().astype(np.int64), side="right") - 1
        span = self._seg_span[lrow]
        dense_both = self._local_dense[lrow] & self._remote_dense[p][rrow]
        sdense = self._span_dense[span]
        return _Entry(key, phase, lrow, rrow, dense_both, int(np.count_nonzero(dense_both)), span, self._span_len[span],
                      sdense, int(np.count_nonzero(sdense)), int(self._span_len[span].sum()), int(self._local_len[lrow].sum()))

    def _sequence(self, resolved: ResolvedRequest) -> list[tuple[_Entry, np.ndarray, np.ndarray, int]] | None:
        """The request's READs as the plan wrote them: per READ (its index ``k``), per entry of it
        with pairs, ``(entry, local blocks, remote blocks, k)``; each of the entry's rows reads the
        remote blocks into the local ones, rows in order. None where pages are read by several
        segments, the request carries no block pairs, or its READs were not written from them."""
        pairs = resolved.pairs
        if pairs is None or self._shared_spans:
            return None
        seq: list[tuple[_Entry, np.ndarray, np.ndarray, int]] = []
        for k, read in enumerate(resolved.reads):
            ids = 0
            for e in self._entries.get(read.remote_rank, ()):
                lp, rp, phase = pairs[e.key]
                if phase is None:
                    if e.phase:
                        continue  # every pair is in phase 0
                else:
                    in_phase = phase == e.phase
                    lp, rp = lp[in_phase], rp[in_phase]
                if lp.size:
                    seq.append((e, lp, rp, k))  # in the plan's ID type (TransferPlan._pair): int32 mostly
                    ids += e.lrow.size * lp.size
            if ids != read.local_ids.size:
                return None  # READs not written from these pairs (changed since)
        return seq

    def counts(self, resolved: ResolvedRequest) -> StagedCounts | None:
        """What :meth:`stage` would give for ``resolved`` (posted descriptors, staged and scattered
        bytes, scatters, rounds) and what its direct READs post (``descriptor_mode.posted_direct``), counted
        from the request's block pairs (``resolved.pairs``) in O(blocks + rows): no staged program
        and no pass over its descriptor IDs. Exact (the tests compare both with the program's
        own figures). None where pages are read by several segments (deduplicated in first-use
        order: :meth:`stage` says) or the request carries no block pairs."""
        seq = self._sequence(resolved)
        if seq is None:
            return None
        return self._counts(seq)

    def _counts(self, seq: list[tuple[_Entry, np.ndarray, np.ndarray, int]]) -> StagedCounts:
        """:meth:`counts` of a request's READs as :meth:`_sequence` gives them."""
        if not seq:
            return StagedCounts(0, 0, 0, 0, 0, 0)
        direct = pages = staged_bytes = scatter_bytes = joins = 0
        runs_r: list[np.ndarray] = []  # per element: where its remote blocks run on (i -> i + 1)
        for e, lp, rp, _ in seq:
            m, rows = lp.size, e.lrow.size
            on_r = np.diff(rp) == 1
            runs_r.append(on_r)
            direct += rows * m - e.n_dense_both * int(np.count_nonzero(on_r & (np.diff(lp) == 1)))
            pages += rows * m
            joins += e.n_sdense * int(np.count_nonzero(on_r))
            staged_bytes += m * e.sum_span
            scatter_bytes += m * e.sum_local
        rows_of, item_m, item_len, page_at, total_pages = _items(seq)
        cat = np.concatenate
        span = cat([e.span for e, *_ in seq])
        sdense = cat([e.sdense for e, *_ in seq])
        lrow, rrow = cat([e.lrow for e, *_ in seq]), cat([e.rrow for e, *_ in seq])
        dense_both = cat([e.dense_both for e, *_ in seq])
        read = np.repeat(np.array([k for *_, k in seq], dtype=np.int64), rows_of)
        firsts = np.array([(lp[0], lp[-1], rp[0], rp[-1]) for _, lp, rp, _ in seq], dtype=np.int64)
        lfirst, llast, rfirst, rlast = np.repeat(firsts, rows_of, axis=0).T
        # Where one item's last page and the next's first continue each other: the same remote
        # span (staged), the same rows of one READ (direct), and the next block on both.
        same_span = span[1:] == span[:-1]
        span_join = same_span & sdense[1:] & (rfirst[1:] == rlast[:-1] + 1)
        direct -= int(np.count_nonzero(
            (read[1:] == read[:-1]) & (lrow[1:] == lrow[:-1]) & (rrow[1:] == rrow[:-1]) & dense_both[1:]
            & (lfirst[1:] == llast[:-1] + 1) & (rfirst[1:] == rlast[:-1] + 1)))
        joins += int(np.count_nonzero(span_join))
        scatters = item_m.size - int(np.count_nonzero(same_span))  # one per item, but a same-span neighbour
        # Rounds: a round that begins inside a run of joined pages or of one scatter splits it.
        _, breaks = self._layout(item_len, page_at, total_pages)
        if breaks:
            at = np.asarray(breaks, dtype=np.int64)
            item = np.searchsorted(page_at, at, side="right") - 1
            inside = at - page_at[item]
            edge = inside == 0  # a round starts with an item: the boundary with the one before splits
            before = item[edge] - 1
            joins -= int(np.count_nonzero(span_join[before]))
            scatters += int(np.count_nonzero(same_span[before]))
            within = ~edge  # a round starts inside an item: its scatter splits, and a join there
            scatters += int(np.count_nonzero(within))
            elem = np.repeat(np.arange(len(seq)), rows_of)[item[within]]
            block = inside[within]
            hit = sdense[item[within]]
            for j in np.unique(elem[hit]).tolist():
                mine = hit & (elem == j)
                joins -= int(np.count_nonzero(runs_r[j][block[mine] - 1]))
        return StagedCounts(pages - joins, staged_bytes, scatter_bytes, scatters, len(breaks) + 1, direct)

    def _layout(self, item_len: np.ndarray, page_at: np.ndarray, total: int) -> tuple[list[tuple[int, int, int, int, int]], list[int]]:
        """Where a request's pages go in the staging buffer, laid out item by item (``item_len``:
        each item's span length, ``page_at``: its first page; ``total`` pages): each run of
        equal span lengths continues in the current round at the next slot aligned to its length,
        spilling into new rounds. Per run ``(start page, end page, its first slot, slots per
        round, length)``, and the pages where a round begins, ascending."""
        cuts = [0, *(np.flatnonzero(item_len[1:] != item_len[:-1]) + 1).tolist(), item_len.size]
        ends = [*page_at[cuts[1:-1]].tolist(), total]
        runs: list[tuple[int, int, int, int, int]] = []
        breaks: list[int] = []
        cursor = 0
        for a, end in zip(cuts[:-1], ends):
            length, start = int(item_len[a]), int(page_at[a])
            per_round = self.staging_bytes // length
            first = -(-cursor // length)
            if first >= per_round:  # no slot of this length left: the run starts a round
                breaks.append(start)
                first = 0
            breaks.extend(range(start + per_round - first, end, per_round))
            runs.append((start, end, first, per_round, length))
            cursor = ((first + end - start - 1) % per_round + 1) * length
        return runs, breaks

    def staging_rows(self, base: int, device_id: int) -> np.ndarray:
        """One dense row per span length over the whole buffer at ``base``: slot ``k`` of length
        ``L`` is bytes ``[k * L, (k + 1) * L)``."""
        rows = [(base, L, device_id, L, self.staging_bytes // L) for L in self.slot_lengths]
        return np.array(rows, dtype=np.uint64).reshape(-1, 5)

    # ------------------------------------------------------------------ per request
    def stage(self, resolved: ResolvedRequest, posted: int | None = None) -> StagedRequest:
        """The rounds of one request: whole remote pages into staging slots, in the request's order
        (so consecutive remote blocks sit in consecutive slots and NIXL merges them), each remote
        page read once, at most ``staging_bytes`` per round. ``posted``: the descriptors it posts
        where :meth:`counts` of this request already said (``auto``'s decision), not counted again."""
        seq = self._sequence(resolved)
        if seq and self._written_from(resolved, seq):
            return self._stage_by_blocks(resolved, seq, posted)
        return self._stage_by_ids(resolved)

    def _written_from(self, resolved: ResolvedRequest, seq: list[tuple[_Entry, np.ndarray, np.ndarray, int]]) -> bool:
        """Whether every READ's IDs are the ones its block pairs give (row start + block, row by
        row): then the program may be laid out from the pairs. A READ changed after resolving (a
        fault a test injects) is staged from its IDs, which says what is wrong with them."""
        at = [0] * len(resolved.reads)
        for e, lp, rp, k in seq:
            read = resolved.reads[k]
            n = e.lrow.size * lp.size
            a = at[k]
            at[k] = a + n
            lids = np.asarray(read.local_ids[a : a + n]).reshape(e.lrow.size, lp.size)
            rids = np.asarray(read.remote_ids[a : a + n]).reshape(e.lrow.size, lp.size)
            # what resolve wrote, computed in the READ's own ID type (int32: half the bytes)
            if not (np.array_equal(lids, np.add(lp, self._local_starts[e.lrow][:, None], dtype=lids.dtype))
                    and np.array_equal(rids, np.add(rp, self._remote_starts[read.remote_rank][e.rrow][:, None], dtype=rids.dtype))):
                return False
        return True

    def _stage_by_blocks(
        self, resolved: ResolvedRequest, seq: list[tuple[_Entry, np.ndarray, np.ndarray, int]], posted: int | None = None,
    ) -> StagedRequest:
        """:meth:`_stage_by_ids`'s program where every remote page is read by one segment, laid out
        from the block pairs: pages run row by row in the READs' order, so each round's READ, each
        scatter and each slot is a slice or an arithmetic progression (O(rounds + rows) records and
        a few passes over the pages, not a pass per step over every descriptor ID)."""
        rows_of, item_m, item_len, page_at, total = _items(seq)
        item_seg = np.concatenate([e.lrow for e, *_ in seq])
        item_read = np.repeat(np.array([k for *_, k in seq], dtype=np.int64), rows_of)
        dtype = self._id_dtype
        remote_ids = np.empty(total, dtype=dtype)
        local_blocks = np.empty(total, dtype=dtype)
        at = 0
        for e, lp, rp, _ in seq:
            n = e.lrow.size * lp.size
            np.add(rp, self._span_row_start_ids[e.span][:, None], out=remote_ids[at : at + n].reshape(e.lrow.size, lp.size))
            local_blocks[at : at + n].reshape(e.lrow.size, lp.size)[:] = lp
            at += n
        # Slots run by run of equal span length (_layout); a round begins at a break.
        slots = np.empty(total, dtype=dtype)
        runs_of_length, breaks = self._layout(item_len, page_at, total)
        # A slot's staging ID is its slot where its length's rows start the list (one slot
        # length, as a dense model has): then both are one array.
        shared = all(self._len_row_start[length] == 0 for *_, length in runs_of_length)
        staging_ids = slots if shared else np.empty(total, dtype=dtype)
        for start, end, first, per_round, length in runs_of_length:
            _fill_cyclic(slots[start:end], first, per_round, 0)
            if not shared:
                _fill_cyclic(staging_ids[start:end], first, per_round, self._len_row_start[length])
        # READs: one per (round, rank); scatters: one per (round, segment). Both are slices.
        edge_items = np.arange(1, item_m.size)
        read_edges = page_at[edge_items[item_read[1:] != item_read[:-1]]].tolist()
        seg_edges = page_at[edge_items[item_seg[1:] != item_seg[:-1]]].tolist()
        bounds = np.asarray(breaks, dtype=np.int64)
        item_bytes = np.concatenate([[0], np.add.accumulate(item_m * item_len)])

        def runs(edges: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
            """Slices ``[a, b)`` between the edges and the breaks: starts, ends, rounds, items."""
            cut = np.unique(np.asarray([0, *edges, *breaks, total], dtype=np.int64))
            starts, stops = cut[:-1], cut[1:]
            return (starts.tolist(), stops.tolist(), np.searchsorted(bounds, starts, side="right").tolist(),
                    (np.searchsorted(page_at, starts, side="right") - 1).tolist())

        def bytes_before(x: np.ndarray) -> np.ndarray:
            t = np.minimum(np.searchsorted(page_at, x, side="right") - 1, item_m.size - 1)
            return item_bytes[t] + (x - page_at[t]) * item_len[t]

        num_rounds = len(breaks) + 1
        reads: list[list[ReadOp]] = [[] for _ in range(num_rounds)]
        staged_bytes = [0] * num_rounds
        last_round: dict[int, int] = {}
        starts, stops, rounds, items = runs(read_edges)
        moved = (bytes_before(np.asarray(stops)) - bytes_before(np.asarray(starts))).tolist()
        for a, b, r, t, nbytes in zip(starts, stops, rounds, items, moved):
            rank = resolved.reads[int(item_read[t])].remote_rank
            reads[r].append(ReadOp(rank, staging_ids[a:b], remote_ids[a:b]))
            staged_bytes[r] += nbytes
            last_round[rank] = r
        scatters: list[list[Scatter]] = [[] for _ in range(num_rounds)]
        starts, stops, rounds, items = runs(seg_edges)
        for a, b, r, t in zip(starts, stops, rounds, items):
            i = int(item_seg[t])
            scatters[r].append(Scatter(
                segment=i, local_address=int(self._local_addr[i]), local_stride=int(self._local_stride[i]),
                local_blocks=local_blocks[a:b], slot_len=int(item_len[t]), slots=slots[a:b],
                delta=int(self._seg_delta[i]), nbytes=int(self._local_len[i]),
            ))
        out = [Round(tuple(reads[r]), tuple(scatters[r]), staged_bytes[r]) for r in range(num_rounds)]
        if posted is None:
            posted = self._counts(seq).posted
        return StagedRequest(tuple(out), resolved.notify_only, resolved.consumers, last_round, posted)

    def _stage_by_ids(self, resolved: ResolvedRequest) -> StagedRequest:
        """:meth:`stage` from the READs' descriptor IDs: every plan, pages read by several
        segments included (each read once, in first-use order)."""
        plan = self.plan
        parts = []
        for read in resolved.reads:
            lids = np.asarray(read.local_ids, dtype=np.int64)
            rids = np.asarray(read.remote_ids, dtype=np.int64)
            seg = row_index(plan.local_descs, lids)
            rrow = row_index(plan.remote_descs[read.remote_rank], rids)
            if not np.array_equal(self._remote_seg[read.remote_rank][rrow], seg):
                raise RequestError(f"READ from remote rank {read.remote_rank} pairs ids of different segments")
            lb = lids - self._local_starts[seg]
            rb = rids - self._remote_starts[read.remote_rank][rrow]
            parts.append((seg, lb, rb))
        if not parts:
            return StagedRequest((), resolved.notify_only, resolved.consumers, {})
        seg = np.concatenate([p[0] for p in parts])
        lb = np.concatenate([p[1] for p in parts])
        rb = np.concatenate([p[2] for p in parts])
        span = self._seg_span[seg]
        if self._shared_spans:  # several segments read one remote page: read it once
            key = span * self._max_blocks + rb
            _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")  # pages in first-use order
            rank_of = np.empty_like(order)
            rank_of[order] = np.arange(order.size)
            page_of_entry = rank_of[inverse.ravel()]
            first = first[order]
        else:  # one segment per span: every entry is its own page, already in request order
            page_of_entry = first = np.arange(seg.size)
        page_span = span[first]
        page_rb = rb[first]
        page_round, page_slot = self._place(page_span)
        page_len = self._span_len[page_span]
        page_rank = self._span_rank[page_span]
        staging_ids = self._span_slot_row[page_span] + page_slot
        remote_ids = self._span_row_start[page_span] + page_rb
        entry_round = page_round[page_of_entry]
        # Entries grouped by (round, segment), request order kept within each group. Without
        # shared pages they already are: a segment's entries are contiguous, rounds ascend.
        if self._shared_spans:
            sort = np.lexsort((seg, entry_round))
            seg, lb, entry_round, entry_slot = seg[sort], lb[sort], entry_round[sort], page_slot[page_of_entry[sort]]
        else:
            entry_slot = page_slot
        num_rounds = int(page_round[-1]) + 1
        # What NIXL will post: neighbouring pages of one READ join when both sides continue, i.e.
        # the next slot of the same length row and the next page of the same dense span.
        joins = (
            (page_round[1:] == page_round[:-1])
            & (page_rank[1:] == page_rank[:-1])
            & (page_span[1:] == page_span[:-1])
            & (np.diff(staging_ids) == 1)
            & (np.diff(remote_ids) == 1)
            & self._span_dense[page_span[1:]]
        )
        posted = int(page_span.size - np.count_nonzero(joins))
        # Pages run rank-major and rounds ascend, so each (round, rank) READ is one slice.
        read_cuts = _runs(page_round, page_rank)
        scatter_cuts = _runs(entry_round, seg)
        reads: list[list[ReadOp]] = [[] for _ in range(num_rounds)]
        staged_bytes = [0] * num_rounds
        last_round: dict[int, int] = {}
        read_bytes = np.concatenate([[0], np.cumsum(page_len)])[read_cuts].tolist()
        for (a, b), (ba, bb) in zip(zip(read_cuts[:-1].tolist(), read_cuts[1:].tolist()), zip(read_bytes, read_bytes[1:])):
            r, rank = int(page_round[a]), int(page_rank[a])
            reads[r].append(ReadOp(rank, staging_ids[a:b], remote_ids[a:b]))
            staged_bytes[r] += bb - ba
            last_round[rank] = r
        scatters: list[list[Scatter]] = [[] for _ in range(num_rounds)]
        for a, b in zip(scatter_cuts[:-1].tolist(), scatter_cuts[1:].tolist()):
            i = int(seg[a])
            scatters[int(entry_round[a])].append(
                Scatter(
                    segment=i,
                    local_address=int(self._local_addr[i]),
                    local_stride=int(self._local_stride[i]),
                    local_blocks=lb[a:b],
                    slot_len=int(self._span_len[self._seg_span[i]]),
                    slots=entry_slot[a:b],
                    delta=int(self._seg_delta[i]),
                    nbytes=int(self._local_len[i]),
                )
            )
        rounds = [Round(tuple(reads[r]), tuple(scatters[r]), staged_bytes[r]) for r in range(num_rounds)]
        return StagedRequest(tuple(rounds), resolved.notify_only, resolved.consumers, last_round, posted)

    def _place(self, page_span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(round, slot) per page, pages in order: each run of equal-length pages continues in the
        current round at the next slot aligned to its length, spilling into new rounds
        (:meth:`_layout`, every page an item of its own)."""
        n = page_span.size
        pages = np.arange(n, dtype=np.int64)
        runs, breaks = self._layout(self._span_len[page_span], pages, n)
        slot = np.empty(n, dtype=np.int64)
        for start, end, first, per_round, _ in runs:
            _fill_cyclic(slot[start:end], first, per_round, 0)
        return np.searchsorted(np.asarray(breaks, dtype=np.int64), pages, side="right"), slot

    def posted(self, staged: StagedRequest) -> int:
        """Descriptors NIXL posts for a staged request (after its merge), recomputed from its IDs
        the way :func:`descriptors_after_merge` does for any READ (``staged.posted`` is the same
        count, taken while staging)."""
        rows = self.staging_rows(0, 0)
        return sum(
            descriptors_after_merge(rows, r.local_ids, self.remote_descs[r.remote_rank], r.remote_ids)
            for rnd in staged.rounds
            for r in rnd.reads
        )


def _items(seq: list[tuple[_Entry, np.ndarray, np.ndarray, int]]) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, int]:
    """A request's items (every row of every element of :meth:`StagedPlan._sequence`, in the
    order their pages are read): rows per element, and per item its pages, its span length and
    its first page; and the pages in all."""
    rows_of = [e.lrow.size for e, *_ in seq]
    item_m = np.repeat(np.array([lp.size for _, lp, _, _ in seq], dtype=np.int64), rows_of)
    item_len = np.concatenate([e.span_len for e, *_ in seq])
    page_at = np.add.accumulate(item_m) - item_m
    return rows_of, item_m, item_len, page_at, int(page_at[-1] + item_m[-1])


def _fill_cyclic(out: np.ndarray, first: int, period: int, base: int) -> None:
    """``out[k] = base + (first + k) % period``, written as copies of one period (an integer
    modulo per element costs several times more)."""
    pattern = np.arange(base, base + period, dtype=out.dtype)
    head = min(out.size, period - first)
    out[:head] = pattern[first : first + head]
    full, tail = divmod(out.size - head, period)
    if full:
        out[head : head + full * period].reshape(full, period)[:] = pattern
    if tail:
        out[head + full * period :] = pattern[:tail]


@dataclass(frozen=True)
class _Entry:
    """One entry of a plan's READ (a pairing in a phase) as :meth:`StagedPlan.counts` reads it:
    per row, its local and remote row, whether both are dense, its span, the span's length and
    whether it is dense; and their counts and sums."""

    key: int
    phase: int
    lrow: np.ndarray
    rrow: np.ndarray
    dense_both: np.ndarray
    n_dense_both: int
    span: np.ndarray
    span_len: np.ndarray
    sdense: np.ndarray
    n_sdense: int
    sum_span: int
    sum_local: int


def _runs(*keys: np.ndarray) -> np.ndarray:
    """Boundaries of the runs of equal consecutive key tuples: ``[0, ..., n]``."""
    n = keys[0].size
    change = np.zeros(max(n - 1, 0), dtype=bool)
    for k in keys:
        change |= k[1:] != k[:-1]
    return np.concatenate([[0], np.flatnonzero(change) + 1, [n]])
