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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import msgspec

HEARTBEAT_PREFIX = b"nixlkv-hb:"
MAX_IDS_PER_HEARTBEAT = 256
MAX_REQUEST_ID_CHARS = 1024


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


def is_heartbeat(msg: bytes) -> bool:
    return bytes(msg[: len(HEARTBEAT_PREFIX)]) == HEARTBEAT_PREFIX


def parse_heartbeat(msg: bytes) -> tuple[str, ...]:
    """The request ids of a heartbeat; ValueError for anything malformed (the caller ignores it)."""
    if not is_heartbeat(msg):
        raise ValueError("not a nixlkv heartbeat")
    try:
        ids = msgspec.msgpack.decode(bytes(msg[len(HEARTBEAT_PREFIX) :]), type=list[str])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"heartbeat body unreadable: {exc}") from None
    if not ids or len(ids) > MAX_IDS_PER_HEARTBEAT:
        raise ValueError(f"heartbeat must name 1..{MAX_IDS_PER_HEARTBEAT} requests, got {len(ids)}")
    if not all(0 < len(i) <= MAX_REQUEST_ID_CHARS for i in ids):
        raise ValueError("heartbeat names an empty or oversized request id")
    return tuple(ids)
