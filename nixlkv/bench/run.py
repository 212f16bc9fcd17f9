"""The benchmark suite: planning cases, real transfers, the quick JSON summary, table and plot."""

from __future__ import annotations

import dataclasses
import math
import platform
import struct
import time
from itertools import chain
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..core import Dispatcher, IdScratch, RankGeometry, covered_remote_ranks
from ..core.errors import NixlkvError
from ..core.dispatcher import forget_handshakes
from ..core.plan import prepare_local
from ..core.request_ids import expand_ids, largest
from ..core.descriptor_mode import TransferCosts, choose, decide, posted_direct
from ..core.staging import StagedPlan, StagingError
from ..transport.reader import DEFAULT_STAGING_BYTES, measured_costs
from .dram import BENCH_NIXL_THREADS, run_transfer
from .hybrid import NEMOTRON_H_8B, HybridShape, hybrid_request_ids, hybrid_setup
from .measure import Untimed, interleaved, posted_after_merge
from .shapes import DEEPSEEK_MLA, LLAMA_8B, LLAMA_70B, PATTERNS, Case, block_ids, fabricate_rank
from .vllm_planner import VllmPlanner

TOKENS = (1024, 8192, 131072)
ENGINES = 4  # prefill engines of one layout a decode rank reads, for the registered descriptors
TRANSFER_LAYERS = 8  # real transfers move 8 of the model's layers: ~0.25 GB per request at TP1
# Cases not measured, with why: reported next to the table so a reader does not assume coverage.
NOT_MEASURED: dict[str, str] = {}


def quick_cases() -> list[Case]:
    """Llama-8B-like only: the headline TP pairs at 8k, plus 1k/128k for the P4->D2 curve."""
    out = [Case(LLAMA_8B, 4, 2, t, "contiguous") for t in TOKENS]
    out.append(Case(LLAMA_8B, 4, 2, 8192, "fragmented"))
    out.append(Case(LLAMA_8B, 1, 1, 8192, "contiguous"))
    return out


def full_cases() -> list[Case]:
    pairs = [(LLAMA_8B, 1, 1), (LLAMA_8B, 4, 2), (LLAMA_8B, 8, 4), (LLAMA_8B, 4, 8),
             (LLAMA_70B, 8, 4), (LLAMA_70B, 4, 8), (DEEPSEEK_MLA, 8, 2), (NEMOTRON_H_8B, 4, 2)]
    return [Case(s, p, d, t, pat) for s, p, d in pairs for t in TOKENS for pat in PATTERNS]


def transfer_cases() -> list[Case]:
    return [Case(LLAMA_8B, 1, 1, 8192, "contiguous"), Case(LLAMA_8B, 4, 2, 8192, "contiguous")]


def _reps(ids_per_request: int, budget: float) -> int:
    """Repetitions so one case costs about ``budget`` x 1e7 descriptor ids, between 15 and 300."""
    return int(min(300, max(15, budget * 1e7 / max(ids_per_request, 1))))


