"""``auto`` decides from block-pair counts: :meth:`StagedPlan.counts` gives exactly the figures the
staged program would have (posted descriptors after NIXL's merge, staged and scattered bytes,
scatters, rounds) and what the direct READs post, without building the program or passing over
the request's descriptor IDs. Checked against the program itself on every scenario, at staging
buffers that force many rounds, and on random block-id patterns."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nixlkv.bench.shapes import LLAMA_8B, LLAMA_70B, Case, fabricate_rank
from nixlkv.core import Dispatcher, covered_remote_ranks
from nixlkv.core.request_ids import ResolvedRequest
from nixlkv.core.descriptor_mode import TransferCosts, choose, decide, posted_direct
from nixlkv.core.staging import StagedPlan, StagingError
from nixlkv.testing import oracle
from nixlkv.testing.rehearsal import build, request_blocks
from nixlkv.testing.scenario import load

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    return Dispatcher.from_plugins()


def _program_figures(sp: StagedPlan, plan, resolved) -> tuple[int, ...]:
    c = sp.stage(resolved).counts()
    return c.posted, c.staged_bytes, c.scatter_bytes, c.scatters, c.rounds, posted_direct(plan, resolved)


def _counted(sp: StagedPlan, resolved) -> tuple[int, ...] | None:
    c = sp.counts(resolved)
    return None if c is None else (c.posted, c.staged_bytes, c.scatter_bytes, c.scatters, c.rounds, c.posted_direct)


def _buffers(plan) -> list[int]:
    """Staging buffers from one page per round (a round break after every page) to all at once."""
    page = max(r.page.nbytes for g in plan.remote.values() for r in g.regions)
    return [1 << 30, 4 * page, 3 * page + 7, page]


def _runs_pattern(n: int, pool: int, rng: np.random.Generator, mean_run: float) -> list[int]:
    """``n`` distinct block ids of ``[1, pool)`` in runs of consecutive ids of geometric length."""
    free = rng.permutation(np.arange(1, pool - 64))
    out: list[int] = []
    i = 0
    while len(out) < n:
        start = int(free[i])
        i += 1
        run = int(rng.geometric(1 / mean_run))
        out.extend(b for b in range(start, min(start + run, pool)) if b not in out)
    return out[:n]


def _every_scenario_request(dispatcher):
    """Every scenario that plans, each decode rank's plan with the scenario's request resolved,
    at each of :func:`_buffers` a staging plan can be built for: ``(name, plan, resolved, sp)``."""
    for path in sorted(SCENARIOS.iterdir()):
        scenario = load(path)
        if scenario.expect_error is not None:
            continue
        try:
            engines = build(scenario, dispatcher)
        except Exception:  # the scenario tests say which ones vLLM's own planner refuses here
            continue
        p_blocks, d_blocks = request_blocks(scenario, engines)
        for plan in engines.plans:
            resolved = plan.resolve(oracle.id_lists(d_blocks), oracle.id_lists(p_blocks), scenario.request.num_tokens)
            for staging_bytes in _buffers(plan):
                try:
                    sp = StagedPlan(plan, staging_bytes)
                except StagingError:
                    continue
                yield f"{path.name} at {staging_bytes} B", plan, resolved, sp


def test_counts_equal_the_staged_program_on_every_scenario(dispatcher) -> None:
    """Every scenario that plans (mixed kinds, windows, MLA, Mamba, phases of different block
    sizes, prefix hits), each decode rank, four staging buffers: the counts are the program's, or
    None exactly where pages are shared between segments (then auto builds the program)."""
    counted = shared = 0
    for name, plan, resolved, sp in _every_scenario_request(dispatcher):
        got = _counted(sp, resolved)
        if got is None:
            assert sp._shared_spans, f"{name}: counts gave up on a plan without shared pages"
            shared += 1
            continue
        assert got == _program_figures(sp, plan, resolved), name
        counted += 1
    assert counted > 500 and shared > 0  # the check ran, on both kinds of plan


@pytest.mark.parametrize(("shape", "p_tp", "d_tp"), [
    (LLAMA_8B, 4, 2), (LLAMA_8B, 8, 2), (LLAMA_8B, 2, 4), (LLAMA_8B, 1, 1), (LLAMA_70B, 8, 4),
])
def test_counts_equal_the_staged_program_on_random_block_runs(dispatcher, shape, p_tp, d_tp) -> None:
    """Random requests: runs of consecutive ids of every mean length, local lists shorter than the
    remote one (a prefix D holds), staging rounds breaking inside runs and at their edges. The
    counts are the program's, and the program laid out from the pairs is the one from the IDs."""
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    nb = 600
    local = fabricate_rank(dispatcher, shape, "decode", d_tp, 0, nb, num_layers=3)
    remote = {r: fabricate_rank(dispatcher, shape, "prefill", p_tp, r, nb, num_layers=3)
              for r in covered_remote_ranks(0, d_tp, p_tp)}
    plan = dispatcher.plan(local, remote)
    for trial in range(40):
        n = int(rng.integers(1, 200))
        mean = float(rng.choice([1.0, 1.5, 4.0, 30.0, 500.0]))
        rids = _runs_pattern(n, nb, rng, mean)
        lids = _runs_pattern(n - int(rng.integers(0, min(n, 5))), nb, rng, mean)
        resolved = plan.resolve([lids], [rids], None)
        for staging_bytes in _buffers(plan):
            try:
                sp = StagedPlan(plan, staging_bytes)
            except StagingError:
                continue
            assert _counted(sp, resolved) == _program_figures(sp, plan, resolved), (trial, staging_bytes)
            # the program laid out from the pairs is the one built from the IDs
            assert _programs_differ(sp._stage_by_blocks(resolved, sp._sequence(resolved)), sp._stage_by_ids(resolved)) is None


