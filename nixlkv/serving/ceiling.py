"""The transport's ceiling for a served transfer: a raw NIXL READ of the same byte count between
agents on this machine, with the agent settings the served engines ran with.

A served request's READs can go no faster than NIXL moving the same bytes as one contiguous
descriptor per prefill rank (what ``nixlkv bench`` calls its ceiling): no planner can post fewer
or larger descriptors. ``serve-bench`` measures it in the same run as the servers (after they
stopped, so they take no core from it) and states each connector's transfer against it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..transport.nixl_rank import NixlRank, TransferError

WAIT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class AgentSettings:
    """What every NIXL agent of a measurement is built with: the served engines' and the ceiling's."""

    progress_delay_us: int  # 0: NIXL's busy-polling progress thread (vLLM's NixlConnector, always)
    num_threads: int  # the UCX backend's worker threads (vLLM's NixlConnector: its ``num_threads``, 4)
    telemetry: bool  # NIXL's per-transfer telemetry (vLLM's NixlConnector: always on)

    def nixlkv_config(self) -> dict[str, object]:
        """These settings as nixlkv's ``kv_connector_extra_config`` keys."""
        return {"nixl_progress_delay_us": self.progress_delay_us, "nixl_num_threads": self.num_threads,
                "nixl_telemetry": self.telemetry}

    def vllm_config(self) -> dict[str, object]:
        """These settings for vLLM's NixlConnector, which exposes only ``num_threads`` and builds its
        agents with telemetry on and NIXL's default progress thread (busy poll)."""
        if self.progress_delay_us != 0 or not self.telemetry:
            raise ValueError("vLLM's NixlConnector always busy-polls (progress_delay_us 0) with telemetry on; "
                             f"got progress_delay_us={self.progress_delay_us}, telemetry={self.telemetry}")
        return {"num_threads": self.num_threads}


# vLLM's NixlConnector's own agent (base_worker: nixl_agent_config(num_threads=4, capture_telemetry=True),
# NIXL's progress thread at its default pthrDelay 0), which nixlkv can be set to match.
VLLM_AGENT = AgentSettings(progress_delay_us=0, num_threads=4, telemetry=True)


def _touched(nbytes: int, fill: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)  # touch every page: untouched ones would fault inside the timed READ
    return buf


def read_ceiling(nbytes: int, prefill_ranks: int, reps: int, settings: AgentSettings) -> list[float]:
    """Seconds for one decode agent to READ ``nbytes`` as one contiguous descriptor from each of
    ``prefill_ranks`` prefill agents (an equal share each), posted together; one warm-up READ, then
    ``reps`` timed (their seconds). Every agent is built with ``settings``."""
    if nbytes <= 0 or prefill_ranks < 1 or reps < 1:
        raise ValueError(f"nbytes, prefill_ranks and reps must be positive, got {nbytes}, {prefill_ranks}, {reps}")
    share = nbytes // prefill_ranks
    d_buf = _touched(share * prefill_ranks, 0)
    p_bufs = [_touched(share, r + 1) for r in range(prefill_ranks)]
    d = NixlRank("ceiling-D", [(d_buf.ctypes.data, d_buf.nbytes)], num_threads=settings.num_threads,
                 capture_telemetry=settings.telemetry, progress_delay_us=settings.progress_delay_us)
    ps = [NixlRank(f"ceiling-P{r}", [(b.ctypes.data, b.nbytes)], num_threads=settings.num_threads,
                   capture_telemetry=settings.telemetry, progress_delay_us=settings.progress_delay_us)
          for r, b in enumerate(p_bufs)]
    try:
        agent = d.agent
        names = [d.add_remote(p.metadata()) for p in ps]
        lists = [(agent.get_xfer_descs(np.array([[d_buf.ctypes.data + r * share, share, 0]], dtype=np.uint64), "DRAM"),
                  agent.get_xfer_descs(np.array([[b.ctypes.data, share, 0]], dtype=np.uint64), "DRAM"), name)
                 for r, (b, name) in enumerate(zip(p_bufs, names))]

        def once() -> float:
            t0 = time.perf_counter()
            handles = [agent.initialize_xfer("READ", loc, rem, name) for loc, rem, name in lists]
            for h in handles:
                if agent.transfer(h) == "ERR":
                    raise TransferError("NIXL refused the ceiling's READ")
            deadline = t0 + WAIT_TIMEOUT_S
            while any(agent.check_xfer_state(h) == "PROC" for h in handles):
                if time.perf_counter() > deadline:
                    raise TransferError(f"the ceiling's READ of {nbytes} bytes was not done in {WAIT_TIMEOUT_S:.0f} s")
            elapsed = time.perf_counter() - t0
            if any(agent.check_xfer_state(h) == "ERR" for h in handles):
                raise TransferError("the ceiling's READ ended in error")
            for h in handles:
                agent.release_xfer_handle(h)
            return elapsed

        once()
        if not all(np.array_equal(d_buf[r * share:(r + 1) * share][:4096], b[:4096]) for r, b in enumerate(p_bufs)):
            raise TransferError("the ceiling's READ did not bring the prefill agents' bytes")
        return [once() for _ in range(reps)]
    finally:
        d.close()
        for p in ps:
            p.close()
