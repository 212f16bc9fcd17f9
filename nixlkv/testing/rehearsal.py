"""A P/D rehearsal: fabricated caches, a real plan, real NIXL READs, and the byte oracle.

One NIXL agent per rank (UCX over DRAM), all in this process. Outcomes: ``byte-exact``,
``mismatch`` (first wrong byte named), ``rejected`` (planning refused, as the scenario expected),
or ``failed`` (an unexpected error, or an expected rejection that did not happen).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..core import Dispatcher, NixlkvError, ResolvedRequest, Topology, TransferPlan
from ..core.descriptor_mode import posted_direct
from ..transport.reader import Reader, memory_tensors
from ..transport.nixl_rank import NixlRank, TransferError, parse_notification
from ..vllm.kv_views import layer_caches, registered_memory
from . import oracle
from .engines import FabricatedRank, build_rank
from .scenario import Scenario

# A small staging buffer, so that staged rehearsals run in several rounds (the connector's is
# larger); never less than two rounds of the largest prefill page (Mamba states are MiBs).
REHEARSAL_STAGING_BYTES = 4 << 20



def build_failure(exc: BaseException) -> str:
    """Why building a scenario's caches failed: memory that could not be allocated is said as such."""
    if isinstance(exc, MemoryError) or "can't allocate memory" in str(exc):
        return (f"could not allocate this scenario's caches ({type(exc).__name__}: {str(exc)[:200]}): "
                "lower num_blocks, the layer count or the head sizes")
    return f"vLLM could not build this scenario's caches: {type(exc).__name__}: {exc}"

def rehearsal_staging_bytes(engines: Engines) -> int:
    largest = max((r.page.nbytes for p in engines.plans for g in p.remote.values() for r in g.regions), default=0)
    return max(REHEARSAL_STAGING_BYTES, 4 * largest)


# Every rank's NIXL agent lives in this one process on DRAM: NIXL's busy-polling progress threads
# (one core each) would take the cores the copies need (see nixlkv.transport.agents), so they pause 1 ms.
PROGRESS_DELAY_US = 1000
REQUEST_ID = "rehearsal-req-0"  # the request's id on the prefill (remote) engine
K = TypeVar("K")  # how a caller names its prefill agents
NOTIFICATION_TIMEOUT = 10.0  # seconds every prefill rank may take to hear from all its readers
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
    descriptor_mode: str = "direct"  # what was asked for: auto | direct | staged
    modes: list[str] = field(default_factory=list)  # per decode rank: the mode its request ran in
    posted_descriptors: int = 0  # what NIXL posted after its merge (telemetry), every rank and round
    computed_posted: int = 0  # the same count as nixlkv computes it (core.staging), to check against NIXL's
    notifications: dict[str, int] = field(default_factory=dict)  # per P rank: messages for REQUEST_ID
    # per P rank, every nixlkv notification received, as (request id, consumers it announces)
    notification_log: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
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
    layers = layer_caches(
        rank.kv_cache_config, rank.kv_caches, lambda name: rank.total_heads[name], lambda name: rank.hints.get(name, {})
    )
    return dispatcher.local_geometry(
        rank.engine_id, Topology(rank.side.tp, rank.tp_rank), layers, registered_memory(rank.kv_caches)
    )