def test_the_comparison_can_fail(dispatcher) -> None:
    """Negative controls: the counts depend on the request (another request's program differs),
    and the round breaks matter (counted as if the buffer held everything, a small buffer's
    program differs)."""
    local = fabricate_rank(dispatcher, LLAMA_8B, "decode", 2, 0, 600, num_layers=3)
    remote = {r: fabricate_rank(dispatcher, LLAMA_8B, "prefill", 4, r, 600, num_layers=3) for r in (0, 1)}
    plan = dispatcher.plan(local, remote)
    runs = plan.resolve([list(range(10, 110))], [list(range(200, 300))], None)
    scattered = plan.resolve([list(range(10, 110))], [list(range(200, 400, 2))], None)
    page = max(r.page.nbytes for r in remote[0].regions)
    small, whole = StagedPlan(plan, 7 * page), StagedPlan(plan, 1 << 30)
    assert _counted(small, runs) == _program_figures(small, plan, runs)
    assert _counted(small, runs) != _program_figures(small, plan, scattered)
    assert _counted(whole, runs)[:1] != _program_figures(small, plan, runs)[:1]  # breaks split joined runs
    assert _counted(whole, runs)[3:5] != _program_figures(small, plan, runs)[3:5]  # and scatters, rounds


def test_auto_builds_the_staged_program_only_when_it_stages(dispatcher, monkeypatch) -> None:
    """Direct chosen: no program built. Staged chosen: built once, for posting. A request that
    carries no block pairs (made by hand) is still decided, from the program."""
    case = Case(LLAMA_8B, 4, 2, 8192, "contiguous")
    local = fabricate_rank(dispatcher, LLAMA_8B, "decode", 2, 0, case.num_blocks, num_layers=4)
    remote = {r: fabricate_rank(dispatcher, LLAMA_8B, "prefill", 4, r, case.num_blocks, num_layers=4) for r in (0, 1)}
    plan = dispatcher.plan(local, remote)
    ids = list(range(1, case.num_request_blocks + 1))
    resolved = plan.resolve([ids], [ids], None)
    sp = StagedPlan(plan, 8 << 20)
    calls = []
    real = StagedPlan.stage
    monkeypatch.setattr(StagedPlan, "stage", lambda self, r, posted=None: calls.append(posted) or real(self, r, posted))
    # copies dear enough that staging loses, cheap enough that auto must weigh it
    close = TransferCosts(per_descriptor_s=6e-6, copy_bytes_per_s=2.8e9, nixl_bytes_per_s=6e9)
    assert choose("auto", plan, sp, resolved, close).mode == "direct" and calls == []
    cheap = TransferCosts(per_descriptor_s=6e-6, copy_bytes_per_s=1e12)
    decided = decide("auto", plan, sp, resolved, cheap)  # the decision alone builds nothing
    assert decided.mode == "staged" and decided.staged is None and calls == []
    staged = choose("auto", plan, sp, resolved, cheap)
    assert staged.mode == "staged" and len(calls) == 1 and staged.posted_staged == staged.staged.posted
    # the program takes the decision's posted count instead of counting it again: the same program
    assert calls == [decided.posted_staged] and decided.posted_staged is not None
    assert _programs_differ(staged.staged, real(sp, resolved)) is None
    by_hand = ResolvedRequest(resolved.reads, resolved.notify_only, resolved.consumers)
    assert choose("auto", plan, sp, by_hand, cheap).mode == "staged" and len(calls) == 2  # decided on the program it posts


def test_reads_changed_after_resolving_are_decided_from_the_program(dispatcher) -> None:
    """A request whose READs no longer match the block pairs they were written from (a test's
    fault, a caller trimming a READ) is not counted from the pairs: the program decides."""
    local = fabricate_rank(dispatcher, LLAMA_8B, "decode", 2, 0, 600, num_layers=3)
    remote = {r: fabricate_rank(dispatcher, LLAMA_8B, "prefill", 4, r, 600, num_layers=3) for r in (0, 1)}
    plan = dispatcher.plan(local, remote)
    resolved = plan.resolve([list(range(10, 110))], [list(range(200, 300))], None)
    sp = StagedPlan(plan, 1 << 30)
    assert sp.counts(resolved) is not None
    first, *rest = resolved.reads
    trimmed = dataclasses.replace(first, local_ids=first.local_ids[:-3], remote_ids=first.remote_ids[:-3])
    assert sp.counts(dataclasses.replace(resolved, reads=(trimmed, *rest))) is None


