"""A P/D rehearsal with pipeline-parallel engines: every (stage, TP rank) its own caches and NIXL agent.

Each side runs ``pp`` stages of ``tp`` ranks. A stage's ranks hold the model layers vLLM gives
that stage (:func:`stage_layers`), with the KV groups of the whole model narrowed to them (one
scheduler, one block ID space for every stage), so every stage's caches are what its worker
allocates. Every decode rank plans with every prefill stage (:meth:`Dispatcher.plan_stages`),
READs each layer from the stage its plans name, and tells every prefill stage once; then every
decode byte is compared with the oracle and every prefill rank's notifications counted.

A negative control moves one layer to the wrong prefill stage (:class:`Misplaced`): that stage
claims it in its handshake while the stage that computed it does not, and its copy of the layer
holds bytes it never computed; the rehearsal must then report the mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core import Dispatcher, NixlkvError, RankGeometry
from ..core.stages import StagePlans
from ..core.topology import Stage, Topology
from ..transport.nixl_rank import NixlRank, TransferError, notification
from ..transport.reader import Reader, memory_tensors
from ..vllm.kv_views import layer_caches, registered_memory
from . import oracle
from .engines import FabricatedRank, build_rank, layer_name
from .rehearsal import (PROGRESS_DELAY_US, REHEARSAL_STAGING_BYTES, REQUEST_ID, choose_blocks, collect_notifications,
                        record_verdict)
from .scenario import Scenario


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The model layers (by index) of each of ``pp`` stages, as vLLM's workers split them."""
    from vllm.distributed.utils import get_pp_indices

    return [range(*get_pp_indices(num_layers, s, pp)) for s in range(pp)]


@dataclass(frozen=True)
class Misplaced:
    """Negative control: prefill stage ``claimed_by`` holds and claims layer ``layer`` (by index)
    with bytes it never computed; the stage vLLM gave it to does not claim it."""

    layer: int
    claimed_by: int


@dataclass
class PipelineResult:
    scenario: str
    prefill: str  # "PP x TP"
    decode: str
    outcome: str = "failed"  # byte-exact | mismatch | rejected | failed
    message: str = ""
    bytes_checked: int = 0
    bytes_moved: int = 0
    reads: int = 0
    notifications: dict[str, int] = field(default_factory=dict)  # per prefill agent: messages for REQUEST_ID
    sources: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # decode agent -> P stage -> layers

    @property
    def ok(self) -> bool:
        return self.outcome == "byte-exact"


@dataclass
class _StageRank:
    """One (stage, TP rank) of a fabricated engine: its caches, geometry and agent name."""

    stage: int
    rank: FabricatedRank
    geometry: RankGeometry

    @property
    def agent(self) -> str:
        return f"{self.rank.engine_id[0].upper()}{self.stage}.{self.rank.tp_rank}"


def _geometry(rank: FabricatedRank, stage: Stage, dispatcher: Dispatcher) -> RankGeometry:
    layers = layer_caches(
        rank.kv_cache_config, rank.kv_caches, lambda name: rank.total_heads[name], lambda name: rank.hints.get(name, {})
    )
    return dispatcher.local_geometry(rank.engine_id, Topology(rank.side.tp, rank.tp_rank), layers,
                                     registered_memory(rank.kv_caches), stage=stage)


def _build_side(scenario: Scenario, role: str, pp: int, dispatcher: Dispatcher,
                misplaced: Misplaced | None = None) -> list[_StageRank]:
    side = scenario.prefill if role == "prefill" else scenario.decode
    ranges = [list(r) for r in stage_layers(len(scenario.layer_kinds(role)), pp)]
    claimed = [set(r) for r in ranges]  # what each stage's handshake names
    if misplaced is not None:  # the owner keeps the layer's memory but does not claim it
        claimed = [c - {misplaced.layer} for c in claimed]
        claimed[misplaced.claimed_by].add(misplaced.layer)
        ranges[misplaced.claimed_by] = sorted({*ranges[misplaced.claimed_by], misplaced.layer})
    out = []
    for s, layers in enumerate(ranges):
        for t in range(side.tp):
            rank = build_rank(scenario, role, t, stage_layers=layers)
            geometry = _geometry(rank, Stage(pp, s), dispatcher).restricted([layer_name(i) for i in claimed[s]])
            out.append(_StageRank(s, rank, geometry))
    return out


