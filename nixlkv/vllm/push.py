"""Push mode: the prefill engine WRITEs a request's KV into the blocks the decode engine reserved.

The plan stays the decode engine's. D handshakes, plans and resolves each request exactly as in
pull mode; instead of posting the READs it sends every prefill rank they name an *order*: those
READs' descriptor IDs, both sides. That rank posts the same descriptor pairs as one NIXL WRITE,
which carries a *pushed* notification to D after its data. So every byte moves between the same
two addresses as in pull mode, chosen by the same strategies, and the byte proof is the same.

Once per plan and prefill rank, before its first order, D sends a *hello*: its NIXL agent metadata
and the two descriptor lists of its plan (its own rows, the prefill rank's rows). The prefill rank
checks that its rows lie in memory it registered, adds D's agent and prepares both lists.

Messages (NIXL notifications; msgpack bodies):

- ``nixlkv-push-hello:`` D -> P: plan number, D's agent metadata and memory type, both row lists.
- ``nixlkv-push:`` D -> P: plan number, P's request id, D's request id, consumers, the ids.
- ``nixlkv-pushed:`` P -> D, on the WRITE (delivered after its data): D's request id.
- ``nixlkv-push-failed:`` P -> D: D's request id and why; sent only once no WRITE of the order
  can write any more (never posted, ended in error, or released by NIXL).
- ``nixlkv-push-abandon:`` D -> P: D's request id; D waited ``transfer_timeout_s``. P drops the
  order if it is not posted and answers failed; a posted WRITE is answered when it ends.

D reports a request only once every rank it ordered has answered: until then a WRITE may still
land in its blocks, so they stay held (the same rule as a READ NIXL would not release).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from ..core.errors import NixlkvError
from ..core.topology import MAX_TP_SIZE
from ..transport.nixl_rank import NixlRank

HELLO = b"nixlkv-push-hello:"
ORDER = b"nixlkv-push:"
PUSHED = b"nixlkv-pushed:"
FAILED = b"nixlkv-push-failed:"
ABANDON = b"nixlkv-push-abandon:"
PREFIXES = (HELLO, ORDER, PUSHED, FAILED, ABANDON)
MAX_ID_CHARS = 1024
MAX_IDS = 1 << 26  # descriptor ids per order: far beyond any request (a 128k-token Llama-70B rank: ~1M)
ROW_COLUMNS = 5  # NIXL's strided row: address, nbytes, device, stride, count


class PushWireError(NixlkvError, ValueError):
    """A push message that does not parse: the receiver ignores it and counts it."""


def kind(msg: bytes) -> bytes | None:
    """The prefix of a push message, or None for any other notification."""
    head = bytes(msg[:24])
    for prefix in PREFIXES:
        if head.startswith(prefix):
            return prefix
    return None


# ---------------------------------------------------------------------------------------- ids, rows
def encode_ids(ids: np.ndarray) -> bytes:
    """Descriptor ids, delta-coded and compressed: a request's ids are runs (``row start + block``),
    so their differences are a few distinct values and compress to a few hundred bytes."""
    a = np.asarray(ids, dtype=np.int64)
    deltas = np.diff(a, prepend=np.int64(0)) if a.size else a
    return zlib.compress(deltas.tobytes(), 1)


def decode_ids(blob: bytes, what: str) -> np.ndarray:
    try:
        raw = zlib.decompressobj().decompress(blob, MAX_IDS * 8 + 1)
    except zlib.error as exc:
        raise PushWireError(f"{what}: not compressed ids ({exc})") from None
    if len(raw) % 8 or len(raw) > MAX_IDS * 8:
        raise PushWireError(f"{what}: {len(raw)} bytes are not a whole number of at most {MAX_IDS} int64 ids")
    ids = np.cumsum(np.frombuffer(raw, dtype=np.int64))
    if ids.size and int(ids.min()) < 0:
        raise PushWireError(f"{what}: negative descriptor id {int(ids.min())}")
    return ids


def descriptor_count(rows: np.ndarray) -> int:
    """Descriptors a prepared list of strided ``rows`` holds (ids run from 0 to this, exclusive)."""
    return int(rows[:, 4].astype(np.int64).sum()) if len(rows) else 0


def rows_outside(rows: np.ndarray, memory: Sequence[tuple[int, int]]) -> np.ndarray:
    """Indices of the strided rows whose bytes are not inside one registered ``(address, nbytes)``
    range: the first byte's range must also hold the last byte."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    r = rows.astype(np.int64)  # addresses and sizes are below 2**63 (nixlkv.core.regions.ADDRESS_LIMIT)
    start, count = r[:, 0], r[:, 4]
    end = start + r[:, 3] * np.maximum(count - 1, 0) + r[:, 1]
    bases = np.array([a for a, _ in memory], dtype=np.int64)
    ends = np.array([a + n for a, n in memory], dtype=np.int64)
    order = np.argsort(bases)
    bases, ends = bases[order], ends[order]
    at = np.searchsorted(bases, start, side="right") - 1
    inside = (at >= 0) & (count >= 1)
    inside &= end <= np.where(at >= 0, ends[np.clip(at, 0, None)], 0)
    return np.flatnonzero(~inside)


