"""P killed while a READ is in flight: D fails that request alone (its blocks reported invalid,
no byte outside them written), never hangs, and reads the next request from a healthy P.
With several KV groups (HMA) a failed load reaches vLLM's real Scheduler as failed_recving alone,
which both of its kv_load_failure_policy values handle."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from nixlkv.testing import oracle
from nixlkv.testing.processes import engine_context, engine_process
from nixlkv.vllm.config import ConnectorConfig
from nixlkv.vllm.metadata import NixlkvMetadata, RecvRequest

from connector_helpers import Engine, blocks, fa_scenario, serve_prefill
from pd_harness import keep_blocks
from test_connector_worker import drive, recv

pytestmark = pytest.mark.nixl

# Small pages (2 heads x 8) in 32 layers, block ids reversed on D so NIXL cannot merge
# descriptors: a 700-block request is ~22k descriptors, hundreds of ms of READ on loopback.
BIG = {"p_tp": 1, "d_tp": 1, "num_tokens": 16, "heads": 2, "head_size": 8, "layers": 32, "num_blocks": 1536}
P_IDS = list(range(1, 701))
WARM, VICTIM, NEXT = list(range(700, 0, -1)), list(range(1400, 700, -1)), list(range(1500, 1400, -1))


def _read(port: int, rid: str, local: list[int], remote: list[int]) -> RecvRequest:
    return RecvRequest(local_block_ids=(local,), remote_block_ids=(remote,), remote_engine_id="P",
                       remote_request_id=rid, remote_host="127.0.0.1", remote_port=port)


def test_prefill_killed_mid_read(monkeypatch, caplog) -> None:
    parent, child = engine_context().Pipe()
    proc = engine_process(serve_prefill, (child, BIG, P_IDS, ["warm", "victim"], 3))
    proc.start()
    sc = fa_scenario(**BIG)
    d = Engine(sc, "decode", "D", config=ConnectorConfig(transfer_timeout_s=10.0, handshake_timeout_s=10.0))
    healthy = Engine(sc, "prefill", "P-healthy", serve=True)
    nobody = SimpleNamespace(workers=[])  # P lives in the other process
    try:
        assert parent.poll(120), "the prefill process did not start"
        port = parent.recv()
        dw, rank = d.workers[0], d.ranks[0]
        oracle.fill_decode(rank)
        calls: list[dict[str, float]] = []
        real_transfer = dw.nixl.agent.transfer
        posted = threading.Event()

        def timed_transfer(handle, *args, **kwargs):  # instrumentation only: the READ is NIXL's
            call = {"posted": time.perf_counter()}
            calls.append(call)
            posted.set()
            try:
                call["state"] = real_transfer(handle, *args, **kwargs)
                return call["state"]
            finally:
                call["returned"] = time.perf_counter()

        monkeypatch.setattr(dw.nixl.agent, "transfer", timed_transfer)
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"warm": _read(port, "warm", WARM, P_IDS)}))
        done, failed, _ = drive(nobody, d, {"warm"}, timeout=60)
        assert done[0] == {"warm"} and not failed[0]
        warm_s = calls[0]["returned"] - calls[0]["posted"]
        assert warm_s > 0.02, f"a {warm_s:.3f} s READ is too short to kill P in the middle of one"

        posted.clear()
        killed: dict[str, float] = {}

        def kill_mid_read() -> None:
            posted.wait(60)
            time.sleep(warm_s / 4)
            os.kill(proc.pid, signal.SIGKILL)
            killed["at"] = time.perf_counter()

        killer = threading.Thread(target=kill_mid_read)
        killer.start()
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="nixlkv.connector"):
            dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"victim": _read(port, "victim", VICTIM, P_IDS)}))
            done, failed, _ = drive(nobody, d, {"victim"}, timeout=30)
        killer.join(10)
        assert failed[0] == {"victim"} and done[0] == {"victim"}, "the READ survived P's death?"
        assert time.monotonic() - t0 < 10, "the decode worker hung on a dead prefill engine"
        victim = calls[1]
        assert victim["posted"] < killed["at"] < victim["returned"], (victim, killed)  # in flight at the kill
        assert dw.take_invalid_block_ids() == set(VICTIM)
        assert "nixlkv recv failed req=victim" in caplog.text and "Traceback" not in caplog.text

        for r in healthy.ranks:
            oracle.fill_prefill(r, blocks(r, P_IDS[:100]), seed=3)
        healthy.workers[0].start_load_kv(NixlkvMetadata(reqs_to_send={"next": 30.0}))
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"next": recv(healthy, "next", NEXT, P_IDS[:100])}))
        done, failed, sent = drive(healthy, d, {"next"}, timeout=60)
        assert done[0] == {"next"} and not failed[0] and sent[0] == {"next"}

        expected = oracle.expected_decode(rank, blocks(rank, WARM), seed=3)
        oracle.write_pattern(rank, expected, blocks(rank, NEXT), seed=3)
        keep_blocks(expected, rank, set(VICTIM))  # the failed READ's own blocks: any state
        assert oracle.compare(rank, expected) is None  # nothing else written, warm/next byte-exact
    finally:
        parent.send("stop") if proc.is_alive() else None
        proc.join(10)
        healthy.close()
        d.close()


def _hybrid_decode(monkeypatch, policy: str):
    import pd_harness

    build = pd_harness.vllm_config

    def with_policy(*args, **kwargs):
        vc = build(*args, **kwargs)
        vc.kv_transfer_config.kv_load_failure_policy = policy
        return vc

    monkeypatch.setattr(pd_harness, "vllm_config", with_policy)
    d = pd_harness.PDEngine(pd_harness.PDCase(model="llama-sw"), "decode", "D",
                            {"side_channel_host": "127.0.0.1", "side_channel_port": 0, "handshake_timeout_s": 0.5})
    assert len(d.ranks[0].kv_cache_config.kv_cache_groups) > 1
    return d


def _dead_remote_params() -> dict:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3], [4, 5, 6]],
            "remote_engine_id": "P-dead", "remote_request_id": "h", "remote_host": "127.0.0.1", "remote_port": port,
            "tp_size": 1, "remote_lease_s": 30.0,
            # what a P of this windowed model publishes for a 40-token prompt: one token held back
            "remote_num_tokens": 39}


@pytest.mark.vllm
def test_vllm_refuses_flat_invalid_block_ids_with_several_kv_groups(monkeypatch) -> None:
    """Why nixlkv reports an HMA failure as failed_recving alone: vLLM 0.33's Scheduler raises on
    invalid_block_ids once there are several KV groups (block ids are per group). If a vLLM
    release accepts them, this fails and the worker's single-group restriction can go."""
    d = _hybrid_decode(monkeypatch, "fail")
    try:
        with pytest.raises(RuntimeError, match="multiple KV cache groups"):
            d.scheduler._handle_invalid_blocks({1, 2}, {})
    finally:
        d.close()


