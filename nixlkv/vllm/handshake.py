"""Handshake wire format and the ZMQ side channel.

Wire format (msgpack through msgspec, never pickle)::

    reply    = [schema_version: int, compat_hash: str, payload: bytes, [compat_inputs: map]]
    payload  = [engine_id: str, tp_size: int, ranks: [[tp_rank: int, agent_metadata: bytes, geometry: map,
                [pp_rank: int]], ...], [pp_size: int], [heartbeat_acks: bool]]
    geometry = {engine_id, tp_size, tp_rank, [pp_size, pp_rank, layers], memory: [[address, nbytes], ...], device_id, mem_type,
                region_classes: [{strategy, num_blocks, block_stride, page, [page_parts], facts}, ...],
                region_columns: {name: [str], base: [int], group: [int], class: [int]}}
    request  = [schema_version: int]

``heartbeat_acks``: the engine answers acknowledged heartbeats (``liveness``); absent (an earlier
nixlkv) means it does not, and D sends it plain ones. An earlier reader ignores the field.

A pipeline-parallel engine lists ``tp_size`` ranks of each of its ``pp_size`` stages, each rank
with its stage, and each rank's geometry names its stage and the layers it holds; a TP-only
engine sends neither field (as before pipeline stages were read).

The geometry is columnar (``RankGeometry.to_wire``): one description per distinct region
geometry and the regions as parallel columns, so the reader parses each geometry once and
checks the per-layer fields in bulk. The per-region form of earlier peers (``regions``: one full
description per region, ``RankGeometry.to_dict``) is still accepted and checked as before.

The reader decodes ``[schema_version, compat_hash]`` first and refuses a different schema or
compatibility hash before it looks at the payload; ``compat_inputs`` (what the hash is made of,
optional: older peers do not send it) lets that refusal name the setting the engines differ in.
Then every field is checked: types (msgspec), then each rank's geometry the reader plans with
(``RankGeometry.from_dict``; a decode rank reads only some ranks, ``Dispatcher.read_ranks``, and
the others' geometry is never parsed: their agent metadata is all it uses, to tell them a request
is done), then the cross-field facts (engine id and TP size agree on every rank, every rank
present once, regions inside registered memory, counts and sizes bounded). Anything wrong raises :class:`HandshakeError` naming the field; nothing is
planned or transferred from a payload that did not pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..core.errors import HandshakeError
from ..core.geometry import RankGeometry, first_outside_memory
from ..core.topology import MAX_PP_SIZE, MAX_TP_SIZE

logger = logging.getLogger("nixlkv.connector")

SCHEMA_VERSION = 1
MAX_REGIONS = 1 << 16
MAX_MEMORY_RANGES = 1 << 12
MAX_PAGE_AXES = 16
MAX_FACT_DEPTH = 4
ADDRESS_LIMIT = 1 << 64


class Header(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    schema_version: int
    compat_hash: str


class Reply(msgspec.Struct, array_like=True):
    schema_version: int
    compat_hash: str
    payload: bytes
    compat_inputs: dict[str, Any] | None = None  # what compat_hash hashes: a refusal names what differs


class RankPayload(msgspec.Struct, array_like=True):
    tp_rank: int
    agent_metadata: bytes
    geometry: dict[str, Any]
    pp_rank: int = 0  # the rank's pipeline stage (sent only by a pipeline-parallel engine)


class EnginePayload(msgspec.Struct, array_like=True):
    engine_id: str
    tp_size: int
    ranks: list[RankPayload]
    pp_size: int = 1  # pipeline stages: ``ranks`` lists tp_size ranks of each
    heartbeat_acks: bool = False  # answers acknowledged heartbeats (an earlier nixlkv sends no such field)


class Request(msgspec.Struct, array_like=True):
    schema_version: int
    # push mode: asks instead which of these prefill request ids the engine still holds (HeldReply)
    held: tuple[str, ...] = ()


class HeldReply(msgspec.Struct, array_like=True):
    """A prefill engine's answer to a held query: for each id asked about, whether its blocks are
    still held. Not held means freed, or never held: no WRITE of it is in flight or will be posted."""

    engine_id: str
    held: list[bool]


@dataclass(frozen=True)
class RemoteEngine:
    """A validated remote engine: every rank's NIXL agent metadata, and the geometry of the ranks
    the reader asked for (every rank's by default; see :func:`decode_reply`). Ranks are keyed by
    :func:`global_rank` (the TP rank where the engine runs one pipeline stage)."""

    engine_id: str
    tp_size: int
    geometry: dict[int, RankGeometry]
    agent_metadata: dict[int, bytes]
    pp_size: int = 1
    heartbeat_acks: bool = False  # its workers acknowledge heartbeats (liveness): D can prove its holds

    def stage(self, pp_rank: int) -> dict[int, RankGeometry]:
        """TP rank -> geometry of the ranks of one pipeline stage whose geometry was parsed."""
        first = pp_rank * self.tp_size
        return {g - first: geo for g, geo in self.geometry.items() if first <= g < first + self.tp_size}

    def stage_agents(self, pp_rank: int) -> dict[int, bytes]:
        """TP rank -> NIXL agent metadata of every rank of one pipeline stage."""
        first = pp_rank * self.tp_size
        return {g - first: m for g, m in self.agent_metadata.items() if first <= g < first + self.tp_size}


def global_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """A rank's index in its engine, vLLM's order: stage-major, TP rank within the stage."""
    return pp_rank * tp_size + tp_rank


def compat_hash(inputs: Mapping[str, Any]) -> str:
    """Hash of what both engines must share exactly (model, dtypes, wire schema...)."""
    return hashlib.sha256(json.dumps(wire_inputs(inputs), sort_keys=True).encode()).hexdigest()[:32]


def wire_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` as the hash sees them and the handshake carries them: plain JSON values."""
    return json.loads(json.dumps({"schema_version": SCHEMA_VERSION, **inputs}, sort_keys=True, default=str))


# What each compatibility input is, for an operator: the setting to make equal on both engines.
COMPAT_SETTINGS = {
    "model": "--model",
    "dtype": "--dtype",
    "cache_dtype": "--kv-cache-dtype",
    "speculative": "--speculative-config",
    "vllm": "the vLLM version",
    "schema_version": "the nixlkv version",
    "transfer": "the nixlkv version",
}


def compat_difference(remote: Mapping[str, Any], local: Mapping[str, Any]) -> str | None:
    """The inputs two engines differ in, each with both values and the setting to make equal;
    None where they differ in none (then the hashes were made otherwise)."""
    keys = sorted(k for k in set(remote) | set(local) if remote.get(k) != local.get(k))
    if not keys:
        return None
    return "; ".join(
        f"{k} is {_short(remote.get(k))} on the remote engine but {_short(local.get(k))} here "
        f"(start both with the same {COMPAT_SETTINGS.get(k, k)})"
        for k in keys
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def encode_reply(
    engine_id: str, tp_size: int, ranks: Mapping[int, tuple[bytes, RankGeometry]], hash_: str,
    inputs: Mapping[str, Any] | None = None, pp_size: int = 1, heartbeat_acks: bool = True,
) -> bytes:
    """``ranks``: by :func:`global_rank`. ``inputs``: what ``hash_`` was made of
    (:func:`compat_hash`), sent so that a peer refusing it can say which setting differs.
    ``heartbeat_acks``: this nixlkv's workers acknowledge heartbeats (False: an earlier peer's reply)."""
    payload = EnginePayload(
        engine_id=engine_id,
        tp_size=tp_size,
        ranks=[RankPayload(r % tp_size, meta, geo.to_wire(), r // tp_size) for r, (meta, geo) in sorted(ranks.items())],
        pp_size=pp_size,
        heartbeat_acks=heartbeat_acks,
    )
    sent = None if inputs is None else wire_inputs(inputs)
    return msgspec.msgpack.encode(Reply(SCHEMA_VERSION, hash_, msgspec.msgpack.encode(payload), sent))


def decode_reply(
    raw: bytes,
    expected_hash: str,
    enforce_hash: bool = True,
    max_bytes: int = 64 << 20,
    expected_engine_id: str | None = None,
    ranks: Callable[[int], Iterable[int]] | None = None,
    expected_inputs: Mapping[str, Any] | None = None,
) -> RemoteEngine:
    """Validate a handshake reply completely, or raise HandshakeError naming what is wrong.

    ``expected_inputs``: what ``expected_hash`` was made of; a refused hash then names the inputs
    the engines differ in, where the remote sent its own.

    ``ranks``: given the remote TP size, the ranks whose geometry the reader plans with
    (``Dispatcher.read_ranks``); only theirs is parsed and checked, and only theirs is in
    :attr:`RemoteEngine.geometry`. Every rank's envelope and agent metadata is checked. Default:
    every rank's geometry."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise HandshakeError(f"handshake reply must be bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise HandshakeError(f"handshake reply of {len(raw)} B exceeds max_handshake_bytes={max_bytes}")
    try:
        header = msgspec.msgpack.decode(raw, type=Header)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise HandshakeError(f"handshake header unreadable: {exc}") from None
    if header.schema_version != SCHEMA_VERSION:
        raise HandshakeError(
            f"handshake schema version {header.schema_version} is not this nixlkv's {SCHEMA_VERSION}: "
            "run the same nixlkv version on prefill and decode"
        )
    if header.compat_hash != expected_hash:
        msg = f"compatibility hash mismatch: remote {header.compat_hash!r}, local {expected_hash!r}: " + (
            _difference(raw, expected_inputs)
            or "model, dtype, kv-cache dtype, speculative decoding, vLLM or nixlkv version differ between the engines"
        )
        if enforce_hash:
            raise HandshakeError(msg)
        logger.warning("nixlkv %s; enforce_compat_hash=false, continuing with the geometry checks", msg)
    try:
        reply = msgspec.msgpack.decode(raw, type=Reply)
        payload = msgspec.msgpack.decode(reply.payload, type=EnginePayload)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise HandshakeError(f"handshake payload malformed: {exc}") from None
    return _validate(payload, expected_engine_id, ranks)


def _difference(raw: bytes | bytearray | memoryview, local: Mapping[str, Any] | None) -> str | None:
    """What a refused reply's compatibility inputs differ in from ``local``; None where either
    side has none to compare."""
    if local is None:
        return None
    try:
        remote = msgspec.msgpack.decode(raw, type=Reply).compat_inputs
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return None
    return None if remote is None else compat_difference(remote, wire_inputs(local))


def _validate(
    payload: EnginePayload, expected_engine_id: str | None, ranks: Callable[[int], Iterable[int]] | None = None
) -> RemoteEngine:
    if not payload.engine_id:
        raise HandshakeError("handshake engine_id is empty")
    if expected_engine_id is not None and payload.engine_id != expected_engine_id:
        raise HandshakeError(
            f"engine id mismatch: kv_transfer_params name {expected_engine_id!r}, the side channel "
            f"answered for {payload.engine_id!r} (wrong remote_host/remote_port?)"
        )
    if not 1 <= payload.tp_size <= MAX_TP_SIZE:
        raise HandshakeError(f"handshake tp_size must be in [1, {MAX_TP_SIZE}], got {payload.tp_size}")
    tp, pp = payload.tp_size, payload.pp_size
    if not 1 <= pp <= MAX_PP_SIZE:
        raise HandshakeError(f"handshake pp_size must be in [1, {MAX_PP_SIZE}], got {pp}")
    if len(payload.ranks) != tp * pp:
        raise HandshakeError(f"handshake lists {len(payload.ranks)} ranks for tp_size={tp} x pp_size={pp}")
    geometry: dict[int, RankGeometry] = {}
    agents: dict[int, bytes] = {}
    wanted = None if ranks is None else frozenset(ranks(tp))
    for rp in payload.ranks:
        if not 0 <= rp.tp_rank < tp:
            raise HandshakeError(f"handshake rank {rp.tp_rank} outside [0, {tp})")
        if not 0 <= rp.pp_rank < pp:
            raise HandshakeError(f"handshake rank {rp.tp_rank}: pipeline stage {rp.pp_rank} outside [0, pp_size={pp})")
        where = f"rank {rp.tp_rank}" if pp == 1 else f"stage {rp.pp_rank} rank {rp.tp_rank}"
        g = global_rank(rp.pp_rank, rp.tp_rank, tp)
        if g in agents:
            raise HandshakeError(f"handshake lists {where} twice")
        if not rp.agent_metadata:
            raise HandshakeError(f"{where}: empty NIXL agent metadata")
        if wanted is not None and rp.tp_rank not in wanted:  # never read: its agent is all we keep
            agents[g] = bytes(rp.agent_metadata)
            continue
        _check_shape(rp.geometry, rp.tp_rank)
        geo = RankGeometry.from_dict(rp.geometry)
        if geo.engine_id != payload.engine_id or geo.tp_size != tp or geo.tp_rank != rp.tp_rank:
            raise HandshakeError(
                f"{where}: geometry says engine {geo.engine_id!r} tp {geo.tp_size} rank "
                f"{geo.tp_rank}, the envelope says engine {payload.engine_id!r} tp {tp} rank {rp.tp_rank}"
            )
        if geo.pp_size != pp or geo.pp_rank != rp.pp_rank:
            raise HandshakeError(
                f"{where}: geometry says pipeline stage {geo.pp_rank} of {geo.pp_size}, the envelope says "
                f"stage {rp.pp_rank} of {pp}"
            )
        for a, n in geo.memory:
            if n == 0 or a + n > ADDRESS_LIMIT:
                raise HandshakeError(f"{where}: memory range ({a:#x}, {n}) is empty or past 2^64")
        _check_regions_in_memory(geo, rp.tp_rank)
        geometry[g] = geo
        agents[g] = bytes(rp.agent_metadata)
    return RemoteEngine(payload.engine_id, tp, geometry, agents, pp, payload.heartbeat_acks)


def _check_regions_in_memory(geo: RankGeometry, rank: int) -> None:
    """Every region inside one registered memory range (``first_outside_memory``, the check the
    plan makes too: done once per geometry)."""
    i = first_outside_memory(geo)
    if i is not None:
        region = geo.regions[i]
        raise HandshakeError(
            f"rank {rank}: region {region.name!r} [{region.base:#x}, {region.end:#x}) lies "
            "outside every memory range the rank registered"
        )


def _check_shape(d: Mapping[str, Any], rank: int) -> None:
    """Bound the sizes before building objects from them (a hostile payload cannot make us loop).

    Either form of a geometry: columnar (``region_classes`` + ``region_columns``, what this
    nixlkv sends) or per-region (``regions``, what earlier peers send)."""
    columnar = "region_classes" in d or "region_columns" in d
    regions = d.get("region_classes") if columnar else d.get("regions")
    memory = d.get("memory")
    if not isinstance(regions, list) or not isinstance(memory, list):
        raise HandshakeError(
            f"rank {rank}: geometry needs a 'memory' list and a 'region_classes' list (or, from an earlier nixlkv, a 'regions' list)"
        )
    if len(regions) > MAX_REGIONS or len(memory) > MAX_MEMORY_RANGES:
        raise HandshakeError(
            f"rank {rank}: {len(regions)} region {'classes' if columnar else 'entries'} / {len(memory)} memory ranges "
            f"exceed the limits {MAX_REGIONS} / {MAX_MEMORY_RANGES}"
        )
    if columnar:
        columns = d.get("region_columns")
        if not isinstance(columns, dict):
            raise HandshakeError(f"rank {rank}: geometry needs a 'region_columns' map beside 'region_classes'")
        for key, col in columns.items():
            if isinstance(col, list) and len(col) > MAX_REGIONS:
                raise HandshakeError(f"rank {rank}: region_columns[{key!r}] lists {len(col)} regions, over the limit {MAX_REGIONS}")
    if not memory:
        raise HandshakeError(f"rank {rank}: no registered memory")
    for m in memory:
        if not isinstance(m, list) or len(m) != 2:
            raise HandshakeError(f"rank {rank}: memory entries must be [address, nbytes], got {m!r}")
    what = "region_classes" if columnar else "regions"
    for i, r in enumerate(regions):  # per class in the columnar form, per region in the other
        if not isinstance(r, dict):
            raise HandshakeError(f"rank {rank}: {what}[{i}]: region entries must be maps, got {type(r).__name__}")
        page = r.get("page")
        if not isinstance(page, list) or not 1 <= len(page) <= MAX_PAGE_AXES:
            raise HandshakeError(f"rank {rank}: {what}[{i}]: region page must list 1..{MAX_PAGE_AXES} axes, got {page!r}")
        for axis in page:
            if not isinstance(axis, list) or len(axis) != 2 or not isinstance(axis[0], str):
                raise HandshakeError(f"rank {rank}: {what}[{i}]: page axes must be [name, size], got {axis!r}")
        if r.get("page") and any(isinstance(a[1], int) and a[1] > ADDRESS_LIMIT for a in page):
            raise HandshakeError(f"rank {rank}: {what}[{i}]: page axis size past 2^64")
        facts = r.get("facts", {})
        if not isinstance(facts, dict) or not _plain(facts, 0):
            raise HandshakeError(f"rank {rank}: {what}[{i}]: region facts must be plain values nested at most {MAX_FACT_DEPTH} deep")


def _plain(value: Any, depth: int) -> bool:
    if depth > MAX_FACT_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


# ---------------------------------------------------------------------------- side channel
class SideChannelServer:
    """Answers handshake requests on ``tcp://host:port`` from a thread (ZMQ ROUTER)."""

    def __init__(self, host: str, port: int, reply: Callable[[], bytes],
                 held: Callable[[tuple[str, ...]], bytes] | None = None) -> None:
        import zmq

        self._reply = reply
        self._held = held
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # requests are tiny
        self._sock.bind(f"tcp://{host}:{port or '*'}")  # port 0: any free port
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self._stop = threading.Event()
        self.served = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._run, name="nixlkv-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3:
                self.refused += 1
                continue
            ident, body = frames[0], frames[-1]
            try:
                request = msgspec.msgpack.decode(body, type=Request)
                if request.held and self._held is None:
                    raise ValueError("this engine answers no held query")
                answer = self._held(request.held) if request.held else self._reply()
                self.served += 1
            except Exception:  # a malformed request gets an empty answer, never a crash
                answer = b""
                self.refused += 1
            try:
                self._sock.send_multipart([ident, b"", answer], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


LOOPBACK_NAMES = ("localhost", "::1", "ip6-localhost")


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in LOOPBACK_NAMES


PROBE_TIMEOUT_S = 1.0  # the TCP probe after a handshake went unanswered


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """What a plain TCP connection to ``host:port`` meets, said for the deployer: ZMQ retries a
    refused connection in silence, so an unanswered handshake alone cannot tell a closed port from
    a host that is unreachable."""
    seen = tcp_connect(host, port, timeout_s)
    if seen == "open":
        return (f"{host}:{port} accepts TCP connections but sent no handshake answer (another service on that "
                "port, or the prefill engine stuck)")
    if seen == "refused":
        return f"connection refused: nothing listens on {host}:{port}"
    if seen == "timeout":
        return f"{host}:{port} did not accept a TCP connection within {timeout_s:g} s (host down or unreachable, or a firewall drops it)"
    return f"a TCP connection to {host}:{port} failed: {seen}"


def tcp_connect(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """What a plain TCP connection to ``host:port`` meets: "open", "refused" (the host answered:
    nothing listens), "timeout", or the error's text."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return str(exc.strerror or exc)


def unanswered(host: str, port: int, timeout_s: float, seen: str | None = None) -> str:
    """Why a handshake went unanswered, in the settings a deployer fixes: the prefill engine's
    ``side_channel_host`` and ``side_channel_port`` are what it publishes to D (``remote_host``,
    ``remote_port``), so a wrong one reaches D only as silence. ``seen``: what a TCP probe met
    (:func:`probe`)."""
    where = (f"{host} is a loopback address: the prefill engine advertised its side channel on its own "
             f"host only; set its side_channel_host (or VLLM_NIXL_SIDE_CHANNEL_HOST) to an address this "
             f"decode engine reaches") if is_loopback(host) else (
             f"check that the prefill engine's side_channel_host ({host}) is an address this decode engine "
             f"reaches, that its side_channel_port ({port}) is open between them, and that the prefill engine runs")
    probed = f" ({seen})" if seen else ""
    return f"no handshake answer from the prefill engine's side channel {host}:{port} within {timeout_s} s{probed}: {where}"


def fetch_held(host: str, port: int, timeout_s: float, ids: Sequence[str], max_bytes: int) -> HeldReply:
    """Ask a prefill engine which of ``ids`` it still holds; HandshakeError when it does not answer
    (or is a nixlkv that answers no such query)."""
    raw = fetch(host, port, timeout_s, max_bytes, Request(SCHEMA_VERSION, tuple(ids)))
    try:
        reply = msgspec.msgpack.decode(raw, type=HeldReply)
    except msgspec.DecodeError as exc:
        raise HandshakeError(f"{host}:{port} answered a held query with something else: {exc}") from None
    if len(reply.held) != len(ids):
        raise HandshakeError(f"{host}:{port} answered {len(reply.held)} of {len(ids)} ids of a held query")
    return reply


def fetch(host: str, port: int, timeout_s: float, max_bytes: int, request: Request | None = None) -> bytes:
    """One handshake request (or ``request``); HandshakeError when nobody answers in ``timeout_s``."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    try:
        ms = max(1, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.setsockopt(zmq.SNDTIMEO, ms)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.connect(f"tcp://{host}:{port}")
        try:
            sock.send(msgspec.msgpack.encode(request or Request(SCHEMA_VERSION)))
            raw = sock.recv()
        except zmq.Again:
            raise HandshakeError(unanswered(host, port, timeout_s, probe(host, port))) from None
        if not raw:
            raise HandshakeError(f"{host}:{port} refused the handshake request")
        return raw
    finally:
        sock.close(0)
