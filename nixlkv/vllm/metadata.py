"""What the scheduler-side connector hands its workers each step, and the stats workers hand back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ..core.errors import RequestError
from .kvdump import DumpOrder
from .params import remote

RemoteKey = tuple[str, str, int]  # (engine id, side-channel host, port)


# D counts P's lease from its own arrival time, which is later than P's start of the lease by
# the proxy's latency: D assumes only this fraction of the lease. Where P also published when its
# hold ends on its wall clock, D takes the earlier of the two ends, that one less the same margin
# (for the two hosts' clocks).
LEASE_SAFETY = 0.9


@dataclass(frozen=True)
class LeaseView:
    """D's conservative view of P's hold on one request, as durations: the scheduler and its
    workers may be processes on different hosts, so no time of one clock is ever read on another.
    The scheduler computes ``held_for_s`` when it builds the step's metadata; a worker adds it to
    its own clock when it receives it (the step's transit makes that a little late, which
    ``LEASE_SAFETY``'s margin covers)."""

    lease_s: float  # what a heartbeat extends P's hold by, counted from its arrival at P
    held_for_s: float  # P holds the blocks at least this long from now without a heartbeat (may be < 0)


@dataclass
class RecvRequest:
    """A decode-side request whose KV is read from a prefill engine."""

    local_block_ids: tuple[list[int], ...]  # per KV group; empty when nothing is to be read
    remote_block_ids: tuple[list[int], ...]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    report: bool = True  # the scheduler waits for this request (WAITING_FOR_REMOTE_KVS)
    remote_generation: str | None = None  # None: the remote did not publish one (not checked)
    # How long P surely still holds the blocks without a heartbeat, from when the worker receives
    # the request (see LeaseView); None when P published no lease (not checked).
    held_for_s: float | None = None
    lease_s: float | None = None  # the lease P published (remote_lease_s), for the message of a lapsed hold
    received_at: float | None = None  # the worker's own clock when it received the request (set there)
    # Tokens each side's block list holds (each list is the tail of the list for that many
    # tokens): what pairs blocks when P and D hold a different number of tokens per block.
    num_tokens: int | None = None  # this (decode) engine's
    remote_num_tokens: int | None = None  # what P published
    damage: str | None = None  # a graded negative control to apply once loaded (nixlkv.vllm.damage; tests only)

    def tokens_to_pair(self) -> int | None:
        """The request's token count both block lists describe; RequestError when P and D disagree."""
        if self.num_tokens is None or self.remote_num_tokens is None:
            return self.remote_num_tokens if self.num_tokens is None else self.num_tokens
        if self.num_tokens != self.remote_num_tokens:
            raise RequestError(
                f"kv_transfer_params remote_num_tokens={self.remote_num_tokens} but the decode engine holds "
                f"{self.num_tokens} tokens of request {self.remote_request_id!r}: send decode the prompt that was prefilled"
            )
        return self.num_tokens

    @property
    def key(self) -> RemoteKey:
        return (self.remote_engine_id, self.remote_host, self.remote_port)


@dataclass
class NixlkvMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, RecvRequest] = field(default_factory=dict)
    reqs_to_send: dict[str, float] = field(default_factory=dict)  # request id -> lease seconds
    # with dump_kv_dir set: request id -> its blocks to write down, as vLLM's KV manager holds them
    reqs_to_dump: dict[str, DumpOrder] = field(default_factory=dict)
    # D: remote engine -> {P request id: LeaseView or None} still waited for (keep them held)
    heartbeats: dict[RemoteKey, dict[str, LeaseView | None]] = field(default_factory=dict)


def recv_from_params(
    params: dict[str, Any], local_block_ids: Any, report: bool, arrived: float | None = None,
    num_tokens: int | None = None, now: float | None = None, wall_now: float | None = None,
) -> RecvRequest:
    """A RecvRequest from vLLM-NixlConnector-compatible kv_transfer_params (ParamsError, a
    ValueError, naming the field: ``nixlkv.vllm.params``); ``num_tokens``: the tokens the decode
    engine's blocks hold once loaded; ``arrived`` and ``now``: the request's arrival and the
    present, both on the scheduler's clock; ``wall_now``: the present in Unix seconds (read
    where not given), for the end of P's hold P published."""
    r = remote(params)
    view = lease_view(r.lease_s, arrived, now, r.held_until, wall_now)
    return RecvRequest(
        local_block_ids=block_id_groups(local_block_ids),
        remote_block_ids=r.block_ids,
        remote_engine_id=r.engine_id,
        remote_request_id=r.request_id,
        remote_host=r.host,
        remote_port=r.port,
        report=report,
        remote_generation=r.generation,
        held_for_s=view.held_for_s if view else None,
        lease_s=r.lease_s,
        num_tokens=num_tokens,
        remote_num_tokens=r.num_tokens,
    )


