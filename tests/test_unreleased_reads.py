"""#19 point 1: a load given up on (READ error or timeout) is never reported, and its blocks never
freed, while NIXL may still write into them. NIXL refuses to release a transfer it cannot cancel;
a wrapper around the real agent refuses the first releases (fault injection, real NIXL below)."""

from __future__ import annotations

import time

import pytest

from nixlkv.testing import oracle
from nixlkv.transport.nixl_rank import InFlight
from nixlkv.vllm.config import ConnectorConfig
from nixlkv.vllm.metadata import NixlkvMetadata

from connector_helpers import Engine, blocks, fa_scenario
from test_connector_worker import recv

pytestmark = pytest.mark.nixl


class RefusingAgent:
    """The real nixl agent, except that ``release_xfer_handle`` raises ``refusals`` times first
    (what NIXL does for an active transfer it cannot cancel)."""

    def __init__(self, agent: object, refusals: int) -> None:
        self._agent = agent
        self.refusals = refusals
        self.refused = 0

    def release_xfer_handle(self, handle: object) -> None:
        if self.refused < self.refusals:
            self.refused += 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: transfer is active and cannot be cancelled")
        self._agent.release_xfer_handle(handle)

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)


def step(d: Engine) -> tuple[set[str], set[str]]:
    w = d.workers[0]
    w.start_load_kv(None)
    _, done = w.get_finished(set())
    return done, w.take_failed_recving()


@pytest.mark.parametrize("refusals", [0, 3])
def test_timed_out_read_is_reported_only_once_released(monkeypatch, refusals: int) -> None:
    sc = fa_scenario(1, 1, num_tokens=40)
    p = Engine(sc, "prefill", "P", serve=True)
    d = Engine(sc, "decode", "D", config=ConnectorConfig(transfer_timeout_s=0.2))
    try:
        dw = d.workers[0]
        agent = RefusingAgent(dw.nixl.agent, refusals)
        monkeypatch.setattr(dw.nixl, "agent", agent)
        monkeypatch.setattr(dw.nixl, "poll", lambda flight: False)  # the READ never reports DONE
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"stuck": recv(p, "stuck", [4, 5], [1, 2])}))
        deadline = time.monotonic() + 10
        reported: list[tuple[set[str], set[str]]] = []
        while time.monotonic() < deadline and not reported:
            done, failed = step(d)
            if done or failed:
                reported.append((done, failed))
            elif agent.refused:  # given up on, but not reported while NIXL keeps the handle
                assert dw.busy and "stuck" in dw._draining
            time.sleep(0.01)
        assert reported == [({"stuck"}, {"stuck"})]
        assert agent.refused == refusals  # reported only after the refusals ran out
        assert dw.take_invalid_block_ids() == {4, 5}
        assert not dw._draining and not dw.busy
        stats = dw.take_stats()
        assert stats is not None
        assert stats.data.get("unreleased_transfers", 0) == (1 if refusals else 0)
        assert stats.data.get("release_retries", 0) == refusals
    finally:
        p.close()
        d.close()


def test_release_reports_what_it_could_not_release() -> None:
    """NixlRank.release keeps a handle NIXL refused (the negative control of the wrapper above:
    without the refusal the same flight empties at once)."""
    sc = fa_scenario(1, 1, num_tokens=40)
    d = Engine(sc, "decode", "D")
    try:
        nixl = d.workers[0].nixl
        real = nixl.agent
        nixl.agent = RefusingAgent(real, 1)
        flight = InFlight(handles=["h1"])
        assert nixl.release(flight) is False and flight.handles == ["h1"]
        nixl.agent = real
    finally:
        d.close()


def test_staged_buffer_is_quarantined_while_a_read_is_unreleased(monkeypatch) -> None:
    """A staged READ NIXL would not release may still write into the staging buffer: the next
    staged request posts nothing until it is released, then lands byte-exact."""
    sc = fa_scenario(1, 1, num_tokens=200, d_layout="BLHNC")  # another layout: staging applies at equal TP
    p = Engine(sc, "prefill", "P", serve=True)
    d = Engine(sc, "decode", "D", config=ConnectorConfig(descriptor_mode="staged", staging_bytes=64 << 10))
    try:
        dw = d.workers[0]
        p_ids, d_ids = [5, 9, 3, 20, 21, 22, 40, 7, 8, 11, 12, 13, 30], [60, 2, 14, 15, 16, 33, 34, 35, 50, 51, 52, 53, 1]
        for r in p.ranks:
            oracle.fill_prefill(r, blocks(r, p_ids), seed=3)
        for r in d.ranks:
            oracle.fill_decode(r)
        p.workers[0].start_load_kv(NixlkvMetadata(reqs_to_send={"req-1": 30.0}))
        reader = dw.reader
        stuck = object()  # a READ of an earlier request that NIXL kept
        agent = RefusingAgent(dw.nixl.agent, 2)
        real_release = agent._agent.release_xfer_handle
        agent._agent = _Only(agent._agent, stuck, real_release)
        monkeypatch.setattr(dw.nixl, "agent", agent)
        reader._stuck.append(stuck)
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"req-1": recv(p, "req-1", d_ids, p_ids)}))
        deadline = time.monotonic() + 20
        while agent.refused < agent.refusals and time.monotonic() < deadline:
            assert reader.rounds_posted == 0  # the handshake finishes, but no round goes into the buffer
            step(d)
            time.sleep(0.01)
        assert agent.refused == agent.refusals and reader.rounds_posted == 0
        done: set[str] = set()
        while time.monotonic() < deadline and not done:
            done, failed = step(d)
            assert not failed
            p.workers[0].get_finished(set())
            time.sleep(0.005)
        assert done == {"req-1"} and not reader._stuck and reader.rounds_posted > 0
        for r in d.ranks:
            assert oracle.compare(r, oracle.expected_decode(r, blocks(r, d_ids), seed=3)) is None
    finally:
        p.close()
        d.close()


class _Only:
    """The agent, with the placeholder handle released as a no-op (it is not NIXL's)."""

    def __init__(self, agent: object, placeholder: object, release) -> None:
        self._agent, self._placeholder, self._release = agent, placeholder, release

    def release_xfer_handle(self, handle: object) -> None:
        if handle is not self._placeholder:
            self._release(handle)

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)
