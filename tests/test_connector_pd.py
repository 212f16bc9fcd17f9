"""Acceptance: P and D as separate processes, each vLLM's real v1 Scheduler + NixlkvConnector workers
(one per TP rank), the real side-channel handshake over loopback, real NIXL READs, the byte oracle,
and no leaked requests or blocks on either side afterwards."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from nixlkv.testing import oracle

from pd_harness import PDEngine, prompt, run_prefill, scenario

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

PROMPTS = {"req-0": 40, "req-1": 17, "req-2": 100, "req-3": 64}
NIXL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
             "remote_request_id", "remote_host", "remote_port", "tp_size"}


def start_prefill(p_tp: int, d_tp: int, prompts: dict[str, int], **kw):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_prefill, args=(child, p_tp, d_tp, prompts), kwargs=kw, daemon=True)
    proc.start()
    deadline = time.monotonic() + 180
    while not parent.poll(0.2):
        assert proc.is_alive() and time.monotonic() < deadline, "the prefill process published nothing"
    params = parent.recv()
    assert "error" not in params, params
    return proc, parent, params


def stop(proc, parent) -> None:
    try:
        parent.send("bye")
    except (BrokenPipeError, OSError):
        pass
    proc.join(15)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2)])
def test_pd_hybrid_sliding_window_is_byte_exact(p_tp: int, d_tp: int) -> None:
    """A hybrid model (sliding-window + full-attention layers, several KV groups, vLLM's hybrid
    KV-cache manager on both sides): only the window's blocks move, null blocks never do."""
    prompts = {"w-0": 150, "w-1": 40}
    proc, parent, params = start_prefill(p_tp, d_tp, prompts, window=64)
    d = None
    try:
        d = PDEngine(scenario(p_tp, d_tp, window=64), "decode", "D",
                     {"side_channel_host": "127.0.0.1", "side_channel_port": 0})
        assert len(d.ranks[0].kv_cache_config.kv_cache_groups) > 1
        for r in d.ranks:
            oracle.fill_decode(r)
        run_decode(d, params, prompts)
        assert d.finished_recving == set(prompts) and not d.failed_recving
        for r in range(d_tp):
            mismatch = oracle.compare(d.ranks[r], d.expected(r, d.recv_blocks, prompts))
            assert mismatch is None, str(mismatch)
        leaks = d.leaks()
        assert leaks["requests"] == 0 and leaks["nonzero_refs"] == 0 and leaks["free_blocks"] == leaks["expected_free"], leaks
        assert parent.poll(60)
        report = parent.recv()
        assert report["finished_sending"] == sorted(prompts) and report["requests"] == 0, report
        assert report["free_blocks"] == report["expected_free"], report
    finally:
        if d is not None:
            d.close()
        stop(proc, parent)


def run_decode(d: PDEngine, params: dict[str, dict], prompts: dict[str, int], timeout: float = 60) -> None:
    for i, (rid, n) in enumerate(prompts.items()):
        d.add(rid, prompt(i, n), 2, dict(params[rid]))
    deadline = time.monotonic() + timeout
    while len(d.outputs) < len(prompts) and time.monotonic() < deadline:
        d.step()
        time.sleep(0.001)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_pd_lifecycle_is_byte_exact_and_leak_free(p_tp: int, d_tp: int) -> None:
    proc, parent, params = start_prefill(p_tp, d_tp, PROMPTS)
    d = None
    try:
        assert set(params) == set(PROMPTS)
        for rid, p in params.items():
            assert NIXL_KEYS <= set(p), p  # what vLLM's NixlConnector proxies forward
            assert p["do_remote_prefill"] is True and p["remote_request_id"] == rid and p["tp_size"] == p_tp
        d = PDEngine(scenario(p_tp, d_tp), "decode", "D", {"side_channel_host": "127.0.0.1", "side_channel_port": 0})
        for r in d.ranks:
            oracle.fill_decode(r)
        run_decode(d, params, PROMPTS)
        assert set(d.outputs) == set(PROMPTS)
        assert d.finished_recving == set(PROMPTS) and not d.failed_recving and not d.invalid_blocks
        assert all(not o.finish_reason or str(o.finish_reason) != "error" for o in d.outputs.values())
        for r in range(d_tp):
            mismatch = oracle.compare(d.ranks[r], d.expected(r, d.recv_blocks))
            assert mismatch is None, str(mismatch)
        assert set(d.recv_blocks) == set(PROMPTS)
        leaks = d.leaks()
        assert leaks["requests"] == leaks["waiting"] == leaks["running"] == leaks["nonzero_refs"] == 0, leaks
        assert leaks["free_blocks"] == leaks["expected_free"], leaks
        total = {}
        for s in d.stats:
            for k, v in s.reduce().items():
                total[k] = total.get(k, 0) + v
        assert total["transfers"] == len(PROMPTS) * d_tp and total["bytes"] > 0 and total["failed_transfers"] == 0
        assert parent.poll(60)
        report = parent.recv()
        assert report["finished_sending"] == sorted(PROMPTS), report
        assert report["requests"] == 0 and report["nonzero_refs"] == 0, report
        assert report["free_blocks"] == report["expected_free"], report
    finally:
        if d is not None:
            d.close()
        stop(proc, parent)


