"""Property and example tests of nixlkv.core.topology.

"local" is the reading side (decode), "remote" the side read from (prefill). The expected head
placement is recomputed here from vLLM's QKVParallelLinear rule, independently of the module.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixlkv.core.errors import IncompatibleTopology, NixlkvError
from nixlkv.core.topology import (
    HeadRun,
    Topology,
    check_heads_shardable,
    MAX_TP_SIZE,
    check_tp_pair,
    check_units_shardable,
    consumers_per_remote_rank,
    covered_remote_ranks,
    head_sources,
    heads_held,
    heads_per_rank,
    unit_sources,
    units_per_rank,
)

TP_SIZES = st.sampled_from([1, 2, 4, 8, 16])
HEAD_COUNTS = st.sampled_from([1, 2, 4, 8, 16, 32, 64])
FAST = settings(max_examples=60, deadline=None)


def expected_heads(rank: int, tp: int, num_heads: int) -> list[int]:
    """vLLM QKVParallelLinear: shard evenly when tp <= H, else replicate each head tp/H times."""
    if tp <= num_heads:
        per = num_heads // tp
        return list(range(rank * per, rank * per + per))
    replicas = tp // num_heads
    return [rank // replicas]


# ----------------------------------------------------------------------------- heads_held


@FAST
@given(tp=TP_SIZES, num_heads=HEAD_COUNTS)
def test_heads_held_matches_vllm_sharding(tp: int, num_heads: int) -> None:
    for rank in range(tp):
        assert list(heads_held(rank, tp, num_heads)) == expected_heads(rank, tp, num_heads)
        assert heads_per_rank(tp, num_heads) == len(expected_heads(rank, tp, num_heads))


@FAST
@given(tp=TP_SIZES, num_heads=HEAD_COUNTS)
def test_heads_held_partitions_or_replicates_exactly(tp: int, num_heads: int) -> None:
    holders: dict[int, list[int]] = {}
    for rank in range(tp):
        for head in heads_held(rank, tp, num_heads):
            holders.setdefault(head, []).append(rank)
    # every head is held, and nothing outside [0, H) is
    assert sorted(holders) == list(range(num_heads))
    replicas = max(1, tp // num_heads)
    for head, ranks in holders.items():
        assert len(ranks) == replicas, (head, ranks)
        # replicas of a head are consecutive ranks
        assert ranks == list(range(ranks[0], ranks[0] + replicas))


# ----------------------------------------------------------------------------- head_sources


@settings(max_examples=150, deadline=None)
@given(local_tp=TP_SIZES, remote_tp=TP_SIZES, num_heads=HEAD_COUNTS, data=st.data())
def test_head_sources_cover_each_local_slot_once_from_a_true_holder(
    local_tp: int, remote_tp: int, num_heads: int, data: st.DataObject
) -> None:
    local_rank = data.draw(st.integers(0, local_tp - 1), label="local_rank")
    runs = head_sources(local_rank, local_tp, remote_tp, num_heads)
    local_heads = expected_heads(local_rank, local_tp, num_heads)
    covered = list(covered_remote_ranks(local_rank, local_tp, remote_tp))

    assert all(isinstance(r, HeadRun) for r in runs)
    filled: list[int] = []
    read_from: dict[int, set[int]] = {}
    for run in runs:
        assert run.count >= 1
        assert run.remote_rank in covered, (run, covered)
        remote_heads = expected_heads(run.remote_rank, remote_tp, num_heads)
        assert 0 <= run.remote_slot and run.remote_slot + run.count <= len(remote_heads)
        assert 0 <= run.local_slot and run.local_slot + run.count <= len(local_heads)
        for i in range(run.count):
            # the remote rank really holds, at that slot, the head the local slot holds
            assert remote_heads[run.remote_slot + i] == local_heads[run.local_slot + i]
            filled.append(run.local_slot + i)
            read_from.setdefault(local_heads[run.local_slot + i], set()).add(run.remote_rank)

    # every local slot exactly once
    assert sorted(filled) == list(range(len(local_heads)))
    assert len(filled) == len(set(filled))
    # dedup: each head (replicated or not) is read from exactly one remote rank
    assert set(read_from) == set(local_heads)
    assert all(len(ranks) == 1 for ranks in read_from.values()), read_from


@settings(max_examples=80, deadline=None)
@given(local_tp=TP_SIZES, remote_tp=TP_SIZES, num_heads=HEAD_COUNTS, data=st.data())
def test_head_sources_runs_are_maximal_and_deterministic(
    local_tp: int, remote_tp: int, num_heads: int, data: st.DataObject
) -> None:
    local_rank = data.draw(st.integers(0, local_tp - 1), label="local_rank")
    runs = head_sources(local_rank, local_tp, remote_tp, num_heads)
    assert runs == head_sources(local_rank, local_tp, remote_tp, num_heads)
    # runs are ordered by local slot and two neighbours never could have been merged
    assert [r.local_slot for r in runs] == sorted(r.local_slot for r in runs)
    for a, b in zip(runs, runs[1:]):
        mergeable = (
            a.remote_rank == b.remote_rank
            and a.remote_slot + a.count == b.remote_slot
            and a.local_slot + a.count == b.local_slot
        )
        assert not mergeable, (a, b)


# ----------------------------------------------------------------------------- covered ranks


@FAST
@given(local_tp=TP_SIZES, remote_tp=TP_SIZES)
def test_every_remote_rank_has_exactly_consumers_readers(local_tp: int, remote_tp: int) -> None:
    consumers = consumers_per_remote_rank(local_tp, remote_tp)
    assert consumers == max(1, local_tp // remote_tp)
    count = {p: 0 for p in range(remote_tp)}
    for local_rank in range(local_tp):
        covered = covered_remote_ranks(local_rank, local_tp, remote_tp)
        assert len(covered) == max(1, remote_tp // local_tp)
        for p in covered:
            assert 0 <= p < remote_tp
            count[p] += 1
    assert all(c == consumers for c in count.values()), count


@FAST
@given(local_tp=TP_SIZES, remote_tp=TP_SIZES, num_heads=HEAD_COUNTS)
def test_all_local_ranks_together_read_every_head(local_tp: int, remote_tp: int, num_heads: int) -> None:
    heads_read: set[int] = set()
    for local_rank in range(local_tp):
        for run in head_sources(local_rank, local_tp, remote_tp, num_heads):
            remote_heads = expected_heads(run.remote_rank, remote_tp, num_heads)
            heads_read.update(remote_heads[run.remote_slot : run.remote_slot + run.count])
    assert heads_read == set(range(num_heads))


# ----------------------------------------------------------------------------- explicit vLLM cases


def test_h8_p2_to_d4_d3_reads_p1_slots_2_3() -> None:
    # local = decode tp 4, remote = prefill tp 2; D3 holds heads 6,7 = P1 slots 2..3
    assert list(heads_held(3, 4, 8)) == [6, 7]
    assert list(heads_held(1, 2, 8)) == [4, 5, 6, 7]
    assert head_sources(3, 4, 2, 8) == (HeadRun(remote_rank=1, remote_slot=2, local_slot=0, count=2),)
    assert list(covered_remote_ranks(3, 4, 2)) == [1]
    assert consumers_per_remote_rank(4, 2) == 2


def test_h8_p4_to_d2_d0_reads_p0_and_p1() -> None:
    assert list(covered_remote_ranks(0, 2, 4)) == [0, 1]
    assert head_sources(0, 2, 4, 8) == (
        HeadRun(remote_rank=0, remote_slot=0, local_slot=0, count=2),
        HeadRun(remote_rank=1, remote_slot=0, local_slot=2, count=2),
    )
    assert head_sources(1, 2, 4, 8) == (
        HeadRun(remote_rank=2, remote_slot=0, local_slot=0, count=2),
        HeadRun(remote_rank=3, remote_slot=0, local_slot=2, count=2),
    )
    assert consumers_per_remote_rank(2, 4) == 1


def test_h2_p1_to_d4_replicated_heads_read_from_p0_slot_1() -> None:
    # D0, D1 replicate head 0; D2, D3 replicate head 1
    assert [list(heads_held(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]
    for d in (0, 1):
        assert head_sources(d, 4, 1, 2) == (HeadRun(0, 0, 0, 1),)
    for d in (2, 3):
        assert head_sources(d, 4, 1, 2) == (HeadRun(remote_rank=0, remote_slot=1, local_slot=0, count=1),)
    assert consumers_per_remote_rank(4, 1) == 4


def test_h2_p4_to_d1_reads_one_replica_of_each_head() -> None:
    # P0, P1 hold head 0; P2, P3 hold head 1; D0 covers all four but reads only P0 and P2
    assert [list(heads_held(p, 4, 2)) for p in range(4)] == [[0], [0], [1], [1]]
    assert list(covered_remote_ranks(0, 1, 4)) == [0, 1, 2, 3]
    runs = head_sources(0, 1, 4, 2)
    assert runs == (
        HeadRun(remote_rank=0, remote_slot=0, local_slot=0, count=1),
        HeadRun(remote_rank=2, remote_slot=0, local_slot=1, count=1),
    )
    assert {r.remote_rank for r in runs} == {0, 2}


def test_equal_tp_reads_own_rank_whole() -> None:
    for rank in range(4):
        assert head_sources(rank, 4, 4, 16) == (HeadRun(rank, 0, 0, 4),)


# ----------------------------------------------------------------------------- errors


def _mentions(message: str, *numbers: int) -> bool:
    return all(re.search(rf"(?<!\d){n}(?!\d)", message) for n in numbers)


@pytest.mark.parametrize("local_tp,remote_tp", [(3, 2), (2, 3), (6, 4), (4, 6), (8, 12)])
def test_non_divisible_tp_pairs_raise(local_tp: int, remote_tp: int) -> None:
    for call in (
        lambda: check_tp_pair(local_tp, remote_tp),
        lambda: covered_remote_ranks(0, local_tp, remote_tp),
        lambda: consumers_per_remote_rank(local_tp, remote_tp),
        lambda: head_sources(0, local_tp, remote_tp, 12 * 8),  # 96 heads shard over all sizes used
    ):
        with pytest.raises(IncompatibleTopology) as info:
            call()
        assert _mentions(str(info.value), local_tp, remote_tp), str(info.value)
        assert isinstance(info.value, NixlkvError)


@pytest.mark.parametrize("local_tp,remote_tp", [(2, 0), (0, 2), (2, -2), (2, MAX_TP_SIZE * 2), (2, 2**40), (2**40, 2)])
def test_tp_sizes_outside_any_engine_raise(local_tp: int, remote_tp: int) -> None:
    """A TP size of 0 divided by zero, and one of 2**40 made a range of covered ranks that
    planning turned into sets and tuples (out of memory): both are refused, naming the side."""
    side = "local" if not 1 <= local_tp <= MAX_TP_SIZE else "remote"
    for call in (
        lambda: check_tp_pair(local_tp, remote_tp),
        lambda: covered_remote_ranks(0, local_tp, remote_tp),
        lambda: consumers_per_remote_rank(local_tp, remote_tp),
    ):
        with pytest.raises(IncompatibleTopology, match=f"{side} tp=") as info:
            call()
        assert str(MAX_TP_SIZE) in str(info.value)
    check_tp_pair(2, MAX_TP_SIZE)  # control: the largest TP group is a TP group


@pytest.mark.parametrize("tp,num_heads", [(4, 6), (2, 3), (6, 4), (16, 12), (3, 8)])
def test_unshardable_head_counts_raise(tp: int, num_heads: int) -> None:
    with pytest.raises(IncompatibleTopology) as info:
        heads_held(0, tp, num_heads)
    assert _mentions(str(info.value), tp, num_heads), str(info.value)
    with pytest.raises(IncompatibleTopology):
        heads_per_rank(tp, num_heads)
    with pytest.raises(IncompatibleTopology):
        check_heads_shardable(tp, num_heads)


def test_head_sources_rejects_unshardable_on_either_side() -> None:
    # H=6 shards over tp 2 but not over tp 4: fails whichever side has tp 4
    assert len(head_sources(0, 2, 2, 6)) == 1
    with pytest.raises(IncompatibleTopology):
        head_sources(0, 4, 2, 6)
    with pytest.raises(IncompatibleTopology):
        head_sources(0, 2, 4, 6)


@pytest.mark.parametrize("num_heads", [0, -1])
def test_non_positive_head_count_raises(num_heads: int) -> None:
    with pytest.raises(IncompatibleTopology):
        heads_held(0, 1, num_heads)


@pytest.mark.parametrize("size,rank", [(0, 0), (-1, 0), (2, 2), (2, -1), (4, 7)])
def test_topology_rejects_bad_rank_or_size(size: int, rank: int) -> None:
    with pytest.raises(IncompatibleTopology):
        Topology(size, rank)


def test_topology_accepts_valid() -> None:
    t = Topology(8, 7)
    assert (t.tp_size, t.tp_rank) == (8, 7)


# ---------------------------------------------------------------- units sharded by TP (mamba groups)

@settings(max_examples=200, deadline=None)
@given(
    units=st.sampled_from([1, 2, 3, 4, 8, 16]),
    local_tp=st.sampled_from([1, 2, 4, 8]),
    remote_tp=st.sampled_from([1, 2, 4, 8]),
    single=st.booleans(),
    data=st.data(),
)
def test_unit_sources_fill_every_local_slot_once_with_the_same_unit(units, local_tp, remote_tp, single, data) -> None:
    """Even split (units % tp == 0) or, where allowed, one unit replicated on every rank: each
    local slot is filled exactly once, from a covered remote rank holding that very unit."""
    ok = all(units % tp == 0 or (single and units == 1) for tp in (local_tp, remote_tp))
    if not ok:
        with pytest.raises(IncompatibleTopology, match=rf"units=\d+ cannot be sharded over tp=\d+"):
            unit_sources(0, local_tp, remote_tp, units, "units", single)
        return
    rank = data.draw(st.integers(0, local_tp - 1))
    runs = unit_sources(rank, local_tp, remote_tp, units, "units", single)
    per = units_per_rank(local_tp, units, "units", single)
    held = lambda r, tp: list(range(r * units // tp, (r + 1) * units // tp)) if units % tp == 0 else [0]  # noqa: E731
    filled = []
    for run in runs:
        assert run.remote_rank in covered_remote_ranks(rank, local_tp, remote_tp)
        for i in range(run.count):
            assert held(rank, local_tp)[run.local_slot + i] == held(run.remote_rank, remote_tp)[run.remote_slot + i]
            filled.append(run.local_slot + i)
    assert sorted(filled) == list(range(per))


def test_single_group_replicated_only_where_allowed() -> None:
    check_units_shardable(4, 1, "n_groups", replicate_single=True)
    with pytest.raises(IncompatibleTopology, match=r"n_groups=1 cannot be sharded over tp=4: vLLM needs n_groups divisible by tp$"):
        check_units_shardable(4, 1, "n_groups", replicate_single=False)
    with pytest.raises(IncompatibleTopology, match=r"n_groups=2 cannot be sharded over tp=4.*or n_groups == 1"):
        check_units_shardable(4, 2, "n_groups", replicate_single=True)


def _head_sources_per_head(local_rank: int, local_tp: int, remote_tp: int, num_heads: int, last_holder: bool = False):
    """The definition, head by head: each local slot from the first covered rank holding its
    head (``last_holder``: the last one, a wrong variant), neighbours merged into runs."""
    check_heads_shardable(local_tp, num_heads)
    check_heads_shardable(remote_tp, num_heads)
    covered = list(covered_remote_ranks(local_rank, local_tp, remote_tp))
    runs: list[HeadRun] = []
    for slot, head in enumerate(heads_held(local_rank, local_tp, num_heads)):
        holders = [p for p in covered if head in heads_held(p, remote_tp, num_heads)]
        holder = holders[-1] if last_holder else holders[0]
        remote_slot = heads_held(holder, remote_tp, num_heads).index(head)
        last = runs[-1] if runs else None
        if last and last.remote_rank == holder and last.remote_slot + last.count == remote_slot and last.local_slot + last.count == slot:
            runs[-1] = HeadRun(holder, last.remote_slot, last.local_slot, last.count + 1)
        else:
            runs.append(HeadRun(holder, remote_slot, slot, 1))
    return tuple(runs)


def test_head_sources_is_the_head_by_head_definition_on_every_small_case() -> None:
    """head_sources works a stretch of heads at a time: exactly the head-by-head definition on
    every TP pair and head count up to 64 ranks and 128 heads that vLLM can shard."""
    sizes, compared, differs = (1, 2, 4, 8, 16, 32, 64), 0, 0
    for local_tp in sizes:
        for remote_tp in sizes:
            for heads in (1, 2, 4, 8, 16, 32, 64, 128):
                if (local_tp <= heads and heads % local_tp) or (remote_tp <= heads and heads % remote_tp):
                    continue
                for rank in range(local_tp):
                    want = _head_sources_per_head(rank, local_tp, remote_tp, heads)
                    assert head_sources(rank, local_tp, remote_tp, heads) == want, (rank, local_tp, remote_tp, heads)
                    differs += _head_sources_per_head(rank, local_tp, remote_tp, heads, last_holder=True) != want
                    compared += 1
    assert compared > 1000 and differs > 0  # negative control: another choice of holder is told apart