def _rows_bytes(rows: np.ndarray) -> bytes:
    return np.ascontiguousarray(rows, dtype=np.uint64).tobytes()


def _rows(blob: bytes, what: str) -> np.ndarray:
    if len(blob) % (8 * ROW_COLUMNS):
        raise PushWireError(f"{what}: {len(blob)} bytes are not whole rows of {ROW_COLUMNS} uint64")
    return np.frombuffer(blob, dtype=np.uint64).reshape(-1, ROW_COLUMNS)


# ---------------------------------------------------------------------------------------- messages
class _HelloBody(msgspec.Struct, array_like=True):
    plan: int
    agent_metadata: bytes
    mem_type: str
    decode_rows: bytes
    prefill_rows: bytes


class _OrderBody(msgspec.Struct, array_like=True):
    plan: int
    prefill_request_id: str
    decode_request_id: str
    consumers: int
    decode_ids: bytes
    prefill_ids: bytes


@dataclass(frozen=True)
class Hello:
    """D's side of one plan, for the prefill rank that will write by it."""

    plan: int
    agent_metadata: bytes
    mem_type: str
    decode_rows: np.ndarray  # D's descriptor rows: the WRITE's remote list
    prefill_rows: np.ndarray  # this prefill rank's rows in D's plan: the WRITE's local list

    def encode(self) -> bytes:
        return HELLO + msgspec.msgpack.encode(_HelloBody(
            self.plan, self.agent_metadata, self.mem_type, _rows_bytes(self.decode_rows), _rows_bytes(self.prefill_rows)))

    @classmethod
    def decode(cls, msg: bytes) -> Hello:
        body = _body(msg, HELLO, _HelloBody)
        if body.mem_type not in ("DRAM", "VRAM"):
            raise PushWireError(f"hello: memory type {body.mem_type!r} is not DRAM or VRAM")
        return cls(body.plan, body.agent_metadata, body.mem_type, _rows(body.decode_rows, "hello decode_rows"),
                   _rows(body.prefill_rows, "hello prefill_rows"))


@dataclass(frozen=True)
class Order:
    """One decode rank's READs from one prefill rank, as the WRITE that rank posts instead."""

    plan: int
    prefill_request_id: str
    decode_request_id: str
    consumers: int  # decode ranks that tell this prefill rank of the request (as in pull mode)
    decode_ids: np.ndarray
    prefill_ids: np.ndarray

    def encode(self) -> bytes:
        return ORDER + msgspec.msgpack.encode(_OrderBody(
            self.plan, self.prefill_request_id, self.decode_request_id, self.consumers,
            encode_ids(self.decode_ids), encode_ids(self.prefill_ids)))

    @classmethod
    def decode(cls, msg: bytes) -> Order:
        body = _body(msg, ORDER, _OrderBody)
        _check_id(body.prefill_request_id, "prefill_request_id")
        _check_id(body.decode_request_id, "decode_request_id")
        if not 1 <= body.consumers <= MAX_TP_SIZE:
            raise PushWireError(f"order: consumers {body.consumers} outside [1, {MAX_TP_SIZE}]")
        d = decode_ids(body.decode_ids, "order decode_ids")
        p = decode_ids(body.prefill_ids, "order prefill_ids")
        if d.size != p.size or not d.size:
            raise PushWireError(f"order: {d.size} decode ids against {p.size} prefill ids (must be equal, not 0)")
        return cls(body.plan, body.prefill_request_id, body.decode_request_id, body.consumers, d, p)


def pushed(decode_request_id: str) -> bytes:
    return PUSHED + decode_request_id.encode()


def failed(decode_request_id: str, why: str) -> bytes:
    return FAILED + msgspec.msgpack.encode([decode_request_id, why[:2000]])


def abandon(decode_request_id: str) -> bytes:
    return ABANDON + decode_request_id.encode()


def parse_pushed(msg: bytes) -> str:
    return _check_id(bytes(msg[len(PUSHED):]).decode(errors="strict"), "pushed request id")


def parse_abandon(msg: bytes) -> str:
    return _check_id(bytes(msg[len(ABANDON):]).decode(errors="strict"), "abandoned request id")


def parse_failed(msg: bytes) -> tuple[str, str]:
    try:
        rid, why = msgspec.msgpack.decode(bytes(msg[len(FAILED):]), type=tuple[str, str])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PushWireError(f"push-failed body unreadable: {exc}") from None
    return _check_id(rid, "failed request id"), why


