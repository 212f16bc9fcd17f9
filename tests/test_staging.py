"""Descriptor modes: the staged layout moves exactly the plan's bytes, posts fewer descriptors where
head slices cannot merge, runs in rounds, notifies after the last one, and fails cleanly."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nixlkv.bench.shapes import LLAMA_8B, Case, block_ids, fabricate_rank
from nixlkv.core import Dispatcher, covered_remote_ranks
from nixlkv.core.request_ids import expand_ids
from nixlkv.core.descriptor_mode import Choice, TransferCosts, choose, posted_direct
from nixlkv.core.staging import StagedPlan, StagingError
from nixlkv.transport.reader import PROBE_EVERY, PROBE_REACH, Reader, ReaderPlan, memory_tensors
from nixlkv.testing import oracle
from nixlkv.testing.rehearsal import build, rehearse, request_blocks
from nixlkv.testing.scenario import load
from nixlkv.transport.nixl_rank import NixlRank, TransferError, parse_notification
from nixlkv.vllm.kv_views import registered_memory

SCENARIOS = Path(__file__).parent / "scenarios"
CHEAP_COPY = TransferCosts(copy_bytes_per_s=1e12)
DEAR_COPY = TransferCosts(copy_bytes_per_s=1e6)


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    return Dispatcher.from_plugins()


def _plan(dispatcher, p_tp: int, d_tp: int, tokens: int, pattern: str, layers: int = 4):
    case = Case(LLAMA_8B, p_tp, d_tp, tokens, pattern)
    nb = case.num_blocks
    local = fabricate_rank(dispatcher, LLAMA_8B, "decode", d_tp, 0, nb, num_layers=layers)
    remote = {
        r: fabricate_rank(dispatcher, LLAMA_8B, "prefill", p_tp, r, nb, num_layers=layers)
        for r in covered_remote_ranks(0, d_tp, p_tp)
    }
    plan = dispatcher.plan(local, remote)
    rng = np.random.default_rng(1)
    n = case.num_request_blocks
    return plan, plan.resolve([block_ids(pattern, n, nb, rng)], [block_ids(pattern, n, nb, rng)], tokens)


def _staged_moves(sp: StagedPlan, staged) -> set[tuple[int, int, int, int]]:
    """(local address, remote rank, remote address, nbytes) the staged program writes: each scatter
    row traced back through its staging slot to the remote page the round's READ put there."""
    rows = sp.staging_rows(0, 0)
    moves = set()
    for rnd in staged.rounds:
        slots: dict[tuple[int, int], tuple[int, int]] = {}  # (offset, length) -> (rank, remote address)
        spans = []
        for read in rnd.reads:
            off, ln = expand_ids(rows, read.local_ids)
            ra, rn = expand_ids(sp.remote_descs[read.remote_rank], read.remote_ids)
            assert np.array_equal(ln, rn)
            for o, n, a in zip(off.tolist(), ln.tolist(), ra.tolist()):
                assert (o, n) not in slots, "two pages share a staging slot in one round"
                slots[(o, n)] = (read.remote_rank, a)
                spans.append((o, o + n))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "staging slots overlap"
        assert spans[-1][1] <= sp.staging_bytes
        assert rnd.staged_bytes == sum(b - a for a, b in spans) <= sp.staging_bytes
        for s in rnd.scatters:
            for block, slot in zip(s.local_blocks.tolist(), s.slots.tolist()):
                rank, addr = slots[(slot * s.slot_len, s.slot_len)]
                moves.add((s.local_address + block * s.local_stride, rank, addr + s.delta, s.nbytes))
    return moves


@pytest.mark.parametrize(("p_tp", "d_tp", "pattern"), [
    (4, 2, "contiguous"), (4, 2, "fragmented"), (8, 2, "contiguous"), (2, 4, "fragmented"), (1, 1, "fragmented"),
])
@pytest.mark.parametrize("staging_bytes", [1 << 30, 1 << 20])
def test_staged_program_moves_exactly_the_plans_bytes(dispatcher, p_tp, d_tp, pattern, staging_bytes) -> None:
    plan, resolved = _plan(dispatcher, p_tp, d_tp, 1024, pattern)
    sp = StagedPlan(plan, staging_bytes)
    staged = sp.stage(resolved)
    want = set(plan.byte_moves(resolved))
    assert _staged_moves(sp, staged) == want
    assert staged.scatter_bytes == sum(m[3] for m in want)
    assert staged.posted == sp.posted(staged)  # counted while staging = recomputed from the IDs
    if staging_bytes == 1 << 20:
        assert len(staged.rounds) > 1
    for rank, last in staged.last_round.items():  # the notification rides on the rank's last READ
        assert last == max(i for i, r in enumerate(staged.rounds) if any(x.remote_rank == rank for x in r.reads))


