"""Posts a plan's requests in a descriptor mode: ``direct`` through :class:`NixlRank`, ``staged``
through a registered staging buffer and a local scatter, ``auto`` chosen per request.

The layout (which remote pages go to which staging slots, which bytes then go where) comes from
:mod:`nixlkv.core.staging`; this module owns the buffer, the NIXL handles and the torch copies
(CPU and CUDA alike). A staged request runs in rounds of at most half the buffer (double
buffering: round ``r``'s scatter runs on a scatter thread while round ``r + 1`` is read into
the other half). Each prefill rank's
notification rides on the last READ from that rank, posted only after every earlier READ from it
completed, so a prefill rank never frees blocks still to be read. Staged requests share the
buffer one at a time, first come first served.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..core.plan import TransferPlan
from ..core.request_ids import ResolvedRequest
from ..core.descriptor_mode import Choice, TransferCosts, choose
from ..core.staging import DEFAULT_STAGING_BYTES, Scatter, StagedPlan, StagedRequest, StagingError, check_mode
from .nixl_rank import InFlight, NixlRank, PreparedPlan, TransferError, notification

logger = logging.getLogger("nixlkv.connector")

PROBE_EVERY = 16  # auto: every so many declined requests, one is staged to re-measure the copy
# ... but only while staging is within reach: the plan's smallest direct descriptor under this many
# times ``TransferCosts.stage_below_bytes`` (a copy twice as fast would make staging win there).
PROBE_REACH = 2.0


@dataclass
class ReaderPlan:
    """A plan prepared for both modes: the direct NIXL lists and, where staging applies, the
    staged layout with its remote lists and the staging lists of each buffer half."""

    prepared: PreparedPlan
    staged: StagedPlan | None = None
    staging_lists: tuple[object, ...] = ()  # per buffer half: the prepped staging dlist
    remote_lists: dict[int, object] = field(default_factory=dict)

    @property
    def plan(self) -> TransferPlan:
        return self.prepared.plan


@dataclass
class StagedFlight:
    """One staged request in flight: its rounds, where it stands, what it has moved."""

    rp: ReaderPlan
    request: StagedRequest
    msg: bytes
    posted_at: float = 0.0
    post_seconds: float = 0.0
    descriptors: int = 0  # descriptor ids handed to NIXL, over every round
    nbytes: int = 0  # bytes placed in the request's local blocks
    posted_descriptors: int | None = None  # NIXL telemetry, summed over the rounds (when captured)
    mode: str = "staged"
    next_round: int = 0  # the next round to post
    reading: tuple[int, list[object]] | None = None  # (round, handles) being read
    scattering: tuple[int, concurrent.futures.Future] | None = None  # (round, copy) on the scatter thread
    done: bool = False
    error: TransferError | None = None
    scatter_seconds: float = 0.0


class Reader:
    """One rank's READ poster in a descriptor mode (see the module docstring)."""

    def __init__(
        self,
        nixl: NixlRank,
        mode: str = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        memory: Sequence[torch.Tensor] = (),
        costs: TransferCosts | None = None,
        overlap: bool = True,
    ) -> None:
        self.nixl = nixl
        self.overlap = overlap  # scatter on a thread while the next round is read
        self.mode = check_mode(mode)
        self.costs = costs  # measured on the first plan that could stage, unless given
        self.staging_bytes = int(staging_bytes)
        self._memory = [_bytes_of(t) for t in memory]
        self._queue: deque[StagedFlight] = deque()
        self._scatter_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._declined = 0  # auto requests that could have staged but went direct
        self.staged_requests = 0  # counters, for logs and tests
        self.rounds_posted = 0
        self._stuck: list[object] = []  # staged READs NIXL would not release: no round is posted meanwhile
        self.buffer: torch.Tensor | None = None  # allocated by the first plan that stages
        self._reg = None
        if self.mode != "direct":
            if self.staging_bytes < 2:
                raise StagingError(f"staging_bytes must be at least 2 bytes for descriptor_mode {mode!r}, got {staging_bytes}")
            if not self._memory:
                raise StagingError(f"descriptor_mode {mode!r} needs the local KV memory as tensors to scatter into")

    def _ensure_buffer(self) -> torch.Tensor:
        """The staging buffer, on the KV cache's device, registered with this rank's agent."""
        if self.buffer is None:
            device = self._memory[0][2].device
            try:
                self.buffer = torch.zeros(self.staging_bytes, dtype=torch.uint8, device=device)
            except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
                raise StagingError(
                    f"staging_bytes={self.staging_bytes} could not be allocated on {device} ({type(exc).__name__}: "
                    f"{str(exc)[:160]}); lower staging_bytes or use descriptor_mode 'direct'"
                ) from None
            regs = [(self.buffer.data_ptr(), self.staging_bytes, device.index or 0, "")]
            self._reg = self.nixl.agent.register_memory(regs, self.nixl.mem_type)
        return self.buffer

    @property
    def half(self) -> int:
        return self.staging_bytes // 2

    # ------------------------------------------------------------------ per plan
    def prepare(self, plan: TransferPlan, agents: Mapping[int, str]) -> ReaderPlan:
        rp = ReaderPlan(self.nixl.prepare(plan, agents))
        if self.mode == "direct" or not plan.read_ranks:
            return rp
        try:
            staged = StagedPlan(plan, self.half)
        except StagingError:
            if self.mode == "staged":
                raise
            return rp  # auto: this plan is posted directly
        if self.mode == "auto" and not staged.can_help:
            return rp
        try:
            buffer = self._ensure_buffer()
        except StagingError as exc:
            if self.mode == "staged":
                raise
            logger.warning("nixlkv: %s; descriptor_mode auto posts this remote's reads directly", exc)
            return rp  # auto: the plan as it is, every request read directly
        dev = buffer.device.index or 0
        halves: list[object] = []
        remote: dict[int, object] = {}
        try:
            for h in range(2):  # the same rows for every engine of one layout: shared
                halves.append(self.nixl.prep_local(staged.staging_rows(buffer.data_ptr() + h * self.half, dev)))
            for p, rows in staged.remote_descs.items():
                remote[p] = self.nixl.prep_remote(agents[p], rows, plan.remote[p].mem_type)
        except Exception:
            self.nixl.release_lists([*halves, *remote.values()])
            self.nixl.release_prepared(rp.prepared)
            raise
        rp.staged, rp.staging_lists, rp.remote_lists = staged, tuple(halves), remote
        return rp

    def forget(self, rp: ReaderPlan) -> None:
        """Give back a prepared plan's NIXL lists (direct and staged); no request of it may be in flight."""
        self.nixl.release_lists([*rp.staging_lists, *rp.remote_lists.values()])
        self.nixl.release_prepared(rp.prepared)

    def choose(self, rp: ReaderPlan, resolved: ResolvedRequest) -> Choice:
        if self.mode == "auto" and rp.staged is not None and self.costs is None:
            self.costs = measured_costs(self._ensure_buffer().device)
        choice = choose(self.mode, rp.plan, rp.staged, resolved, self.costs)
        staged = rp.staged
        if (
            self.mode == "auto" and choice.mode == "direct" and staged is not None and staged.can_help
            and staged.min_direct_bytes < PROBE_REACH * self.costs.stage_below_bytes
        ):
            # Staging could help but costs more now: stage one request in PROBE_EVERY anyway,
            # so that a machine that got quieter is noticed (the scatter refreshes the measure).
            # Far out of reach (large head slices) a probe would only cost a slow request.
            self._declined += 1
            if self._declined % PROBE_EVERY == 0:
                return Choice("staged", choice.staged or rp.staged.stage(resolved, choice.posted_staged))
        return choice

    # ------------------------------------------------------------------ per request
    def post(self, rp: ReaderPlan, resolved: ResolvedRequest, remote_request_id: str) -> InFlight | StagedFlight:
        """Post one request in the mode :meth:`choose` picks; staged requests queue for the buffer."""
        choice = self.choose(rp, resolved)
        if choice.mode == "direct":
            return self.nixl.post(rp.prepared, resolved, remote_request_id)
        msg = notification(remote_request_id, resolved.consumers)
        flight = StagedFlight(rp, choice.staged, msg, posted_at=time.perf_counter())
        self.staged_requests += 1
        try:
            for rank in choice.staged.notify_only:
                self.nixl.agent.send_notif(rp.prepared.agents[rank], msg)
        except Exception as exc:  # nixl raises its own types
            raise TransferError(f"sending a notification failed: {type(exc).__name__}: {exc}") from exc
        if not choice.staged.rounds:
            flight.done = True
        else:
            self._queue.append(flight)
            self._advance()
        flight.post_seconds = time.perf_counter() - flight.posted_at
        return flight

    def poll(self, flight: InFlight | StagedFlight) -> bool:
        """Non-blocking: True once the request's bytes are all in place. Raises TransferError."""
        if isinstance(flight, InFlight):
            return self.nixl.poll(flight)
        self._advance()
        if flight.error is not None:
            raise flight.error
        return flight.done

    def wait(self, flight: InFlight | StagedFlight, timeout: float = 60.0) -> float:
        """Block until done; seconds from post to done. Raises TransferError."""
        if isinstance(flight, InFlight):
            return self.nixl.wait(flight, timeout)
        deadline = time.perf_counter() + timeout
        while not self.poll(flight):
            if time.perf_counter() > deadline:
                self.release(flight)
                raise TransferError(f"staged READs not done after {timeout} s")
            copying = self._queue[0].scattering if self._queue else None
            if copying is not None:  # block on the copy instead of spinning against it for the GIL
                concurrent.futures.wait([copying[1]], timeout=0.01)
            else:
                time.sleep(50e-6)
        return time.perf_counter() - flight.posted_at

    def release(self, flight: InFlight | StagedFlight) -> bool:
        """Give up on a request (timeout, error, shutdown): its handles go, nothing more is scattered.
        True when nothing NIXL posted can still write into the request's blocks. A staged READ
        writes only the staging buffer, so a staged request's blocks are safe once its scatter
        settled; a READ NIXL will not release quarantines the buffer instead (see ``_advance``)."""
        if isinstance(flight, InFlight):
            return self.nixl.release(flight)
        if flight.reading is not None:
            self._release_handles(flight.reading[1])
            flight.reading = None
        try:
            self._settle(flight)  # a copy in progress finishes before the blocks are given up
        except TransferError:
            pass
        if flight in self._queue:
            self._queue.remove(flight)
        if not flight.done and flight.error is None:
            flight.error = TransferError("the staged request was released before it finished")
        self._advance()
        return True

    def close(self) -> None:
        for flight in list(self._queue):
            self.release(flight)
        if self._scatter_pool is not None:
            self._scatter_pool.shutdown(wait=True)
            self._scatter_pool = None
        if self._reg is not None:
            try:
                self.nixl.agent.deregister_memory(self._reg)
            except Exception:  # the agent may already be gone
                pass
            self._reg = None

    # ------------------------------------------------------------------ the state machine
    def _advance(self) -> None:
        """Move the head of the queue as far as it goes without blocking. While a READ that NIXL
        would not release may still write into the staging buffer, no round is posted into it."""
        while self._queue:
            if self._stuck and not self._retry_stuck():
                return
            flight = self._queue[0]
            try:
                progressed = self._step(flight)
            except TransferError as exc:
                try:
                    self._settle(flight)  # never leave a copy running into blocks given up
                except TransferError:
                    pass
                flight.error = exc
                progressed = True
            if flight.done or flight.error is not None:
                self._queue.popleft()
                continue
            if not progressed:
                return

    def _step(self, flight: StagedFlight) -> bool:
        """One move of a staged request. Round ``r``'s scatter runs on the scatter thread while
        this thread posts round ``r + 1`` into the other half (UCX over ``cma`` moves the bytes
        inside the posting call); round ``r + 2`` reuses round ``r``'s half only once that
        scatter finished."""
        if flight.reading is None and flight.next_round == 0:
            self._post_round(flight)
            return True
        if flight.scattering is not None and not flight.scattering[1].done():
            return False
        self._settle(flight)
        if flight.reading is None:  # every round read and scattered
            flight.done = True
            return True
        r, handles = flight.reading
        if not self._handles_done(handles):
            return False
        if self.nixl.capture_telemetry:
            flight.posted_descriptors = (flight.posted_descriptors or 0) + sum(
                int(self.nixl.agent.get_xfer_telemetry(h).descCount) for h in handles
            )
        self._release_handles(handles)
        flight.reading = None
        scatters = flight.request.rounds[r].scatters
        if self.overlap:
            flight.scattering = (r, self._pool().submit(self._scatter, scatters, r % 2))
        else:  # copy while the round is still in cache, then read the next one
            flight.scatter_seconds += self._scatter(scatters, r % 2)
            flight.nbytes += sum(s.total_bytes for s in scatters)
            if flight.next_round == len(flight.request.rounds):
                self._learn(flight)
        if flight.next_round < len(flight.request.rounds):
            self._post_round(flight)
        return True

    def _settle(self, flight: StagedFlight) -> None:
        """Wait for the request's scatter in progress, if any (it writes only the request's own
        blocks, from a READ that completed), and account for it; a failed copy fails the request."""
        if flight.scattering is None:
            return
        r, future = flight.scattering
        flight.scattering = None
        try:
            flight.scatter_seconds += future.result()
        except TransferError:
            raise
        except Exception as exc:  # a torch/numpy error in the copy
            raise TransferError(f"scattering round {r} failed: {type(exc).__name__}: {exc}") from exc
        flight.nbytes += sum(s.total_bytes for s in flight.request.rounds[r].scatters)
        if flight.reading is None and flight.next_round == len(flight.request.rounds):
            self._learn(flight)

    def _learn(self, flight: StagedFlight) -> None:
        """Refresh ``auto``'s copy bandwidth from a finished request's real scatter."""
        if self.mode != "auto" or self.costs is None or flight.scatter_seconds <= 0 or flight.nbytes <= 0:
            return
        seen = flight.nbytes / flight.scatter_seconds
        self.costs = replace(self.costs, copy_bytes_per_s=0.5 * self.costs.copy_bytes_per_s + 0.5 * seen)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._scatter_pool is None:
            self._scatter_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixlkv-scatter")
        return self._scatter_pool

    def _post_round(self, flight: StagedFlight) -> None:
        r = flight.next_round
        rnd = flight.request.rounds[r]
        rp = flight.rp
        handles: list[object] = []
        try:
            for read in rnd.reads:
                notif = flight.msg if flight.request.last_round.get(read.remote_rank) == r else b""
                h = self.nixl.agent.make_prepped_xfer(
                    "READ", rp.staging_lists[r % 2], read.local_ids, rp.remote_lists[read.remote_rank], read.remote_ids, notif
                )
                handles.append(h)
                if self.nixl.agent.transfer(h) == "ERR":
                    raise TransferError(f"NIXL refused the staged READ of round {r} from remote rank {read.remote_rank}")
                flight.descriptors += read.num_descriptors
        except TransferError:
            self._release_handles(handles)
            raise
        except Exception as exc:  # nixl raises its own types
            self._release_handles(handles)
            raise TransferError(f"posting the staged READs of round {r} failed: {type(exc).__name__}: {exc}") from exc
        flight.reading = (r, handles)
        flight.next_round = r + 1
        self.rounds_posted += 1

    def _handles_done(self, handles: list[object]) -> bool:
        release = lambda: self._release_handles(handles)  # noqa: E731
        states = [self.nixl.state(h, release, "a staged NIXL READ", "; nothing of its round was scattered") for h in handles]
        return all(s == "DONE" for s in states)

    def _release_handles(self, handles: list[object]) -> bool:
        """Release staged READs; one NIXL cannot cancel yet may still write into the staging
        buffer, so it is kept in ``_stuck`` and retried by ``_advance``. True when every one went."""
        kept = [h for h in handles if not self.nixl.release_handle(h)]
        handles.clear()
        self._stuck.extend(kept)
        return not kept

    def _retry_stuck(self) -> bool:
        self._stuck = [h for h in self._stuck if not self.nixl.release_handle(h)]
        return not self._stuck

    def _scatter(self, scatters: Iterable[Scatter], half: int) -> float:
        """Copy one round out of its half (on the scatter thread); seconds it took."""
        t0 = time.perf_counter()
        base = self.buffer.data_ptr() + half * self.half
        for s in scatters:
            copy_rows(self._memory, self.buffer, base, s)
        if self.buffer.is_cuda:  # the next READ into this half must not overtake the copies
            torch.cuda.current_stream(self.buffer.device).synchronize()
        return time.perf_counter() - t0


