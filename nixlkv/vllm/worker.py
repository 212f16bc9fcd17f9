"""Worker side: register the KV caches, handshake with remote engines, post READs, report outcomes.

One ``NixlkvWorker`` per TP rank. Decode side: a request's remote engine is handshaken once (on a
background thread, bounded by ``handshake_timeout_s``), the dispatcher builds one TransferPlan for
it, and every request bound to that engine resolves its block ids through the plan and posts its
READs. Prefill side: the worker counts the consumers' notifications for each request it was told
to hold and reports it as sent (its blocks free) once all arrived or its lease expired.

Failures stay local: a handshake that fails fails only the requests bound to that remote; a READ
that errors or times out fails its request and reports its blocks as invalid.

Liveness (``liveness``): D sends the heartbeats the scheduler asks for to the P ranks it reads
from, and never reads a request P may no longer hold (lease possibly expired) or that a previous
incarnation of P prefilled (generation changed: the remote is handshaken again). P extends a hold
by its lease on each heartbeat naming it, on its own clock, and acknowledges it to the sender. D
counts a hold extended only by an acknowledged heartbeat, by every P rank it tells (every stage),
from the heartbeat's send on D's clock; a READ posted after, or ending after, the end of the hold
D can prove is not taken as loaded.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import Dispatcher, IdScratch, NixlkvError, Stage, StagePlans, Topology, TransferPlan
from ..transport.reader import Reader, ReaderPlan, StagedFlight, memory_tensors
from ..transport.nixl_rank import InFlight, NixlRank, TransferError, notification, parse_notification
from .kv_views import layer_caches, memory_device, registered_memory
from .capture import engine_capture, write_capture
from . import damage
from .kvdump import DumpOrder, dump_request, write_failure
from . import handshake
from .config import ConfigError, ConnectorConfig
from .liveness import (
    ACKED_HEARTBEAT_PREFIX, AckedHeartbeat, acked_heartbeat_messages, encode_ack, encode_acked_heartbeat,
    engine_generation, heartbeat_messages, is_ack, is_heartbeat, parse_ack, parse_acked_heartbeat, parse_heartbeat,
)
from . import push
from .metadata import LEASE_SAFETY, LeaseView, NixlkvMetadata, NixlkvStats, RecvRequest, RemoteKey

# A LeaseView read on this worker's clock: (lease_s, held at least until).
Held = tuple[float, float]
# Requests whose notifications came before this worker was handed them (D read before P's next
# step), remembered until lease_s passes. Bounded: a peer sending distinct unknown ids cannot grow
# it without end; past the bound the oldest is forgotten (its request then frees by its lease).
MAX_EARLY_REQUESTS = 4096


def remember_latest(memory: dict, key: Any, value: Any, limit: int = MAX_EARLY_REQUESTS) -> None:
    """Note ``key`` in an insertion-ordered ``memory`` that keeps only its latest ``limit`` keys."""
    memory[key] = value
    if len(memory) > limit:
        del memory[next(iter(memory))]
# P: decode agents loaded to acknowledge their heartbeats; one not heard from for two leases is
# forgotten (a decode engine that restarted has a new agent), the oldest beyond this bound too.
MAX_ACK_PEERS = 1024

logger = logging.getLogger("nixlkv.connector")


@dataclass
class HandshakeInfo:
    """What one rank advertises (KVConnectorHandshakeMetadata payload; plain, picklable)."""

    tp_rank: int
    agent_metadata: bytes
    geometry: Any  # RankGeometry
    pp_rank: int = 0


@dataclass
class _Remote:
    key: RemoteKey
    future: concurrent.futures.Future | None = None
    prepared: ReaderPlan | None = None
    agents: dict[int, str] = field(default_factory=dict)  # by global rank (stage-major): every agent told
    # with pipeline stages on either side: the plans per remote stage, each stage's prepared lists
    # (stages read from) and its covered ranks' agents (every stage, to tell those read nothing)
    stages: StagePlans | None = None
    stage_prepared: dict[int, ReaderPlan] = field(default_factory=dict)
    stage_agents: dict[int, dict[int, str]] = field(default_factory=dict)
    generation: str | None = None
    acks: bool = False  # its workers acknowledge heartbeats (handshake): holds are proven, not assumed
    pending_heartbeats: dict[str, Held | None] = field(default_factory=dict)  # sent once handshaken
    # push mode: this handshake's plan numbers (one per remote stage read; each prefill rank prepares
    # its plan once), and the (stage, remote rank) pairs said hello to
    push_plans: dict[int, int] = field(default_factory=dict)
    push_hello: set[tuple[int, int]] = field(default_factory=set)
    nixl_seconds: float = 0.0  # adding its agents and preparing its lists, on the handshake thread
    prepare_seconds: float = 0.0  # of which preparing the lists


@dataclass
class _Handshaken:
    """A remote ready to read from, made on the handshake thread."""

    engine: handshake.RemoteEngine
    plan: TransferPlan  # with pipeline stages: the first stage's read (what the log line names)
    agents: dict[int, str]  # remote global rank -> NIXL agent name
    prepared: ReaderPlan
    nixl_seconds: float  # adding the agents and preparing the lists (an engine step's stall before)
    prepare_seconds: float  # of which preparing the lists
    stages: StagePlans | None = None
    stage_prepared: dict[int, ReaderPlan] = field(default_factory=dict)
    stage_agents: dict[int, dict[int, str]] = field(default_factory=dict)


@dataclass
class _StageFlights:
    """One request's READs from a pipeline-parallel remote: a flight per stage read (each its
    own READs in the reader), done when all are; what the worker reads of a flight, summed."""

    flights: tuple[InFlight | StagedFlight, ...]

    @property
    def posted_at(self) -> float:
        return min((f.posted_at for f in self.flights), default=time.perf_counter())

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.flights)

    @property
    def descriptors(self) -> int:
        return sum(f.descriptors for f in self.flights)

    @property
    def post_seconds(self) -> float:
        return sum(f.post_seconds for f in self.flights)

    @property
    def mode(self) -> str:
        return "staged" if any(f.mode == "staged" for f in self.flights) else "direct"


@dataclass
class _Flight:
    request: RecvRequest
    owner: _Remote  # the handshake whose lists the READs use
    flight: InFlight | StagedFlight | _StageFlights


@dataclass(frozen=True)
class _SentBeat:
    """An acknowledged heartbeat D sent, until its acknowledgements are of no more use."""

    key: RemoteKey
    sent_at: float  # this worker's monotonic clock, read before sending: P extended after it
    leases: Mapping[str, float]  # P request id -> its lease, for the ids whose hold D judges
    agents: frozenset[str]  # the P agents it went to: only their acknowledgements count


@dataclass(frozen=True)
class _ProbeResult:
    """D, push mode: what asking a silent prefill engine's side channel found."""

    gone: str | None  # why nothing more can be written, or None while something may be
    answers: bool  # the same incarnation answered: it is alive and reachable again
    released: frozenset[str] = frozenset()  # prefill request ids it no longer holds: never written now


@dataclass
class _Hold:
    deadline: float
    lease: float
    count: int = 0
    consumers: int | None = None


def lapsed_hold_reason(lease_s: float | None) -> str:
    """Why a load is not read when the prefill engine's hold may have ended, and the fix: what D's
    log says of the request (the client sees vLLM's "internal error" only; vLLM gives a connector no
    way to tell it why)."""
    lease = f"lease_s={lease_s:g} s" if lease_s is not None else "its lease_s"
    return (
        f"the prefill engine's hold on the blocks ({lease}) may have ended before they could be read: queued "
        "here longer than its lease with no heartbeat in time, or reached this engine after the end of the hold "
        "the remote published (a decode leg delayed on its way, e.g. in a router's queue, or the two hosts' clocks "
        "apart by more than a tenth of the lease); not reading them. If decode legs may reach this engine later "
        "than that after the prefill engine answered, raise lease_s in the prefill engine's "
        'kv_connector_extra_config (docs/configuration.md, "The lease"); if the clocks disagree, synchronise them'
    )


