"""A prefill engine restarted under the same host:port and engine id (new process, new NIXL
agents, new memory): D notices before reading (the request names a new generation), handshakes
again and loads byte-exact from the new P; a request the old P prefilled fails cleanly without a
READ, never read from the new P's memory at the old block ids."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from nixlkv.testing import oracle

from pd_harness import PDCase, PDEngine, prompt, publish, run_decode, spawn_prefill, start_prefill, stop

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]


def stop_all(d: PDEngine | None, *prefills: tuple) -> None:
    """Close the decode engine and stop every prefill process that was started."""
    if d is not None:
        d.close()
    for proc, pipe in prefills:
        if proc is not None:
            stop(proc, pipe)


def decode_engine(case: PDCase = PDCase()) -> PDEngine:
    """The decode engine of these tests: short timeouts, its caches filled with the sentinel."""
    d = PDEngine(case, "decode", "D", {"side_channel_host": "127.0.0.1", "side_channel_port": 0,
                                       "transfer_timeout_s": 5.0, "handshake_timeout_s": 5.0})
    oracle.fill_decode(d.ranks[0])
    return d


def test_prefill_restart_on_the_same_port_is_handshaken_again(caplog) -> None:
    old, old_pipe = spawn_prefill(PDCase(), {"a": 40, "b": 40})
    new = new_pipe = d = None
    try:
        d = decode_engine()  # while P builds: P prefills, and its hold starts, once D is ready
        old_params = publish(old, old_pipe)
        port = old_params["a"]["remote_port"]
        with caplog.at_level(logging.INFO, logger="nixlkv.connector"):
            run_decode(d, old_params, {"a": 40})
            assert d.finished_recving == {"a"} and not d.failed_recving
            old_agent_names = [a for r in d.workers[0]._worker._remotes.values() for a in r.agents.values()]
            (first_plan,) = [r.prepared.plan for r in d.workers[0]._worker._remotes.values()]
            old.kill()
            old.join(10)
            # A new process image, as a restart is (a fork of the engine-process server would reuse
            # the old P's addresses, and the rebased plan below must point elsewhere).
            new, new_pipe, new_params = start_prefill(PDCase(), {"c": 40}, port=port, first_prompt=10, new_image=True)
            c = new_params["c"]
            assert (c["remote_port"], c["remote_engine_id"]) == (port, old_params["a"]["remote_engine_id"])
            assert c["remote_generation"] != old_params["b"]["remote_generation"]
            d.add("c", prompt(10, 40), 2, dict(c))  # the new P's request first: D's handshake is stale
            d.add("b", prompt(1, 40), 2, dict(old_params["b"]))  # the old P's: its blocks are gone
            deadline = time.monotonic() + 60
            while not {"b", "c"} <= set(d.outputs) and time.monotonic() < deadline:
                d.step()
                time.sleep(0.002)
        assert {"b", "c"} <= set(d.outputs), "the decode engine hung"
        assert d.failed_recving == {"b"} and "c" in d.finished_recving
        assert d.invalid_blocks == set(d.recv_blocks["b"][0])
        assert str(d.outputs["b"].finish_reason).lower().endswith("error")
        assert caplog.text.count("nixlkv handshake done engine=P") == 2
        assert "remote_tp=1 plan=planned" in caplog.text and "remote_tp=1 plan=rebased" in caplog.text
        assert "nixlkv remote restarted engine=P" in caplog.text and "previous incarnation" in caplog.text
        expected = d.expected(0, {"a": d.recv_blocks["a"], "c": d.recv_blocks["c"]})
        assert oracle.compare(d.ranks[0], expected) is None  # b's blocks: never written (no READ)
        # The new P is laid out like the old one at other addresses: D's plan for it is the first
        # plan rebased (the same segment table), and c's bytes above came through it.
        (live_plan,) = [r.prepared.plan for r in d.workers[0]._worker._remotes.values()]
        assert live_plan is not first_plan and live_plan._table is first_plan._table
        assert not all(np.array_equal(live_plan.remote_descs[p], first_plan.remote_descs[p]) for p in live_plan.remote_descs)
        assert new_pipe.poll(60)
        report = new_pipe.recv()
        assert report["finished_sending"] == ["c"] and report["requests"] == 0, report
        leaks = d.leaks()
        assert leaks["requests"] == 0 and leaks["nonzero_refs"] == 0 and leaks["free_blocks"] == leaks["expected_free"]
        # The dead P's handshake left nothing behind in D's NIXL agent: its lists were given back
        # and its agent forgotten; only the new P's remain.
        worker = d.workers[0]._worker
        assert not worker._retiring
        (live,) = worker._remotes.values()
        assert len(worker.nixl._prepped) == 1 + len(live.prepared.prepared.remote)
        old_agents = set(old_agent_names) - set(live.agents.values())
        assert old_agents and not any(worker.nixl.agent.check_remote_metadata(a) for a in old_agents)
        assert all(worker.nixl.agent.check_remote_metadata(a) for a in live.agents.values())
    finally:
        stop_all(d, (old, old_pipe), (new, new_pipe))


# per model, the blocks a 40-token prompt loads in each KV group (the hybrid: two Mamba groups, one
# running state each, and its attention group at a larger block size)
@pytest.mark.parametrize("model,loads", [("llama", [3]), ("nemotron-h", [1, 1, 2])])
def test_a_prefill_engine_restarted_with_fewer_blocks_is_planned_from_the_first_plans_segments(model: str, loads, caplog) -> None:
    """The same model and configuration restarted with another memory budget (fewer KV blocks):
    D plans it from the segments it already has (the shape memo: no strategy asked again) with
    rows and bounds of the new block count, only its remote side made anew (the hybrid's groups
    alias one tensor on both engines alike), and loads byte-exact through real NIXL."""
    old, old_pipe = spawn_prefill(PDCase(model), {"a": 40})
    new = new_pipe = d = None
    try:
        d = decode_engine(PDCase(model))  # while P builds: P prefills, and its hold starts, once D is ready
        old_params = publish(old, old_pipe)
        port = old_params["a"]["remote_port"]
        run_decode(d, old_params, {"a": 40})
        assert d.finished_recving == {"a"} and not d.failed_recving
        (first_plan,) = [r.prepared.plan for r in d.workers[0]._worker._remotes.values()]
        old.kill()
        old.join(10)
        new, new_pipe, new_params = start_prefill(PDCase(model, num_blocks=72), {"c": 40}, port=port, first_prompt=10,
                                                  new_image=True)  # a new process image, as a restart is
        d.add("c", prompt(10, 40), 2, dict(new_params["c"]))  # another prompt: nothing of it cached on D
        deadline = time.monotonic() + 60
        with caplog.at_level(logging.INFO, logger="nixlkv.connector"):
            while "c" not in d.outputs and time.monotonic() < deadline:
                d.step()
                time.sleep(0.002)
        assert "nixlkv handshake done engine=P remote_tp=1 plan=recounted" in caplog.text
        counted = [sum(s.reduce()[k] for s in d.stats) for k in ("handshakes_planned", "handshakes_rebased", "handshakes_recounted")]
        assert counted == [1, 0, 1]  # what D's metrics count: the first P planned, the restarted one recounted
        assert d.finished_recving == {"a", "c"} and not d.failed_recving
        assert [len(g) for g in d.recv_blocks["c"]] == loads  # every block of the 40-token prompt loaded
        expected = d.expected(0, {"a": d.recv_blocks["a"], "c": d.recv_blocks["c"]}, d.recv_tokens)
        assert oracle.compare(d.ranks[0], expected) is None
        (live_plan,) = [r.prepared.plan for r in d.workers[0]._worker._remotes.values()]
        assert live_plan._table is first_plan._table  # the first plan's segments, recounted
        assert live_plan.local_descs is first_plan.local_descs  # its local rows kept: the remote side made anew
        assert live_plan._aliased == (model == "nemotron-h")
        assert {g.remote_num_blocks for g in live_plan.pairings} == {72} != {g.remote_num_blocks for g in first_plan.pairings}
        assert not all(np.array_equal(live_plan.remote_descs[p], first_plan.remote_descs[p]) for p in live_plan.remote_descs)
        assert new_pipe.poll(60)
        report = new_pipe.recv()
        assert report["finished_sending"] == ["c"] and report["requests"] == 0, report
    finally:
        stop_all(d, (old, old_pipe), (new, new_pipe))