def choose_blocks(
    rank: FabricatedRank,
    num_tokens: int,
    skip: int,
    rng: np.random.Generator,
    peer: FabricatedRank | None = None,
    state_blocks: int = 1,
) -> list[oracle.GroupBlocks]:
    """A request's block IDs per group, as the engine's scheduler would hand them over.

    Random, non-contiguous and distinct across groups (groups alias one memory pool), never the
    null block 0 except where the scheduler itself put it: on prefill, window blocks already
    freed below the window, and blocks below the tokens the kind's manager skips
    (``KindDef.skipped_tokens``). ``skip`` leading blocks of each group are left out (a prefix the
    decode engine already holds; on decode, at least the blocks its own manager skips). Without
    ``peer`` this is the prefill side; with it, the decode side, whose expected content depends
    on the prefill engine's blocks. A state group
    lists ``state_blocks`` entries: the running state, then the spec's speculative scratch blocks;
    before it, null placeholders alternate with superseded states (random bytes on prefill).
    """
    sizes = [rank.group_block_size(g) for g in range(rank.num_groups)]
    fixed = [rank.fixed_blocks(g) for g in range(rank.num_groups)]
    need = [
        state_blocks if rank.is_state_group(g) else fixed[g] or -(-num_tokens // bs) for g, bs in enumerate(sizes)
    ]
    pool = rng.permutation(np.arange(1, rank.kv_cache_config.num_blocks))
    if sum(need) > pool.size:
        raise NixlkvError(f"{rank.engine_id}: {sum(need)} blocks needed, only {pool.size} in the pool; raise num_blocks")
    out, at = [], 0
    for group, (n, bs) in enumerate(zip(need, sizes)):
        ids = pool[at : at + n].astype(np.int64)
        at += n
        if rank.is_state_group(group):
            # One running state per request: never trimmed by a prefix hit, never token-paired.
            scratch = min(rank.state_scratch_blocks(group), n - 1)
            ids[: n - 1 - scratch : 2] = 0
            out.append(oracle.GroupBlocks(ids=ids, first_position=0, holds=np.ones((n, 1), dtype=bool)))
            continue
        if fixed[group] is not None:
            # The request's own blocks for its whole life (a ring): all held, all delivered, no prefix.
            out.append(oracle.GroupBlocks(ids=ids, first_position=0, holds=np.ones((n, bs), dtype=bool)))
            continue
        window = oracle.window_of(rank, group)
        # Blocks wholly below the tokens the group's manager freed (chunked local: left of the
        # current chunk) are null on prefill and not in the decode engine's list at all.
        skipped = oracle.skipped_tokens(rank, group, num_tokens) // bs
        if peer is None:
            ids[: max(oracle.prefill_null_positions(num_tokens, window, bs), skipped)] = 0
            holds = np.repeat((ids != 0)[:, None], bs, axis=1)
        else:
            if peer.group_layers(group) != rank.group_layers(group):
                raise NixlkvError(f"prefill and decode group their layers differently (group {group})")
            # What the transfer fills follows each layer's own window (what the dispatcher sees,
            # inside a wrapped group too) and what prefill's block manager nulled (its group's window).
            peer_bs, nulled = peer.group_block_size(group), oracle.window_of(peer, group)
            prefill_skipped = oracle.skipped_tokens(peer, group, num_tokens)
            holds = oracle.decode_receives(np.arange(n), num_tokens, window, bs, peer_bs, nulled_window=nulled,
                                           prefill_skipped=prefill_skipped)
        first = min(skip if peer is None else max(skip, skipped), n)
        layer_holds = {}
        if peer is not None:
            for name in rank.group_layers(group):
                own = oracle.layer_window(rank, name)
                if own != window:  # a wrapped group's layer with a window of its own
                    mine = oracle.decode_receives(np.arange(n), num_tokens, own, bs, peer_bs, nulled_window=nulled,
                                                  prefill_skipped=prefill_skipped)
                    layer_holds[name] = mine[first:]
        out.append(oracle.GroupBlocks(ids=ids[first:], first_position=first, holds=holds[first:],
                                      layer_holds=layer_holds))
    return out


def rehearse(
    scenario: Scenario,
    dispatcher: Dispatcher | None = None,
    fault: Fault | None = None,
    descriptor_mode: str = "auto",
    staging_bytes: int | None = None,
) -> RehearsalResult:
    """Run one scenario end to end. ``fault`` (tests only) may corrupt each resolved request;
    ``descriptor_mode`` is how the READs are posted (see :mod:`nixlkv.transport.reader`)."""
    dispatcher = dispatcher or Dispatcher.from_plugins()
    result = RehearsalResult(scenario.name, "failed", descriptor_mode=descriptor_mode)
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
        result.message = build_failure(exc)
        return result
    result.build_seconds = time.perf_counter() - t0
    result.plans = [p.to_dict() for p in engines.plans]
    if scenario.expect_error is not None:
        result.message = f"expected planning to fail with {scenario.expect_error!r}, but it succeeded"
        return result
    try:
        _transfer_and_check(scenario, engines, result, fault, staging_bytes)
    except (NixlkvError, NotImplementedError) as exc:
        result.outcome, result.message = "failed", f"{type(exc).__name__}: {exc}"
    return result


def request_blocks(
    scenario: Scenario, engines: Engines
) -> tuple[list[oracle.GroupBlocks], list[oracle.GroupBlocks]]:
    """The scenario's request as (prefill, decode) block IDs per group: the same every call."""
    req = scenario.request
    rng = np.random.default_rng(req.seed)
    p_blocks = choose_blocks(engines.prefill[0], req.num_tokens, 0, rng, state_blocks=req.state_blocks)
    d_blocks = choose_blocks(
        engines.decode[0], req.num_tokens, req.cached_blocks, rng, peer=engines.prefill[0], state_blocks=req.state_blocks
    )
    return p_blocks, d_blocks


def transfer_and_check(
    scenario: Scenario,
    engines: Engines,
    fault: Fault | None = None,
    descriptor_mode: str = "auto",
    staging_bytes: int | None = None,
) -> RehearsalResult:
    """The NIXL half of :func:`rehearse` on engines already built (by :func:`build`)."""
    return transfer_and_check_modes(scenario, engines, (descriptor_mode,), fault, staging_bytes)[descriptor_mode]


def transfer_and_check_modes(
    scenario: Scenario,
    engines: Engines,
    modes: Sequence[str],
    fault: Fault | None = None,
    staging_bytes: int | None = None,
) -> dict[str, RehearsalResult]:
    """The NIXL half of :func:`rehearse`, once per descriptor mode on the same engines: prefill
    is filled and the expected decode bytes computed once (READs never write prefill memory);
    decode is reset to the sentinel before each mode, and every byte checked after it."""
    truth = _Truth(scenario, engines)
    out = {}
    for mode in modes:
        result = RehearsalResult(scenario.name, "failed", descriptor_mode=mode)
        result.plans = [p.to_dict() for p in engines.plans]
        try:
            _transfer_and_check(scenario, engines, result, fault, staging_bytes, truth)
        except (NixlkvError, NotImplementedError) as exc:
            result.outcome, result.message = "failed", f"{type(exc).__name__}: {exc}"
        out[mode] = result
    return out


class _Truth:
    """A request's block ids, prefill filled with them, and (computed on first use) what every
    decode rank must hold afterwards."""

    def __init__(self, scenario: Scenario, engines: Engines) -> None:
        self.p_blocks, self.d_blocks = request_blocks(scenario, engines)
        self.seed = scenario.request.seed
        for p in engines.prefill:
            oracle.fill_prefill(p, self.p_blocks, self.seed)
        self._expected: dict[int, Any] = {}

    def expected(self, d: FabricatedRank):
        if d.tp_rank not in self._expected:
            self._expected[d.tp_rank] = oracle.expected_decode(d, self.d_blocks, self.seed)
        return self._expected[d.tp_rank]


def _transfer_and_check(
    scenario: Scenario,
    engines: Engines,
    result: RehearsalResult,
    fault: Fault | None,
    staging_bytes: int | None,
    truth: _Truth | None = None,
) -> None:
    req = scenario.request
    truth = truth or _Truth(scenario, engines)
    staging_bytes = staging_bytes or rehearsal_staging_bytes(engines)
    p_blocks, d_blocks = truth.p_blocks, truth.d_blocks
    for d in engines.decode:
        oracle.fill_decode(d)

    p_nixl = {
        p.tp_rank: NixlRank(f"P{p.tp_rank}", registered_memory(p.kv_caches), progress_delay_us=PROGRESS_DELAY_US)
        for p in engines.prefill
    }
    d_nixl = {
        d.tp_rank: NixlRank(
            f"D{d.tp_rank}", registered_memory(d.kv_caches), capture_telemetry=True, progress_delay_us=PROGRESS_DELAY_US
        )
        for d in engines.decode
    }
    readers: list[Reader] = []
    try:
        flights = []
        for d, plan in zip(engines.decode, engines.plans):
            agent = d_nixl[d.tp_rank]
            reader = Reader(agent, result.descriptor_mode, staging_bytes, memory_tensors(d.kv_caches))
            readers.append(reader)
            names = {rank: agent.add_remote(p_nixl[rank].metadata()) for rank in plan.covered}
            prepared = reader.prepare(plan, names)
            resolved = plan.resolve(oracle.id_lists(d_blocks), oracle.id_lists(p_blocks), req.num_tokens)
            if fault is not None:
                resolved = fault(d.tp_rank, resolved)
            flight = reader.post(prepared, resolved, REQUEST_ID)
            result.modes.append(flight.mode)
            result.computed_posted += flight.request.posted if flight.mode == "staged" else posted_direct(plan, resolved)
            result.reads += len(resolved.reads)
            flights.append((reader, flight))
        t_start = min(f.posted_at for _, f in flights)
        for reader, flight in flights:
            reader.wait(flight)
            result.descriptors += flight.descriptors
            result.bytes_moved += flight.nbytes
            result.posted_descriptors += flight.posted_descriptors or 0
        result.transfer_seconds = time.perf_counter() - t_start
        consumers = engines.plans[0].consumers
        result.notification_log = {f"P{rank}": log for rank, log in collect_notifications(p_nixl, consumers).items()}
        result.notifications = {
            rank: sum(1 for rid, _ in log if rid == REQUEST_ID) for rank, log in result.notification_log.items()
        }
    except TransferError as exc:
        result.outcome, result.message = "failed", str(exc)
        return
    finally:
        for reader in readers:
            reader.close()
        for n in (*p_nixl.values(), *d_nixl.values()):
            n.close()

    wrong = _notification_errors(result.notification_log, consumers)
    mismatches = []
    for d in engines.decode:
        expected = truth.expected(d)
        result.bytes_checked += d.buffer.numel()
        m = oracle.compare(d, expected)
        if m is not None:
            mismatches.append(str(m))
    record_verdict(result, mismatches, wrong)


def record_verdict(result: Any, mismatches: Sequence[str], wrong: Sequence[str]) -> None:
    """A rehearsal's outcome and message: a wrong byte first, then wrong notifications, else
    byte-exact (``result`` has ``outcome``, ``message`` and ``bytes_checked``)."""
    if mismatches:
        result.outcome, result.message = "mismatch", "; ".join(mismatches)
    elif wrong:
        result.outcome, result.message = "failed", "; ".join(wrong)
    else:
        result.outcome, result.message = "byte-exact", f"{result.bytes_checked} decode bytes checked"


def _notification_errors(log: dict[str, list[tuple[str, int]]], consumers: int) -> list[str]:
    """Every prefill rank holds the request, so each must hear exactly ``consumers`` times, each time
    with the prefill-side request id and the consumer count: else it frees too early or never."""
    errors = []
    for rank, messages in log.items():
        if len(messages) != consumers:
            errors.append(f"{rank}: {len(messages)} notifications, expected {consumers}")
        for rid, announced in messages:
            if rid != REQUEST_ID:
                errors.append(f"{rank}: notification carries request id {rid!r}, expected the remote id {REQUEST_ID!r}")
            if announced != consumers:
                errors.append(f"{rank}: notification announces {announced} consumers, expected {consumers}")
    return errors


def collect_notifications(agents: Mapping[K, NixlRank], consumers: int) -> dict[K, list[tuple[str, int]]]:
    """Every nixlkv notification per prefill agent, until each has ``consumers`` of them (then a
    short grace period, so duplicates are seen too)."""
    log: dict[K, list[tuple[str, int]]] = {key: [] for key in agents}
    deadline = time.perf_counter() + NOTIFICATION_TIMEOUT
    grace_until = None
    while time.perf_counter() < deadline:
        for key, n in agents.items():
            for msgs in n.notifications().values():
                for msg in msgs:
                    parsed = parse_notification(msg)
                    if parsed is not None:
                        log[key].append(parsed)
        if all(len(m) >= consumers for m in log.values()):
            grace_until = grace_until or time.perf_counter() + 0.05
            if time.perf_counter() >= grace_until:
                break
        time.sleep(0.001)
    return log