def id_floor(local: list[int], remote: list[int], ids_per_read: Sequence[int]) -> Callable[[], None] | None:
    """The least any planner handing NIXL prepped-list IDs does per request: convert both Python
    block lists in one step (the fastest conversion known: one ``struct`` pack of both), and write
    one int32 ID per descriptor on each side of every READ (no validation, no pairing). None where
    a READ's IDs are not whole rows of the request's blocks."""
    n = len(local)
    if n == 0 or len(remote) != n or any(k % n for k in ids_per_read):
        return None
    return group_id_floor([local], [remote], [[(0, 0, k // n)] for k in ids_per_read])


def group_id_floor(
    local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], reads: Sequence[Sequence[tuple[int, int, int]]],
    checked_limits: tuple[int, int] | None = None,
) -> Callable[[], None] | None:
    """:func:`id_floor` for a request with several KV groups (a hybrid): convert every group's
    block lists in one step (one ``struct`` pack of them all), and per READ write one int32 ID per
    descriptor on each side, ``rows`` IDs per block for each ``(local group, remote group, rows)``
    the READ reads. None where a group's lists differ in length (pairing would be needed).
    Where the request is one group on each side, one broadcast add writes a READ's IDs on both
    sides at once (the two lists lie side by side after the one conversion), as nixlkv does.

    ``checked_limits`` = (local, remote) block counts: the floor then also does the least a
    planner that refuses bad ids must do, over all the ids at once: one count of null blocks (id
    0) and one unsigned max against the smaller block count (each side against its own where
    that fails); it is the floor of validated planning."""
    if any(len(local[lg]) != len(remote[rg]) for read in reads for lg, rg, _ in read):
        return None
    stride = max([max(g) for g in (*local, *remote) if len(g)], default=0) + 1
    offsets = {rows: np.arange(rows, dtype=np.int32)[:, None] * np.int32(stride) for read in reads for _, _, rows in read}
    groups = [*local, *remote]
    sizes = [len(g) for g in groups]
    cuts = np.cumsum([0, *sizes]).tolist()
    total = cuts[-1]
    pack = struct.Struct(f"{total}i").pack
    two = len(groups) == 2
    paired = two and all(len(read) == 1 for read in reads)  # one add per READ writes both sides
    out = []
    both_out = []  # where paired: per READ, both sides' row starts and IDs as (2, rows, ...) arrays
    for read in reads:
        n = sum(rows * len(local[lg]) for lg, _, rows in read)
        buf = np.empty(2 * n, dtype=np.int32)
        out.append((buf[:n], buf[n:]))
        if paired:
            ((_, _, rows),) = read
            both_out.append((np.stack((offsets[rows], offsets[rows])), buf.reshape(2, rows, sizes[0])))
    limit = min(checked_limits) if checked_limits is not None else None
    sizes_l, sizes_r = sizes[: len(local)], sizes[len(local) :]

    def floor() -> None:
        ids = np.frombuffer(pack(*groups[0], *groups[1]) if two else pack(*chain.from_iterable(groups)), dtype=np.int32)
        if limit is not None and total:
            if np.count_nonzero(ids) != total:
                raise ValueError("a null block id")
            if largest(ids.view(np.uint32)) >= limit:  # then each side against its own count
                views = [ids[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
                for side, bound in ((views[: len(local)], checked_limits[0]), (views[len(local) :], checked_limits[1])):
                    if any(a.size and largest(a.view(np.uint32)) >= bound for a in side):
                        raise ValueError("a block id out of bounds")
        if paired:
            both = ids.reshape(2, 1, sizes[0])
            for starts, dst in both_out:
                np.add(both, starts, out=dst)
            return
        views = [ids[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        lids, rids = views[: len(local)], views[len(local) :]
        for read, (lo, ro) in zip(reads, out):
            at = 0
            for lg, rg, rows in read:
                k = rows * sizes_l[lg]
                np.add(lids[lg], offsets[rows], out=lo[at : at + k].reshape(rows, sizes_l[lg]))
                np.add(rids[rg], offsets[rows], out=ro[at : at + k].reshape(rows, sizes_r[rg]))
                at += k

    floor.out = out  # type: ignore[attr-defined]  # what it wrote, per READ: (local IDs, remote IDs)
    return floor


def floor_reads(plan: Any) -> list[list[tuple[int, int, int]]]:
    """Per READ of ``plan`` (in its read order), ``(local group, remote group, rows)`` for every
    (pairing, phase) it reads: the descriptor rows a block of that group has in the READ."""
    out = []
    for p in plan.read_ranks:
        read = []
        for key, _phase, lstarts, _rstarts, _bytes in plan._rank_keys[p]:
            pairing = plan.pairings[key]
            read.append((pairing.local_group, pairing.remote_group, int(lstarts.size)))
        out.append(read)
    return out


def plan_case(
    case: Case, dispatcher: Dispatcher, seed: int = 0, budget: float = 3.0, costs: TransferCosts | None = None
) -> dict[str, Any]:
    """Every planning figure of one case, nixlkv and vLLM on the same geometry and block ids."""
    rng = np.random.default_rng(seed)
    nb = case.num_blocks
    hybrid = isinstance(case.shape, HybridShape)
    if hybrid:
        local, remote, vllm = hybrid_setup(case, dispatcher)
    else:
        local = fabricate_rank(dispatcher, case.shape, "decode", case.d_tp, case.d_rank, nb)
        covered = list(covered_remote_ranks(case.d_rank, case.d_tp, case.p_tp))
        remote = {r: fabricate_rank(dispatcher, case.shape, "prefill", case.p_tp, r, nb) for r in covered}
        vllm = VllmPlanner(case.shape, case.p_tp, case.d_tp, case.d_rank, nb,
                           [r.base for r in local.regions], {r: [x.base for x in g.regions] for r, g in remote.items()})
    # What a decode rank parses of a handshake: the geometry of each remote rank it plans with
    # (Dispatcher.read_ranks: the covered ranks its strategies read; one of the four at MLA
    # P8->D2, as the connector parses) as plain data, in the columnar form nixlkv sends (one
    # description per distinct region geometry, the regions as columns). Every
    # timed handshake is with another prefill engine (its own id and addresses), as a decode rank
    # meets them: the dispatcher has planned the layout before (with the first engine), so it
    # rebases that plan; the first handshake of a layout is timed on its own (a fresh dispatcher
    # and no process-wide memo of parsing or planning, each time; the decode geometry is the worker's own,
    # as registering its caches prepared it, and a new one each time: nothing a plan left on it).
    # Each side's timing starts from what the transport decoded, made in the timed call (as
    # decoding leaves it, in cache): nixlkv's wire dicts, vLLM's NixlAgentMetadata.
    wire = {r: remote[r].to_wire() for r in dispatcher.read_ranks(local, case.p_tp)}
    hs_reps = 5 if case.shape.num_layers * nb > 200_000 else 15
    engine_ids = iter(range(1, 3 * (hs_reps + 1) + 1))
    # the decode geometry as each first handshake meets it: as registering the caches made it
    registered = iter([prepare_local(dataclasses.replace(local)) for _ in range(hs_reps + 1)])

    def received() -> dict[int, RankGeometry]:  # another prefill engine's ranks, parsed and checked
        k = next(engine_ids)
        return {r: RankGeometry.from_dict(other_engine(w, k)) for r, w in wire.items()}

    def ours_handshake():
        return dispatcher.plan(local, received())

    counts = iter(range(1, hs_reps + 2))

    def ours_other_blocks():  # another engine of the model whose caches hold other block counts
        k = next(counts)
        return dispatcher.plan(local, {r: RankGeometry.from_dict(fewer_blocks(other_engine(w, 1000 + k), k))
                                       for r, w in wire.items()})

    def worker_that_never_met_a_peer() -> tuple[Dispatcher, RankGeometry]:  # untimed: no handshake does this
        forget_handshakes()
        return Dispatcher(dispatcher.registry, unwrap=dispatcher._unwrap), next(registered)

    # nothing of this layout planned, nor parsed, in this decode worker
    ours_first = Untimed(worker_that_never_met_a_peer, lambda fresh: fresh[0].plan(fresh[1], received()))

    dispatcher.plan(local, {r: RankGeometry.from_dict(d) for r, d in wire.items()})  # the layout's first engine
    vllm.handshake()  # vLLM's first engine of this TP size: its split local handles are kept for later ones
    hs_ours, hs_vllm, hs_parse, hs_first, hs_first_vllm = interleaved(
        [ours_handshake, vllm.handshake, received, ours_first, vllm.handshake_first], hs_reps, warmup=1)
    # apart: what one kind of call leaves in the caches and memos moves the others' timings
    hs_other, hs_other_vllm = interleaved([ours_other_blocks, vllm.handshake], hs_reps, warmup=1)
    plan = dispatcher.plan(local, {r: RankGeometry.from_dict(d) for r, d in wire.items()})

    n = case.num_request_blocks
    if hybrid:  # per group: the attention group's prompt blocks, one running state per Mamba group
        p_groups, d_groups = hybrid_request_ids(case, vllm.local_layout, rng)
    else:
        p_groups, d_groups = [block_ids(case.pattern, n, nb, rng)], [block_ids(case.pattern, n, nb, rng)]
    resolved = plan.resolve(d_groups, p_groups, case.num_tokens)
    v_reads = vllm.reads(d_groups, p_groups)
    ours_bytes = sum(int(expand_ids(plan.local_descs, r.local_ids)[1].sum()) for r in resolved.reads)
    vllm_bytes = sum(int(expand_ids(r.local_rows, r.local_ids)[1].sum()) for r in v_reads)
    if ours_bytes != vllm_bytes:
        raise RuntimeError(f"{case.label}: nixlkv moves {ours_bytes} bytes per request, vLLM {vllm_bytes}")

    reps = _reps(resolved.num_descriptors + sum(r.local_ids.size for r in v_reads), budget)
    scratch = IdScratch()  # what the connector's worker does: one id buffer reused per request
    fns = [lambda: plan.resolve(d_groups, p_groups, case.num_tokens, scratch=scratch), lambda: vllm.desc_ids(d_groups, p_groups)]
    reads = floor_reads(plan)
    floor = group_id_floor(d_groups, p_groups, reads)
    limits = (min(g.local_num_blocks for g in plan.pairings), min(g.remote_num_blocks for g in plan.pairings))
    floor_checked = group_id_floor(d_groups, p_groups, reads, checked_limits=limits)
    if floor is not None and sum(lo.size for lo, _ in floor.out) != resolved.num_descriptors:
        floor = floor_checked = None  # not the request's descriptor count: no floor for it
    if floor is not None and floor_checked is not None:
        fns += [floor, floor_checked]
    t_ours, t_vllm, *t_floor = interleaved(fns, reps)
    merged_direct = posted_direct(plan, resolved)
    # What the connector's default (descriptor_mode auto, default staging buffer) posts.
    try:
        staged_plan = StagedPlan(plan, DEFAULT_STAGING_BYTES // 2)
    except StagingError:
        staged_plan = None
    usable = staged_plan if staged_plan is not None and staged_plan.can_help else None
    choice = choose("auto", plan, usable, resolved, costs)
    staged = (choice.staged or staged_plan.stage(resolved)) if staged_plan is not None else None
    merged_ours = staged.posted if choice.mode == "staged" else merged_direct
    merged_staged = staged.posted if staged is not None else None
    # auto's decision alone (the staged program, where it stages, is posting work; it is built
    # only then, and timed as part of the staged transfer)
    (t_choose,) = interleaved([lambda: decide("auto", plan, usable, resolved, costs)], max(5, reps // 4), warmup=1)
    merged_vllm = sum(posted_after_merge(r.local_rows, r.local_ids, vllm.remote_rows[r.remote_rank], r.remote_ids) for r in v_reads)
    reg_local = int(plan.local_descs[:, 4].sum())
    reg_ours = reg_local + sum(int(d[:, 4].sum()) for d in plan.remote_descs.values())
    # A decode rank reading ENGINES prefill engines of the layout: nixlkv shares its local list
    # between their plans (NixlRank.prep_local), vLLM keeps its local and split handles; each
    # engine brings its own remote rows on both sides.
    reg_vllm = vllm.registered_descriptors()
    reg_vllm_remote = int(sum(int(r[:, 4].sum()) for r in vllm.remote_rows.values()))
    return {
        "label": case.label,
        "shape": case.shape.name,
        "p_tp": case.p_tp,
        "d_tp": case.d_tp,
        "tokens": case.num_tokens,
        "pattern": case.pattern,
        "bytes_per_request": ours_bytes,
        "plan_us_ours_p50": t_ours.p50 * 1e6,
        "plan_us_ours_p99": t_ours.p99 * 1e6,
        "plan_us_vllm_p50": t_vllm.p50 * 1e6,
        "plan_us_vllm_p99": t_vllm.p99 * 1e6,
        "plan_reps": reps,
        "plan_time_ratio": t_ours.p50 / t_vllm.p50,
        "plan_floor_ratio": t_floor[0].p50 / t_vllm.p50 if t_floor else None,
        # the floor plus the least validation (bounds and null block per list): what nixlkv keeps
        "plan_floor_checked_ratio": t_floor[1].p50 / t_vllm.p50 if t_floor else None,
        "reads_ours": len(resolved.reads),
        "reads_vllm": len(v_reads),
        "descs_ids_ours": resolved.num_descriptors,
        "descs_ids_vllm": int(sum(r.local_ids.size for r in v_reads)),
        "descs_posted_ours": merged_ours,
        "descriptor_mode_ours": choice.mode,
        "descs_posted_ours_direct": merged_direct,
        "descs_posted_ours_staged": merged_staged,
        "choose_us_ours_p50": t_choose.p50 * 1e6,
        "descs_posted_vllm": merged_vllm,
        "descs_ratio": merged_ours / merged_vllm,
        "registered_ours": reg_ours,
        "registered_vllm": reg_vllm,
        "registered_ours_engines": reg_local + ENGINES * (reg_ours - reg_local),
        "registered_vllm_engines": reg_vllm + (ENGINES - 1) * reg_vllm_remote,
        "registered_ratio_engines": (reg_local + ENGINES * (reg_ours - reg_local)) / (reg_vllm + (ENGINES - 1) * reg_vllm_remote),
        "handshake_ms_ours": hs_ours.p50 * 1e3,
        "handshake_ms_vllm": hs_vllm.p50 * 1e3,
        "handshake_ratio": hs_ours.p50 / hs_vllm.p50,
        # the first handshake of this layout on a decode rank: ours planned from scratch, vLLM's
        # building its split local handles (which it keeps for later engines of this TP size)
        "handshake_ms_first_ours": hs_first.p50 * 1e3,
        "handshake_ms_first_vllm": hs_first_vllm.p50 * 1e3,
        "handshake_first_ratio": hs_first.p50 / hs_first_vllm.p50,
        # another engine of the model whose caches hold other block counts (each a count not met
        # before): ours plans it from the layout's segments (Dispatcher: the shape memo), against
        # vLLM's handshake with another engine of the TP size
        "handshake_ms_other_blocks_ours": hs_other.p50 * 1e3,
        "handshake_other_blocks_ratio": hs_other.p50 / hs_other_vllm.p50,
        # of ours: the covered ranks' geometry as received (the wire dicts made) parsed and checked alone
        "handshake_ms_parse_ours": hs_parse.p50 * 1e3,
        "handshake_parse_ratio": hs_parse.p50 / hs_vllm.p50,
    }


def other_engine(wire: dict[str, Any], k: int) -> dict[str, Any]:
    """A columnar rank geometry (``RankGeometry.to_wire``) as the ``k``-th other engine of the same
    layout would send it: its own engine id, its regions and memory ``k`` pages of 4 KiB higher."""
    shift = k << 12
    cols = wire["region_columns"]
    return {
        **wire,
        "engine_id": f"{wire['engine_id']}-{k}",
        "region_columns": {**cols, "base": [b + shift for b in cols["base"]]},
        "memory": [[a + shift, n] for a, n in wire["memory"]],
    }


def fewer_blocks(wire: dict[str, Any], k: int) -> dict[str, Any]:
    """A columnar rank geometry whose regions hold ``k`` fewer blocks (as an engine of the model
    whose memory holds fewer: its registered memory as it was, the regions ending lower)."""
    return {**wire, "region_classes": [{**c, "num_blocks": c["num_blocks"] - k} for c in wire["region_classes"]]}


def memcpy_note() -> str:
    return "memcpy: single-thread numpy.copyto of the request's byte count, same run, interleaved"


def run(
    quick: bool,
    with_transfers: bool = True,
    transfer_reps: int | None = None,
    progress: Callable[[str], None] | None = None,
    shape: str | None = None,
    progress_delay_us: int = 1000,
    nixl_num_threads: int = BENCH_NIXL_THREADS,
) -> dict[str, Any]:
    """Run the suite; return one JSON-ready object (headline keys first, then every row).

    ``shape`` keeps only that shape's planning cases (by name). ``progress_delay_us``: the NIXL
    agents' progress-thread pause in the real transfers (0: NIXL's busy poll).
    """
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    dispatcher = Dispatcher.from_plugins()
    cases = quick_cases() if quick else full_cases()
    if shape is not None:
        names = sorted({c.shape.name for c in cases})
        cases = [c for c in cases if c.shape.name == shape]
        if not cases:
            raise NixlkvError(f"--shape {shape!r}: no {'quick' if quick else 'full'} case has it; use one of {names}")
    # What auto decides on: this machine's copy bandwidth now, refined by the real transfers'
    # scatters when they run (first, so that the planning cases report what auto would pick).
    costs = measured_costs(torch.device("cpu"))
    transfers, learned = [], []
    if with_transfers:
        for case in transfer_cases():
            say(f"transfer {case.label} ({TRANSFER_LAYERS} layers)")
            result = run_transfer(case, TRANSFER_LAYERS, transfer_reps or (5 if quick else 9), dispatcher, costs=costs,
                                  progress_delay_us=progress_delay_us, nixl_num_threads=nixl_num_threads)
            transfers.append(result.to_dict())
            learned.append(result.costs)
    costs = next((c for c in reversed(learned) if c is not None), costs)
    rows = []
    for case in cases:
        say(f"planning {case.label}")
        rows.append(plan_case(case, dispatcher, budget=1.5 if quick else 3.0, costs=costs))
    out = summary(rows, transfers)
    out["auto_costs"] = {"per_descriptor_us": costs.per_descriptor_s * 1e6, "copy_gbps_measured": costs.copy_bytes_per_s / 1e9,
                         "nixl_gbps_assumed": costs.nixl_bytes_per_s / 1e9}
    out["nixl_progress_delay_us"] = progress_delay_us
    out["nixl_num_threads"] = nixl_num_threads
    out["mode"] = "quick" if quick else "full"
    out["runtime_s"] = time.perf_counter() - t0
    out["machine"] = f"{platform.node()} {platform.machine()} cpus={_cpus()} (shared: timings noisy, ratios from one run)"
    out["cases"] = rows
    out["transfers"] = transfers
    out["not_measured"] = NOT_MEASURED
    out["notes"] = [
        "planning: decode rank 0; vLLM = compute_tp_mapping/_build_fa_local/_build_fa_remote/"
        "_build_local_splits_from_plan at handshake and 2 x _compute_desc_ids per READ per request, "
        "called on a stand-in worker (vLLM's code, not a copy); nixlkv = RankGeometry.from_dict + "
        "Dispatcher.plan at handshake and TransferPlan.resolve per request",
        "descs_posted: descriptors NIXL 1.5.1 posts after merging, computed by measure.posted_after_merge "
        "and checked against NIXL telemetry (descCount) in the real transfers",
        "nixlkv runs in descriptor_mode auto (the connector's default, staging buffer "
        f"{DEFAULT_STAGING_BYTES >> 20} MiB): descs_posted_ours and the transfer GB/s are for the mode auto picked "
        "(READs plus the local scatter when staged, timed end to end); *_direct keys are the plan's own descriptors",
        memcpy_note(),
        f"NIXL agents' progress threads pause {progress_delay_us} us between polls (0: NIXL's busy poll, one core "
        "per agent; the bench holds three agents in one process)",
        f"the decode agent runs with NIXL num_threads={nixl_num_threads} (vLLM's NixlConnector uses 4); nixlkv, "
        "vLLM-style and the one-descriptor ceiling READs are all posted by it; *_vs_ceiling: the same run's "
        "one-descriptor-per-prefill-rank READ over each",
    ]
    return out


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _find(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


# Headline key -> the planning row's key it is taken from, per headline case (Llama-8B-like, 8k).
HETERO_KEYS = {  # P4->D2, contiguous
    "plan_time_ratio_vs_vllm": "plan_time_ratio",
    "plan_floor_ratio_vs_vllm": "plan_floor_ratio",
    "plan_us_ours_p50": "plan_us_ours_p50",
    "plan_us_ours_p99": "plan_us_ours_p99",
    "plan_us_vllm_p50": "plan_us_vllm_p50",
    "plan_us_vllm_p99": "plan_us_vllm_p99",
    "descs_ratio_vs_vllm_hetero": "descs_ratio",
    "descriptor_mode_hetero": "descriptor_mode_ours",
    "descs_posted_direct_hetero": "descs_posted_ours_direct",
    "choose_us_hetero_p50": "choose_us_ours_p50",
    "descs_posted_ours_hetero": "descs_posted_ours",
    "descs_posted_vllm_hetero": "descs_posted_vllm",
    "registered_ours_hetero": "registered_ours",
    "registered_vllm_hetero": "registered_vllm",
    "registered_ratio_vs_vllm_4_engines_hetero": "registered_ratio_engines",
    "handshake_ratio_vs_vllm_hetero": "handshake_ratio",
    "handshake_first_ratio_vs_vllm_hetero": "handshake_first_ratio",
    "handshake_other_blocks_ratio_vs_vllm_hetero": "handshake_other_blocks_ratio",
    "handshake_ms_other_blocks_ours_hetero": "handshake_ms_other_blocks_ours",
    "handshake_ms_first_ours_hetero": "handshake_ms_first_ours",
    "handshake_ms_first_vllm_hetero": "handshake_ms_first_vllm",
    "handshake_ms_ours_hetero": "handshake_ms_ours",
    "handshake_ms_vllm_hetero": "handshake_ms_vllm",
    "handshake_ms_parse_ours_hetero": "handshake_ms_parse_ours",
    "handshake_parse_ratio_vs_vllm_hetero": "handshake_parse_ratio",
    "plan_floor_checked_ratio_vs_vllm": "plan_floor_checked_ratio",
}
FRAGMENTED_KEYS = {  # P4->D2, fragmented
    "descs_ratio_vs_vllm_fragmented": "descs_ratio",
    "descriptor_mode_fragmented": "descriptor_mode_ours",
    "descs_posted_ours_fragmented": "descs_posted_ours",
    "descs_posted_vllm_fragmented": "descs_posted_vllm",
    "plan_time_ratio_vs_vllm_fragmented": "plan_time_ratio",
}
TRANSFER_KEYS = {  # per real transfer (P1->D1, and P4->D2 with the suffix _hetero)
    "nixl_vs_memcpy": "ours_vs_memcpy",
    "transfer_mode": "descriptor_mode",
    "nixl_direct_vs_memcpy": "ours_direct_vs_memcpy",
    "nixl_staged_vs_memcpy": "ours_staged_vs_memcpy",
    "nixl_gbps": "ours_gbps",
    "memcpy_gbps": "memcpy_gbps",
    "vllm_style_nixl_vs_memcpy": "vllm_vs_memcpy",
    "nixl_ceiling_vs_memcpy": "ceiling_vs_memcpy",
    "two_pass_vs_ceiling": "two_pass_vs_ceiling",
    "direct_extra_us_per_descriptor": "direct_extra_us_per_descriptor",
    "direct_us_per_descriptor_for_90pct": "direct_us_per_descriptor_for_90pct",
    "nixl_vs_ceiling": "ours_vs_ceiling",
    "nixl_direct_vs_ceiling": "ours_direct_vs_ceiling",
    "nixl_staged_vs_ceiling": "ours_staged_vs_ceiling",
    "vllm_style_nixl_vs_ceiling": "vllm_vs_ceiling",
    "transfer_bytes": "bytes",
}
EQUAL_TP_KEYS = {  # P1->D1, contiguous
    "plan_time_ratio_vs_vllm_equal_tp": "plan_time_ratio",
    "plan_floor_ratio_vs_vllm_equal_tp": "plan_floor_ratio",
    "plan_floor_checked_ratio_vs_vllm_equal_tp": "plan_floor_checked_ratio",
    "handshake_ratio_vs_vllm_equal_tp": "handshake_ratio",
    "handshake_first_ratio_vs_vllm_equal_tp": "handshake_first_ratio",
    "handshake_other_blocks_ratio_vs_vllm_equal_tp": "handshake_other_blocks_ratio",
    "descs_ratio_vs_vllm_equal_tp": "descs_ratio",
}


def summary(rows: Sequence[dict[str, Any]], transfers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline keys the issue asks for, with the absolute figures they came from."""
    out: dict[str, Any] = {}
    base = dict(shape=LLAMA_8B.name, tokens=8192)
    hetero = _find(rows, **base, p_tp=4, d_tp=2, pattern="contiguous")
    frag = _find(rows, **base, p_tp=4, d_tp=2, pattern="fragmented")
    equal = _find(rows, **base, p_tp=1, d_tp=1, pattern="contiguous")
    for row, keys in ((hetero, HETERO_KEYS), (frag, FRAGMENTED_KEYS), (equal, EQUAL_TP_KEYS)):
        if row:
            out.update({headline: row[key] for headline, key in keys.items()})
    if hetero:
        out["descs_ratio_vs_vllm_hetero_staged"] = hetero["descs_posted_ours_staged"] / hetero["descs_posted_vllm"]
    for key, label in (("", "P1->D1"), ("_hetero", "P4->D2")):
        t = next((x for x in transfers if label in x["label"]), None)
        if t:
            out.update({f"{headline}{key}": t[field] for headline, field in TRANSFER_KEYS.items()})
            out[f"transfer_layers{key}"] = f"{t['layers']} of {t['model_layers']}"
            out[f"merge_count_checked{key}"] = (
                t["descs_posted_ours_nixl"] == t["descs_posted_ours_computed"]
                and t["descs_posted_vllm_nixl"] == t["descs_posted_vllm_computed"]
                and t["descs_posted_staged_nixl"] == t["descs_posted_staged_computed"]
            )
    return out


def headline_ok(out: dict[str, Any]) -> list[str]:
    """Problems with the headline keys (missing, non-finite, not positive): empty when sane."""
    keys = ["plan_time_ratio_vs_vllm", "descs_ratio_vs_vllm_hetero", "descs_ratio_vs_vllm_fragmented"]
    if out.get("transfers"):
        keys += ["nixl_vs_memcpy", "nixl_vs_memcpy_hetero"]
    bad = []
    for k in keys:
        v = out.get(k)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad.append(f"{k}={v!r}")
    return bad
