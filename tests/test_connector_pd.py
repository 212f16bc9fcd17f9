"""Acceptance: P and D as separate processes, each vLLM's real v1 Scheduler + NixlkvConnector workers
(one per TP rank), the real side-channel handshake over loopback, real NIXL READs, the byte oracle,
and no leaked requests or blocks on either side afterwards (``pd_harness.run_pd``)."""

from __future__ import annotations

import pytest

from nixlkv.testing import oracle

from pd_harness import (PDCase, PDEngine, assert_failed_not_hung, load_from_a_healthy_prefill, prompt, publish,
                        run_decode, run_pd, spawn_prefill, stop)

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

PROMPTS = {"req-0": 40, "req-1": 17, "req-2": 100, "req-3": 64}
NIXL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
             "remote_request_id", "remote_host", "remote_port", "tp_size"}


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_pd_lifecycle_is_byte_exact_and_leak_free(p_tp: int, d_tp: int) -> None:
    run = run_pd(PDCase("llama", p_tp, d_tp), PROMPTS)
    for rid, p in run.params.items():
        assert NIXL_KEYS <= set(p), p  # what vLLM's NixlConnector proxies forward
        assert p["do_remote_prefill"] is True and p["remote_request_id"] == rid and p["tp_size"] == p_tp
        assert p["remote_num_tokens"] == PROMPTS[rid]
    assert run.transfers["transfers"] == len(PROMPTS) * d_tp and run.transfers["bytes"] > 0
    assert run.transfers["failed_transfers"] == 0


@pytest.mark.parametrize("p_tp,d_tp,p_block,d_block", [(2, 1, 16, 16), (1, 2, 32, 16)])
def test_a_decode_prefix_hit_reads_only_the_rest_and_leaves_the_hit_alone(p_tp: int, d_tp: int, p_block: int,
                                                                          d_block: int) -> None:
    """D's own prefix cache holds the first whole blocks of two prompts (D computed them before, and
    vLLM's real scheduler finds the hit): D claims the rest, reads only its own new blocks, every
    byte of them from the right P token slots, and leaves the hit's blocks untouched (the oracle
    expects them as D left them). Before 2026-11-25 such requests failed: the lists were
    described as holding only the claimed tokens."""
    prompts = {"hit-0": 100, "hit-1": 64, "miss-2": 40}
    hits = {"hit-0": 48, "hit-1": 32, "miss-2": 0}  # whole D blocks of the warming prompts below
    run = run_pd(PDCase("llama", p_tp, d_tp, p_block=p_block, d_block=d_block), prompts, d_warm={0: 48, 1: 33})
    assert run.loaded_tokens == prompts  # the lists describe the hit plus the claim: each whole prompt
    for rid, n in prompts.items():
        assert len(run.recv_blocks[rid][0]) == -(-n // d_block) - hits[rid] // d_block, (rid, run.recv_blocks[rid])
    assert run.transfers["failed_transfers"] == 0


def test_pd_hybrid_sliding_window_is_byte_exact() -> None:
    """A hybrid model (sliding-window + full-attention layers, several KV groups, vLLM's hybrid
    KV-cache manager on both sides): only the window's blocks move, null blocks never do."""
    run = run_pd(PDCase("llama-sw", 1, 2), {"w-0": 150, "w-1": 40})
    assert run.decode_groups > 1


def test_prefill_killed_fails_its_requests_and_decode_keeps_serving() -> None:
    """P dies after D's handshake with a request of D outstanding: D's READ fails (error or
    transfer_timeout_s), the request is reported failed with its blocks invalid, vLLM's scheduler
    finishes it, and the next request from a healthy P loads byte-exact; nothing leaks."""
    proc, parent = spawn_prefill(PDCase(), {"a": 40, "b": 40})
    d = None
    try:
        d = PDEngine(PDCase(), "decode", "D", {"side_channel_host": "127.0.0.1", "side_channel_port": 0,
                                               "transfer_timeout_s": 3.0, "handshake_timeout_s": 2.0})
        params = publish(proc, parent)  # P built alongside D, its hold starting once D is ready
        oracle.fill_decode(d.ranks[0])
        run_decode(d, params, {"a": 40})
        assert d.finished_recving == {"a"} and not d.failed_recving
        proc.kill()
        proc.join(10)
        d.add("b", prompt(1, 40), 2, dict(params["b"]))
        assert_failed_not_hung(d, "b")
        assert str(d.outputs["b"].finish_reason).lower().endswith("error")
        load_from_a_healthy_prefill(d, "b")
    finally:
        if d is not None:
            d.close()
        stop(proc, parent)