def _programs_differ(a, b) -> str | None:
    """Where two staged programs differ (None: the same rounds, READs, scatters and figures)."""
    if (len(a.rounds), a.last_round, a.posted, a.notify_only, a.consumers) != (
            len(b.rounds), b.last_round, b.posted, b.notify_only, b.consumers):
        return "rounds, last rounds, posted count or notifications"
    for r, (ra, rb) in enumerate(zip(a.rounds, b.rounds)):
        if ra.staged_bytes != rb.staged_bytes or len(ra.reads) != len(rb.reads) or len(ra.scatters) != len(rb.scatters):
            return f"round {r}: bytes or counts"
        for x, y in zip(ra.reads, rb.reads):
            if x.remote_rank != y.remote_rank or not np.array_equal(x.local_ids, y.local_ids) \
                    or not np.array_equal(x.remote_ids, y.remote_ids):
                return f"round {r}: a READ"
        for x, y in zip(ra.scatters, rb.scatters):
            fields = ("segment", "local_address", "local_stride", "slot_len", "delta", "nbytes")
            if any(getattr(x, f) != getattr(y, f) for f in fields) or not np.array_equal(x.local_blocks, y.local_blocks) \
                    or not np.array_equal(x.slots, y.slots):
                return f"round {r}: a scatter"
    return None


def test_the_program_laid_out_from_block_pairs_is_the_program_from_ids(dispatcher) -> None:
    """Where every remote page is read by one segment, stage() lays the program out from the
    block pairs (slices and progressions); it is the same program, READ by READ and scatter by
    scatter, as the one built from the descriptor IDs, on every scenario at four buffers."""
    compared = 0
    for name, _, resolved, sp in _every_scenario_request(dispatcher):
        seq = sp._sequence(resolved)
        if not seq:
            continue
        assert sp._written_from(resolved, seq)
        diff = _programs_differ(sp._stage_by_blocks(resolved, seq), sp._stage_by_ids(resolved))
        assert diff is None, f"{name}: {diff}"
        compared += 1
    assert compared > 500


def test_a_read_changed_after_resolving_is_staged_from_its_ids(dispatcher, monkeypatch) -> None:
    """Negative control: a READ whose IDs are not what its block pairs give (two remote IDs
    swapped, as a test's fault does) is staged from the IDs, so the program carries the change
    (and the byte check sees it); the comparison of the two layouts sees it too."""
    local = fabricate_rank(dispatcher, LLAMA_8B, "decode", 2, 0, 600, num_layers=3)
    remote = {r: fabricate_rank(dispatcher, LLAMA_8B, "prefill", 4, r, 600, num_layers=3) for r in (0, 1)}
    plan = dispatcher.plan(local, remote)
    resolved = plan.resolve([list(range(10, 110))], [list(range(200, 300))], None)
    sp = StagedPlan(plan, 1 << 30)
    first, *rest = resolved.reads
    swapped = first.remote_ids.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    faulted = dataclasses.replace(resolved, reads=(dataclasses.replace(first, remote_ids=swapped), *rest))
    seq = sp._sequence(faulted)
    assert seq and not sp._written_from(faulted, seq)
    calls = []
    real = StagedPlan._stage_by_ids
    monkeypatch.setattr(StagedPlan, "_stage_by_ids", lambda self, r: calls.append(r) or real(self, r))
    program = sp.stage(faulted)
    assert calls == [faulted]
    assert _programs_differ(program, sp._stage_by_blocks(faulted, seq)) is not None


@pytest.mark.parametrize("num_blocks, dtype", [(600, np.int32), (2**31 + 8, np.int64)])
def test_the_staged_program_writes_int32_where_every_list_fits(dispatcher, num_blocks, dtype) -> None:
    """The program's IDs, slots and local blocks are int32 where every list it indexes (the
    staging rows, each rank's staged remote rows, the local blocks) holds fewer than 2**31
    entries, else int64; either way the same program as the one staged from the IDs."""
    local = fabricate_rank(dispatcher, LLAMA_8B, "decode", 2, 0, num_blocks, num_layers=2)
    remote = {r: fabricate_rank(dispatcher, LLAMA_8B, "prefill", 4, r, num_blocks, num_layers=2) for r in (0, 1)}
    plan = dispatcher.plan(local, remote)
    resolved = plan.resolve([list(range(num_blocks - 100, num_blocks))], [list(range(1, 101))], None)
    sp = StagedPlan(plan, 1 << 20)
    program = sp.stage(resolved)
    arrays = [a for rnd in program.rounds for r in rnd.reads for a in (r.local_ids, r.remote_ids)]
    arrays += [a for rnd in program.rounds for s in rnd.scatters for a in (s.local_blocks, s.slots)]
    assert arrays and {a.dtype for a in arrays} == {np.dtype(dtype)}
    assert _programs_differ(program, sp._stage_by_ids(resolved)) is None
