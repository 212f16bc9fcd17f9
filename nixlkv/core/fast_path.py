"""The per-request fast path: block ids to descriptor IDs for the plans most requests meet.

:meth:`TransferPlan.resolve <nixlkv.core.plan.TransferPlan.resolve>` is the general path: each
KV group's block pairs from its strategy (or the pairing it declared), then per remote rank one
broadcast add per entry. Where every pairing is one the core applies itself (a strategy's
declared :class:`~nixlkv.core.strategy.OwnedTail` or
:class:`~nixlkv.core.strategy.RunningState`), the pairs here come from one conversion of all the
request's lists; where the plan is one OwnedTail pairing in one phase (a dense model at one block
size), the whole request is resolved here. Each returns None for any request it does not take
(a list that is not plain ints, a null id, an id out of bounds): the general path then resolves
it and names what is wrong. ``tests/test_plan_fast_path.py`` checks this path against the general
one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .errors import RequestError
from .request_ids import IdScratch, ReadOp, ResolvedRequest, check_bounds, largest, packer
from .strategy import count_mismatch_message, null_block_message


class TailFacts(NamedTuple):
    """What the core reads to pair one :class:`OwnedTail` group's block ids itself
    (:func:`tail_pairs`), bound once per plan."""

    local_group: int
    remote_group: int
    pack_code: str  # struct code of the descriptor-id dtype ("i": int32, "q": int64)
    dtype: np.dtype  # descriptor-id dtype
    unsigned: np.dtype  # its unsigned counterpart, for one-sided bounds checks
    local_limit: int  # block ids must be below these (the groups' least block counts)
    remote_limit: int
    kind: str  # the strategy's name for its blocks, in messages


# The one place records are filled through their slots rather than made by their constructors: a
# frozen dataclass's __init__ sets each field through object.__setattr__, about a microsecond a
# record, and this path makes a ResolvedRequest and a ReadOp per remote rank for every request.
# Measured with `nixlkv bench --quick --no-transfer`, before and after, alternated in one run:
# with the constructors, per-request planning at P4->D2 8k went from 0.317-0.324 to 0.336-0.359
# of vLLM's (about 3 us of 60), beyond the run's spread; with these, 0.302-0.326 (docs/performance.md).
# Measured again (2026-11-27, six alternated runs each, 2-core VM loaded by a serving job): main
# 0.308-0.327 (median 0.320), slot setters 0.317-0.323 (0.318), constructors 0.322-0.334 (0.327);
# fragmented ids 0.307-0.321, 0.296-0.327 and 0.324-0.347: the constructors stay out.
_READ_OP_FIELDS = tuple(getattr(ReadOp, name).__set__ for name in ReadOp.__slots__)
_RESOLVED_FIELDS = tuple(getattr(ResolvedRequest, name).__set__ for name in ResolvedRequest.__slots__)


def _read_op(remote_rank: int, local_ids: np.ndarray, remote_ids: np.ndarray, nbytes: int | None) -> ReadOp:
    """``ReadOp(remote_rank, local_ids, remote_ids, nbytes)``, its fields set through its slots."""
    op = object.__new__(ReadOp)
    set_rank, set_local, set_remote, set_nbytes = _READ_OP_FIELDS
    set_rank(op, remote_rank)
    set_local(op, local_ids)
    set_remote(op, remote_ids)
    set_nbytes(op, nbytes)
    return op


def _resolved(reads: tuple[ReadOp, ...], notify_only: tuple[int, ...], consumers: int, pairs: Any) -> ResolvedRequest:
    """``ResolvedRequest(reads, notify_only, consumers, pairs)``, its fields set through its slots."""
    out = object.__new__(ResolvedRequest)
    set_reads, set_notify, set_consumers, set_pairs = _RESOLVED_FIELDS
    set_reads(out, reads)
    set_notify(out, notify_only)
    set_consumers(out, consumers)
    set_pairs(out, pairs)
    return out


def resolve_one_tail(
    one_tail: tuple[TailFacts, tuple[tuple[int, np.ndarray, int, int | None], ...], tuple[int, ...]],
    covered: tuple[int, ...],
    consumers: int,
    local_block_ids: Sequence[Any],
    remote_block_ids: Sequence[Any],
    scratch: IdScratch | None,
) -> ResolvedRequest | None:
    """A request of a plan of one OwnedTail pairing in one phase: ``one_tail`` is what the plan
    bound (the pairing's :class:`TailFacts`; per READ its rank, both sides' row starts stacked
    ``(2, rows, 1)``, bytes per block pair and the earlier rank whose remote IDs it shares; the
    ranks only told). None where :func:`tail_pairs` declines the ids."""
    tail, reads_of, notify = one_tail
    paired = tail_pairs(tail, local_block_ids, remote_block_ids)
    if paired is None:
        return None
    lp, rp, side_by_side = paired
    k = lp.size
    if not k:
        return _resolved((), covered, consumers, None)
    take = np.empty if scratch is None else scratch.take
    dtype, add = tail.dtype, np.add
    reads = []
    written = {}
    for p, starts, block_bytes, same_ids_as in reads_of:  # starts: (local, remote) row starts as columns
        rows = starts.shape[1]
        total = rows * k
        if same_ids_as is None:
            both = take(2 * total, dtype)
            local_ids, remote_ids = both[:total], both[total:]
            if side_by_side is not None:  # one broadcast add writes both sides' IDs
                # block ids first: numpy's loop over a contiguous operand and a
                # broadcast one runs ~10% faster in this order than in the other
                add(side_by_side, starts, out=both.reshape(2, rows, k))
            else:
                add(rp, starts[1], out=remote_ids.reshape(rows, k))
                add(lp, starts[0], out=local_ids.reshape(rows, k))
        else:
            local_ids, remote_ids = take(total, dtype), written[same_ids_as]
            add(lp, starts[0], out=local_ids.reshape(rows, k))
        written[p] = remote_ids
        reads.append(_read_op(p, local_ids, remote_ids, block_bytes * k))
    return _resolved(tuple(reads), notify, consumers, ((lp, rp, None),))

def tail_pairs(
    tail: TailFacts, local_block_ids: Sequence[Any], remote_block_ids: Sequence[Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """The pairs of an :class:`OwnedTail` group (``tail``: what TransferPlan bound for it), with
    both sides' id lists converted and checked together (one conversion, one null count, one
    bound): the pairs, refusals and messages of the strategy's own ``pair_blocks``
    (:func:`check_owned`, then :func:`tail_aligned`), and where both lists are as long (the
    usual request), both as one ``(2, 1, n)`` array (local, then remote), so that one broadcast
    add writes a READ's IDs on both sides: about a fifth cheaper than an add per side. None
    where the ids are not two plain lists of ints that fit: then the general path converts
    them and names what is wrong."""
    lg, rg, code, dtype, unsigned, llim, rlim, kind = tail
    if lg >= len(local_block_ids) or rg >= len(remote_block_ids):
        return None
    lraw, rraw = local_block_ids[lg], remote_block_ids[rg]
    if type(lraw) is not list or type(rraw) is not list:
        return None
    n, m = len(lraw), len(rraw)
    try:
        both = np.frombuffer(packer(n + m, code)(*lraw, *rraw), dtype=dtype)
    except struct.error:
        return None
    if np.count_nonzero(both) != n + m:
        raise RequestError(null_block_message(kind))
    if n > m:
        raise RequestError(count_mismatch_message(n, m))
    lp, rp = both[:n], both[m:]  # the local ids, and the last n remote ids
    # one unsigned bound over both lists (negative ids wrap to huge values); where it fails, the
    # paired ids are checked side by side, as the general path checks them
    if n and largest(both.view(unsigned)) >= min(llim, rlim):
        check_bounds(lp, llim, "local", lg)
        check_bounds(rp, rlim, "remote", rg)
    return lp, rp, both.reshape(2, 1, n) if n == m else None


def declared_pairs(
    declared: tuple[Any, ...], local_block_ids: Sequence[Any], remote_block_ids: Sequence[Any]
) -> list[tuple[np.ndarray, np.ndarray, None]] | None:
    """The pairs of every group of a plan whose pairings are all declared (:class:`OwnedTail`,
    :class:`RunningState`; ``declared``: what TransferPlan bound), from one conversion of all
    their lists, one null count over the OwnedTail lists (and a look at each running state) and
    one bound: the pairs the pairings give, where the request is as they expect. None for any
    other request (a list that is not a list of ints, a null id, an id out of bounds, a remote
    list too short): the pairings then run one by one, as the strategies' own ``pair_blocks``
    do, and name what is wrong."""
    code, dtype, unsigned, limit, groups = declared
    nl, nr = len(local_block_ids), len(remote_block_ids)
    owned: list[Any] = []  # the OwnedTail groups' lists, converted first: every id of them is checked
    states: list[Any] = []  # then the RunningState groups' lists, of which only the running states are
    cuts = []  # per pairing: in the owned part?, its local and remote pairs' start there, pairs
    for lg, rg, state in groups:
        if lg >= nl or rg >= nr:
            return None
        lraw, rraw = local_block_ids[lg], remote_block_ids[rg]
        if type(lraw) is not list or type(rraw) is not list:
            return None
        n, m = len(lraw), len(rraw)
        if state is None:  # the local blocks with the last as many remote ones
            if n > m:
                return None
            cuts.append((True, len(owned), len(owned) + m, n))
            owned += lraw
            owned += rraw
        else:  # each side's entry before its speculative slots; an empty local list pairs nothing
            i, j = n - 1 - min(state[0], n - 1), m - 1 - min(state[1], m - 1)
            if n and (not m or not lraw[i] or not rraw[j]):
                return None  # no remote state, or a running state that is the null block
            cuts.append((False, len(states) + i, len(states) + n + j, 1 if n else 0))
            states += lraw
            states += rraw
    total = len(owned) + len(states)
    try:
        both = np.frombuffer(packer(total, code)(*owned, *states), dtype=dtype)
    except struct.error:
        return None
    # one unsigned bound for all (negative ids wrap to huge values), against the smallest block count
    if np.count_nonzero(both[: len(owned)]) != len(owned) or (total and largest(both.view(unsigned)) >= limit):
        return None
    shift = len(owned)  # where the state lists start
    return [(both[a : a + k], both[b : b + k], None) if own else (both[shift + a : shift + a + k], both[shift + b : shift + b + k], None)
            for own, a, b, k in cuts]
