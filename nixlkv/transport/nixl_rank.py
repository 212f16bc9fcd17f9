"""Runs a TransferPlan with NIXL: one agent per rank, prepped descriptor lists, READs, notifications.

Used by the connector's worker, the rehearsal and the bench. The plan's descriptor rows are NIXL's strided
``(address, nbytes, device, stride, count)`` form, so preparation is one call per side and a
request is one ``make_prepped_xfer`` per remote rank with the IDs ``TransferPlan.resolve`` gave.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import NixlkvError
from ..core.plan import TransferPlan
from ..core.request_ids import ResolvedRequest
from ..core.topology import MAX_TP_SIZE
from .agents import make_agent

NOTIF_PREFIX = "nixlkv"


class TransferError(NixlkvError):
    """A NIXL transfer failed or timed out; the request's blocks must be treated as invalid.

    ``flight`` is set when READs of the request were posted and NIXL would not release them all:
    they may still write, so the request's blocks must stay held until a later release succeeds.
    """

    def __init__(self, message: str, flight: InFlight | None = None) -> None:
        super().__init__(message)
        self.flight = flight


def notification(remote_request_id: str, consumers: int) -> bytes:
    """What a remote rank receives once per covering reader: it frees after ``consumers`` of them."""
    return f"{NOTIF_PREFIX}:{remote_request_id}:{consumers}".encode()


def parse_notification(msg: bytes) -> tuple[str, int] | None:
    """(request id, consumers) of a nixlkv notification, or None for anything else: a count of
    consumers outside [1, MAX_TP_SIZE] too (every notification comes from one of them, so 0 would
    free the blocks while the other readers still read)."""
    try:
        prefix, rest = msg.decode().split(":", 1)
        request_id, consumers = rest.rsplit(":", 1)
        count = int(consumers)
        if prefix != NOTIF_PREFIX or not request_id or not 1 <= count <= MAX_TP_SIZE:
            return None
        return request_id, count
    except (UnicodeDecodeError, ValueError):
        return None


@dataclass
class PreparedPlan:
    """NIXL handles for one plan: the local descriptor list and one list per remote rank read."""

    plan: TransferPlan
    local: object
    remote: dict[int, object]
    agents: dict[int, str]  # remote rank -> NIXL agent name


@dataclass(eq=False)  # compared by identity: rows are arrays
class _SharedList:
    """A prepped list of this rank's own descriptor rows and how many plans hold it."""

    rows: np.ndarray
    handle: object
    users: int


@dataclass
class InFlight:
    handles: list[object] = field(default_factory=list)
    posted_at: float = 0.0
    post_seconds: float = 0.0
    descriptors: int = 0
    nbytes: int = 0
    # Descriptors NIXL actually posted after merging adjacent ones (telemetry; None unless captured).
    posted_descriptors: int | None = None
    mode: str = "direct"  # descriptor mode (see nixlkv.transport.reader): this class is always direct