def _check_id(rid: str, what: str) -> str:
    if not 0 < len(rid) <= MAX_ID_CHARS:
        raise PushWireError(f"{what} is empty or longer than {MAX_ID_CHARS} characters")
    return rid


def _body(msg: bytes, prefix: bytes, typ: type) -> object:
    try:
        return msgspec.msgpack.decode(bytes(msg[len(prefix):]), type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PushWireError(f"{prefix.decode().rstrip(':')} body unreadable: {exc}") from None


# ---------------------------------------------------------------------------------------- prefill side
@dataclass
class _Peer:
    """One decode rank's plan, prepared on this prefill rank."""

    agent: str
    local: object  # this rank's rows, as D's plan lists them
    remote: object  # D's rows
    local_count: int
    remote_count: int


@dataclass
class Write:
    """One order's WRITE in flight."""

    sender: str
    order: Order
    handle: object
    posted_at: float


@dataclass
class PushWriter:
    """A prefill rank's WRITEs: the plans decode ranks said hello with, and the orders in flight.

    It owns the NIXL side only; which requests are held, and when a hold ends, stays the worker's.
    """

    nixl: NixlRank
    memory: Sequence[tuple[int, int]]  # this rank's registered (address, nbytes)
    peers: dict[tuple[str, int], _Peer] = field(default_factory=dict)  # (D agent, plan) -> lists
    writes: dict[tuple[str, str], Write] = field(default_factory=dict)  # (D agent, D request id) -> WRITE

    def hello(self, sender: str, hello: Hello) -> None:
        """Prepare the two lists of a decode rank's plan (its agent added first); PushWireError or
        NixlkvError when the rows name memory this rank did not register."""
        bad = rows_outside(hello.prefill_rows, self.memory)
        if bad.size:
            raise PushWireError(f"hello from {sender}: {bad.size} of its {len(hello.prefill_rows)} rows for this rank lie "
                                f"outside the memory this rank registered (first: row {int(bad[0])})")
        agent = self.nixl.add_remote(hello.agent_metadata)
        if agent != sender:
            raise PushWireError(f"hello from {sender} carries the metadata of agent {agent}")
        local = self.nixl.prep_local(hello.prefill_rows)
        try:
            remote = self.nixl.prep_remote(agent, hello.decode_rows, hello.mem_type)
        except Exception:
            self.nixl.release_lists([local])
            raise
        old = self.peers.pop((sender, hello.plan), None)
        if old is not None:
            self.nixl.release_lists([old.local, old.remote])
        self.peers[(sender, hello.plan)] = _Peer(agent, local, remote, descriptor_count(hello.prefill_rows),
                                                 descriptor_count(hello.decode_rows))

    def agents(self) -> set[str]:
        """The decode agents some plan of which is prepared here."""
        return {peer.agent for peer in self.peers.values()}

    def knows(self, sender: str, plan: int) -> bool:
        return (sender, plan) in self.peers

    def post(self, sender: str, order: Order) -> Write:
        """Post ``order``'s WRITE; NixlkvError (nothing posted) for ids outside the lists or a refusal."""
        peer = self.peers[(sender, order.plan)]
        for ids, count, side in ((order.prefill_ids, peer.local_count, "this rank's"),
                                 (order.decode_ids, peer.remote_count, "the decode rank's")):
            if int(ids.max()) >= count:
                raise NixlkvError(f"order {order.decode_request_id}: descriptor id {int(ids.max())} beyond {side} "
                                  f"list of {count}")
        msg = pushed(order.decode_request_id)
        handle = self.nixl.agent.make_prepped_xfer("WRITE", peer.local, order.prefill_ids, peer.remote,
                                                   order.decode_ids, msg)
        write = Write(sender, order, handle, time.perf_counter())
        if self.nixl.agent.transfer(handle) == "ERR":
            self.nixl.release_handle(handle)
            raise NixlkvError(f"NIXL refused the WRITE of order {order.decode_request_id}")
        self.writes[(sender, order.decode_request_id)] = write
        return write

    def state(self, write: Write) -> str:
        """"DONE", "PROC" or "ERR" (a peer gone counts as an error)."""
        try:
            return self.nixl.agent.check_xfer_state(write.handle)
        except Exception:  # noqa: BLE001 - nixl raises for a transfer whose peer went away
            return "ERR"

    def release(self, write: Write) -> bool:
        """Give the WRITE's handle back; False while NIXL may still write it (kept)."""
        return self.nixl.release_handle(write.handle)


# ---------------------------------------------------------------------------------------- decode side
@dataclass
class PushWait:
    """A decode request whose orders are out: which prefill agents have still to answer."""

    pending: dict[str, int]  # prefill agent -> its global rank
    posted_at: float
    nbytes: int
    descriptors: int
    errors: list[str] = field(default_factory=list)
    abandoned: bool = False