def measured_costs(device: torch.device, page: int = 16 << 10, pages: int = 2048) -> TransferCosts:
    """TransferCosts with this machine's copy bandwidth as it is now: the scatter's own kind of
    copy (pages into every other page slot, as a P>D head slice lands; 32 MiB by default, out of
    the core's caches), best of three. The executor then refines the copy bandwidth from every
    staged request's real scatter.

    NIXL's own byte rate is taken as half of a plain copy's (``cma`` measured at 45-75% of
    memcpy for large descriptors); the per-descriptor cost is the measured constant of
    :class:`TransferCosts`.
    """
    src = torch.ones(pages * page, dtype=torch.uint8, device=device)
    dst = torch.zeros(2 * pages * page, dtype=torch.uint8, device=device)
    best_strided, best_plain = float("inf"), float("inf")
    for _ in range(3):
        for strided in (True, False):
            if src.is_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if src.is_cuda:
                target = dst.view(pages, 2 * page)[:, :page] if strided else dst[: pages * page].view(pages, page)
                target.copy_(src.view(pages, page))
                torch.cuda.synchronize(device)
            else:
                d, s_ = dst.numpy().reshape(pages, 2 * page), src.numpy().reshape(pages, page)
                np.copyto(d[:, :page] if strided else dst.numpy()[: pages * page].reshape(pages, page), s_)
            dt = time.perf_counter() - t0
            if strided:
                best_strided = min(best_strided, dt)
            else:
                best_plain = min(best_plain, dt)
    nbytes = pages * page
    return TransferCosts(copy_bytes_per_s=nbytes / best_strided, nixl_bytes_per_s=0.5 * nbytes / best_plain)