class NixlRank:
    """One rank's NIXL agent with its KV memory registered."""

    def __init__(
        self,
        name: str,
        memory: Iterable[tuple[int, int]],
        mem_type: str = "DRAM",
        device_id: int = 0,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        capture_telemetry: bool = False,
        progress_delay_us: int = 0,
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.mem_type = mem_type
        self.capture_telemetry = capture_telemetry
        self.agent = make_agent(self.name, backends, num_threads, capture_telemetry, progress_delay_us)
        regs = [(int(a), int(n), device_id, "") for a, n in memory]
        self._reg = self.agent.register_memory(regs, mem_type)
        self._prepped: list[object] = []  # every prepped list, each once
        # Local lists by their rows: plans that describe the same local bytes (every prefill engine
        # of one layout, a restarted one) share one prepped list, as vLLM keeps its local handles.
        self._local_lists: list[_SharedList] = []
        self._lists_lock = threading.Lock()  # handshakes prepare on their thread; the engine releases
        self._connection_md: bytes | None = None

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connection_metadata(self) -> bytes:
        """What a peer needs to send this agent notifications, and nothing of its memory: a few
        hundred bytes, where the full metadata describes every registered region (kilobytes).
        The full metadata where this NIXL cannot make the partial one."""
        if self._connection_md is None:
            try:
                from nixl._api import nixlBind

                no_memory = nixlBind.nixlRegDList(self.agent.nixl_mems[self.mem_type], np.zeros((0, 3), np.uint64))
                self._connection_md = bytes(self.agent.get_partial_agent_metadata(no_memory, True, []))
            except Exception:  # noqa: BLE001 - another NIXL's wrapper: the full metadata serves too
                self._connection_md = bytes(self.metadata())
        return self._connection_md

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def prepare(self, plan: TransferPlan, agents: Mapping[int, str]) -> PreparedPlan:
        local = self.prep_local(plan.local_descs)
        remote = {}
        try:
            for rank, rows in plan.remote_descs.items():
                remote[rank] = self.prep_remote(agents[rank], rows, plan.remote[rank].mem_type)
        except Exception:
            self.release_lists([local, *remote.values()])
            raise
        return PreparedPlan(plan, local, remote, dict(agents))

    def prep_remote(self, agent: str, rows: np.ndarray, mem_type: str) -> object:
        """A prepped list of a remote agent's descriptor rows (its own: every engine's addresses differ)."""
        handle = self.agent.prep_xfer_dlist(agent, rows, mem_type)
        with self._lists_lock:
            self._prepped.append(handle)
        return handle

    def prep_local(self, rows: np.ndarray) -> object:
        """A prepped list of this rank's own descriptor ``rows``: the one already prepped for the
        same rows where there is one (each user gives it back with :meth:`release_lists`)."""
        found = self._take_local(rows)
        if found is not None:
            return found
        handle = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self.mem_type)  # outside the lock: milliseconds
        with self._lists_lock:
            twin = self._find_local(rows)  # another handshake prepared the same rows meanwhile
            if twin is None:
                self._local_lists.append(_SharedList(rows, handle, 1))
                self._prepped.append(handle)
                return handle
            twin.users += 1
        self._release_dlist(handle)
        return twin.handle

    def _take_local(self, rows: np.ndarray) -> object | None:
        with self._lists_lock:
            entry = self._find_local(rows)
            if entry is None:
                return None
            entry.users += 1
            return entry.handle

    def _find_local(self, rows: np.ndarray) -> _SharedList | None:
        for entry in self._local_lists:
            if entry.rows is rows or (entry.rows.shape == rows.shape and entry.rows.dtype == rows.dtype
                                      and np.array_equal(entry.rows, rows)):
                return entry
        return None

    @property
    def local_lists(self) -> int:
        """Local descriptor lists prepped now (each shared by the plans with its rows)."""
        return len(self._local_lists)

    def post(self, prepared: PreparedPlan, resolved: ResolvedRequest, remote_request_id: str) -> InFlight:
        """Post every READ (each carries the notification, delivered after its data) and tell the
        covered ranks that are not read from."""
        msg = notification(remote_request_id, resolved.consumers)
        flight = InFlight(posted_at=time.perf_counter())
        try:
            for read in resolved.reads:
                handle = self.agent.make_prepped_xfer(
                    "READ", prepared.local, read.local_ids, prepared.remote[read.remote_rank], read.remote_ids, msg
                )
                flight.handles.append(handle)
                state = self.agent.transfer(handle)
                if state == "ERR":
                    raise TransferError(f"NIXL refused the READ from remote rank {read.remote_rank}")
                flight.descriptors += read.num_descriptors
                flight.nbytes += prepared.plan.read_bytes(read)
        except TransferError as exc:
            raise self._given_up(flight, exc)
        except Exception as exc:  # nixl raises its own types (e.g. nixlInvalidParamError)
            raise self._given_up(flight, TransferError(f"posting the READs failed: {type(exc).__name__}: {exc}")) from exc
        for rank in resolved.notify_only:
            self.agent.send_notif(prepared.agents[rank], msg)
        flight.post_seconds = time.perf_counter() - flight.posted_at
        return flight

    def wait(self, flight: InFlight, timeout: float = 60.0) -> float:
        """Block until every READ is done; seconds from post to done. Raises TransferError."""
        deadline = time.perf_counter() + timeout
        pending = list(flight.handles)
        while pending:
            pending = [h for h in pending if self.state(h, lambda: self.release(flight), "a NIXL READ") != "DONE"]
            if pending and time.perf_counter() > deadline:
                raise self._given_up(flight, TransferError(f"READs not done after {timeout} s"))
        elapsed = time.perf_counter() - flight.posted_at
        if self.capture_telemetry:  # what NIXL posted after its merge, read before the handles go
            flight.posted_descriptors = sum(int(self.agent.get_xfer_telemetry(h).descCount) for h in flight.handles)
        self.release(flight)
        return elapsed

    def poll(self, flight: InFlight) -> bool:
        """Non-blocking: True once every READ of ``flight`` is done (handles released then).
        Raises TransferError (handles released) when one ended in error."""
        pending = [h for h in flight.handles if self.state(h, lambda: self.release(flight), "a NIXL READ") != "DONE"]
        if pending:
            return False
        self.release(flight)
        return True

    def state(self, handle: object, release: Callable[[], None], what: str, after: str = "") -> str:
        """NIXL's state of one transfer; for an error, or a peer that went away, ``release`` runs
        and TransferError names ``what`` (and ``after``, what it means for the request)."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as exc:  # nixl raises for a transfer whose peer went away
            release()
            raise TransferError(f"checking {what} failed: {type(exc).__name__}: {exc}{after}") from exc
        if state == "ERR":
            release()
            raise TransferError(f"{what} ended in error{after}")
        return state

    def release(self, flight: InFlight) -> bool:
        """Release the request's transfer handles; True when every one went. NIXL refuses to release
        a READ it cannot cancel (it may still write): that handle stays in ``flight.handles`` and the
        request's blocks must stay held until a later call returns True."""
        flight.handles[:] = [h for h in flight.handles if not self.release_handle(h)]
        return not flight.handles

    def release_handle(self, handle: object) -> bool:
        """Release one transfer handle; False while it may still write: NIXL still reports it in
        progress, or refused. NIXL releases a READ in progress over a connection that only stalled
        (a link down), but does not stop it: its data lands when the link comes back, seconds after
        the release, into blocks given up by then (measured over UCX's TCP, tests/test_connector_netns.py).
        So a READ in progress is kept until NIXL says it ended."""
        try:
            if self.agent.check_xfer_state(handle) == "PROC":
                return False
        except Exception:  # nixl raises for a transfer whose peer went away: nothing more comes from it
            pass
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # nixl raises when the transfer is active and cannot be cancelled
            return False
        return True

    def _given_up(self, flight: InFlight, error: TransferError) -> TransferError:
        """``error`` for a flight given up on, carrying the flight when NIXL kept some of its READs."""
        if not self.release(flight):
            error.flight = flight
        return error

    def release_lists(self, handles: Iterable[object]) -> None:
        """Give back prepped descriptor lists no READ will use again (a remote that went away); a
        shared local list is released when its last plan gives it back."""
        for handle in handles:
            with self._lists_lock:
                shared = next((e for e in self._local_lists if e.handle is handle), None)
                if shared is not None:
                    shared.users -= 1
                    if shared.users > 0:
                        continue
                    self._local_lists = [e for e in self._local_lists if e is not shared]
                if not any(handle is h for h in self._prepped):
                    continue
                self._prepped = [h for h in self._prepped if h is not handle]
            self._release_dlist(handle)

    def _release_dlist(self, handle: object) -> None:
        try:
            self.agent.release_dlist_handle(handle)
        except Exception:  # already gone with its remote: nothing left to free
            pass

    def release_prepared(self, prepared: PreparedPlan) -> None:
        """Give back a plan's lists once no READ of it is in flight."""
        self.release_lists([prepared.local, *prepared.remote.values()])

    def remove_remote(self, agent: str) -> None:
        """Forget a remote agent's metadata (its connection and memory keys)."""
        try:
            self.agent.remove_remote_agent(agent)
        except Exception:  # unknown already: nothing to forget
            pass

    def notify(self, agent: str, msg: bytes) -> None:
        """A notification alone (no transfer) to a remote agent added with ``add_remote``."""
        self.agent.send_notif(agent, msg)

    def notifications(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    def close(self) -> None:
        with self._lists_lock:
            handles, self._prepped = self._prepped, []
            self._local_lists.clear()
        for handle in handles:
            self._release_dlist(handle)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            pass
