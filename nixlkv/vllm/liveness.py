"""Is the prefill engine still the one we handshook, and does it still hold our blocks?

Two small wire facts shared by both engines:

- **Generation.** A hash of the NIXL agent metadata of every rank of an engine. P publishes it in
  ``kv_transfer_params`` (``remote_generation``); D computes it from the handshake reply. A P that
  restarted under the same host:port has new agents, hence a new generation: D re-handshakes
  before reading, and a request prefilled by the previous incarnation is failed, never read from
  memory that now belongs to something else.
- **Heartbeat.** ``nixlkv-hb:`` + a msgpack list of P request ids that D still waits for. It carries
  no time: P extends each named hold by its own ``lease_s`` on its own clock, so the engines'
  clocks never need to agree.
- **Acknowledged heartbeat.** A heartbeat that leaves is not one that arrived: over a link that is
  down P's lease runs out while D believes it extended. So to a P that says in its handshake that
  it acknowledges (``heartbeat_acks``), D sends ``nixlkv-hb2:`` + msgpack ``[seq, ids, reply_to]``
  (``reply_to``: D's NIXL connection metadata, so that P can answer) and P answers
  ``nixlkv-hback:`` + msgpack ``[seq, ids]``, the ids of that heartbeat whose hold it extended. D
  counts a hold extended only from an acknowledgement: P extended it at the heartbeat's arrival,
  which is after D sent it, so the hold lasts at least ``lease_s`` from the send on D's own clock.
  A P that never acknowledges (an earlier nixlkv) gets plain heartbeats, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

HEARTBEAT_PREFIX = b"nixlkv-hb:"
ACKED_HEARTBEAT_PREFIX = b"nixlkv-hb2:"  # not a prefix of HEARTBEAT_PREFIX's messages, nor they of it
ACK_PREFIX = b"nixlkv-hback:"
MAX_IDS_PER_HEARTBEAT = 256
MAX_REQUEST_ID_CHARS = 1024
MAX_SEQ = (1 << 63) - 1
MAX_REPLY_TO_BYTES = 1 << 16  # NIXL connection metadata is a few hundred bytes


class AckedHeartbeat(msgspec.Struct, array_like=True, frozen=True):
    """A heartbeat P answers: its sequence number (D's, per worker), the P request ids, and D's NIXL
    connection metadata (P loads it once per sender to send the acknowledgement)."""

    seq: int
    ids: tuple[str, ...]
    reply_to: bytes


class HeartbeatAck(msgspec.Struct, array_like=True, frozen=True):
    """P's answer to heartbeat ``seq``: the ids of it whose hold P extended (those it still held)."""

    seq: int
    ids: tuple[str, ...]


def engine_generation(agent_metadata: Mapping[int, bytes]) -> str:
    """Identity of one incarnation of an engine: changes whenever any rank's NIXL agent does."""
    digest = hashlib.sha256()
    for rank in sorted(agent_metadata):
        blob = bytes(agent_metadata[rank])
        digest.update(f"{rank}:{len(blob)}:".encode())
        digest.update(blob)
    return digest.hexdigest()[:24]


def heartbeat_messages(remote_request_ids: Iterable[str]) -> list[bytes]:
    """The notifications that keep ``remote_request_ids`` held (bounded size each)."""
    ids = sorted(set(remote_request_ids))
    return [
        HEARTBEAT_PREFIX + msgspec.msgpack.encode(ids[i : i + MAX_IDS_PER_HEARTBEAT])
        for i in range(0, len(ids), MAX_IDS_PER_HEARTBEAT)
    ]


def acked_heartbeat_messages(remote_request_ids: Iterable[str], first_seq: int, reply_to: bytes) -> list[AckedHeartbeat]:
    """The acknowledged heartbeats that keep ``remote_request_ids`` held, numbered from ``first_seq``
    (bounded size each); :func:`encode_acked_heartbeat` makes the message of each."""
    ids = sorted(set(remote_request_ids))
    return [
        AckedHeartbeat(first_seq + n, tuple(ids[i : i + MAX_IDS_PER_HEARTBEAT]), reply_to)
        for n, i in enumerate(range(0, len(ids), MAX_IDS_PER_HEARTBEAT))
    ]


def encode_acked_heartbeat(beat: AckedHeartbeat) -> bytes:
    return ACKED_HEARTBEAT_PREFIX + msgspec.msgpack.encode(beat)


def encode_ack(seq: int, ids: Iterable[str]) -> bytes:
    return ACK_PREFIX + msgspec.msgpack.encode(HeartbeatAck(seq, tuple(ids)))


def is_heartbeat(msg: bytes) -> bool:
    """A heartbeat of either kind (plain or acknowledged)."""
    head = bytes(msg[: len(ACKED_HEARTBEAT_PREFIX)])
    return head.startswith(HEARTBEAT_PREFIX) or head == ACKED_HEARTBEAT_PREFIX


def is_ack(msg: bytes) -> bool:
    return bytes(msg[: len(ACK_PREFIX)]) == ACK_PREFIX


def parse_heartbeat(msg: bytes) -> tuple[str, ...]:
    """The request ids of a plain heartbeat; ValueError for anything malformed (the caller ignores it)."""
    if bytes(msg[: len(HEARTBEAT_PREFIX)]) != HEARTBEAT_PREFIX:
        raise ValueError("not a nixlkv heartbeat")
    ids = _body(msg, HEARTBEAT_PREFIX, list[str], "heartbeat")
    return _checked_ids(ids, "heartbeat", allow_empty=False)


def _body(msg: bytes, prefix: bytes, typ: Any, what: str) -> Any:
    """The msgpack body after ``prefix``, as ``typ``; ValueError naming ``what`` for anything else."""
    try:
        return msgspec.msgpack.decode(bytes(msg[len(prefix) :]), type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{what} body unreadable: {exc}") from None


def parse_acked_heartbeat(msg: bytes) -> AckedHeartbeat:
    """An acknowledged heartbeat, checked; ValueError for anything malformed (the caller ignores it)."""
    if bytes(msg[: len(ACKED_HEARTBEAT_PREFIX)]) != ACKED_HEARTBEAT_PREFIX:
        raise ValueError("not a nixlkv acknowledged heartbeat")
    beat = _body(msg, ACKED_HEARTBEAT_PREFIX, AckedHeartbeat, "heartbeat")
    _check_seq(beat.seq, "heartbeat")
    _checked_ids(beat.ids, "heartbeat", allow_empty=False)
    if not 0 < len(beat.reply_to) <= MAX_REPLY_TO_BYTES:
        raise ValueError(f"heartbeat reply_to must hold 1..{MAX_REPLY_TO_BYTES} bytes, got {len(beat.reply_to)}")
    return beat


def parse_ack(msg: bytes) -> HeartbeatAck:
    """A heartbeat acknowledgement, checked; ValueError for anything malformed (the caller ignores it)."""
    if not is_ack(msg):
        raise ValueError("not a nixlkv heartbeat acknowledgement")
    ack = _body(msg, ACK_PREFIX, HeartbeatAck, "acknowledgement")
    _check_seq(ack.seq, "acknowledgement")
    _checked_ids(ack.ids, "acknowledgement", allow_empty=True)  # P held none of the heartbeat's
    return ack


def _check_seq(seq: int, what: str) -> None:
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"{what} sequence number must be in [0, 2^63), got {seq}")


def _checked_ids(ids: Iterable[str], what: str, allow_empty: bool) -> tuple[str, ...]:
    ids = tuple(ids)
    if (not ids and not allow_empty) or len(ids) > MAX_IDS_PER_HEARTBEAT:
        raise ValueError(f"{what} must name {0 if allow_empty else 1}..{MAX_IDS_PER_HEARTBEAT} requests, got {len(ids)}")
    if not all(0 < len(i) <= MAX_REQUEST_ID_CHARS for i in ids):
        raise ValueError(f"{what} names an empty or oversized request id")
    return ids