def _bytes_of(t: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(address, nbytes, uint8 tensor) over a tensor's whole storage."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return int(storage.data_ptr()), int(storage.nbytes()), flat


def memory_tensors(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct backing allocation of the layer views (what the scatter writes)."""
    seen: dict[int, torch.Tensor] = {}
    for view in kv_caches.values():
        seen.setdefault(int(view.untyped_storage().data_ptr()), view)
    return list(seen.values())


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def copy_rows(memory: Sequence[tuple[int, int, torch.Tensor]], staging: torch.Tensor, base: int, s: Scatter) -> None:
    """Put one scatter's rows in place with one vectorised copy: row slices where blocks and
    slots run consecutively, else a row-wise fancy index (numpy on CPU, where it copies whole
    rows; torch's ``index_copy_`` on a strided CPU view goes element by element)."""
    n = int(s.local_blocks.size)
    if n == 0:
        return
    last = int(s.local_blocks.max())
    lo, hi = s.local_address, s.local_address + last * s.local_stride + s.nbytes
    mem = next(((a, m, t) for a, m, t in memory if a <= lo and hi <= a + m), None)
    if mem is None:
        raise TransferError(f"scatter target [{lo:#x}, {hi:#x}) is outside the local KV memory")
    m_addr, _, m_bytes = mem
    src_off = base - staging.data_ptr() + s.delta
    blocks, slots = s.local_blocks, s.slots
    runs_blocks = n == 1 or bool(np.all(np.diff(blocks) == 1))
    runs_slots = n == 1 or bool(np.all(np.diff(slots) == 1))
    if not staging.is_cuda:
        mem_np, stage_np = m_bytes.numpy(), staging.numpy()
        dst = np.lib.stride_tricks.as_strided(mem_np[lo - m_addr :], (last + 1, s.nbytes), (s.local_stride, 1))
        table = np.lib.stride_tricks.as_strided(stage_np[src_off:], (int(slots.max()) + 1, s.nbytes), (s.slot_len, 1))
        src = table[int(slots[0]) : int(slots[0]) + n] if runs_slots else table[slots]
        if runs_blocks:
            np.copyto(dst[int(blocks[0]) : int(blocks[0]) + n], src)
        else:
            dst[blocks] = src
        return
    w, dtype = next(  # on CUDA, the widest word every offset and length divides
        (w, d) for w, d in _WORDS
        if (lo - m_addr) % w == 0 and s.local_stride % w == 0 and s.nbytes % w == 0
        and src_off % w == 0 and s.slot_len % w == 0 and m_bytes.numel() % w == 0 and staging.numel() % w == 0
    )
    mem_w, stage_w = m_bytes.view(dtype), staging.view(dtype)
    k = s.nbytes // w
    dst_t = mem_w.as_strided((last + 1, k), (s.local_stride // w, 1), (lo - m_addr) // w)
    table_t = stage_w.as_strided((int(slots.max()) + 1, k), (s.slot_len // w, 1), src_off // w)
    if runs_slots:
        src_t = table_t[int(slots[0]) : int(slots[0]) + n]
    else:
        src_t = table_t.index_select(0, torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(staging.device))
    if runs_blocks:
        dst_t[int(blocks[0]) : int(blocks[0]) + n].copy_(src_t)
    else:
        dst_t.index_copy_(0, torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64)).to(staging.device), src_t)