@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_hybrid_load_failure_reaches_vllm_as_failed_recving(monkeypatch, policy: str) -> None:
    """A hybrid model's load fails (its P is gone): no invalid block ids (which would raise in
    vLLM's scheduler), the request alone fails ("fail") or is prefilled locally ("recompute"),
    the engine keeps stepping and every block comes back."""
    from pd_harness import prompt

    d = _hybrid_decode(monkeypatch, policy)
    try:
        oracle.fill_decode(d.ranks[0])
        d.add("h", prompt(3, 40), 2, _dead_remote_params())
        deadline = time.monotonic() + 30
        while "h" not in d.outputs and time.monotonic() < deadline:
            d.step()
            time.sleep(0.005)
        assert "h" in d.outputs, "the decode engine did not finish the request"
        assert d.failed_recving == {"h"} and not d.invalid_blocks
        reason = str(d.outputs["h"].finish_reason).lower()
        assert reason.endswith("error") if policy == "fail" else reason.endswith("length"), reason
        assert (d.ranks[0].buffer.numpy().view("uint8") == oracle.SENTINEL).all()  # no READ landed
        leaks = d.leaks()
        assert leaks["requests"] == 0 and leaks["nonzero_refs"] == 0 and leaks["free_blocks"] == leaks["expected_free"]
    finally:
        d.close()
