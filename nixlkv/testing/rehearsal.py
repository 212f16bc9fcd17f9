"""A P/D rehearsal: fabricated caches, a real plan, real NIXL READs, and the byte oracle.

One NIXL agent per rank (UCX over DRAM), all in this process. Outcomes: ``byte-exact``,
``mismatch`` (first wrong byte named), ``rejected`` (planning refused, as the scenario expected),
or ``failed`` (an unexpected error, or an expected rejection that did not happen).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..core import Dispatcher, NixlkvError, ResolvedRequest, Topology, TransferPlan
from ..transfer import NixlRank, TransferError, parse_notification
from ..vllm_layers import layer_caches, registered_memory
from . import oracle
from .engines import FabricatedRank, build_rank
from .scenario import Scenario

REQUEST_ID = "rehearsal-req-0"
Fault = Callable[[int, ResolvedRequest], ResolvedRequest]


@dataclass
class RehearsalResult:
    scenario: str
    outcome: str  # byte-exact | mismatch | rejected | failed
    message: str = ""
    bytes_checked: int = 0
    bytes_moved: int = 0
    descriptors: int = 0
    reads: int = 0
    transfer_seconds: float = 0.0
    build_seconds: float = 0.0
    notifications: dict[str, int] = field(default_factory=dict)
    plans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome in ("byte-exact", "rejected")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


@dataclass
class Engines:
    prefill: list[FabricatedRank]
    decode: list[FabricatedRank]
    plans: list[TransferPlan]


def build(scenario: Scenario, dispatcher: Dispatcher) -> Engines:
    """Fabricate every rank, describe each with the dispatcher, and plan every decode rank."""
    prefill = [build_rank(scenario, "prefill", r) for r in range(scenario.prefill.tp)]
    decode = [build_rank(scenario, "decode", r) for r in range(scenario.decode.tp)]
    p_geo = {r.tp_rank: geometry(r, dispatcher) for r in prefill}
    plans = [dispatcher.plan(geometry(d, dispatcher), p_geo) for d in decode]
    return Engines(prefill, decode, plans)


def geometry(rank: FabricatedRank, dispatcher: Dispatcher):
    layers = layer_caches(rank.kv_cache_config, rank.kv_caches, lambda name: rank.total_heads[name])
    return dispatcher.local_geometry(
        rank.engine_id, Topology(rank.side.tp, rank.tp_rank), layers, registered_memory(rank.kv_caches)
    )


def choose_blocks(
    rank: FabricatedRank, num_tokens: int, skip: int, rng: np.random.Generator, role: str
) -> list[oracle.GroupBlocks]:
    """A request's block IDs per group, as the engine's scheduler would hand them over.

    Random, non-contiguous and distinct across groups (groups alias one memory pool), never the
    null block 0 except where the scheduler itself put it: on prefill, window blocks already
    freed below the window. ``skip`` leading blocks of each group are left out (a prefix the
    decode engine already holds).
    """
    sizes = [rank.group_block_size(g) for g in range(rank.num_groups)]
    need = [-(-num_tokens // bs) for bs in sizes]
    pool = rng.permutation(np.arange(1, rank.kv_cache_config.num_blocks))
    if sum(need) > pool.size:
        raise NixlkvError(f"{rank.engine_id}: {sum(need)} blocks needed, only {pool.size} in the pool; raise num_blocks")
    out, at = [], 0
    for group, (n, bs) in enumerate(zip(need, sizes)):
        ids = pool[at : at + n].astype(np.int64)
        at += n
        window = oracle.window_of(rank, group)
        positions = np.arange(n)
        if role == "prefill":
            ids[: oracle.prefill_null_positions(num_tokens, window, bs)] = 0
            holds = ids != 0
        else:
            holds = oracle.decode_needs(positions, num_tokens, window, bs)
        first = min(skip, n)
        out.append(oracle.GroupBlocks(ids=ids[first:], first_position=first, holds=holds[first:]))
    return out


def rehearse(scenario: Scenario, dispatcher: Dispatcher | None = None, fault: Fault | None = None) -> RehearsalResult:
    """Run one scenario end to end. ``fault`` (tests only) may corrupt each resolved request."""
    dispatcher = dispatcher or Dispatcher.from_plugins()
    result = RehearsalResult(scenario.name, "failed")
    t0 = time.perf_counter()
    try:
        engines = build(scenario, dispatcher)
    except (NixlkvError, NotImplementedError) as exc:
        if scenario.expect_error is not None and scenario.expect_error in str(exc):
            result.outcome, result.message = "rejected", f"{type(exc).__name__}: {exc}"
        else:
            result.message = f"planning failed: {type(exc).__name__}: {exc}"
        return result
    except Exception as exc:  # vLLM's own planner refusing the model (ValueError, AssertionError...)
        result.message = f"vLLM could not build this scenario's caches: {type(exc).__name__}: {exc}"
        return result
    result.build_seconds = time.perf_counter() - t0
    result.plans = [p.to_dict() for p in engines.plans]
    if scenario.expect_error is not None:
        result.message = f"expected planning to fail with {scenario.expect_error!r}, but it succeeded"
        return result
    try:
        _transfer_and_check(scenario, engines, result, fault)
    except (NixlkvError, NotImplementedError) as exc:
        result.outcome, result.message = "failed", f"{type(exc).__name__}: {exc}"
    return result


def request_blocks(
    scenario: Scenario, engines: Engines
) -> tuple[list[oracle.GroupBlocks], list[oracle.GroupBlocks]]:
    """The scenario's request as (prefill, decode) block IDs per group: the same every call."""
    req = scenario.request
    rng = np.random.default_rng(req.seed)
    p_blocks = choose_blocks(engines.prefill[0], req.num_tokens, 0, rng, "prefill")
    d_blocks = choose_blocks(engines.decode[0], req.num_tokens, req.cached_blocks, rng, "decode")
    return p_blocks, d_blocks