def lapsed_read_reason(lease_s: float | None) -> str:
    """Why a load whose READs completed is not taken as loaded, and the fix (D's log for the request)."""
    lease = f"lease_s={lease_s:g} s" if lease_s is not None else "its lease_s"
    return (
        f"its READs ended after the last moment this engine can prove the prefill engine still held the blocks "
        f"({lease} from the last heartbeat it acknowledged): the link to it was down or stalled for longer, so it "
        "may have freed and reused them and what was read may be another request's KV; not taking it as loaded. "
        "If the link to the prefill engine may be down longer than lease_s less transfer_timeout_s, raise lease_s "
        "in the prefill engine's kv_connector_extra_config (docs/configuration.md, \"The lease\")"
    )


class NixlkvWorker:
    def __init__(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        kv_cache_config: Any,
        config: ConnectorConfig,
        compat: str,
        total_kv_heads: Callable[[str], int] | int,
        dispatcher: Dispatcher | None = None,
        model_hints: Callable[[str], Mapping[str, Any]] | None = None,
        model_facts: Mapping[str, Any] | None = None,
        compat_inputs: Mapping[str, Any] | None = None,
        stage: Stage | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.topology = Topology(tp_size, tp_rank)
        self.stage = stage or Stage()  # this rank's pipeline stage: its layers are the caches it registers
        self.kv_cache_config = kv_cache_config
        self.config = config
        self.compat = compat
        self.compat_inputs = compat_inputs  # what compat hashes: a refused peer is told what differs
        self.total_kv_heads = total_kv_heads
        self.model_hints = model_hints  # per-layer model facts beyond head counts (Mamba geometry)
        self.model_facts = dict(model_facts or {})  # model config facts a capture records
        self.dispatcher = dispatcher or config.dispatcher()
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.nixl: NixlRank | None = None
        self.reader: Reader | None = None  # posts READs in config.descriptor_mode
        self.geometry = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nixlkv-handshake")
        self._remotes: dict[RemoteKey, _Remote] = {}
        self._generations: dict[RemoteKey, str] = {}  # last handshaken incarnation of each remote
        self._retired: dict[RemoteKey, set[str]] = {}  # its previous incarnations
        # P request -> held at least until, from heartbeats sent to a remote that does not acknowledge
        self._held_until: dict[tuple[RemoteKey, str], float] = {}
        # P request -> P agent -> held at least until, proven by that agent's acknowledgement
        self._proven: dict[tuple[RemoteKey, str], dict[str, float]] = {}
        self._beats: dict[int, _SentBeat] = {}  # acknowledged heartbeats sent, by sequence number
        self._seq = 0
        self._unacked_warned: set[RemoteKey] = set()
        self._ack_peers: dict[str, float] = {}  # P: decode agent -> last heartbeat from it (monotonic)
        self._waiting: dict[str, RecvRequest] = {}  # bound to a remote whose handshake is pending
        self._flights: dict[str, _Flight] = {}
        self._draining: dict[str, tuple[_Flight, str]] = {}  # given up, but NIXL may still write: (flight, why)
        self._retiring: list[_Remote] = []  # dropped handshakes whose NIXL state is freed when idle
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._holds: dict[str, _Hold] = {}
        self._early: dict[str, tuple[int, int, float]] = {}  # notifications before the hold: count, consumers, seen
        self._done_send: set[str] = set()
        # push mode (nixlkv.vllm.push): D's requests whose orders are out, P's WRITEs and early orders
        self.push_mode = config.transfer_mode == "push"
        self._pushes: dict[str, tuple[RecvRequest, _Remote, push.PushWait]] = {}
        self._writer: push.PushWriter | None = None
        self._early_orders: dict[str, list[tuple[push.Order, float]]] = {}  # by D agent: (order, seen), not postable yet
        self._writing: dict[str, int] = {}  # P request -> its WRITEs in flight
        self._freed: dict[str, str] = {}  # P: holds ended here -> why (bounded), so a late order is refused at once
        self._abandoned: dict[tuple[str, str], None] = {}  # P: (D agent, D request) given up (bounded): never written
        self._probes: dict[RemoteKey, tuple[concurrent.futures.Future, float]] = {}  # D: is a silent P gone?
        self._push_plans = 0
        self.stats = NixlkvStats()
        self._ids = IdScratch()  # descriptor ids of the request being posted (NIXL copies them)
        # kept only to dump requests (dump_kv_dir) or damage them (the graded controls' test hook)
        self._kv_caches: Mapping[str, Any] | None = None
        self._capture: dict[str, Any] | None = None  # the capture record, where the two need it
        self._damage = damage.enabled()
        self._damaged: dict[str, dict[str, Any]] = {}  # request -> what its control damaged, until dumped
        self._dumps_on_load: dict[str, DumpOrder] = {}  # with dump_kv_dir: D's loads to dump once read

    # ------------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        memory = registered_memory(kv_caches)
        mem_type, device_id = memory_device(kv_caches)
        layers = layer_caches(self.kv_cache_config, kv_caches, self.total_kv_heads, self.model_hints)
        self.geometry = self.dispatcher.local_geometry(
            self.engine_id, self.topology, layers, memory, device_id=device_id, mem_type=mem_type, stage=self.stage
        )
        # before NIXL: a directory that cannot be written stops the engine with nothing to tear down
        dirs = {key: d for key in ("capture_dir", "dump_kv_dir") if (d := getattr(self.config, key))}
        record = engine_capture(self.engine_id, self.topology.tp_rank, self.topology.tp_size,
                                self.kv_cache_config, kv_caches, layers, self.model_facts) \
            if dirs or self._damage else None
        for key, directory in dirs.items():  # a dump is read through the capture record beside it
            try:
                logger.info("nixlkv captured the KV cache geometry to %s", write_capture(directory, record))
            except OSError as exc:
                raise ConfigError(f"{key} {directory!r} cannot be written ({exc}); give a writable directory") from exc
        self.nixl = NixlRank(
            f"{self.engine_id}-tp{self.topology.tp_rank}" + (f"-pp{self.stage.pp_rank}" if self.stage.pp_size > 1 else ""),
            memory,
            mem_type=mem_type,
            device_id=device_id,
            backends=self.config.backends,
            num_threads=self.config.nixl_num_threads,
            capture_telemetry=self.config.nixl_telemetry,
            progress_delay_us=self.config.nixl_progress_delay_us,
        )
        self.reader = Reader(
            self.nixl, self.config.descriptor_mode, self.config.staging_bytes, memory_tensors(kv_caches)
        )
        if self.push_mode:
            self._writer = push.PushWriter(self.nixl, memory)
        if self.config.dump_kv_dir or self._damage:
            self._kv_caches, self._capture = dict(kv_caches), record
        logger.info(
            "nixlkv registered engine=%s rank=%d/%d regions=%d memory_ranges=%d",
            self.engine_id, self.topology.tp_rank, self.topology.tp_size, len(self.geometry.regions), len(memory),
        )

    def handshake_info(self) -> HandshakeInfo:
        if self.nixl is None:
            raise NixlkvError("register_kv_caches must run before the handshake metadata is asked for")
        return HandshakeInfo(self.topology.tp_rank, self.nixl.metadata(), self.geometry, self.stage.pp_rank)

    # ------------------------------------------------------------------ per step
    def start_load_kv(self, meta: NixlkvMetadata | None) -> None:
        if meta is not None:
            now = time.monotonic()
            for rid, lease in meta.reqs_to_send.items():
                hold = _Hold(deadline=now + lease, lease=lease)
                early = self._early.pop(rid, None)
                if early is not None:  # D read before this worker heard of the request
                    hold.count, hold.consumers = early[0], early[1]
                    if hold.count >= hold.consumers:
                        self._freed_here(rid, "every decode rank was done with it before the hand-over")
                        logger.info("nixlkv notifications arrived before the hand-over req=%s: freed", rid)
                        continue
                self._freed.pop(rid, None)
                self._holds[rid] = hold
            for rid, order in meta.reqs_to_dump.items():
                if order.role == "decode":  # written when its READs complete (or noted failed)
                    self._dumps_on_load[rid] = order
                else:
                    self._dump(rid, order)
            for rid, req in meta.reqs_to_recv.items():
                req.received_at = now  # durations in the metadata are read on this clock from here
                self._start_recv(rid, req)
            self._send_heartbeats(meta.heartbeats, now)
        self._progress()

    def get_finished(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[str]]:
        self._progress()
        self._poll_flights()
        self._drain()
        self._reap()
        self._read_notifications()
        if self.push_mode:
            self._poll_writes()
            self._poll_pushes()
        self._expire_holds()
        sending, self._done_send = self._done_send, set()
        recving, self._done_recv = self._done_recv, set()
        return sending, recving

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recv = self._failed_recv, set()
        return failed

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_stats(self) -> NixlkvStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, NixlkvStats()
        return out

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._flights or self._draining or self._pushes)

    def _dump(self, rid: str, order: DumpOrder) -> None:
        """Write a request's blocks (dump_kv_dir), or why they are not worth judging (its load failed);
        a failure to write is noted for the judge and logged, never the request's."""
        if self._kv_caches is None or not self.config.dump_kv_dir:
            return
        where = (self.config.dump_kv_dir, order.prefill_request_id, order.role, self.engine_id, self.topology.tp_rank)
        try:
            extra: dict[str, Any] = {"local_hit": order.local_hit}
            if rid in self._damaged:
                extra["damage"] = self._damaged.pop(rid)
            dump_request(self.config.dump_kv_dir, role=order.role, engine_id=self.engine_id,
                         tp_rank=self.topology.tp_rank, tp_size=self.topology.tp_size,
                         prefill_request_id=order.prefill_request_id, request_id=rid, num_tokens=order.num_tokens,
                         block_ids=order.block_ids, kv_cache_config=self.kv_cache_config, kv_caches=self._kv_caches,
                         extra=extra)
        except (OSError, RuntimeError, ValueError, IndexError) as exc:
            logger.warning("nixlkv could not dump the KV blocks of req=%s to %s: %s", rid, self.config.dump_kv_dir, exc)
            try:
                write_failure(*where, rid, f"the dump could not be written: {type(exc).__name__}: {exc}")
            except OSError:
                pass  # the directory itself is gone: the judge finds no dump, which fails the load too

    def _apply_control(self, rid: str, req: RecvRequest) -> None:
        """The graded negative control a test asked for (nixlkv.vllm.damage), on decode rank 0 only."""
        if self._kv_caches is None or self._capture is None or self.topology.tp_rank != 0 or req.damage is None:
            return
        try:
            self._damaged[rid] = damage.damage_load(req.damage, self._capture, self._kv_caches,
                                                    req.local_block_ids, int(req.num_tokens or 0))
        except (RuntimeError, ValueError, IndexError, KeyError) as exc:
            self._damaged[rid] = {"kind": req.damage, "skipped": f"{type(exc).__name__}: {exc}"}
        logger.warning("nixlkv TEST CONTROL damaged the load of req=%s: %s", rid, self._damaged[rid])

    # ------------------------------------------------------------------ decode side
    def _remote(self, key: RemoteKey) -> _Remote:
        """The remote, its handshake started on the background thread if there is none yet."""
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._remotes[key] = _Remote(key)
            remote.future = self._executor.submit(self._handshake, *key)
            logger.info("nixlkv handshake start engine=%s remote=%s:%d", key[0], key[1], key[2])
        return remote

    def _start_recv(self, rid: str, req: RecvRequest) -> None:
        remote = self._remote(req.key)
        if remote.prepared is None:
            self._waiting[rid] = req
        elif req.remote_generation is None or req.remote_generation == remote.generation:
            self._post(rid, req, remote)
        elif req.remote_generation in self._retired.get(req.key, ()):
            self._fail(rid, req, f"prefilled by a previous incarnation of the remote (generation {req.remote_generation})")
        else:  # the remote restarted since we handshook it: handshake again before reading
            logger.warning(
                "nixlkv remote changed engine=%s remote=%s:%d: req=%s names generation %s, handshaken %s",
                req.key[0], req.key[1], req.key[2], rid, req.remote_generation, remote.generation,
            )
            self._invalidate(req.key)
            self._remote(req.key)
            self._waiting[rid] = req

    def _handshake(self, engine_id: str, host: str, port: int) -> _Handshaken:
        """Everything a new remote costs, on the handshake thread so that no engine step waits for
        it: fetch and check the reply, plan, add the remote agents, prepare the descriptor lists."""
        raw = handshake.fetch(host, port, self.config.handshake_timeout_s, self.config.max_handshake_bytes)
        engine = handshake.decode_reply(
            raw, self.compat, self.config.enforce_compat_hash, self.config.max_handshake_bytes, engine_id,
            ranks=lambda remote_tp: self.dispatcher.read_ranks(self.geometry, remote_tp),  # the others are only told
            expected_inputs=self.compat_inputs,
        )
        if engine.pp_size > 1 or self.stage.pp_size > 1:
            return self._handshake_stages(engine)
        plan = self.dispatcher.plan(self.geometry, engine.geometry)
        t0 = time.perf_counter()
        agents: dict[int, str] = {}
        try:
            for r in plan.covered:
                agents[r] = self.nixl.add_remote(engine.agent_metadata[r])
            t1 = time.perf_counter()
            prepared = self.reader.prepare(plan, agents)
        except Exception as exc:
            exc.added_agents = set(agents.values())  # forgotten on the engine thread (see _progress)
            raise
        t2 = time.perf_counter()
        return _Handshaken(engine, plan, agents, prepared, t2 - t0, t2 - t1)

    def _handshake_stages(self, engine: handshake.RemoteEngine) -> _Handshaken:
        """:meth:`_handshake` where either engine runs pipeline stages: a plan per remote stage
        this rank reads layers from (:meth:`Dispatcher.plan_stages`), each stage's covered ranks'
        agents added (every stage is told of every request), each plan's lists prepared."""
        stages = self.dispatcher.plan_stages(self.geometry, {s: engine.stage(s) for s in range(engine.pp_size)})
        t0 = time.perf_counter()
        agents: dict[int, str] = {}
        by_stage: dict[int, dict[int, str]] = {}
        prepared: dict[int, ReaderPlan] = {}
        try:
            for s in stages.stages:
                metadata = engine.stage_agents(s)
                mine = by_stage[s] = {}
                for r in stages.covered:
                    mine[r] = agents[handshake.global_rank(s, r, engine.tp_size)] = self.nixl.add_remote(metadata[r])
            t1 = time.perf_counter()
            for s, plan in stages.plans.items():
                prepared[s] = self.reader.prepare(plan, by_stage[s])
        except Exception as exc:
            exc.added_agents = set(agents.values())  # forgotten on the engine thread (see _progress)
            raise
        t2 = time.perf_counter()
        first = min(stages.plans)
        return _Handshaken(engine, stages.plans[first], agents, prepared[first], t2 - t0, t2 - t1,
                           stages, prepared, by_stage)

    def _live_agents(self) -> set[str]:
        return {name for r in self._remotes.values() for name in r.agents.values()}

    def _progress(self) -> None:
        """Take the handshakes that completed (on the handshake thread) and post the requests
        waiting on them: nothing here waits for NIXL or the network."""
        for key, remote in list(self._remotes.items()):
            if remote.prepared is not None or remote.future is None or not remote.future.done():
                continue
            try:
                done: _Handshaken = remote.future.result()
                engine, plan = done.engine, done.plan
                remote.agents, remote.prepared = done.agents, done.prepared
                remote.stages, remote.stage_prepared, remote.stage_agents = done.stages, done.stage_prepared, done.stage_agents
                remote.nixl_seconds, remote.prepare_seconds = done.nixl_seconds, done.prepare_seconds
                remote.generation = self._new_generation(key, engine_generation(engine.agent_metadata))
                remote.acks = engine.heartbeat_acks
            except Exception as exc:  # noqa: BLE001 - any failure fails this remote's requests only
                del self._remotes[key]
                in_use = self._live_agents() | {n for r in self._retiring for n in r.agents.values()}
                for name in set(getattr(exc, "added_agents", ())) - in_use:
                    self.nixl.remove_remote(name)
                bound = [rid for rid, req in self._waiting.items() if req.key == key]
                self.stats.count("failed_handshakes")
                logger.error(
                    "nixlkv handshake failed engine=%s remote=%s:%d error=%s: %s failing_requests=%s",
                    key[0], key[1], key[2], type(exc).__name__, exc, bound,
                )
                for rid in bound:
                    self._fail(rid, self._waiting.pop(rid), f"handshake failed: {exc}")
                continue
            self.stats.count(f"handshakes_{plan.origin}")
            if remote.stages is not None:
                logger.info("nixlkv pipeline stages engine=%s remote_pp=%d local_stage=%d/%d layers_from=%s told=%s",
                            key[0], engine.pp_size, self.stage.pp_rank, self.stage.pp_size,
                            {s: len(layers) for s, layers in remote.stages.layers.items()}, list(remote.stages.told))
            logger.info(
                "nixlkv handshake done engine=%s remote_tp=%d plan=%s covered=%s read_ranks=%s descriptors=%s "
                "nixl_ms=%.1f (lists %.1f) local_lists=%d",
                key[0], engine.tp_size, plan.origin, list(plan.covered), list(plan.read_ranks),
                plan.registered_descriptors(), 1e3 * remote.nixl_seconds, 1e3 * remote.prepare_seconds,
                self.nixl.local_lists,
            )
            for rid in [rid for rid, req in self._waiting.items() if req.key == key]:
                req = self._waiting.pop(rid)
                if req.remote_generation not in (None, remote.generation):  # checked after the request arrived
                    self._retired.setdefault(key, set()).add(req.remote_generation)
                    self._fail(rid, req, f"prefilled by a previous incarnation of the remote (generation "
                                         f"{req.remote_generation}, now {remote.generation})")
                else:
                    self._post(rid, req, remote)
            if remote.pending_heartbeats:
                self._beat(remote, remote.pending_heartbeats)
                remote.pending_heartbeats = {}

    def _new_generation(self, key: RemoteKey, generation: str) -> str:
        previous = self._generations.get(key)
        if previous is not None and previous != generation:
            self._retired.setdefault(key, set()).add(previous)
            logger.warning(
                "nixlkv remote restarted engine=%s remote=%s:%d generation %s -> %s: its earlier requests fail",
                key[0], key[1], key[2], previous, generation,
            )
        self._generations[key] = generation
        return generation

    def _send_heartbeats(self, heartbeats: Mapping[RemoteKey, Mapping[str, LeaseView | None]], now: float) -> None:
        """Name every request D still waits for to the P ranks this rank reads from (``now``: when
        the scheduler's views were received, on this worker's clock)."""
        if not heartbeats:
            return
        named = {(key, rid) for key, views in heartbeats.items() for rid in views}
        self._held_until = {k: v for k, v in self._held_until.items() if k in named}
        self._proven = {k: v for k, v in self._proven.items() if k in named}
        clock = time.monotonic()  # an acknowledgement past a heartbeat's lease proves nothing more
        self._beats = {seq: b for seq, b in self._beats.items() if clock < b.sent_at + max(b.leases.values(), default=0.0)}
        for key, leases in heartbeats.items():
            views = {rid: None if v is None else (v.lease_s, now + v.held_for_s) for rid, v in leases.items()}
            remote = self._remote(key)
            if remote.prepared is None:  # first heartbeat of a remote: sent once handshaken
                remote.pending_heartbeats.update(views)
            else:
                self._beat(remote, views)

    def _beat(self, remote: _Remote, views: Mapping[str, Held | None]) -> None:
        """Send one heartbeat to every P rank of ``remote``: an acknowledged one where it answers
        them (the hold counts from its acknowledgement, :meth:`_on_ack`), a plain one to an earlier
        nixlkv (the hold counts from the send, as before acknowledgements)."""
        now = time.monotonic()  # before sending: P extends at the arrival, after it
        beats: list[AckedHeartbeat] = []
        if remote.acks:
            beats = acked_heartbeat_messages(views, self._seq, self.nixl.connection_metadata())
            self._seq += len(beats)
            msgs = [encode_acked_heartbeat(b) for b in beats]
        else:
            msgs = heartbeat_messages(views)
        try:
            for msg in msgs:
                for agent in remote.agents.values():
                    self.nixl.notify(agent, msg)
        except Exception as exc:  # noqa: BLE001 - the remote is gone: handshake again before reading
            logger.warning("nixlkv heartbeat to engine=%s failed: %s: %s", remote.key[0], type(exc).__name__, exc)
            self._invalidate(remote.key)
            return
        self.stats.count("heartbeats_sent", len(views))
        if remote.acks:
            agents = frozenset(remote.agents.values())
            for b in beats:
                leases = {rid: views[rid][0] for rid in b.ids if views[rid] is not None}
                self._beats[b.seq] = _SentBeat(remote.key, now, leases, agents)
            return
        if remote.key not in self._unacked_warned:
            self._unacked_warned.add(remote.key)
            logger.warning(
                "nixlkv engine=%s remote=%s:%d does not acknowledge heartbeats (an earlier nixlkv): this engine counts "
                "a heartbeat as arrived when it leaves, so a link to it down for longer than its lease_s less "
                "transfer_timeout_s can go undetected (a READ of blocks it freed, taken as loaded). Upgrade the "
                "prefill engine's nixlkv", *remote.key,
            )
        for rid, view in views.items():
            # Still held when the heartbeat left: held a lease after it arrives.
            if view is not None and now < self._held(remote, rid, view[1]):
                self._held_until[(remote.key, rid)] = now + view[0]

    def _on_ack(self, agent: str, msg: bytes) -> None:
        """D: P's acknowledgement of an acknowledged heartbeat: the holds it names were extended
        at its arrival, so they last ``LEASE_SAFETY`` x the lease from its send (the margin for the
        two hosts' clock rates). Malformed acknowledgements, and those of a heartbeat never sent (to
        that agent), are ignored and counted; a late one (its heartbeat's lease over) is dropped."""
        try:
            ack = parse_ack(msg)
        except ValueError as exc:
            self.stats.count("ignored_acks")
            logger.warning("nixlkv ignored a malformed heartbeat acknowledgement from %s (%s): %r", agent, exc,
                           bytes(msg[:64]))
            return
        beat = self._beats.get(ack.seq)
        if beat is None and ack.seq < self._seq:  # late: past its lease (a link back up), it proves nothing more
            logger.debug("nixlkv acknowledgement of heartbeat %d from %s came after its lease", ack.seq, agent)
            return
        if beat is None or agent not in beat.agents:
            self.stats.count("ignored_acks")
            logger.warning("nixlkv ignored an acknowledgement of heartbeat %d from %s: %s", ack.seq, agent,
                           "never sent" if beat is None else "not sent to that agent")
            return
        for rid in ack.ids:
            lease = beat.leases.get(rid)
            if lease is None:  # not named in that heartbeat, or no lease to judge
                continue
            ends = self._proven.setdefault((beat.key, rid), {})
            end = beat.sent_at + LEASE_SAFETY * lease
            if end > ends.get(agent, float("-inf")):
                ends[agent] = end
        self.stats.count("hold_acks", len(ack.ids))

    def _held(self, remote: _Remote, remote_rid: str, without_heartbeats: float) -> float:
        """Until when P surely holds the request's blocks (this worker's clock): where P
        acknowledges heartbeats, the latest end every P rank told of the request acknowledged (each
        stage's ranks hold their own layers' blocks), else the end the heartbeats sent promise."""
        key = (remote.key, remote_rid)
        if remote.acks:
            ends = self._proven.get(key)
            if not ends or not remote.agents:
                return without_heartbeats
            proven = min(ends.get(a, float("-inf")) for a in remote.agents.values())
            return max(without_heartbeats, proven)
        return max(without_heartbeats, self._held_until.get(key, without_heartbeats))

    def _lease_lapsed(self, req: RecvRequest, remote: _Remote) -> bool:
        """True when P may have freed the blocks (no heartbeat kept the hold alive in time)."""
        if req.held_for_s is None:
            return False
        received = time.monotonic() if req.received_at is None else req.received_at
        return time.monotonic() > self._held(remote, req.remote_request_id, received + req.held_for_s)

    def _post(self, rid: str, req: RecvRequest, remote: _Remote) -> None:
        plan = remote.prepared.plan if remote.stages is None else remote.stages
        if any(req.local_block_ids) and self._lease_lapsed(req, remote):
            self.stats.count("lapsed_holds")
            self._fail(rid, req, lapsed_hold_reason(req.lease_s))
            return
        try:
            local = list(req.local_block_ids) + [[]] * (self.num_groups - len(req.local_block_ids))
            remote_ids = list(req.remote_block_ids) + [[]] * (len(local) - len(req.remote_block_ids))
            reads = any(local)
            if not reads:  # nothing to read (prefix hit, abort, D computes the prompt): only free P's blocks
                remote_ids = [[] for _ in remote_ids]
            # Token counts pair blocks; with nothing to read D's count (its own prefix) need not be P's.
            if remote.stages is None:
                resolved = plan.resolve(local, remote_ids, num_tokens=req.tokens_to_pair() if reads else None,
                                        scratch=self._ids)
            else:  # every stage resolved before any is posted: no shared scratch
                resolved = remote.stages.resolve(local, remote_ids, num_tokens=req.tokens_to_pair() if reads else None)
        except (NixlkvError, ValueError) as exc:
            self._fail(rid, req, f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - a strategy's bug fails its request, not the engine: nothing is posted yet
            logger.exception("nixlkv req=%s: planning its reads raised", rid)
            self._fail(rid, req, f"{type(exc).__name__} while planning its reads (a strategy's bug?): {exc}")
            return
        if self.push_mode:
            self._order(rid, req, remote, resolved)
            return
        posted: list[InFlight | StagedFlight] = []
        try:
            if remote.stages is None:
                flight = self.reader.post(remote.prepared, resolved, req.remote_request_id)
            else:
                for stage, stage_resolved in resolved.items():
                    prepared = remote.stage_prepared.get(stage)
                    if prepared is None:  # nothing read there: its covered ranks are told, so they free the request
                        self._tell(remote.stage_agents[stage].values(), req.remote_request_id, remote.stages.consumers)
                    else:
                        posted.append(self.reader.post(prepared, stage_resolved, req.remote_request_id))
                flight = _StageFlights(tuple(posted))
        except (NixlkvError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            unreleased = exc.flight if isinstance(exc, TransferError) else None
            if posted:  # READs of earlier stages run: released before the request fails
                self._invalidate(remote.key)
                flights = (*posted, unreleased) if unreleased is not None else tuple(posted)
                self._give_up(rid, _Flight(req, remote, _StageFlights(flights)), why)
                return
            if isinstance(exc, TransferError):
                self._invalidate(remote.key)
                if unreleased is not None:  # READs posted that NIXL would not release
                    self._give_up(rid, _Flight(req, remote, unreleased), why)
                    return
            self._fail(rid, req, why)
            return
        self._flights[rid] = _Flight(req, remote, flight)

    def _tell(self, agents: Any, remote_request_id: str, consumers: int) -> None:
        """A notification alone to each of ``agents`` (a stage read nothing from frees the request)."""
        msg = notification(remote_request_id, consumers)
        try:
            for agent in agents:
                self.nixl.notify(agent, msg)
        except Exception as exc:  # nixl raises its own types
            raise TransferError(f"sending a notification failed: {type(exc).__name__}: {exc}") from exc

    def _poll(self, flight: InFlight | StagedFlight | _StageFlights) -> bool:
        """Whether a request's READs are done (every stage's, where it read several)."""
        if isinstance(flight, _StageFlights):
            done = [self.reader.poll(f) for f in flight.flights]  # each polled: a staged flight advances so
            return all(done)
        return self.reader.poll(flight)

    def _release(self, flight: InFlight | StagedFlight | _StageFlights) -> bool:
        """Release a request's READs (every stage's); True once none can write any more."""
        if isinstance(flight, _StageFlights):
            released = [self.reader.release(f) for f in flight.flights]
            return all(released)
        return self.reader.release(flight)

    def _poll_flights(self) -> None:
        now = time.perf_counter()
        for rid, f in list(self._flights.items()):
            try:
                done = self._poll(f.flight)
            except TransferError as exc:
                del self._flights[rid]
                self._invalidate(f.owner.key)
                self._give_up(rid, f, str(exc))
                continue
            if done:
                del self._flights[rid]
                if any(f.request.local_block_ids) and self._lease_lapsed(f.request, f.owner):
                    # ended after the hold D can prove: P may have freed and reused the blocks meanwhile
                    self.stats.count("lapsed_reads")
                    self._fail(rid, f.request, lapsed_read_reason(f.request.lease_s))
                    continue
                self._loaded(rid, f.request, f.owner.key[0], f.flight.nbytes, f.flight.descriptors,
                             now - f.flight.posted_at, f.flight.post_seconds, f.flight.mode)
            elif now - f.flight.posted_at > self.config.transfer_timeout_s:
                del self._flights[rid]
                self._invalidate(f.owner.key)
                self._give_up(rid, f, f"READs from {f.owner.key[1]} not done after transfer_timeout_s="
                                      f"{self.config.transfer_timeout_s:g} s: the prefill engine is unreachable "
                                      f"from here or too slow (its link, or UCX's listener on it, closed?)")

    def _loaded(self, rid: str, req: RecvRequest, engine_id: str, nbytes: int, descriptors: int, elapsed: float,
                post_seconds: float, mode: str) -> None:
        """A request whose bytes all landed (read, or written by P in push mode): counted, its
        control applied and its dump written (tests and checks), reported to the scheduler."""
        self.stats.record(nbytes, descriptors, elapsed, post_seconds)
        if mode == "staged":
            self.stats.count("staged_loads")
        if self._damage and req.damage:
            self._apply_control(rid, req)
        order = self._dumps_on_load.pop(rid, None)
        if order is not None:
            self._dump(rid, order)
        if req.report:
            self._done_recv.add(rid)
        logger.debug("nixlkv recv done req=%s engine=%s mode=%s bytes=%d descriptors=%d transfer_ms=%.2f",
                     rid, engine_id, mode, nbytes, descriptors, 1e3 * elapsed)

    def _give_up(self, rid: str, f: _Flight, why: str) -> None:
        """Fail a request whose READs errored or timed out, but only once NIXL released every one
        of them: until then a READ may still write, and reporting the request (failed or done)
        would let vLLM free its blocks and give them to another request."""
        if self._release(f.flight):
            self._fail(rid, f.request, why)
            return
        self.stats.count("unreleased_transfers")
        logger.warning(
            "nixlkv could not release the READs of req=%s (NIXL still runs them, or cannot cancel them yet): its blocks stay "
            "held and it is reported failed once they are released; %s", rid, why,
        )
        self._draining[rid] = (f, why)

    def _drain(self) -> None:
        """Retry releasing the READs of requests given up on; fail each once nothing can write."""
        for rid, (f, why) in list(self._draining.items()):
            self.stats.count("release_retries")
            if self._release(f.flight):
                del self._draining[rid]
                logger.warning("nixlkv released the READs of req=%s at last: reporting it failed", rid)
                self._fail(rid, f.request, why)

    def _invalidate(self, key: RemoteKey) -> None:
        """After a transfer error the remote is handshaken again before it is read from again."""
        remote = self._remotes.get(key)
        if remote is not None and remote.prepared is not None:
            del self._remotes[key]
            self._retiring.append(remote)

    def _reap(self) -> None:
        """Give back the NIXL lists and remote agents of dropped handshakes once no READ uses them
        (a prefill that restarted would otherwise leave its agent and lists behind, per restart)."""
        if not self._retiring or self.nixl is None:
            return
        if any(r.prepared is None for r in self._remotes.values()):
            return  # a handshake in progress may have re-added a retiring remote's agent name
        busy = {id(f.owner) for f in self._flights.values()} | {id(f.owner) for f, _ in self._draining.values()} \
            | {id(remote) for _, remote, _ in self._pushes.values()}  # its agents still answer our orders
        live = self._live_agents() | set(self._ack_peers)  # a decode agent this worker also acknowledges
        keep = []
        for remote in self._retiring:
            if id(remote) in busy:
                keep.append(remote)
                continue
            for prepared in {id(p): p for p in (remote.prepared, *remote.stage_prepared.values())}.values():
                self.reader.forget(prepared)
            for name in set(remote.agents.values()) - live:  # a re-handshake of the same P reuses its name
                self.nixl.remove_remote(name)
            self.stats.count("remotes_released")
        self._retiring = keep

    def _fail(self, rid: str, req: RecvRequest, why: str) -> None:
        self.stats.count("failed_transfers")
        order = self._dumps_on_load.pop(rid, None)
        if order is not None:  # the judge hears of it by name
            try:
                write_failure(self.config.dump_kv_dir, order.prefill_request_id, "decode", self.engine_id,
                              self.topology.tp_rank, rid, f"the load failed: {why}")
            except OSError as exc:
                logger.warning("nixlkv could not note the failed load of req=%s in %s: %s", rid,
                               self.config.dump_kv_dir, exc)
        self._held_until.pop((req.key, req.remote_request_id), None)
        self._proven.pop((req.key, req.remote_request_id), None)
        blocks = sorted({b for g in req.local_block_ids for b in g})
        logger.error(
            "nixlkv recv failed req=%s engine=%s remote=%s:%d blocks=%d reason=%s",
            rid, req.remote_engine_id, req.remote_host, req.remote_port, len(blocks), why,
        )
        if not req.report:
            return
        self._done_recv.add(rid)
        self._failed_recv.add(rid)
        # vLLM's scheduler (0.32 and 0.33 alike) maps invalid block ids to requests only with one KV group; with
        # several (HMA) block ids are per group, so the failure travels as failed_recving only.
        if self.num_groups == 1:
            self._invalid_blocks.update(blocks)

    # ------------------------------------------------------------------ prefill side
    def _read_notifications(self) -> None:
        if self.nixl is None:
            return
        notifications = self.nixl.notifications()
        now = time.monotonic()  # after they arrived: a hold extended from now outlasts the heartbeat's send by lease_s
        for agent, msgs in notifications.items():
            agent = agent.decode() if isinstance(agent, bytes) else str(agent)
            for msg in msgs:
                if is_heartbeat(msg):
                    self._on_heartbeat(agent, msg, now)
                    continue
                if is_ack(msg):
                    self._on_ack(agent, msg)
                    continue
                kind = push.kind(msg)
                if kind is not None:
                    self._on_push(agent, kind, msg, now)
                    continue
                parsed = parse_notification(msg)
                if parsed is None:
                    self.stats.count("ignored_notifications")
                    logger.warning("nixlkv ignored a notification that is not nixlkv's: %r", msg[:64])
                    continue
                rid, consumers = parsed
                hold = self._holds.get(rid)
                if hold is None:
                    count, _, seen = self._early.get(rid, (0, consumers, now))
                    if not count and len(self._early) >= MAX_EARLY_REQUESTS:
                        self._forget_oldest_early()
                    self._early[rid] = (count + 1, consumers, seen)
                    logger.warning(
                        "nixlkv notification for unknown request %s (not held by this worker); "
                        "ignored unless the request is handed over within lease_s=%s",
                        rid, self.config.lease_s,
                    )
                    continue
                self._consumed(rid, consumers)

    def _forget_oldest_early(self) -> None:
        """Make room in the bounded map of early notifications: its oldest request is forgotten
        (if it is handed over after all, it is freed when its lease expires)."""
        oldest = next(iter(self._early))
        count = self._early.pop(oldest)[0]
        self.stats.count("ignored_notifications", count)
        logger.warning(
            "nixlkv holds notifications for %d requests it was not handed: forgot the oldest, %s (%d notification(s))",
            MAX_EARLY_REQUESTS, oldest, count,
        )

    def _on_heartbeat(self, agent: str, msg: bytes, now: float) -> None:
        """P: extend the hold of every request a heartbeat names that this worker still holds, by
        its lease from ``now``; answer an acknowledged heartbeat with the ids extended."""
        acked = bytes(msg[: len(ACKED_HEARTBEAT_PREFIX)]) == ACKED_HEARTBEAT_PREFIX
        try:
            beat = parse_acked_heartbeat(msg) if acked else None
            rids = beat.ids if beat is not None else parse_heartbeat(msg)
        except ValueError as exc:
            self.stats.count("ignored_notifications")
            logger.warning("nixlkv ignored a malformed heartbeat (%s): %r", exc, bytes(msg[:64]))
            return
        extended = []
        for rid in rids:
            hold = self._holds.get(rid)
            if hold is None:  # already freed (read, expired) or never held here
                self.stats.count("stale_heartbeats")
                logger.debug("nixlkv heartbeat for request %s not held by this worker", rid)
                continue
            hold.deadline = max(hold.deadline, now + hold.lease)
            extended.append(rid)
            self.stats.count("lease_extensions")
        if beat is not None:
            self._acknowledge(agent, beat, extended, now)

    def _acknowledge(self, agent: str, beat: AckedHeartbeat, extended: list[str], now: float) -> None:
        """P: tell the decode agent which holds its heartbeat ``beat`` extended (an empty list too:
        it then knows those holds ended). Its agent is loaded from ``beat.reply_to`` the first time."""
        if agent not in self._ack_peers and agent not in self._live_agents() and agent not in self._writer_agents():
            try:
                name = self.nixl.add_remote(beat.reply_to)
            except Exception as exc:  # noqa: BLE001 - nixl raises its own types for metadata it cannot load
                self.stats.count("failed_acks")
                logger.warning("nixlkv cannot acknowledge heartbeats of %s: its reply_to did not load: %s: %s",
                               agent, type(exc).__name__, exc)
                return
            if name != agent:  # metadata of another agent: not loaded for it
                if name not in self._live_agents() and name not in self._ack_peers:
                    self.nixl.remove_remote(name)
                self.stats.count("failed_acks")
                logger.warning("nixlkv cannot acknowledge heartbeats of %s: its reply_to names agent %s", agent, name)
                return
        self._ack_peers.pop(agent, None)
        self._ack_peers[agent] = now  # last: the oldest peer is first
        try:
            self.nixl.notify(agent, encode_ack(beat.seq, extended))
        except Exception as exc:  # noqa: BLE001 - D gone or unreachable: its holds end by their lease
            self.stats.count("failed_acks")
            logger.warning("nixlkv could not acknowledge a heartbeat of %s: %s: %s", agent, type(exc).__name__, exc)
            self._forget_ack_peer(agent)
            return
        while len(self._ack_peers) > MAX_ACK_PEERS:
            self._forget_ack_peer(next(iter(self._ack_peers)))

    def _forget_ack_peer(self, agent: str) -> None:
        """P: drop a decode agent loaded only to acknowledge its heartbeats (not one this worker reads from)."""
        self._ack_peers.pop(agent, None)
        if agent not in self._live_agents() and agent not in self._writer_agents():
            self.nixl.remove_remote(agent)

    def _writer_agents(self) -> set[str]:
        """P in push mode: the decode agents this worker writes to (loaded whole from their hellos)."""
        return self._writer.agents() if self._writer is not None else set()

    def _expire_holds(self) -> None:
        now = time.monotonic()
        for rid, hold in list(self._holds.items()):
            if now >= hold.deadline and rid not in self._writing:  # a WRITE reads the blocks: held until it ends
                del self._holds[rid]
                self._freed_here(rid, f"its lease (lease_s={hold.lease:g} s) expired with no decode engine reading it")
                self.stats.count("expired_leases")
                logger.warning(
                    "nixlkv lease expired req=%s notifications=%d/%s: freeing its blocks, held lease_s=%s s with no "
                    "decode engine reading them or naming them in a heartbeat. A decode leg that reaches its decode "
                    "engine later is failed there (HTTP 500 to the client). If a router may hold decode legs longer "
                    "than that between this engine's answer and the decode engine, raise lease_s in this engine's "
                    "kv_connector_extra_config (docs/configuration.md, \"The lease\")",
                    rid, hold.count, hold.consumers if hold.consumers is not None else "?", f"{hold.lease:g}",
                )
        for agent, heard in list(self._ack_peers.items()):
            if now - heard > 2 * self.config.lease_s:  # ordered by last heard: the rest are newer
                self._forget_ack_peer(agent)
            else:
                break
        for rid, (count, _, seen) in list(self._early.items()):
            if now - seen > self.config.lease_s:
                del self._early[rid]
                self.stats.count("ignored_notifications", count)
                logger.warning("nixlkv dropped %d notification(s) for unknown request %s", count, rid)

    def _consumed(self, rid: str, consumers: int) -> None:
        """One decode rank is done with held request ``rid`` (notified, or its WRITE ended): the
        blocks are free once ``consumers`` are, and no WRITE of the request still runs."""
        hold = self._holds.get(rid)
        if hold is None:
            return
        hold.count += 1
        hold.consumers = consumers
        if hold.count >= consumers and rid not in self._writing:
            del self._holds[rid]
            self._freed_here(rid, "every decode rank it was handed to has read it or had it written")

    def _freed_here(self, rid: str, why: str) -> None:
        """P: request ``rid``'s blocks go back to vLLM. In push mode the id is remembered (the
        latest MAX_EARLY_REQUESTS), so that an order arriving for it later is refused at once, not
        after waiting lease_s for a hand-over that will not come."""
        self._done_send.add(rid)
        if self.push_mode:
            remember_latest(self._freed, rid, why)

    # ------------------------------------------------------------------ push mode (nixlkv.vllm.push)
    def _order(self, rid: str, req: RecvRequest, remote: _Remote, resolved: Any) -> None:
        """D: the request's READs, sent to the prefill ranks they name as orders to WRITE them (a
        hello first, once per plan and rank); the ranks read nothing from are told as in pull mode.
        With pipeline stages, each remote stage read by its own plan, the others told."""
        if remote.stages is None:
            parts = [(0, remote.prepared.plan, remote.agents, resolved)]
        else:
            parts = [(s, remote.stages.plans.get(s), remote.stage_agents[s], r) for s, r in resolved.items()]
        wait = push.PushWait({}, time.perf_counter(), 0, 0)
        try:
            for stage, plan, agents, part in parts:
                if plan is None:  # a stage this rank reads nothing from: told, so it frees the request
                    self._tell(agents.values(), req.remote_request_id, remote.stages.consumers)
                    continue
                if stage not in remote.push_plans:
                    self._push_plans += 1
                    remote.push_plans[stage] = self._push_plans
                number = remote.push_plans[stage]
                wait.nbytes += sum(plan.read_bytes(r) for r in part.reads)
                wait.descriptors += part.num_descriptors
                for read in part.reads:
                    agent = agents[read.remote_rank]
                    if (stage, read.remote_rank) not in remote.push_hello:
                        hello = push.Hello(number, self.nixl.metadata(), plan.local.mem_type, plan.local_descs,
                                           plan.remote_descs[read.remote_rank])
                        self.nixl.notify(agent, hello.encode())
                        remote.push_hello.add((stage, read.remote_rank))
                    order = push.Order(number, req.remote_request_id, rid, part.consumers, read.local_ids, read.remote_ids)
                    self.nixl.notify(agent, order.encode())
                    wait.pending[agent] = read.remote_rank
                self._tell([agents[r] for r in part.notify_only], req.remote_request_id, part.consumers)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own types; the remote is handshaken again
            why = f"sending the push orders failed: {type(exc).__name__}: {exc}"
            self._invalidate(remote.key)
            if not wait.pending:
                self._fail(rid, req, why)
                return
            wait.errors.append(why)  # an order is out: its rank may write; failed once it answers
            self._abandon(rid, wait)
        self._pushes[rid] = (req, remote, wait)

    def _abandon(self, rid: str, wait: push.PushWait) -> None:
        wait.abandoned = True
        self.stats.count("push_abandoned")
        self._tell_abandon(rid, wait)

    def _tell_abandon(self, rid: str, wait: push.PushWait) -> None:
        """D: ask every prefill rank that has not answered ``rid`` to answer it now."""
        for agent in wait.pending:
            try:
                self.nixl.notify(agent, push.abandon(rid))
            except Exception as exc:  # noqa: BLE001 - the rank answers when it can; its blocks stay held
                logger.warning("nixlkv could not tell %s to abandon req=%s: %s: %s", agent, rid, type(exc).__name__, exc)

    def _poll_pushes(self) -> None:
        """D: report requests every ordered rank answered; abandon those waited on too long (their
        blocks stay held until each rank answers: a WRITE may still land)."""
        now = time.perf_counter()
        for rid, (req, remote, wait) in list(self._pushes.items()):
            if not wait.pending:
                del self._pushes[rid]
                if wait.errors:
                    self._fail(rid, req, "; ".join(wait.errors))
                else:
                    self._loaded(rid, req, remote.key[0], wait.nbytes, wait.descriptors, now - wait.posted_at, 0.0, "push")
            elif not wait.abandoned and now - wait.posted_at > self.config.transfer_timeout_s:
                wait.errors.append(f"the prefill engine {remote.key[1]} did not write within transfer_timeout_s="
                                   f"{self.config.transfer_timeout_s:g} s (ranks {sorted(wait.pending.values())})")
                logger.warning("nixlkv push of req=%s not written after transfer_timeout_s=%g s: abandoned; its blocks stay "
                               "held until every prefill rank answers or the engine is gone", rid,
                               self.config.transfer_timeout_s)
                self._abandon(rid, wait)
            elif wait.abandoned:
                self._probe(remote.key, remote.generation)  # the handshake that took the orders

    def _probe(self, key: RemoteKey, generation: str | None) -> None:
        """D: ask (on the handshake thread, at most once per handshake_timeout_s) whether the silent
        prefill engine ``key`` is gone; if so, fail every push still waiting on it."""
        now = time.monotonic()
        probe = self._probes.get(key)
        if probe is not None and probe[0].done():
            self._settle(key, probe[0])
        if probe is None or (probe[0].done() and now - probe[1] > self.config.handshake_timeout_s):
            ids = tuple(sorted({req.remote_request_id for _, req, _ in self._waiting_on(key)}))
            self._probes[key] = (self._executor.submit(self._gone, key, generation, ids), now)

    def _settle(self, key: RemoteKey, probe: concurrent.futures.Future) -> None:
        result = probe.result() if probe.exception() is None else _ProbeResult(None, False)
        waiting = self._waiting_on(key)
        if result.gone is None:
            if any(req.remote_request_id in result.released for _, req, _ in waiting):
                self._invalidate(key)  # orders were lost on the way: the next request connects afresh
            for rid, req, wait in waiting:
                if req.remote_request_id in result.released:  # final: nothing of it can be written any more
                    why = (f"the prefill engine {key[1]}:{key[2]} no longer holds request {req.remote_request_id} "
                           f"(its hold ended unwritten: lease_s there, or the order never reached it)")
                    logger.warning("nixlkv push of req=%s: %s; failing it", rid, why)
                    wait.errors.append(why)
                    wait.pending.clear()
                elif result.answers:  # reachable again: an order, its abandon or the answer may have been lost
                    self._tell_abandon(rid, wait)
            return
        self._invalidate(key)
        for rid, _, wait in waiting:
            logger.warning("nixlkv push of req=%s: %s; nothing more can be written, failing it", rid, result.gone)
            wait.errors.append(result.gone)
            wait.pending.clear()

    def _waiting_on(self, key: RemoteKey) -> list[tuple[str, RecvRequest, push.PushWait]]:
        """D: the requests whose orders prefill engine ``key`` has still to answer."""
        return [(rid, req, wait) for rid, (req, remote, wait) in self._pushes.items()
                if remote.key == key and wait.pending]

    def _gone(self, key: RemoteKey, generation: str | None, ids: tuple[str, ...]) -> _ProbeResult:
        """On the handshake thread: whether the prefill engine ``key`` that took an order can still
        write. Gone: its side channel refuses connections (its host answers, so the link works and
        anything its dead process sent has landed), or another incarnation answers. Not gone: its
        host is silent (a link down may still deliver a WRITE when it comes back), or it answers as
        itself: then it says which of the prefill requests ``ids`` it still holds (one it does not
        hold is never written any more), and is asked again to answer the others."""
        engine_id, host, port = key
        seen = handshake.tcp_connect(host, port, self.config.handshake_timeout_s)
        if seen == "refused":
            return _ProbeResult(f"the prefill engine is gone (nothing listens on its side channel {host}:{port})", False)
        if seen != "open":
            return _ProbeResult(None, False)
        try:
            raw = handshake.fetch(host, port, self.config.handshake_timeout_s, self.config.max_handshake_bytes)
        except NixlkvError:
            return _ProbeResult(None, False)
        try:
            engine = handshake.decode_reply(
                raw, self.compat, self.config.enforce_compat_hash, self.config.max_handshake_bytes, engine_id,
                ranks=lambda remote_tp: self.dispatcher.read_ranks(self.geometry, remote_tp),
                expected_inputs=self.compat_inputs,
            )
        except NixlkvError as exc:
            return _ProbeResult(f"another engine answers on {host}:{port} ({exc})", False)
        now = engine_generation(engine.agent_metadata)
        if now == generation:
            try:
                reply = handshake.fetch_held(host, port, self.config.handshake_timeout_s, ids,
                                             self.config.max_handshake_bytes) if ids else None
            except NixlkvError:  # an earlier nixlkv answers no held query: the orders are asked again only
                reply = None
            if reply is None or reply.engine_id != engine_id:
                return _ProbeResult(None, True)
            return _ProbeResult(None, True, frozenset(i for i, held in zip(ids, reply.held) if not held))
        return _ProbeResult(f"the prefill engine restarted (generation {generation} -> {now})", False)

    def _on_push(self, agent: str, kind: bytes, msg: bytes, now: float) -> None:
        try:
            if kind == push.PUSHED:
                self._answered(agent, push.parse_pushed(msg), None)
            elif kind == push.FAILED:
                rid, why = push.parse_failed(msg)
                self._answered(agent, rid, f"the prefill engine did not write: {why}")
            elif self._writer is None:
                raise push.PushWireError("this engine runs transfer_mode 'pull': it writes nothing")
            elif kind == push.HELLO:
                self._writer.hello(agent, push.Hello.decode(msg))
            elif kind == push.ORDER:
                order = push.Order.decode(msg)
                if (agent, order.decode_request_id) in self._abandoned:  # came after its abandon: never written
                    self._refuse(agent, order, "abandoned by the decode engine before it arrived")
                else:
                    self._early_orders.setdefault(agent, []).append((order, now))
            elif kind == push.ABANDON:
                self._drop_order(agent, push.parse_abandon(msg))
        except (NixlkvError, ValueError) as exc:
            self.stats.count("ignored_notifications")
            logger.warning("nixlkv ignored a push message from %s (%s): %r", agent, exc, bytes(msg[:64]))
        except Exception as exc:  # noqa: BLE001 - nixl raises its own types (adding the agent, preparing lists)
            self.stats.count("ignored_notifications")
            logger.warning("nixlkv could not take a push message from %s: %s: %s", agent, type(exc).__name__, exc)

    def _answered(self, agent: str, rid: str, error: str | None) -> None:
        entry = self._pushes.get(rid)
        if entry is None or entry[2].pending.pop(agent, None) is None:
            self.stats.count("stale_push_answers")
            logger.debug("nixlkv push answer for req=%s from %s not waited for", rid, agent)
            return
        if error is not None:
            entry[2].errors.append(error)

    def _drop_order(self, agent: str, rid: str) -> None:
        """P: D gave up on an order: dropped if not posted (answered failed); a posted WRITE is
        answered when it ends (:meth:`_poll_writes`), as it would have been; one never received (lost
        on the way) or answered already is answered failed at once. Remembered, so that the order
        arriving after its abandon is refused, never written into blocks D may have freed."""
        remember_latest(self._abandoned, (agent, rid), None)
        queued = self._early_orders.get(agent, [])
        for i, (order, _seen) in enumerate(queued):
            if order.decode_request_id == rid:
                del queued[i]
                self._refuse(agent, order, "abandoned by the decode engine before it was written")
                return
        if (agent, rid) in self._writer.writes:
            return
        why = "no order for it is here: it never arrived (lost on the way?) or was answered already"
        self._answer_failed(agent, rid, why)  # nothing is or will be written for it: D may free its blocks
        logger.warning("nixlkv answered an abandon from %s for req=%s: %s", agent, rid, why)

    def _refuse(self, agent: str, order: push.Order, why: str) -> None:
        """P: answer an order that is not (or no longer) written; its decode rank counts as done."""
        self._answer_failed(agent, order.decode_request_id, why)
        logger.warning("nixlkv did not write req=%s for %s: %s", order.prefill_request_id, agent, why)
        self._consumed(order.prefill_request_id, order.consumers)

    def _answer_failed(self, agent: str, decode_request_id: str, why: str) -> None:
        """P: tell decode rank ``agent`` that nothing is written for its request, and why."""
        try:
            self.nixl.notify(agent, push.failed(decode_request_id, why))
        except Exception as exc:  # noqa: BLE001 - the decode rank is gone
            logger.warning("nixlkv could not answer %s for req=%s: %s", agent, decode_request_id, exc)

    def _poll_writes(self) -> None:
        """P: post the orders whose plan and hold are known, count the WRITEs that ended."""
        now = time.monotonic()
        for agent, queued in list(self._early_orders.items()):
            keep = []
            for entry in queued:
                order, seen = entry
                if order.prefill_request_id in self._holds and self._writer.knows(agent, order.plan):
                    self._write(agent, order)
                elif order.prefill_request_id in self._freed:
                    self._refuse(agent, order, f"freed here already: {self._freed[order.prefill_request_id]}")
                elif now - seen > self.config.lease_s:
                    self._refuse(agent, order, f"not held here (freed, or never handed over) within lease_s={self.config.lease_s:g} s")
                elif not self._writer.knows(agent, order.plan) and now - seen > self.config.handshake_timeout_s:
                    self._refuse(agent, order, "no hello for its plan arrived")
                else:
                    keep.append(entry)
            if keep:
                self._early_orders[agent] = keep[-MAX_EARLY_REQUESTS:]
                for order, _ in keep[:-MAX_EARLY_REQUESTS]:
                    self._refuse(agent, order, "too many orders waiting for their requests")
            else:
                del self._early_orders[agent]
        for key, write in list(self._writer.writes.items()):
            state = self._writer.state(write)
            if state == "PROC" or not self._writer.release(write):
                continue
            del self._writer.writes[key]
            rid = write.order.prefill_request_id
            self._writing[rid] -= 1
            if not self._writing[rid]:
                del self._writing[rid]
            if state == "DONE":
                self.stats.count("push_writes")
                self._consumed(rid, write.order.consumers)
            else:
                self._refuse(write.sender, write.order, "the WRITE ended in error (the decode engine gone?)")

    def _write(self, agent: str, order: push.Order) -> None:
        try:
            self._writer.post(agent, order)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own types: nothing was posted
            self._refuse(agent, order, f"{type(exc).__name__}: {exc}")
            return
        self._writing[order.prefill_request_id] = self._writing.get(order.prefill_request_id, 0) + 1

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.nixl is not None:
            for f in self._flights.values():
                self._release(f.flight)
            self._flights.clear()
            if self._writer is not None:
                for write in self._writer.writes.values():
                    self._writer.release(write)
            self.reader.close()
            self.nixl.close()
            self.nixl = None


def serve_reply(
    engine_id: str, tp_size: int, infos: Mapping[int, HandshakeInfo], compat: str,
    compat_inputs: Mapping[str, Any] | None = None, pp_size: int = 1,
) -> bytes:
    """The side channel's answer for an engine whose ranks advertised ``infos``, keyed by
    :func:`handshake.global_rank` (``compat_inputs``: what ``compat`` hashes, sent so that a
    refusing peer can name what differs)."""
    if sorted(infos) != list(range(tp_size * pp_size)):
        raise NixlkvError(f"handshake metadata of ranks {sorted(infos)} for tp_size={tp_size} x pp_size={pp_size}")
    return handshake.encode_reply(engine_id, tp_size, {r: (i.agent_metadata, i.geometry) for r, i in infos.items()},
                                  compat, compat_inputs, pp_size)
