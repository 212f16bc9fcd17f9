"""Real NIXL READs over DRAM: nixlkv's plan and vLLM's descriptors, next to a same-run memcpy.

One decode rank (rank 0) and the prefill ranks it covers get real, touched numpy buffers laid out
as :func:`nixlkv.bench.shapes.fabricate_rank` describes; the model may be scaled down in layers
(same per-layer geometry) so that the buffers fit a small shared machine. Each repetition runs,
in alternating order: a single-thread memcpy of the request's byte count, nixlkv's READs
(``NixlRank.post`` of ``TransferPlan.resolve``), and the READs vLLM's own code computes
(its descriptor rows and ids, posted the way ``_read_blocks`` posts them).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import torch

from ..core import Dispatcher, covered_remote_ranks
from ..core.request_ids import expand_ids
from ..core.descriptor_mode import TransferCosts, posted_direct
from ..transport.reader import DEFAULT_STAGING_BYTES, Reader
from ..transport.nixl_rank import NixlRank, TransferError
from .measure import Timing, memcpy_seconds, posted_after_merge
from .shapes import Case, block_ids, fabricate_rank, rank_layout
from .vllm_planner import VllmPlanner

WAIT_TIMEOUT = 120.0
# The decode agent's UCX worker threads (``num_threads``), vLLM's NixlConnector's own setting: the
# head-slice READs of a P>D request are then posted by several threads, which on this 2-core VM
# took P4->D2 from ~0.6 to ~0.86-0.98 of the one-descriptor-per-rank ceiling (docs/performance.md).
BENCH_NIXL_THREADS = 4


@dataclass
class TransferResult:
    label: str
    layers: int  # layers actually moved
    model_layers: int  # layers of the model shape (the transfer is scaled down when fewer)
    nbytes: int  # bytes one request moves into decode rank 0
    ours: Timing  # in the descriptor mode ``auto`` picks, READs and local scatter end to end
    ours_direct: Timing  # the plan's own descriptors, posted directly
    ours_staged: Timing  # staged forced: whole pages through the staging buffer, then the scatter
    vllm: Timing
    memcpy: Timing
    ceiling: Timing  # the same byte count as one large descriptor per covered prefill rank: UCX's best here
    # the ceiling's READs with a memcpy of the same byte count on another thread at the same time:
    # two passes over the request's bytes, overlapped (what staging's READ and scatter are at best)
    two_pass: Timing
    nixl_num_threads: int  # the decode agent's num_threads (every READ here is posted by that agent)
    mode: str  # the descriptor mode auto picked in most repetitions
    modes: list[str]  # what auto picked, repetition by repetition
    descs_posted_staged_nixl: int
    descs_posted_staged_computed: int
    costs: TransferCosts | None  # what auto decided on at the end (refined from its real scatters)
    descs_posted_ours_nixl: int  # NIXL telemetry descCount, summed over the READs (every round)
    descs_posted_ours_computed: int  # computed for the same READs (core.staging, measure.posted_after_merge)
    descs_posted_direct: int  # computed for the plan's own READs
    descs_posted_vllm_nixl: int
    descs_posted_vllm_computed: int
    spot_checked_bytes: int
    notes: list[str] = field(default_factory=list)

    def gbps(self, t: Timing) -> float:
        return self.nbytes / t.p50 / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "layers": self.layers,
            "model_layers": self.model_layers,
            "bytes": self.nbytes,
            "ours_ms_p50": self.ours.p50 * 1e3,
            "ours_ms_p99": self.ours.p99 * 1e3,
            "ours_direct_ms_p50": self.ours_direct.p50 * 1e3,
            "ours_staged_ms_p50": self.ours_staged.p50 * 1e3,
            "descriptor_mode": self.mode,
            "descriptor_modes": self.modes,
            "vllm_ms_p50": self.vllm.p50 * 1e3,
            "vllm_ms_p99": self.vllm.p99 * 1e3,
            "memcpy_ms_p50": self.memcpy.p50 * 1e3,
            "ours_gbps": self.gbps(self.ours),
            "vllm_gbps": self.gbps(self.vllm),
            "memcpy_gbps": self.gbps(self.memcpy),
            "ours_vs_memcpy": self.memcpy.p50 / self.ours.p50,
            "ours_direct_gbps": self.gbps(self.ours_direct),
            "ours_direct_vs_memcpy": self.memcpy.p50 / self.ours_direct.p50,
            "ours_staged_gbps": self.gbps(self.ours_staged),
            "ours_staged_vs_memcpy": self.memcpy.p50 / self.ours_staged.p50,
            "descs_posted_staged_nixl": self.descs_posted_staged_nixl,
            "descs_posted_staged_computed": self.descs_posted_staged_computed,
            "auto_copy_gbps": self.costs.copy_bytes_per_s / 1e9 if self.costs else None,
            "vllm_vs_memcpy": self.memcpy.p50 / self.vllm.p50,
            "ceiling_gbps": self.gbps(self.ceiling),
            "ceiling_vs_memcpy": self.memcpy.p50 / self.ceiling.p50,
            # against the same run's ceiling: what a planner can still gain here
            "ours_vs_ceiling": self.ceiling.p50 / self.ours.p50,
            "ours_direct_vs_ceiling": self.ceiling.p50 / self.ours_direct.p50,
            "ours_staged_vs_ceiling": self.ceiling.p50 / self.ours_staged.p50,
            "vllm_vs_ceiling": self.ceiling.p50 / self.vllm.p50,
            # Same-run limits. Staging moves every byte twice (a READ, then the scatter): at best
            # the two overlap, as the ceiling's READs with a concurrent memcpy do here.
            "two_pass_ms_p50": self.two_pass.p50 * 1e3,
            "two_pass_vs_ceiling": self.ceiling.p50 / self.two_pass.p50,
            # The direct READs' time beyond the ceiling's, per descriptor NIXL posted for them,
            # and what it would have to be for direct to reach 90% of the ceiling.
            "direct_extra_us_per_descriptor": 1e6 * (self.ours_direct.p50 - self.ceiling.p50) / max(self.descs_posted_direct, 1),
            "direct_us_per_descriptor_for_90pct": 1e6 * self.ceiling.p50 * (1 / 0.9 - 1) / max(self.descs_posted_direct, 1),
            "nixl_num_threads": self.nixl_num_threads,
            "reps": self.ours.reps,
            "descs_posted_ours_nixl": self.descs_posted_ours_nixl,
            "descs_posted_ours_computed": self.descs_posted_ours_computed,
            "descs_posted_direct": self.descs_posted_direct,
            "descs_posted_vllm_nixl": self.descs_posted_vllm_nixl,
            "descs_posted_vllm_computed": self.descs_posted_vllm_computed,
            "spot_checked_bytes": self.spot_checked_bytes,
            "notes": self.notes,
        }


def _buffer(nbytes: int, fill: int | None) -> np.ndarray:
    """A page-touched buffer: untouched pages would make reads free and writes fault mid-timing."""
    buf = np.empty(nbytes, dtype=np.uint8)
    if fill is None:
        buf.fill(0)
    else:
        words = buf[: nbytes - nbytes % 8].view(np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(fill)
    return buf


def run_transfer(
    case: Case,
    num_layers: int,
    reps: int,
    dispatcher: Dispatcher,
    seed: int = 0,
    descriptor_mode: str = "auto",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    costs: TransferCosts | None = None,
    progress_delay_us: int = 0,
    nixl_num_threads: int = BENCH_NIXL_THREADS,
) -> TransferResult:
    """Move one request of ``case`` into decode rank ``case.d_rank``, ``reps`` times each way:
    nixlkv in ``descriptor_mode`` (READs plus, when staged, the local scatter), nixlkv direct,
    vLLM's descriptors, and a memcpy of the same byte count. ``nixl_num_threads``: the decode
    agent's worker threads, for every READ alike."""
    shape = case.shape
    rng = np.random.default_rng(seed)
    nb = case.num_blocks
    covered = list(covered_remote_ranks(case.d_rank, case.d_tp, case.p_tp))
    _, d_bytes = rank_layout(shape, case.d_tp, nb, num_layers)
    _, p_bytes = rank_layout(shape, case.p_tp, nb, num_layers)
    d_buf = _buffer(d_bytes, None)
    p_bufs = {r: _buffer(p_bytes, fill=r + 1) for r in covered}
    local = fabricate_rank(dispatcher, shape, "decode", case.d_tp, case.d_rank, nb, base=d_buf.ctypes.data, num_layers=num_layers)
    remote = {
        r: fabricate_rank(dispatcher, shape, "prefill", case.p_tp, r, nb, base=b.ctypes.data, num_layers=num_layers)
        for r, b in p_bufs.items()
    }
    plan = dispatcher.plan(local, remote)
    vllm = VllmPlanner(
        shape, case.p_tp, case.d_tp, case.d_rank, nb,
        [r.base for r in local.regions], {r: [x.base for x in g.regions] for r, g in remote.items()},
        num_layers=num_layers,
    )
    vllm.handshake()
    n = case.num_request_blocks
    p_ids = block_ids(case.pattern, n, nb, rng)
    d_ids = block_ids(case.pattern, n, nb, rng)
    resolved = plan.resolve([d_ids], [p_ids], case.num_tokens)
    v_reads = vllm.reads([d_ids], [p_ids])
    nbytes = sum(int(expand_ids(plan.local_descs, r.local_ids)[1].sum()) for r in resolved.reads)
    v_bytes = sum(int(expand_ids(r.local_rows, r.local_ids)[1].sum()) for r in v_reads)
    if v_bytes != nbytes:
        raise TransferError(f"{case.label}: nixlkv moves {nbytes} bytes but vLLM's descriptors move {v_bytes}")

    d_nixl = NixlRank("bench-D", [(d_buf.ctypes.data, d_buf.nbytes)], num_threads=nixl_num_threads, capture_telemetry=True,
                      progress_delay_us=progress_delay_us)
    p_nixl = {r: NixlRank(f"bench-P{r}", [(b.ctypes.data, b.nbytes)], progress_delay_us=progress_delay_us) for r, b in p_bufs.items()}
    src, dst = _buffer(nbytes, fill=7), _buffer(nbytes, None)
    reader = None
    readers: list[Reader] = []
    try:
        agents = {r: d_nixl.add_remote(p.metadata()) for r, p in p_nixl.items()}
        memory = [torch.from_numpy(d_buf)]
        reader = Reader(d_nixl, descriptor_mode, staging_bytes, memory, costs=costs)
        prepared = reader.prepare(plan, agents)
        stager = Reader(d_nixl, "staged", staging_bytes, memory)
        readers.append(stager)
        staged_prepared = stager.prepare(plan, agents)
        staged_request = stager.choose(staged_prepared, resolved).staged
        agent = d_nixl.agent
        v_local = {id(rows): agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM") for rows in [vllm.local_rows, *vllm.split_rows]}
        v_remote = {r: agent.prep_xfer_dlist(agents[r], rows, "DRAM") for r, rows in vllm.remote_rows.items()}
        posted: dict[str, int] = {}

        def ours() -> None:
            flight = reader.post(prepared, resolved, "bench-req")
            reader.wait(flight, WAIT_TIMEOUT)
            modes.append(flight.mode)
            posted["ours"] = int(flight.posted_descriptors or 0)

        def ours_staged() -> None:
            flight = stager.post(staged_prepared, resolved, "bench-req")
            stager.wait(flight, WAIT_TIMEOUT)
            posted["staged"] = int(flight.posted_descriptors or 0)

        def ours_direct() -> None:
            flight = d_nixl.post(prepared.prepared, resolved, "bench-req")
            d_nixl.wait(flight, WAIT_TIMEOUT)

        def theirs() -> None:
            handles = [
                agent.make_prepped_xfer(
                    "READ", v_local[id(read.local_rows)], read.local_ids, v_remote[read.remote_rank], read.remote_ids,
                    notif_msg=b"bench-req:1",
                )
                for read in v_reads
            ]
            _run_reads(agent, handles, "vLLM-style READ")
            posted["vllm"] = sum(int(agent.get_xfer_telemetry(h).descCount) for h in handles)
            for h in handles:
                agent.release_xfer_handle(h)

        # The transport's ceiling: the request's byte count as one descriptor per covered prefill
        # rank (contiguous on both sides), so no planner can post fewer or larger ones.
        share = nbytes // len(covered)
        ceiling_lists = [
            (
                agent.get_xfer_descs(np.array([[d_buf.ctypes.data + i * share, share, 0]], dtype=np.uint64), "DRAM"),
                agent.get_xfer_descs(np.array([[p_bufs[r].ctypes.data, share, 0]], dtype=np.uint64), "DRAM"),
                agents[r],
            )
            for i, r in enumerate(covered)
        ]

        def ceiling() -> None:
            handles = [agent.initialize_xfer("READ", loc, rem, name) for loc, rem, name in ceiling_lists]
            _run_reads(agent, handles, "one-descriptor READ")
            for h in handles:
                agent.release_xfer_handle(h)

        def two_pass() -> None:  # the memcpy's own buffers: the two never run at once
            copier = threading.Thread(target=np.copyto, args=(dst, src))  # numpy copies without the GIL
            copier.start()
            ceiling()
            copier.join()

        fns = [lambda: memcpy_seconds(dst, src), ours, theirs, ours_direct, ours_staged, ceiling, two_pass]
        samples: list[list[float]] = [[] for _ in fns]
        modes: list[str] = []
        for fn in fns:  # warm-up: connections, page tables, first-touch
            fn()
        checked = 0
        for fn in (ours_staged, ours):  # what the spot check reads is what that mode wrote
            d_buf.fill(0)
            fn()
            checked += _spot_check(plan, resolved, d_buf, p_bufs)
        modes.clear()
        order = list(range(len(fns)))
        for rep in range(reps):
            for i in order if rep % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                fns[i]()
                samples[i].append(time.perf_counter() - t0)
        for p in p_nixl.values():
            p.notifications()  # drain
    finally:
        for r in ([reader] if reader is not None else []) + readers:
            r.close()
        d_nixl.close()
        for p in p_nixl.values():
            p.close()
    comp_direct = posted_direct(plan, resolved)
    comp_staged = staged_prepared.staged.posted(staged_request)
    last_mode = modes[-1]
    comp_ours = comp_staged if last_mode == "staged" else comp_direct
    comp_vllm = sum(posted_after_merge(r.local_rows, r.local_ids, vllm.remote_rows[r.remote_rank], r.remote_ids) for r in v_reads)
    notes = []
    if num_layers != shape.num_layers:
        notes.append(f"scaled down to {num_layers} of {shape.num_layers} layers (same per-layer geometry)")
    return TransferResult(
        label=case.label,
        layers=num_layers,
        model_layers=shape.num_layers,
        nbytes=nbytes,
        memcpy=Timing.of(samples[0]),
        ours=Timing.of(samples[1]),
        ours_direct=Timing.of(samples[3]),
        ours_staged=Timing.of(samples[4]),
        vllm=Timing.of(samples[2]),
        ceiling=Timing.of(samples[5]),
        two_pass=Timing.of(samples[6]),
        nixl_num_threads=nixl_num_threads,
        mode=max(set(modes), key=modes.count),
        modes=modes,
        descs_posted_staged_nixl=posted["staged"],
        descs_posted_staged_computed=comp_staged,
        costs=reader.costs,
        descs_posted_ours_nixl=posted["ours"],
        descs_posted_ours_computed=comp_ours,
        descs_posted_direct=comp_direct,
        descs_posted_vllm_nixl=posted["vllm"],
        descs_posted_vllm_computed=comp_vllm,
        spot_checked_bytes=checked,
        notes=notes,
    )


def _run_reads(agent: Any, handles: list[object], what: str) -> None:
    """Post READs made outside NixlRank (vLLM's descriptors, the one-descriptor ceiling) and wait
    until all are done; an error or a READ past WAIT_TIMEOUT fails the run."""
    for h in handles:
        if agent.transfer(h) == "ERR":
            raise TransferError(f"NIXL refused a {what}")
    deadline = time.perf_counter() + WAIT_TIMEOUT
    while any(agent.check_xfer_state(h) == "PROC" for h in handles):
        if time.perf_counter() > deadline:
            raise TransferError(f"{what}s not done in time")
    if any(agent.check_xfer_state(h) == "ERR" for h in handles):
        raise TransferError(f"a {what} ended in error")


def _spot_check(plan, resolved, d_buf: np.ndarray, p_bufs: dict[int, np.ndarray], samples: int = 512) -> int:
    """Compare a spread of moved descriptors byte for byte (after the warm-up READs): a bench that
    moves the wrong bytes fast is worthless. Returns bytes compared; raises on a difference."""
    d0 = d_buf.ctypes.data
    checked = 0
    for read in resolved.reads:
        la, ln = expand_ids(plan.local_descs, read.local_ids)
        ra, _ = expand_ids(plan.remote_descs[read.remote_rank], read.remote_ids)
        p = p_bufs[read.remote_rank]
        p0 = p.ctypes.data
        for i in np.linspace(0, la.size - 1, num=min(samples, la.size)).astype(np.int64):
            lo, ro, k = int(la[i]) - d0, int(ra[i]) - p0, int(ln[i])
            if not np.array_equal(d_buf[lo : lo + k], p[ro : ro + k]):
                raise TransferError(f"descriptor {i} of the READ from rank {read.remote_rank}: bytes differ after the transfer")
            checked += k
    return checked