def transfer_and_check(scenario: Scenario, engines: Engines, fault: Fault | None = None) -> RehearsalResult:
    """The NIXL half of :func:`rehearse` on engines already built (by :func:`build`)."""
    result = RehearsalResult(scenario.name, "failed")
    result.plans = [p.to_dict() for p in engines.plans]
    try:
        _transfer_and_check(scenario, engines, result, fault)
    except (NixlkvError, NotImplementedError) as exc:
        result.outcome, result.message = "failed", f"{type(exc).__name__}: {exc}"
    return result


def _transfer_and_check(scenario: Scenario, engines: Engines, result: RehearsalResult, fault: Fault | None) -> None:
    req = scenario.request
    p_blocks, d_blocks = request_blocks(scenario, engines)
    for p in engines.prefill:
        oracle.fill_prefill(p, p_blocks, req.seed)
    for d in engines.decode:
        oracle.fill_decode(d)

    p_nixl = {p.tp_rank: NixlRank(f"P{p.tp_rank}", registered_memory(p.kv_caches)) for p in engines.prefill}
    d_nixl = {d.tp_rank: NixlRank(f"D{d.tp_rank}", registered_memory(d.kv_caches)) for d in engines.decode}
    try:
        flights = []
        for d, plan in zip(engines.decode, engines.plans):
            agent = d_nixl[d.tp_rank]
            names = {rank: agent.add_remote(p_nixl[rank].metadata()) for rank in plan.covered}
            prepared = agent.prepare(plan, names)
            resolved = plan.resolve([g.ids for g in d_blocks], [g.ids for g in p_blocks])
            if fault is not None:
                resolved = fault(d.tp_rank, resolved)
            result.descriptors += resolved.num_descriptors
            result.reads += len(resolved.reads)
            flights.append((agent, agent.post(prepared, resolved, REQUEST_ID)))
        t_start = min(f.posted_at for _, f in flights)
        for agent, flight in flights:
            agent.wait(flight)
            result.bytes_moved += flight.nbytes
        result.transfer_seconds = time.perf_counter() - t_start
        consumers = engines.plans[0].consumers
        result.notifications = _collect_notifications(p_nixl, consumers)
    except TransferError as exc:
        result.outcome, result.message = "failed", str(exc)
        return
    finally:
        for n in (*p_nixl.values(), *d_nixl.values()):
            n.close()

    wrong = [f"P rank {r}: {n} notifications, expected {consumers}" for r, n in result.notifications.items() if n != consumers]
    mismatches = []
    for d in engines.decode:
        expected = oracle.expected_decode(d, d_blocks, req.seed)
        result.bytes_checked += d.buffer.numel()
        m = oracle.compare(d, expected)
        if m is not None:
            mismatches.append(str(m))
    if mismatches:
        result.outcome, result.message = "mismatch", "; ".join(mismatches)
    elif wrong:
        result.outcome, result.message = "failed", "; ".join(wrong)
    else:
        result.outcome, result.message = "byte-exact", f"{result.bytes_checked} decode bytes checked"


def _collect_notifications(p_nixl: dict[int, NixlRank], consumers: int, timeout: float = 10.0) -> dict[str, int]:
    """Count nixlkv notifications for the request per prefill rank, until each has ``consumers``
    (then a short grace period, so duplicates are counted too)."""
    counts = {f"P{r}": 0 for r in p_nixl}
    deadline = time.perf_counter() + timeout
    grace_until = None
    while time.perf_counter() < deadline:
        for rank, n in p_nixl.items():
            for msgs in n.notifications().values():
                for msg in msgs:
                    parsed = parse_notification(msg)
                    if parsed is not None and parsed[0] == REQUEST_ID:
                        counts[f"P{rank}"] += 1
        if all(c >= consumers for c in counts.values()):
            grace_until = grace_until or time.perf_counter() + 0.05
            if time.perf_counter() >= grace_until:
                break
        time.sleep(0.001)
    return counts
