"""The pairing a strategy declares for the core to apply (``Strategy.block_pairing``): it pairs,
refuses and words its refusals exactly as the strategy's own ``pair_blocks``, and is trusted only
where the class that declares it also pairs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nixlkv.core import Dispatcher, OwnedTail, PlanError, RequestError
from nixlkv.core import fast_path, request_ids
from nixlkv.core.strategy import declared_pairing
from nixlkv.strategies.full_attention import FullAttentionStrategy
from nixlkv.strategies.sliding_window import SlidingWindowStrategy
from test_faults import dispatcher_with
from test_plan_by_geometry import SMALL, ranks

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def undeclared(plan):
    """The same plan resolving through the strategy's pair_blocks."""
    other = plan.undeclared()
    assert all(g.declared is None for g in other.pairings) and other._one_tail_reads is None
    return other


def outcome(plan, local, remote):
    try:
        r = plan.resolve(local, remote, 16 * 64)
    except RequestError as exc:
        return ("refused", str(exc))
    return [(x.remote_rank, x.local_ids.tolist(), x.remote_ids.tolist(), x.nbytes) for x in r.reads], r.notify_only


def requests(rng: np.random.Generator, num_blocks: int):
    for _ in range(300):
        m = int(rng.integers(0, 12))
        n = int(rng.integers(0, m + 3))  # sometimes more local blocks than remote ones
        lo, ro = rng.integers(1, num_blocks, n).tolist(), rng.integers(1, num_blocks, m).tolist()
        fault = int(rng.integers(0, 8))
        side = lo if fault % 2 else ro
        if side and fault == 1:
            side[int(rng.integers(len(side)))] = 0  # vLLM's null block
        elif side and fault == 2:
            side[int(rng.integers(len(side)))] = num_blocks + int(rng.integers(0, 3))  # out of bounds
        elif side and fault == 3:
            side[int(rng.integers(len(side)))] = -1
        elif side and fault == 4:
            side[int(rng.integers(len(side)))] = 1 << 40  # beyond the id type
        elif side and fault == 5:
            side[int(rng.integers(len(side)))] = 2.0  # not an integer
        yield lo, ro


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (1, 1)])
def test_the_core_pairs_and_refuses_as_pair_blocks_does(p_tp: int, d_tp: int) -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, p_tp, d_tp)
    plan = d.plan(local, remote)
    assert plan.pairings[0].declared == OwnedTail("full-attention")
    slow = undeclared(plan)
    refused = 0
    for lo, ro in requests(np.random.default_rng(p_tp * 10 + d_tp), 40):
        fast = outcome(plan, [lo], [ro])
        assert fast == outcome(slow, [lo], [ro]), (lo, ro)
        refused += fast[0] == "refused"
    assert 50 < refused < 250  # both kinds of answer were compared


def test_the_comparison_can_fail(monkeypatch) -> None:
    """Negative control: a core pairing that took the first remote blocks, not the last, differs."""
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 2, 1)
    plan = d.plan(local, remote)
    monkeypatch.setattr(fast_path, "tail_pairs", lambda tail, lb, rb: (np.array(lb[0], np.int32), np.array(rb[0][: len(lb[0])], np.int32), None))
    assert outcome(plan, [[1, 2]], [[3, 4, 5]]) != outcome(undeclared(plan), [[1, 2]], [[3, 4, 5]])


@pytest.mark.parametrize("bad", [1.5, 2.0, "2", None, [2]])
@pytest.mark.parametrize("side", ["local", "remote"])
def test_an_id_that_is_no_integer_is_refused_not_truncated(bad, side: str) -> None:
    """Found by fuzzing resolve: a Python list holding 1.5 fell back to ``np.fromiter``, which
    truncated it to block 1 and read that block. Refused, on the core's path and the strategy's,
    where an array of floats always was (control: the same request with the integer resolves)."""
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 2, 1)
    plan = d.plan(local, remote)
    for p in (plan, undeclared(plan)):
        lo, ro = [1, 3], [4, 5]
        (lo if side == "local" else ro)[0] = bad
        verdict = outcome(p, [lo], [ro])
        assert verdict[0] == "refused" and f"{side} block ids of group 0 must be a flat list" in verdict[1], verdict
        (lo if side == "local" else ro)[0] = 2
        assert outcome(p, [lo], [ro])[0] != "refused"


def test_a_subclass_that_pairs_otherwise_is_not_paired_by_the_core() -> None:
    class Trims(FullAttentionStrategy):
        name = "trims"
        overrides = ("full_attention",)

        def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
            lp, rp, *_ = super().pair_blocks(local_ids, remote_ids, local, remote, num_tokens)
            return lp[:-1], rp[:-1]

    d = dispatcher_with(Trims())
    local, remote = ranks(d, SMALL, 2, 1)
    plan = d.plan(local, remote)
    assert plan.pairings[0].declared is None
    assert outcome(plan, [[1, 2, 3]], [[4, 5, 6]])[0][0][1][:2] == [1, 2]  # the trimmed pairs
    region = local.regions[0]
    assert declared_pairing(SlidingWindowStrategy(), region, region) is None  # Windowed pairs before FullAttention declares
    assert declared_pairing(FullAttentionStrategy(), region, region) == OwnedTail("full-attention")


def test_a_declaration_of_another_type_is_refused() -> None:
    class Odd(FullAttentionStrategy):
        name = "odd"
        overrides = ("full_attention",)

        def block_pairing(self, local, remote):
            return "tail"

    d = dispatcher_with(Odd())
    local, remote = ranks(d, SMALL, 2, 1)
    with pytest.raises(PlanError, match="block_pairing must return an OwnedTail, a RunningState or None"):
        d.plan(local, remote)