def test_staged_posts_at_most_an_eighth_for_p_gt_d_consecutive_blocks(dispatcher) -> None:
    plan, resolved = _plan(dispatcher, 4, 2, 8192, "contiguous", layers=32)
    sp = StagedPlan(plan, 32 << 20)
    direct, staged = posted_direct(plan, resolved), sp.posted(sp.stage(resolved))
    assert direct == 32 * 2 * 512  # a head slice per block, layer and P rank: nothing merges
    assert staged * 8 <= direct and staged <= 32 * 2 + len(sp.stage(resolved).rounds)
    assert sp.can_help


def test_auto_follows_the_costs_and_only_where_staging_can_merge_more(dispatcher) -> None:
    plan, resolved = _plan(dispatcher, 4, 2, 1024, "contiguous")
    sp = StagedPlan(plan, 32 << 20)
    assert choose("auto", plan, sp, resolved, CHEAP_COPY).mode == "staged"
    assert choose("auto", plan, sp, resolved, DEAR_COPY).mode == "direct"
    cheap = choose("auto", plan, sp, resolved, CHEAP_COPY)
    assert cheap.posted_staged * 8 <= cheap.posted_direct  # what it was chosen on
    for p_tp, d_tp in ((1, 1), (2, 4)):  # whole local pages, or remote slices: nothing to gain
        plan, resolved = _plan(dispatcher, p_tp, d_tp, 1024, "contiguous")
        sp = StagedPlan(plan, 32 << 20)
        assert not sp.can_help
        assert choose("auto", plan, sp, resolved, CHEAP_COPY).mode == "direct"
        assert choose("staged", plan, sp, resolved).mode == "staged"  # forced: still served


def test_auto_decides_from_the_plans_counts_without_staging_the_request(dispatcher, monkeypatch) -> None:
    """Where every direct descriptor staging would save is larger than what one descriptor costs in
    copy time (``stage_below_bytes``), auto answers direct from the plan alone: it neither stages
    the request nor builds its program; below that bound it still weighs the staged program."""
    plan, resolved = _plan(dispatcher, 4, 2, 1024, "contiguous")
    sp = StagedPlan(plan, 32 << 20)
    assert sp.can_help and sp.min_direct_bytes == 16384  # P4->D2: a 16 KiB head slice per block
    staged_calls = []
    real_stage = StagedPlan.stage
    monkeypatch.setattr(StagedPlan, "stage", lambda self, r, posted=None: staged_calls.append(r) or real_stage(self, r, posted))
    # 1.5 us per descriptor at 8 GB/s: copying 12 kB costs what one descriptor does
    measured = TransferCosts(per_descriptor_s=1.5e-6, copy_bytes_per_s=8e9)
    assert measured.stage_below_bytes == pytest.approx(12000)
    assert choose("auto", plan, sp, resolved, measured) == Choice("direct", None)
    assert staged_calls == []
    # descriptors dearer than 16 KiB of copy: the decision needs the staged program again
    dear = TransferCosts(per_descriptor_s=6e-6, copy_bytes_per_s=8e9)
    assert choose("auto", plan, sp, resolved, dear).mode == "staged" and len(staged_calls) == 1


class _NoNixl:
    """A Reader's NIXL rank for :meth:`Reader.choose` alone, which posts nothing."""

    agent = None


def test_auto_probes_staging_only_while_it_is_within_reach(dispatcher, monkeypatch) -> None:
    """A declined request is staged now and then to re-measure the copy, but not where the copy
    would have to be more than PROBE_REACH times faster for staging to win (a wasted slow request)."""
    plan, resolved = _plan(dispatcher, 4, 2, 1024, "contiguous")
    sp = StagedPlan(plan, 16 << 20)
    rp = ReaderPlan(prepared=SimpleNamespace(plan=plan), staged=sp)
    memory = [torch.zeros(64, dtype=torch.uint8)]
    staged_calls = []
    real_stage = StagedPlan.stage
    monkeypatch.setattr(StagedPlan, "stage", lambda self, r, posted=None: staged_calls.append(r) or real_stage(self, r, posted))
    far = Reader(_NoNixl(), "auto", 16 << 20, memory, costs=TransferCosts(per_descriptor_s=1.5e-6, copy_bytes_per_s=4e9))
    assert sp.min_direct_bytes >= PROBE_REACH * far.costs.stage_below_bytes
    assert {far.choose(rp, resolved).mode for _ in range(2 * PROBE_EVERY)} == {"direct"} and staged_calls == []
    # just out of staging's reach (the slice copies in 1.2 descriptors' time): one in PROBE_EVERY is staged
    near_copy = sp.min_direct_bytes / 1.2 / 1.5e-6
    near = Reader(_NoNixl(), "auto", 16 << 20, memory, costs=TransferCosts(per_descriptor_s=1.5e-6, copy_bytes_per_s=near_copy))
    modes = [near.choose(rp, resolved).mode for _ in range(2 * PROBE_EVERY)]
    assert modes.count("staged") == 2 and modes[PROBE_EVERY - 1] == "staged"