def lease_view(
    lease_s: float | None, arrived: float | None, now: float | None = None, held_until: float | None = None,
    wall_now: float | None = None,
) -> LeaseView | None:
    """What D may assume of P's hold at ``now``, from P's published lease and D's arrival time
    (both on the scheduler's clock; ``now`` defaults to the arrival) and, where P published it,
    the end of its hold on its wall clock (``held_until``, against ``wall_now``, read where not
    given): the earlier end. A decode leg that reached D late (a router queueing it) has less of
    the lease left than D's arrival says; one that reached D after P freed the blocks has none."""
    if lease_s is None or (arrived is None and held_until is None):
        return None
    margin = (1 - LEASE_SAFETY) * lease_s
    ends = []
    if arrived is not None:
        ends.append(arrived + LEASE_SAFETY * lease_s - (arrived if now is None else now))
    if held_until is not None:
        ends.append(held_until - (time.time() if wall_now is None else wall_now) - margin)
    return LeaseView(lease_s, min(ends))


def block_id_groups(ids: Any) -> tuple[list[int], ...]:
    """Block ids per KV group; a flat list (vLLM's single-group form) is one group."""
    ids = list(ids or ())
    if ids and not isinstance(ids[0], (list, tuple)):
        return ([int(b) for b in ids],)
    return tuple([int(b) for b in g] for g in ids)


@dataclass
class NixlkvStats(KVConnectorStats):
    """Per-transfer observations of one interval; ``reduce`` summarises them for the logger."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    # Counted events. D: failed_transfers, failed_handshakes, heartbeats_sent (request ids named),
    # remotes_released (dropped handshakes whose NIXL lists and agents were given back),
    # unreleased_transfers (requests given up on whose READs NIXL would not release at once: their
    # blocks stay held), release_retries (the retries until it did) and staged_loads (loads read
    # through the staging buffer), handshakes_planned / _rebased / _recounted (completed
    # handshakes by how their plan was made: the strategies asked, another engine's plan at these
    # addresses, or another engine's segments with these block counts), lapsed_holds (loads not
    # read because P's hold may have ended: queued past the lease, or reached D after the end P
    # published, a late decode leg or the hosts' clocks apart), lapsed_reads (loads whose READs
    # ended after the hold D can prove, not taken as loaded), hold_acks (holds P's acknowledgements
    # confirmed extended), ignored_acks (acknowledgements malformed, unknown or from another agent);
    # P: expired_leases, ignored_notifications (not nixlkv's or malformed), lease_extensions (a
    # heartbeat kept a hold alive), stale_heartbeats (a heartbeat named a request no longer held),
    # failed_acks (acknowledgements that could not be sent).
    # Push mode: push_writes (P: WRITEs that ended done), push_abandoned (D: requests whose orders
    # were not written within transfer_timeout_s), stale_push_answers (D: an answer for no order out).
    COUNTERS = ("failed_transfers", "failed_handshakes", "expired_leases", "ignored_notifications",
                "heartbeats_sent", "lease_extensions", "stale_heartbeats", "remotes_released",
                "unreleased_transfers", "release_retries", "staged_loads",
                "handshakes_planned", "handshakes_rebased", "handshakes_recounted", "lapsed_holds",
                "lapsed_reads", "hold_acks", "ignored_acks", "failed_acks",
                "push_writes", "push_abandoned", "stale_push_answers")

    def reset(self) -> None:
        self.data = {"bytes": [], "descriptors": [], "transfer_s": [], "post_s": [], **dict.fromkeys(self.COUNTERS, 0)}

    def record(self, nbytes: int, descriptors: int, transfer_s: float, post_s: float) -> None:
        self.data["bytes"].append(nbytes)
        self.data["descriptors"].append(descriptors)
        self.data["transfer_s"].append(transfer_s)
        self.data["post_s"].append(post_s)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        n = len(self.data["bytes"])
        out: dict[str, int | float] = {
            "transfers": n,
            "bytes": int(sum(self.data["bytes"])),
            "descriptors": int(sum(self.data["descriptors"])),
            "avg_transfer_ms": 1e3 * sum(self.data["transfer_s"]) / n if n else 0.0,
            "avg_post_ms": 1e3 * sum(self.data["post_s"]) / n if n else 0.0,
        }
        for key in self.COUNTERS:
            out[key] = self.data.get(key, 0)
        return out

    def is_empty(self) -> bool:
        return not self.data["bytes"] and not any(self.data.get(k, 0) for k in self.COUNTERS)
