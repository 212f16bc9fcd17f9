"""NIXL agents with a progress-thread pause: the setting must reach NIXL, and bad values are refused."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from nixlkv.transport.agents import AgentConfigError, make_agent
from nixlkv.transport.nixl_rank import NixlRank


_IDLE = """
import sys, time
from nixlkv.transport.agents import make_agent
delay, seconds = int(sys.argv[1]), float(sys.argv[2])
agent = make_agent(f"idle-{delay}", progress_delay_us=delay)
time.sleep(0.1)  # the thread starts
c0 = time.process_time()
time.sleep(seconds)
print(time.process_time() - c0)
"""


def _idle_cpu_seconds(progress_delay_us: int, seconds: float = 1.0) -> float:
    """CPU time a process burns while one idle agent exists (its progress thread's polling). A
    process of its own: agents other tests left in this one would count too."""
    out = subprocess.run([sys.executable, "-c", _IDLE, str(progress_delay_us), str(seconds)],
                         capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_progress_delay_stops_the_busy_poll() -> None:
    busy = _idle_cpu_seconds(0)
    paused = _idle_cpu_seconds(1000)
    # NIXL's default polls without pause: an idle agent takes most of a core. Paused 1 ms per
    # poll it takes a small fraction; if the setting did not reach NIXL both would be alike.
    assert busy > 0.2, f"an idle busy-polling agent used only {busy:.3f} s CPU in 1 s"
    assert paused < 0.5 * busy, f"paused agent used {paused:.3f} s CPU, busy one {busy:.3f} s"


def test_transfer_with_paused_progress_is_byte_exact() -> None:
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros(2 << 20, dtype=np.uint8)
    p = NixlRank("P", [(src.ctypes.data, src.nbytes)], progress_delay_us=1000)
    d = NixlRank("D", [(dst.ctypes.data, dst.nbytes)], progress_delay_us=1000)
    try:
        name = d.add_remote(p.metadata())
        agent = d.agent
        rows = np.array([[dst.ctypes.data + 4096, src.nbytes - 8192, 0]], dtype=np.uint64)
        remote = np.array([[src.ctypes.data + 8192, src.nbytes - 8192, 0]], dtype=np.uint64)
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(rows, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), name, b"done"
        )
        assert agent.transfer(handle) != "ERR"
        deadline = time.monotonic() + 30
        while agent.check_xfer_state(handle) == "PROC":
            assert time.monotonic() < deadline, "READ did not finish"
        assert agent.check_xfer_state(handle) == "DONE"
        agent.release_xfer_handle(handle)
        expected = np.zeros_like(dst)
        expected[4096 : 4096 + src.nbytes - 8192] = src[8192:]
        assert np.array_equal(dst, expected)
        deadline = time.monotonic() + 30
        while not p.notifications():  # the notification still arrives with a paused progress thread
            assert time.monotonic() < deadline, "notification never arrived"
            time.sleep(0.01)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_progress_delay_is_refused_by_name(bad: object) -> None:
    with pytest.raises(AgentConfigError, match="progress_delay_us"):
        make_agent("bad", progress_delay_us=bad)  # type: ignore[arg-type]
