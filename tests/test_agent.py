"""NIXL agents with a progress-thread pause: the setting must reach NIXL, and bad values are refused."""

from __future__ import annotations

import json
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


_VLLM_WAY = """
import json, sys, time
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every vLLM engine process does before it builds its connector
from nixl._api import nixl_agent, nixl_agent_config
from nixlkv.transport.agents import make_agent, pause_every_agent

def idle() -> float:  # CPU seconds this process burns in 1 s with its agents idle
    time.sleep(0.1)
    c0 = time.process_time()
    time.sleep(1.0)
    return time.process_time() - c0

agents, out = [], {}
# as vLLM's NixlConnector builds its agent: no pause it could give
agents.append(nixl_agent("vllm-way", nixl_agent_config(num_threads=4, capture_telemetry=True)))
out["vllm"] = idle()
if sys.argv[1] == "all":
    agents.append(make_agent("own", progress_delay_us=1000))  # a pause of its own, whatever the process's
    out["own"] = idle()
    pause_every_agent(0)  # the process's pause taken back: NIXL's busy poll again, from the next agent on
    agents.append(make_agent("restored"))
    out["restored"] = idle()
print(json.dumps(out))
"""


def _idle_in_engine(how: str, pause: str | None) -> dict[str, float]:
    """CPU seconds idle agents burn in 1 s in a process that loaded vLLM's general plugins with
    NIXLKV_NIXL_PROGRESS_DELAY_US set to ``pause`` (None: unset); ``how``: "vllm" (vLLM's way
    only) or "all" (then one with its own pause, then one after the process's pause is taken back)."""
    import os

    from nixlkv.serving import agent_pause

    env = {k: v for k, v in os.environ.items() if k != agent_pause.ENV}
    if pause is not None:
        env[agent_pause.ENV] = pause
    out = subprocess.run([sys.executable, "-c", _VLLM_WAY, how], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_plugin_pauses_agents_nixlkv_does_not_make() -> None:
    """serve-bench gives vLLM's NixlConnector nixlkv's pause through the engine's environment: the
    plugin vLLM loads in every engine process pauses every agent of it, however made."""
    busy = _idle_in_engine("vllm", None)["vllm"]  # the control: unset, vLLM's agent busy-polls
    paused = _idle_in_engine("all", "1000")
    assert busy > 0.2, f"vLLM's idle agent used only {busy:.3f} s CPU in 1 s"
    assert paused["vllm"] < 0.5 * busy, f"vLLM's agent under the plugin's pause used {paused['vllm']:.3f} s, busy {busy:.3f} s"
    assert paused["own"] < 0.5 * busy  # make_agent's own pause, as before
    assert paused["restored"] > 2 * paused["own"]  # pause_every_agent(0) takes it back


def test_a_bad_pause_in_the_environment_is_refused_by_its_name(monkeypatch) -> None:
    from nixlkv.serving import agent_pause
    from nixlkv.transport.agents import pause_every_agent

    for bad in ("x", "-5", "1.5"):
        monkeypatch.setenv(agent_pause.ENV, bad)
        with pytest.raises(AgentConfigError, match=agent_pause.ENV):
            agent_pause.register()
    with pytest.raises(AgentConfigError, match="NIXLKV_NIXL_PROGRESS_DELAY_US"):
        pause_every_agent(-1, setting="NIXLKV_NIXL_PROGRESS_DELAY_US")
    monkeypatch.delenv(agent_pause.ENV)
    agent_pause.register()  # unset: nothing happens
    from nixl import _api
    assert not hasattr(_api.nixlBind.nixlAgentConfig, "nixlkv_original")


def test_the_plugin_is_registered_for_vllm_to_load() -> None:
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("nixlkv_agent_pause") == "nixlkv.serving.agent_pause:register"