def test_a_staging_buffer_that_cannot_be_allocated_fails_staged_by_name_and_auto_reads_directly(dispatcher, caplog) -> None:
    """An operator's staging_bytes beyond the device's memory: ``staged`` fails the handshake that
    first needs the buffer with a StagingError naming the setting and both fixes (the worker fails
    that remote's requests only), not torch's bare allocator message; ``auto`` reads that remote
    directly, saying why (what auto does wherever staging cannot apply)."""
    plan, resolved = _plan(dispatcher, 4, 2, 1024, "contiguous")
    huge = 1 << 50  # beyond any address space: refused at once, nothing touched
    memory = [torch.zeros(64, dtype=torch.uint8)]
    nixl = SimpleNamespace(prepare=lambda plan, agents: SimpleNamespace(plan=plan), agent=None)
    assert StagedPlan(plan, huge // 2).can_help  # the plan would stage: the buffer is asked for
    staged = Reader(nixl, "staged", huge, memory)
    with pytest.raises(StagingError, match=rf"staging_bytes={huge} could not be allocated on cpu .*descriptor_mode 'direct'"):
        staged.prepare(plan, {})
    assert staged.buffer is None
    auto = Reader(nixl, "auto", huge, memory, costs=CHEAP_COPY)
    with caplog.at_level("WARNING", logger="nixlkv.connector"):
        rp = auto.prepare(plan, {})
    assert rp.staged is None and auto.buffer is None and "posts this remote's reads directly" in caplog.text
    assert auto.choose(rp, resolved).mode == "direct"
    # the control: a buffer that fits is allocated and registered on the same path
    registered = []
    fits = Reader(SimpleNamespace(agent=SimpleNamespace(register_memory=lambda regs, mem_type: registered.append(regs)),
                                  mem_type="DRAM"), "auto", 1 << 20, memory)
    fits.choose(ReaderPlan(prepared=SimpleNamespace(plan=plan), staged=StagedPlan(plan, 1 << 19)), resolved)
    assert fits.buffer is not None and fits.buffer.numel() == 1 << 20 and len(registered) == 1


def test_staging_refuses_a_page_larger_than_the_buffer(dispatcher) -> None:
    plan, resolved = _plan(dispatcher, 4, 2, 1024, "contiguous")
    with pytest.raises(StagingError, match=r"staging_bytes=4096 .*16384 B.*descriptor_mode 'direct'"):
        StagedPlan(plan, 4096)
    with pytest.raises(StagingError, match="has no staging buffer"):
        choose("staged", plan, None, resolved)
    assert choose("auto", plan, None, resolved).mode == "direct"
    with pytest.raises(StagingError, match="descriptor_mode must be one of"):
        choose("fast", plan, None, resolved)


@pytest.mark.nixl
def test_rehearsal_with_a_too_small_buffer_fails_staged_and_falls_back_in_auto() -> None:
    scenario = load(SCENARIOS / "fa-p4-d2-h8.yaml")
    staged = rehearse(scenario, descriptor_mode="staged", staging_bytes=2048)
    assert staged.outcome == "failed" and "staging_bytes=1024" in staged.message
    auto = rehearse(scenario, descriptor_mode="auto", staging_bytes=2048)
    assert auto.outcome == "byte-exact" and set(auto.modes) == {"direct"}


class _Rig:
    """One scenario's prefill ranks and decode rank 0 with real NIXL agents and a staged Reader."""

    def __init__(self, name: str, staging_bytes: int) -> None:
        self.scenario = load(SCENARIOS / name)
        self.engines = build(self.scenario, Dispatcher.from_plugins())
        self.p_blocks, self.d_blocks = request_blocks(self.scenario, self.engines)
        seed = self.scenario.request.seed
        for p in self.engines.prefill:
            oracle.fill_prefill(p, self.p_blocks, seed)
        self.d = self.engines.decode[0]
        oracle.fill_decode(self.d)
        self.expected = oracle.expected_decode(self.d, self.d_blocks, seed)
        self.plan = self.engines.plans[0]
        self.p_nixl = {r: NixlRank(f"P{r}", registered_memory(self.engines.prefill[r].kv_caches)) for r in self.plan.covered}
        self.d_nixl = NixlRank("D0", registered_memory(self.d.kv_caches), capture_telemetry=True)
        self.reader = Reader(self.d_nixl, "staged", staging_bytes, memory_tensors(self.d.kv_caches))
        agents = {r: self.d_nixl.add_remote(n.metadata()) for r, n in self.p_nixl.items()}
        self.prepared = self.reader.prepare(self.plan, agents)
        self.rank_of = {id(h): r for r, h in self.prepared.remote_lists.items()}
        self.resolved = self.plan.resolve([g.ids for g in self.d_blocks], [g.ids for g in self.p_blocks], self.scenario.request.num_tokens)

    def notifications(self, wait: float) -> dict[int, list[tuple[str, int]]]:
        out: dict[int, list[tuple[str, int]]] = {r: [] for r in self.p_nixl}
        deadline = time.perf_counter() + wait
        while time.perf_counter() < deadline:
            for r, n in self.p_nixl.items():
                for msgs in n.notifications().values():
                    out[r].extend(p for p in map(parse_notification, msgs) if p is not None)
            time.sleep(0.01)
        return out

    def close(self) -> None:
        self.reader.close()
        for n in (*self.p_nixl.values(), self.d_nixl):
            n.close()


@pytest.mark.nixl
def test_rounds_notify_each_prefill_rank_once_after_its_last_read(monkeypatch) -> None:
    rig = _Rig("fa-p4-d2-h8.yaml", staging_bytes=64 << 10)
    try:
        calls: list[tuple[int, bytes]] = []  # (remote rank, notification) per READ, in posting order
        agent = rig.d_nixl.agent
        real = agent.make_prepped_xfer

        def spy(op, local, lids, remote, rids, notif=b"", *args, **kwargs):
            calls.append((rig.rank_of[id(remote)], bytes(notif)))
            return real(op, local, lids, remote, rids, notif, *args, **kwargs)

        monkeypatch.setattr(agent, "make_prepped_xfer", spy)
        flight = rig.reader.post(rig.prepared, rig.resolved, "req-7")
        rig.reader.wait(flight)
        assert oracle.compare(rig.d, rig.expected) is None  # every byte of decode rank 0
        rounds = len(flight.request.rounds)
        assert rounds > 2 and rig.reader.rounds_posted == rounds
        for rank in rig.plan.read_ranks:
            mine = [n for r, n in calls if r == rank]
            assert len(mine) > 1 and all(n == b"" for n in mine[:-1]) and mine[-1] != b""
            last = max(i for i, (r, _) in enumerate(calls) if r == rank)
            assert calls[last][1] == mine[-1]
        heard = rig.notifications(0.5)
        assert all(v == [("req-7", rig.plan.consumers)] for r, v in heard.items() if r in rig.plan.read_ranks), heard
        assert flight.posted_descriptors == rig.prepared.staged.posted(flight.request)  # NIXL's own count
        assert flight.posted_descriptors == flight.request.posted
    finally:
        rig.close()


@pytest.mark.nixl
def test_a_failed_read_in_a_later_round_fails_the_request_with_nothing_of_it_scattered(monkeypatch) -> None:
    rig = _Rig("fa-p4-d2-h8.yaml", staging_bytes=64 << 10)
    try:
        bad_round = 2
        posted: dict[int, list[object]] = {}
        real_post = rig.reader._post_round

        def record(flight):
            real_post(flight)
            posted[flight.reading[0]] = list(flight.reading[1])

        agent = rig.d_nixl.agent
        real_state = agent.check_xfer_state

        def state(handle):  # fault injection: round 2's READs end in error
            if any(handle is h for h in posted.get(bad_round, [])):
                return "ERR"
            return real_state(handle)

        monkeypatch.setattr(rig.reader, "_post_round", record)
        monkeypatch.setattr(agent, "check_xfer_state", state)
        flight = rig.reader.post(rig.prepared, rig.resolved, "req-8")
        with pytest.raises(TransferError, match="nothing of its round was scattered"):
            rig.reader.wait(flight)
        actual = rig.d.buffer.numpy().view(np.uint8)
        expected = rig.expected.numpy().view(np.uint8)
        sentinel = actual == oracle.SENTINEL
        assert np.all(sentinel | (actual == expected)), "a byte holds neither the sentinel nor its true value"
        assert np.all(sentinel[expected == oracle.SENTINEL]), "a byte outside the request was written"
        base = rig.d.buffer.data_ptr()
        for s in flight.request.rounds[bad_round].scatters:  # the failed round's rows: untouched
            for b in s.local_blocks.tolist():
                lo = s.local_address + b * s.local_stride - base
                assert np.all(actual[lo : lo + s.nbytes] == oracle.SENTINEL)
        s0 = flight.request.rounds[0].scatters[0]  # an earlier round did land
        lo = s0.local_address + int(s0.local_blocks[0]) * s0.local_stride - base
        assert np.array_equal(actual[lo : lo + s0.nbytes], expected[lo : lo + s0.nbytes])
        assert rig.reader.rounds_posted == bad_round + 1  # nothing posted after the failure
        assert not any(rig.notifications(0.3).values())  # P frees by lease: no early "done"
    finally:
        rig.close()