def test_blocks_of_other_sizes_are_paired_by_the_strategy() -> None:
    from nixlkv.bench.shapes import fabricate_rank

    d = Dispatcher.from_plugins()
    big = dataclasses.replace(SMALL, block_size=32)
    local = fabricate_rank(d, SMALL, "decode", 1, 0, 40)
    remote = {0: fabricate_rank(d, big, "prefill", 1, 0, 40)}
    plan = d.plan(local, remote)
    assert plan.pairings[0].declared is None


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_largest_is_the_max_on_both_sides_of_its_switch(dtype):
    """The per-request bound check's max (argmax below the switch, a reduce above) is the max,
    including ids past 2**31 (a negative int32 id viewed unsigned) at any position."""
    rng = np.random.default_rng(7)
    switch = request_ids.LARGEST_BY_ARGMAX
    for n in (1, 2, 63, switch - 1, switch, 3 * switch + 1):
        ids = rng.integers(0, 1 << 20, n).astype(dtype)
        for at in {0, n // 2, n - 1}:
            case = ids.copy()
            case[at] = np.iinfo(np.uint32).max - 1
            assert request_ids.largest(case) == case.max()
        assert request_ids.largest(ids) == ids.max()


def _group_requests(rng: np.random.Generator, plan, n: int):
    """Random per-group block lists for ``plan`` (each group its own list, as vLLM hands them),
    a fault in about half of them: a null block, an id out of bounds, negative, beyond the id
    type or not an integer, in a random place (a state group's null entries before its running
    state are what vLLM sends)."""
    groups_l = max(g.local_group for g in plan.pairings) + 1
    groups_r = max(g.remote_group for g in plan.pairings) + 1
    limit = min(min(g.local_num_blocks, g.remote_num_blocks) for g in plan.pairings)
    for _ in range(n):
        lists = []
        for count in (groups_l, groups_r):
            side = []
            for _ in range(count):
                m = int(rng.integers(0, 6))
                ids = rng.integers(1, limit, m).tolist()
                if m > 1 and rng.random() < 0.3:
                    ids[0] = 0  # a state group's superseded entry, or an attention group's null block
                side.append(ids)
            lists.append(side)
        lo, ro = lists
        fault = int(rng.integers(0, 14))
        target = (lo if fault % 2 else ro)[int(rng.integers(len(lo if fault % 2 else ro)))]
        if target and fault < 8:
            k = int(rng.integers(len(target)))
            target[k] = [0, limit + 1, -1, 1 << 40, 2.0, 0, limit, -5][fault]
        yield lo, ro


def test_every_declared_group_is_paired_in_one_step_as_pair_blocks_does(monkeypatch) -> None:
    """A plan whose groups are all declared (a hybrid: OwnedTail attention, RunningState Mamba
    groups, speculative scratch slots included) converts and checks every group's ids in one
    step; it pairs and refuses, with the same words, as the strategies' own pair_blocks, on
    every hybrid scenario, valid and faulty requests alike."""
    from pathlib import Path

    from nixlkv.core import RunningState
    from nixlkv.testing.rehearsal import build
    from nixlkv.testing.scenario import load

    calls = {"fast": 0, "declined": 0}
    real = fast_path.declared_pairs

    def spy(*args):
        out = real(*args)
        calls["fast" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(fast_path, "declared_pairs", spy)
    d = Dispatcher.from_plugins()
    compared = refused = 0
    scenarios = sorted((Path(__file__).parent / "scenarios").glob("*mamba*.yaml"))
    for path in scenarios:
        scenario = load(path)
        if scenario.expect_error is not None:
            continue
        try:
            engines = build(scenario, d)
        except Exception:
            continue
        for plan in engines.plans:
            if not any(isinstance(g.declared, RunningState) for g in plan.pairings):
                continue
            assert plan._declared is not None
            slow = undeclared(plan)
            for lo, ro in _group_requests(np.random.default_rng(compared), plan, 40):
                fast = outcome(plan, lo, ro)
                assert fast == outcome(slow, lo, ro), (path.name, lo, ro)
                refused += fast[0] == "refused"
                compared += 1
    assert compared >= 400 and 0.2 * compared < refused < 0.8 * compared
    assert calls["fast"] > 0.15 * compared and calls["declined"] > 0.2 * compared  # both ways were taken


def test_the_one_step_comparison_can_fail(monkeypatch) -> None:
    """Negative control: a one-step pairing that took each state list's last entry (ignoring
    the speculative slots) differs from the strategy's own pairing."""
    from pathlib import Path

    from nixlkv.testing.rehearsal import build
    from nixlkv.testing.scenario import load

    d = Dispatcher.from_plugins()
    engines = build(load(Path(__file__).parent / "scenarios" / "mamba2-spec2-p4-d2.yaml"), d)
    plan = engines.plans[0]
    code, dtype, unsigned, limit, lanes = plan._declared
    plan._declared = (code, dtype, unsigned, limit, tuple((lg, rg, None if s is None else (0, 0)) for lg, rg, s in lanes))
    groups_l = max(g.local_group for g in plan.pairings) + 1
    groups_r = max(g.remote_group for g in plan.pairings) + 1
    lo, ro = [[3, 4, 5]] * groups_l, [[6, 7, 8]] * groups_r
    assert outcome(plan, lo, ro) != outcome(undeclared(plan), lo, ro)
