"""serve-bench's ceiling: a raw NIXL READ of a served request's byte count, one contiguous
descriptor per prefill agent, in one process or with every agent on a host of its own (network
namespaces; root). Each measurement checks that it brought the prefill agents' bytes, and across
hosts that they crossed the decode host's interface; the controls show both checks can fail."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from nixlkv.serving import ceiling, netns
from nixlkv.serving.ceiling import VLLM_AGENT, AgentSettings, PrefillAgent, read_ceiling, read_ceiling_across_hosts
from nixlkv.transport.nixl_rank import TransferError

QUIET = AgentSettings(progress_delay_us=1000, num_threads=0, telemetry=False)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_the_ceiling_reads_each_prefill_agents_bytes_and_refuses_bytes_that_are_not_theirs() -> None:
    secs = read_ceiling(3 << 20, 2, 2, VLLM_AGENT)
    assert len(secs) == 2 and all(0 < s < ceiling.WAIT_TIMEOUT_S for s in secs)
    # the control: the decode side handed the agents in the wrong order reads rank 1's bytes where
    # rank 0's belong, and says so
    share = 1 << 20
    agents = [PrefillAgent.make(QUIET, r, share) for r in range(2)]
    d_buf = np.zeros(2 * share, dtype=np.uint8)
    d = QUIET.agent("ceiling-D", d_buf)
    try:
        with pytest.raises(TransferError, match="prefill agent 0's bytes"):
            ceiling.timed_reads(d, d_buf, share, [agents[1].address, agents[0].address], 1)
        assert ceiling.timed_reads(d, d_buf, share, [a.address for a in agents], 1)[0] > 0
    finally:
        d.close()
        for a in agents:
            a.nixl.close()
    with pytest.raises(ValueError, match="positive"):
        read_ceiling(0, 1, 1, VLLM_AGENT)


def test_the_ceiling_across_hosts_crosses_the_decode_hosts_interface(monkeypatch) -> None:
    before = _namespaces()
    secs = read_ceiling_across_hosts(2 << 20, 2, 2, QUIET, sys.executable)
    assert len(secs) == 2 and all(0 < s < ceiling.WAIT_TIMEOUT_S for s in secs)
    assert _namespaces() == before  # the hosts are gone
    # the control: UCX left free to pick its transport moves the bytes through process memory
    # (cma) between the namespaces, and the interface's counter tells
    monkeypatch.setattr(netns, "UCX_ENV", {})
    with pytest.raises(TransferError, match="did not go over the network"):
        read_ceiling_across_hosts(2 << 20, 2, 1, QUIET, sys.executable)
    assert _namespaces() == before


def test_a_prefill_agent_that_dies_ends_the_ceiling_across_hosts_at_once(tmp_path) -> None:
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\n[ \"$3\" = prefill ] && {{ echo 'prefill agent: no memory' >&2; exit 3; }}\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="prefill0 exited .*no memory"):
        read_ceiling_across_hosts(1 << 20, 1, 1, QUIET, str(wrapper))
    assert time.monotonic() - t0 < 60  # not the whole HOSTS_TIMEOUT_S
    assert "nxc" not in _namespaces()
