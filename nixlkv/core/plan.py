"""The transfer plan: segments turned into NIXL descriptor lists, validated once, resolved per request.

Every segment becomes one strided descriptor row on each side, ``(address, nbytes, device,
block_stride, num_blocks)``; the descriptor ID of block ``b`` in that row is
``row_start + b``. A request's block IDs therefore resolve to descriptor IDs with one broadcast
add per (remote rank, group): no Python loop per block. Rows are segment-major, so consecutive
blocks of a whole-page segment are adjacent on both sides and NIXL merges them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from . import fast_path
from .errors import PlanValidationError, RequestError
from .fast_path import TailFacts
from .geometry import RankGeometry, check_groups_disjoint, check_registered, first_outside_memory
from .plan_reuse import PairingLayers, ReusablePlan
from .regions import COL_BASE, COL_PAGE, Region, Segment
from .request_ids import (IdScratch, ReadOp, ResolvedRequest, as_ids, check_bounds, expand_ids, group_ids, largest,
                          row_index)
from .segment_table import SegmentTable
from .strategy import DeclaredPairing, OwnedTail, RunningState, Strategy
from .token_blocks import PHASE_ZERO


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
    declared: DeclaredPairing | None = None  # the strategy's declared pairing, applied by the core (Strategy.block_pairing)


class ReadEntry(NamedTuple):
    """One run of a remote rank's descriptor rows that one request's READ from it takes: the
    rows of one pairing in one phase, with both sides' row starts as columns (so a request's IDs
    are one broadcast add: row start + block id)."""

    pairing: int  # index into TransferPlan.pairings
    phase: int
    local_starts: np.ndarray
    remote_starts: np.ndarray
    block_bytes: int  # bytes the rows move per block pair


class _RankRows(NamedTuple):
    """One remote rank's descriptor rows in a plan: where they sit among all rows (``places``,
    in row order), and the region, page offset and length each is made of (what a rebase or a
    recount makes them from, at the new engine's addresses and block counts)."""

    places: np.ndarray
    region: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray

    def rows(self, geometry: RankGeometry) -> np.ndarray:
        """These rows (int64 ``(address, length, device, stride, count)``) in ``geometry``."""
        return _descriptor_rows(geometry, self.region, self.offset, self.nbytes)


SMALL_CHECK = 64  # segments to check below which a loop beats numpy's per-call cost
SMALL_IDS = 8  # paired ids per group below which bounds are checked in Python


class TransferPlan(ReusablePlan):
    """Immutable plan for one local rank reading from one remote engine."""

    def __init__(
        self,
        local: RankGeometry,
        remote: Mapping[int, RankGeometry],
        covered: Sequence[int],
        consumers: int,
        segments: SegmentTable,
        pairings: Sequence[GroupPairing],
        sources: Sequence[int] | None = None,
        pairing_layers: PairingLayers | None = None,
    ) -> None:
        self.local = local
        self.remote = dict(remote)
        self.covered = tuple(covered)  # every rank told when a request is done
        # the covered ranks whose geometry the plan holds (segments name them by position): all
        # covered, or those the strategies read from (Strategy.source_ranks)
        self.sources = self.covered if sources is None else tuple(sources)
        self.consumers = consumers
        self.pairings = tuple(pairings)
        self._table = segments
        self._seg_key = segments.key
        self._pairing_layers = pairing_layers  # where recounted() reads the pairings' remote bounds
        # how this plan was made for its remote engine: "planned" (the strategies asked),
        # "rebased" (another engine's plan at this one's addresses) or "recounted" (another
        # engine's segments with this one's block counts); the connector logs it
        self.origin = "planned"
        self._validate()
        self._build_rows()

    # ---------------------------------------------------------------- construction
    def _segment(self, i: int) -> Segment:
        t = self._table
        p = self.sources[int(t.rank_pos[i])]
        return Segment(
            self.local.regions[int(t.local_idx[i])].name, int(t.local_offset[i]), p,
            self.remote[p].regions[int(t.remote_idx[i])].name, int(t.remote_offset[i]), int(t.nbytes[i]), int(t.phase[i]),
        )

    @cached_property
    def layer_segments(self) -> tuple[Segment, ...]:
        """Every layer's segments, in layer order (what ``explain`` lists)."""
        return tuple(self._segment(i) for i in range(len(self._table)))

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """One segment per descriptor row, in row order: local row ``i`` is segment ``i``, and
        each remote rank's rows are its segments in this order. Layers that alias the same memory
        (a hybrid's groups sharing one KV tensor) share rows, so this lists the first of them."""
        return tuple(self._segment(int(i)) for i in self._row_segment)

    def _validate(self) -> None:
        t = self._table
        idx = t.check_idx
        if idx.size <= SMALL_CHECK:  # a handful of distinct geometries: checked in Python
            self._validate_few(idx)
        else:
            self._validate_many(idx)
        for geometry in (self.local, *(self.remote[p] for p in self.sources)):
            check_registered(geometry)
        # Pages of two written regions of one KV group must never share a byte (block IDs are shared).
        if t.every_layer:  # local_idx is every layer's own index, each at least once
            written = None
        else:
            written = np.unique(t.local_idx)
            written = None if written.size == len(self.local.regions) else written
        if written is None:
            self.local.groups_disjoint
        else:
            check_groups_disjoint(self.local, written)

    def _validate_few(self, idx: np.ndarray) -> None:
        t = self._table
        cols = (t.local_idx, t.rank_pos, t.remote_idx, t.local_offset, t.remote_offset, t.nbytes, t.phase)
        rows = [[c.item(i) for c in cols] + [i] for i in idx.tolist()]  # a few rows: scalar reads beat fancy indexing
        local, covered = self.local.regions, self.sources
        for li, j, ri, loff, roff, nb, phase, i in rows:
            self._check_segment(i, nb, loff, roff, phase, local[li].page.nbytes, self.remote[covered[j]].regions[ri].page.nbytes)
        rows.sort(key=lambda r: (r[0], r[6], r[3]))  # by local region, phase, offset
        for a, b in zip(rows, rows[1:]):
            if a[0] == b[0] and a[6] == b[6] and a[3] + a[5] > b[3]:
                self._overlap(a[7], b[7])

    def _validate_many(self, idx: np.ndarray) -> None:
        t = self._table
        li, rk, ri = t.local_idx[idx], t.rank_pos[idx], t.remote_idx[idx]
        loff, roff, nb, phase = t.local_offset[idx], t.remote_offset[idx], t.nbytes[idx], t.phase[idx]
        lpage = self.local.columns[li, COL_PAGE]
        rpage = np.zeros(idx.size, dtype=np.int64)
        for j, p in enumerate(self.sources):
            m = rk == j
            rpage[m] = self.remote[p].columns[ri[m], COL_PAGE]
        bad = (nb <= 0) | (loff < 0) | (roff < 0) | (phase < 0) | (loff + nb > lpage) | (roff + nb > rpage)
        if bad.any():
            k = int(np.argmax(bad))
            self._check_segment(int(idx[k]), int(nb[k]), int(loff[k]), int(roff[k]), int(phase[k]), int(lpage[k]), int(rpage[k]))
        order = np.lexsort((loff, phase, li))
        li, phase, off = li[order], phase[order], loff[order]
        clash = (li[1:] == li[:-1]) & (phase[1:] == phase[:-1]) & (off[:-1] + nb[order[:-1]] > off[1:])
        if clash.any():
            k = int(np.argmax(clash))
            self._overlap(int(idx[order[k]]), int(idx[order[k + 1]]))

    def _check_segment(self, i: int, nbytes: int, loff: int, roff: int, phase: int, lpage: int, rpage: int) -> None:
        """One segment's bytes lie inside both pages; a message naming it where not."""
        if nbytes > 0 and 0 <= loff and loff + nbytes <= lpage and 0 <= roff and roff + nbytes <= rpage and phase >= 0:
            return
        s = self._segment(i)
        if nbytes <= 0:
            raise PlanValidationError(f"segment {s} moves no bytes")
        if loff < 0 or loff + nbytes > lpage:
            raise PlanValidationError(f"segment {s} leaves local page of {s.local_region!r} ({lpage} B)")
        if roff < 0 or roff + nbytes > rpage:
            raise PlanValidationError(f"segment {s} leaves the page of {s.remote_region!r} on remote rank {s.remote_rank} ({rpage} B)")
        raise PlanValidationError(f"segment {s} has a negative phase")

    def _overlap(self, i: int, j: int) -> None:
        a, b = self._segment(i), self._segment(j)
        raise PlanValidationError(f"two segments write the same bytes of local region {a.local_region!r}: {a} and {b}")

    def _shared_rows(self, remote: Mapping[int, RankGeometry]) -> np.ndarray | None:
        """Per segment, the first segment with the same descriptor rows on both sides (reading
        the ranks ``remote``), or None where there is none: layers of one geometry class at the
        same local base and the same peer bases (a hybrid's groups aliasing one KV tensor) have
        the same rows."""
        t = self._table
        if t.layer_class is None or t.layer_start is None:
            return None  # a strategy's segments name other regions: rows stay per segment
        keys = [t.layer_class.tolist(), self.local.columns[:, COL_BASE].tolist()]
        for j, p in enumerate(self.sources):
            base = remote[p].columns[:, COL_BASE]
            keys.append((base if t.peer_idx is None else base[t.peer_idx[j]]).tolist())
        canon: dict[tuple[int, ...], int] = {}
        canon_of = [canon.setdefault(k, i) for i, k in enumerate(zip(*keys))]
        if len(canon) == len(canon_of):
            return None
        layer = np.repeat(np.arange(len(canon_of), dtype=np.int64), np.diff(np.append(t.layer_start, len(t))))
        return t.layer_start[np.asarray(canon_of, dtype=np.int64)[layer]] + (np.arange(len(t)) - t.layer_start[layer])

    def _build_rows(self) -> None:
        """Descriptor rows, ID starts and what the per-request path reads: the local rows and how the rows
        are laid out here, the remote rows in :meth:`_build_remote_rows`."""
        t = self._table
        n = len(t)
        # One descriptor row per distinct (local row, remote rank, remote row): layers that alias
        # one KV tensor (a hybrid's groups) describe the same bytes, and register them once.
        aliased = n > 1 and _regions_overlap(self.local)
        self._shared = shared = self._shared_rows(self.remote) if aliased else None
        self._aliased = aliased
        # Another engine's addresses change only each remote row's own address where every
        # strategy's segments ignore addresses (and, where local layers alias, the new engine
        # shares rows between the same layers): see rebased().
        self.rebasable = all(getattr(g.strategy, "segments_by_geometry", False) for g in self.pairings)
        if shared is None:
            seg = None  # rows are the segments, in order
            self._row_segment = np.arange(n, dtype=np.int64)
        else:
            canonical = shared == np.arange(n)
            seg = np.flatnonzero(canonical)  # the segment each row is made of
            row_of = (np.cumsum(canonical) - 1)[shared]  # segment -> its row
            self._row_segment = seg
        pick = (lambda a: a) if seg is None else (lambda a: a[seg])
        loff, roff, nbytes, rank_pos = pick(t.local_offset), pick(t.remote_offset), pick(t.nbytes), pick(t.rank_pos)
        # Descriptor rows (address, length, device, stride, count) start as the regions' columns.
        local_rows = _descriptor_rows(self.local, pick(t.local_idx), loff, nbytes)
        self.local_descs = local_rows.astype(np.uint64)
        counts = local_rows[:, 4]
        local_start = np.add.accumulate(counts)  # np.cumsum's wrapper costs more than the sum here
        self._local_total = int(local_start[-1]) if local_start.size else 0
        local_start -= counts
        # Rows of each remote rank, in row order: one slice of a stable sort by rank.
        remote_idx = pick(t.remote_idx)
        if len(self.sources) == 1:
            rank_order, cuts = None, [0, rank_pos.size]
            by_rank = [np.arange(rank_pos.size, dtype=np.int64)]
        else:
            rank_order = rank_pos.argsort(kind="stable")
            cuts = rank_pos[rank_order].searchsorted(np.arange(len(self.sources) + 1)).tolist()
            by_rank = [rank_order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        self._rank_rows: dict[int, _RankRows] = {}  # per remote rank with rows (what rebased() makes anew)
        rank_bytes: dict[int, int] = {}  # bytes per block pair each remote rank's rows move
        for p, idx in zip(self.sources, by_rank):
            if idx.size:
                self._rank_rows[p] = found = _RankRows(idx, remote_idx[idx], roff[idx], nbytes[idx])
                rank_bytes[p] = sum(found.nbytes.tolist())  # tens of rows: a Python sum beats a reduction's call
        self._row_of = None if shared is None else row_of
        self._local_start = local_start if shared is None else local_start[row_of]
        # remote rank -> [(pairing key, phase, start, stop, bytes per block)]: resolve()'s entries,
        # whatever the remote rows' block counts, each the segments at [start, stop) of
        # _entry_order (None: segment order)
        entries: dict[int, list[tuple[int, int, int, int, int]]] = {}
        order = None
        phased = bool(np.count_nonzero(t.phase))  # any pair not in phase 0 (count_nonzero: the cheapest call)
        if n and len(self.pairings) == 1 and shared is None and not phased:
            # one pairing, one phase: an entry is a rank's rows (rows are segments here)
            order = rank_order
            for p, a, b in zip(self.sources, cuts[:-1], cuts[1:]):
                if b > a:
                    entries[p] = [(0, 0, a, b, rank_bytes[p])]
        elif n:
            # entries: runs of equal (rank, pairing, phase) in that order, layer order within
            sel = t.rank_pos * (len(self.pairings) + 1) + t.key
            if phased:
                sel = sel * (int(t.phase.max()) + 1) + t.phase
            order = np.argsort(sel, kind="stable")
            sel = sel[order]
            bounds = [0, *(np.flatnonzero(sel[1:] != sel[:-1]) + 1).tolist(), n]
            sizes = np.add.reduceat(t.nbytes[order], bounds[:-1]).tolist()
            heads = order[bounds[:-1]]
            for j, key, phase, a, b, nb in zip(t.rank_pos[heads].tolist(), t.key[heads].tolist(), t.phase[heads].tolist(),
                                                bounds[:-1], bounds[1:], sizes):
                entries.setdefault(self.sources[j], []).append((key, phase, a, b, nb))
        self._entry_order = order
        self._entries = entries
        self._build_remote_rows()

    def _build_remote_rows(self) -> None:
        """The remote descriptor rows, ID starts and what the per-request path reads, from the remote ranks'
        regions and the row layout :meth:`_build_rows` made: all that another engine of the
        layout whose regions hold other block counts changes (:meth:`recounted`)."""
        remote_start = np.empty(len(self._row_segment), dtype=np.int64)
        self.remote_descs = {}
        totals = [self._local_total]
        for p, found in self._rank_rows.items():
            rows = found.rows(self.remote[p])
            self.remote_descs[p] = rows.astype(np.uint64)
            starts = np.add.accumulate(rows[:, 4])
            totals.append(int(starts[-1]))
            remote_start[found.places] = starts - rows[:, 4]
        if self._row_of is not None:
            remote_start = remote_start[self._row_of]
        self.read_ranks = tuple(self.remote_descs)  # covered order: ascending
        # Descriptor IDs fit NIXL's int32 indices unless a list holds 2**31 descriptors; int32
        # halves the memory every request writes.
        self._id_dtype = np.int32 if max(totals) < 2**31 else np.int64
        self._np_dtype = np.dtype(self._id_dtype)
        self._unsigned = np.dtype(np.uint32 if self._id_dtype is np.int32 else np.uint64)  # for one-sided bounds checks
        self._remote_start = remote_start
        # remote rank -> [(pairing key, phase, local row starts, remote row starts (as columns), bytes per block)],
        # precomputed so resolve() is one broadcast add per entry into a preallocated array.
        lstart, rstart = self._local_start.astype(self._id_dtype), remote_start.astype(self._id_dtype)
        if self._entry_order is not None:  # each entry: a slice of the starts in entry order
            lstart, rstart = lstart[self._entry_order], rstart[self._entry_order]
        lcol, rcol = lstart[:, None], rstart[:, None]
        self._rank_keys: dict[int, list[ReadEntry]] = {
            p: [ReadEntry(key, phase, lcol[a:b], rcol[a:b], nb) for key, phase, a, b, nb in found]
            for p, found in self._entries.items()
        }
        # A remote rank whose entries start at the same row IDs as an earlier one's reads the same
        # remote IDs (P>D: every prefill rank's list has the same shape), so resolve writes them once.
        self._same_remote_ids: dict[int, int] = {}  # rank -> the earlier rank whose remote IDs it reads
        for i, p in enumerate(self.read_ranks):
            for q in self.read_ranks[:i]:
                if q not in self._same_remote_ids and _same_remote_rows(self._rank_keys[p], self._rank_keys[q]):
                    self._same_remote_ids[p] = q
                    break
        self._rank_entries = [(p, self._rank_keys[p]) for p in self.read_ranks]
        self._bind_request_paths()

    def _bind_request_paths(self) -> None:
        """What the per-request path of pairings the core applies itself reads, bound once:
        per :class:`OwnedTail` pairing its :class:`TailFacts` (None: the strategy's pair_blocks);
        where every pairing is declared, what :func:`_declared_pairs` reads; and where the plan
        is one OwnedTail pairing in one phase, per READ (rank, both sides' row starts stacked
        ``(2, rows, 1)``, bytes per block pair, the rank whose remote IDs it shares) and the
        ranks only told."""
        code = "i" if self._id_dtype is np.int32 else "q"
        self._tail_facts = [
            TailFacts(g.local_group, g.remote_group, code, self._np_dtype, self._unsigned, g.local_num_blocks,
                      g.remote_num_blocks, g.declared.kind)
            if isinstance(g.declared, OwnedTail) else None
            for g in self.pairings
        ]
        self._declared = None
        if self.pairings and all(g.declared is not None for g in self.pairings):
            self._declared = (
                code, self._np_dtype, self._unsigned,
                min(min(g.local_num_blocks, g.remote_num_blocks) for g in self.pairings),
                tuple((g.local_group, g.remote_group,
                       (g.declared.local_speculative, g.declared.remote_speculative)
                       if isinstance(g.declared, RunningState) else None)
                      for g in self.pairings),
            )
        self._one_tail_reads = None
        if len(self.pairings) == 1 and self._tail_facts[0] is not None \
                and all(len(e) == 1 and e[0].phase == 0 for _, e in self._rank_entries):
            self._one_tail_reads = (
                self._tail_facts[0],
                tuple((p, np.array((e[0].local_starts, e[0].remote_starts)), e[0].block_bytes, self._same_remote_ids.get(p))
                      for p, e in self._rank_entries),
                tuple(p for p in self.covered if p not in self.read_ranks),
            )

    def undeclared(self) -> TransferPlan:
        """This plan with every group paired by its strategy's own ``pair_blocks``, none by the
        core (what the contract kit compares a declared pairing with)."""
        plan = self._with(pairings=tuple(replace(g, declared=None) for g in self.pairings))
        plan._bind_request_paths()
        return plan

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
        one_tail = self._one_tail_reads
        if one_tail is not None:
            # One pairing the core applies itself, in one phase (a dense model at one block size).
            resolved = fast_path.resolve_one_tail(one_tail, self.covered, self.consumers, local_block_ids,
                                                  remote_block_ids, scratch)
            if resolved is not None:
                return resolved
        pairs = None if self._declared is None else fast_path.declared_pairs(self._declared, local_block_ids, remote_block_ids)
        if pairs is None:  # pairings asked one by one: they pair what the core does not, and name what is wrong
            pairs = [self._pair(pairing, tail, local_block_ids, remote_block_ids, num_tokens)
                     for pairing, tail in zip(self.pairings, self._tail_facts)]
        reads = []
        remote_of: dict[int, np.ndarray] = {}  # remote IDs written this request, by rank
        dtype = self._np_dtype
        take = np.empty if scratch is None else scratch.take
        same_ids = self._same_remote_ids
        add = np.add
        for p, entries in self._rank_entries:
            jobs = []
            total = nbytes = 0
            for key, ph, lstarts, rstarts, block_bytes in entries:
                lp, rp, phase = pairs[key]
                if phase is None:
                    if ph:
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
            same_ids_as = remote_of.get(same_ids.get(p, -1))  # the remote IDs an earlier rank's READ wrote
            if same_ids_as is None:  # both sides' IDs in one allocation
                both = take(2 * total, dtype)
                local_ids, remote_ids = both[:total], both[total:]
            else:
                local_ids, remote_ids = take(total, dtype), same_ids_as
            at = 0
            for lstarts, rstarts, lp, rp in jobs:  # starts are columns: one broadcast add per side
                end = at + lstarts.size * lp.size
                add(lp, lstarts, out=local_ids[at:end].reshape(lstarts.size, lp.size))
                if same_ids_as is None:
                    add(rp, rstarts, out=remote_ids[at:end].reshape(rstarts.size, rp.size))
                at = end
            remote_of[p] = remote_ids
            reads.append(ReadOp(p, local_ids, remote_ids, nbytes))
        if len(reads) == len(self.covered):
            notify_only: tuple[int, ...] = ()
        else:
            read = {r.remote_rank for r in reads}
            notify_only = tuple(p for p in self.covered if p not in read)
        return ResolvedRequest(tuple(reads), notify_only, self.consumers, pairs)

    def _pair(
        self, pairing: GroupPairing, tail: TailFacts | None, local_block_ids: Sequence[Any], remote_block_ids: Sequence[Any],
        num_tokens: int | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The strategy's block pairs of one group as descriptor-id dtype arrays, bounds checked;
        phases only where some pair is not in phase 0. ``tail``: the core applies the pairing."""
        dtype = self._np_dtype
        if tail is not None:
            paired = fast_path.tail_pairs(tail, local_block_ids, remote_block_ids)
            if paired is not None:
                return paired[0], paired[1], None
        lids = group_ids(local_block_ids, pairing.local_group, "local", dtype)
        rids = group_ids(remote_block_ids, pairing.remote_group, "remote", dtype)
        paired = pairing.strategy.pair_blocks(lids, rids, pairing.local_region, pairing.remote_region, num_tokens=num_tokens)
        if len(paired) == 2:
            (lp, rp), phase = paired, None
        else:
            lp, rp, phase = paired
            if phase is not None:
                if type(phase) is np.ndarray and phase.base is PHASE_ZERO:
                    phase = None  # every pair in phase 0 (equal block sizes), as most requests are
                else:
                    phase = np.asarray(phase)
        if type(lp) is not np.ndarray or type(rp) is not np.ndarray:
            lp, rp = np.asarray(lp), np.asarray(rp)
        if lp.shape != rp.shape or lp.ndim != 1 or (phase is not None and phase.shape != lp.shape):
            raise RequestError(
                f"strategy {pairing.strategy.name!r} paired {lp.shape} local with {rp.shape} remote blocks"
            )
        if (lp.dtype is not dtype and lp.dtype != dtype) or (rp.dtype is not dtype and rp.dtype != dtype):
            # a strategy that pairs in another dtype (int64)
            lp = as_ids(lp, dtype, pairing.local_num_blocks, "local", pairing.local_group)
            rp = as_ids(rp, dtype, pairing.remote_num_blocks, "remote", pairing.remote_group)
        elif lp.size > SMALL_IDS:
            # one unsigned comparison per side catches negative ids too (they wrap to huge values)
            unsigned = self._unsigned
            if largest(lp.view(unsigned)) >= pairing.local_num_blocks:
                check_bounds(lp, pairing.local_num_blocks, "local", pairing.local_group)
            if largest(rp.view(unsigned)) >= pairing.remote_num_blocks:
                check_bounds(rp, pairing.remote_num_blocks, "remote", pairing.remote_group)
        elif lp.size:  # a running state's one block: a Python comparison beats a ufunc call
            lv, rv = lp.tolist(), rp.tolist()
            if min(lv) < 0 or max(lv) >= pairing.local_num_blocks:
                check_bounds(lp, pairing.local_num_blocks, "local", pairing.local_group)
            if min(rv) < 0 or max(rv) >= pairing.remote_num_blocks:
                check_bounds(rp, pairing.remote_num_blocks, "remote", pairing.remote_group)
        if phase is not None and not phase.any():
            phase = None
        return lp, rp, phase

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
                for s, k in zip(self.layer_segments, self._seg_key)
            ],
            "registered_descriptors": self.registered_descriptors(),
        }

    def registered_descriptors(self) -> dict[str, int]:
        """Descriptors of the prepared lists, local and per remote rank (cheap: for log lines)."""
        return {
            "local": int(self.local_descs[:, 4].sum()) if len(self.local_descs) else 0,
            **{f"remote_rank_{p}": int(d[:, 4].sum()) for p, d in self.remote_descs.items()},
        }


def _same_remote_rows(a: list[ReadEntry], b: list[ReadEntry]) -> bool:
    """Two ranks' resolve entries name the same (pairing, phase, remote row starts) in order."""
    return len(a) == len(b) and all(  # integer arrays of one dtype and shape: equal bytes are equal values
        x.pairing == y.pairing and x.phase == y.phase and x.remote_starts.dtype == y.remote_starts.dtype
        and x.remote_starts.shape == y.remote_starts.shape and x.remote_starts.tobytes() == y.remote_starts.tobytes()
        for x, y in zip(a, b)
    )


def _descriptor_rows(geometry: RankGeometry, idx: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """int64 descriptor rows ``(address, length, device, stride, count)`` of segments of
    ``nbytes`` at ``offset`` in pages of ``geometry``'s regions ``idx``."""
    rows = geometry.columns[idx, :5]
    rows[:, 0] += offset
    rows[:, 1] = nbytes
    return rows


def prepare_local(geometry: RankGeometry) -> RankGeometry:
    """What every plan reads or checks of a local geometry alone, made once when the worker
    registers its caches rather than at its first handshake: its layout key, columns and class
    regions, whether its regions lie in its registered memory, alias one another, and keep each
    KV group's pages apart. A check that fails is not remembered: each plan makes it again, and
    refuses what it writes, naming the regions."""
    geometry.layout_key, geometry.columns, geometry.column_lists, geometry.class_regions
    first_outside_memory(geometry)
    _regions_overlap(geometry)
    try:
        geometry.groups_disjoint
    except PlanValidationError:
        pass  # a plan writes only some regions: it checks those, and refuses an overlap among them
    return geometry


def _regions_overlap(geometry: RankGeometry) -> bool:
    """Whether any two regions of ``geometry`` share bytes (a hybrid's groups alias one tensor);
    once per geometry."""
    return geometry.regions_overlap