def rehearse_pipeline(
    scenario: Scenario,
    prefill_pp: int,
    decode_pp: int,
    dispatcher: Dispatcher | None = None,
    misplaced: Misplaced | None = None,
    descriptor_mode: str = "auto",
) -> PipelineResult:
    """Build both engines at their pipeline sizes (TP sizes from the scenario), plan, READ over
    real NIXL, and check every decode byte and every prefill rank's notification count."""
    dispatcher = dispatcher or Dispatcher.from_plugins()
    result = PipelineResult(scenario.name, f"PP{prefill_pp}xTP{scenario.prefill.tp}",
                            f"PP{decode_pp}xTP{scenario.decode.tp}")
    req = scenario.request
    # Block IDs are the scheduler's, one space for every stage: chosen on whole-model ranks.
    rng = np.random.default_rng(req.seed)
    ref_p, ref_d = build_rank(scenario, "prefill", 0), build_rank(scenario, "decode", 0)
    p_blocks = choose_blocks(ref_p, req.num_tokens, 0, rng, state_blocks=req.state_blocks)
    d_blocks = choose_blocks(ref_d, req.num_tokens, req.cached_blocks, rng, peer=ref_p, state_blocks=req.state_blocks)
    prefill = _build_side(scenario, "prefill", prefill_pp, dispatcher, misplaced)
    decode = _build_side(scenario, "decode", decode_pp, dispatcher)
    remote: dict[int, dict[int, RankGeometry]] = {}
    for p in prefill:
        remote.setdefault(p.stage, {})[p.rank.tp_rank] = p.geometry
    try:
        plans = [dispatcher.plan_stages(d.geometry, remote) for d in decode]
    except NixlkvError as exc:
        result.outcome, result.message = "rejected", f"{type(exc).__name__}: {exc}"
        return result
    for d, sp in zip(decode, plans):
        result.sources[d.agent] = {s: list(layers) for s, layers in sp.layers.items()}

    for p in prefill:
        oracle.fill_prefill(p.rank, p_blocks, req.seed)
    if misplaced is not None:  # the claiming stage never computed the layer: its copy holds other bytes
        for p in prefill:
            if p.stage == misplaced.claimed_by:
                _scramble(p, layer_name(misplaced.layer))
    for d in decode:
        oracle.fill_decode(d.rank)

    _transfer(prefill, decode, plans, result, descriptor_mode, (d_blocks, p_blocks, req.num_tokens))
    if result.message:
        return result
    mismatches = []
    for d in decode:
        expected = oracle.expected_decode(d.rank, d_blocks, req.seed)
        result.bytes_checked += d.rank.buffer.numel()
        m = oracle.compare(d.rank, expected)
        if m is not None:
            mismatches.append(f"{d.agent}: {m}")
    consumers = plans[0].consumers
    wrong = [f"{a}: {n} notifications, expected {consumers}" for a, n in result.notifications.items() if n != consumers]
    record_verdict(result, mismatches, wrong)
    return result


def _scramble(rank: _StageRank, layer: str) -> None:
    """Invert every byte of ``layer``'s pages on ``rank`` (every block of each of its regions):
    what a stage that never computed the layer holds there is anything but its KV."""
    buf = rank.rank.buffer.numpy().view(np.uint8)
    origin = rank.rank.buffer.data_ptr()
    for region in rank.geometry.regions:
        if region.name.split(":", 1)[0] != layer:
            continue
        for b in range(region.num_blocks):
            at = region.base - origin + b * region.block_stride
            buf[at : at + region.page.nbytes] ^= 0xFF


def _transfer(prefill: Sequence[_StageRank], decode: Sequence[_StageRank], plans: Sequence[StagePlans],
              result: PipelineResult, descriptor_mode: str,
              request: tuple[Sequence[oracle.GroupBlocks], Sequence[oracle.GroupBlocks], int]) -> None:
    """Every decode rank's READs from every stage it reads, and a notification to every stage
    it does not; then every prefill agent's notifications for the request, counted."""
    p_nixl = {p.agent: NixlRank(p.agent, registered_memory(p.rank.kv_caches), progress_delay_us=PROGRESS_DELAY_US)
              for p in prefill}
    by_place = {(p.stage, p.rank.tp_rank): p.agent for p in prefill}
    d_nixl = {d.agent: NixlRank(d.agent, registered_memory(d.rank.kv_caches), progress_delay_us=PROGRESS_DELAY_US)
              for d in decode}
    readers: list[Reader] = []
    try:
        flights = []
        for d, sp in zip(decode, plans):
            agent = d_nixl[d.agent]
            reader = Reader(agent, descriptor_mode, REHEARSAL_STAGING_BYTES, memory_tensors(d.rank.kv_caches))
            readers.append(reader)
            d_blocks, p_blocks, num_tokens = request
            resolved = sp.resolve(oracle.id_lists(d_blocks), oracle.id_lists(p_blocks), num_tokens)
            for stage in sp.stages:
                names = {rank: agent.add_remote(p_nixl[by_place[(stage, rank)]].metadata()) for rank in sp.covered}
                plan = sp.plans.get(stage)
                if plan is None:
                    for rank in sp.covered:
                        agent.notify(names[rank], notification(REQUEST_ID, sp.consumers))
                    continue
                prepared = reader.prepare(plan, names)
                flight = reader.post(prepared, resolved[stage], REQUEST_ID)
                result.reads += len(resolved[stage].reads)
                flights.append((reader, flight))
        for reader, flight in flights:
            reader.wait(flight)
            result.bytes_moved += flight.nbytes
        result.notifications = _count_notifications(p_nixl, plans[0].consumers)
    except TransferError as exc:
        result.outcome, result.message = "failed", str(exc)
    finally:
        for reader in readers:
            reader.close()
        for n in (*p_nixl.values(), *d_nixl.values()):
            n.close()


def _count_notifications(p_nixl: Mapping[str, NixlRank], consumers: int) -> dict[str, int]:
    """Per prefill agent, the notifications of the request that name ``consumers`` (every one,
    duplicates included: :func:`~nixlkv.testing.rehearsal.collect_notifications`)."""
    log = collect_notifications(p_nixl, consumers)
    return {agent: sum(1 for parsed in msgs if parsed == (REQUEST_ID, consumers)) for agent, msgs in log.items()}