def test_prefill_killed_fails_its_requests_and_decode_keeps_serving() -> None:
    """P dies after D's handshake with a request of D outstanding: D's READ fails (error or
    transfer_timeout_s), the request is reported failed with its blocks invalid, vLLM's scheduler
    finishes it, and the next request from a healthy P loads byte-exact; nothing leaks."""
    from pd_harness import keep_blocks

    proc, parent, params = start_prefill(1, 1, {"a": 40, "b": 40})
    d = healthy = None
    try:
        d = PDEngine(scenario(1, 1), "decode", "D", {"side_channel_host": "127.0.0.1", "side_channel_port": 0,
                                                    "transfer_timeout_s": 3.0, "handshake_timeout_s": 2.0})
        oracle.fill_decode(d.ranks[0])
        run_decode(d, params, {"a": 40})
        assert d.finished_recving == {"a"} and not d.failed_recving
        proc.kill()
        proc.join(10)
        d.add("b", prompt(1, 40), 2, dict(params["b"]))
        deadline = time.monotonic() + 30
        while "b" not in d.outputs and time.monotonic() < deadline:
            d.step()
            time.sleep(0.002)
        assert "b" in d.outputs, "the decode engine hung on a dead prefill engine"
        assert d.failed_recving == {"b"}
        b_blocks = set(d.recv_blocks["b"][0])
        assert d.invalid_blocks == b_blocks
        assert str(d.outputs["b"].finish_reason).lower().endswith("error")

        healthy = PDEngine(scenario(1, 1), "prefill", "P2", {"side_channel_host": "127.0.0.1", "side_channel_port": 0})
        healthy.add("c", prompt(2, 40), 1, {"do_remote_decode": True, "do_remote_prefill": False})
        while "c" not in healthy.outputs:
            healthy.step()
        d.add("c", prompt(2, 40), 2, dict(healthy.outputs["c"].kv_transfer_params))
        deadline = time.monotonic() + 30
        while ("c" not in d.outputs or "c" not in healthy.finished_sending) and time.monotonic() < deadline:
            d.step()
            healthy.step()
        assert "c" in d.finished_recving and "c" not in d.failed_recving
        assert healthy.finished_sending == {"c"}
        expected = d.expected(0, {"a": d.recv_blocks["a"], "c": d.recv_blocks["c"]})
        keep_blocks(expected, d.ranks[0], b_blocks - set(d.recv_blocks["c"][0]))
        assert oracle.compare(d.ranks[0], expected) is None
        for engine in (d, healthy):
            leaks = engine.leaks()
            assert leaks["requests"] == 0 and leaks["nonzero_refs"] == 0, leaks
            assert leaks["free_blocks"] == leaks["expected_free"], leaks
    finally:
        for e in (d, healthy):
            if e is not None:
                e.close()
        stop(proc, parent)
