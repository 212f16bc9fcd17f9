"""Request lifecycle edges with vLLM's real Scheduler on both sides (P and D in this process):
aborts on either side and lease expiry free every block, with no transfer where none is due."""

from __future__ import annotations

import time

import pytest

from pd_harness import PDCase, PDEngine, prompt

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

SIDE = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}


def clean(engine: PDEngine) -> None:
    leaks = engine.leaks()
    assert leaks["requests"] == leaks["waiting"] == leaks["running"] == leaks["nonzero_refs"] == 0, leaks
    assert leaks["free_blocks"] == leaks["expected_free"], leaks


def prefill(p: PDEngine, rid: str, n: int) -> dict:
    p.add(rid, prompt(1, n), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    while rid not in p.outputs:
        p.step()
    return dict(p.outputs[rid].kv_transfer_params)


def test_decode_abort_before_allocation_frees_prefill_blocks_at_once() -> None:
    from vllm.v1.request import RequestStatus

    p = PDEngine(PDCase(), "prefill", "P", {**SIDE, "lease_s": 600.0})
    d = PDEngine(PDCase(), "decode", "D", SIDE)
    try:
        params = prefill(p, "r", 50)
        assert p.scheduler.requests  # held for the consumer
        d.add("r", prompt(1, 50), 2, params)
        d.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        deadline = time.monotonic() + 20
        while "r" not in p.finished_sending and time.monotonic() < deadline:
            d.step()
            p.step()
        assert p.finished_sending == {"r"}  # by D's notification, long before the 600 s lease
        assert not d.finished_recving and not d.failed_recving
        clean(p)
        clean(d)
    finally:
        p.close()
        d.close()


def test_prefill_abort_publishes_nothing_and_frees() -> None:
    from vllm.v1.request import RequestStatus

    p = PDEngine(PDCase(), "prefill", "P", SIDE)
    try:
        p.add("x", prompt(2, 70), 1, {"do_remote_decode": True, "do_remote_prefill": False})
        p.scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
        p.step()
        assert not p.finished_sending
        clean(p)
    finally:
        p.close()


def test_lease_expiry_frees_unread_blocks() -> None:
    p = PDEngine(PDCase(), "prefill", "P", {**SIDE, "lease_s": 0.5})
    try:
        prefill(p, "y", 33)
        assert p.scheduler.requests
        deadline = time.monotonic() + 10
        while "y" not in p.finished_sending and time.monotonic() < deadline:
            p.step()
            time.sleep(0.01)
        assert p.finished_sending == {"y"}
        clean(p)
        total = sum(s.reduce()["expired_leases"] for s in p.stats)
        assert total == 1
    finally:
        p.close()


@pytest.mark.parametrize("broken", [
    {"remote_port": "not-a-port"},
    {"remote_block_ids": None},
    {"remote_num_tokens": -3},
    {"remote_generation": 7},
    {"remote_port": float("inf")},  # was OverflowError out of get_num_new_matched_tokens
    {"remote_port": 70000},
    {"remote_block_ids": "123"},  # was read as blocks 1, 2, 3
    {"remote_block_ids": [[1, 1, 2]]},  # D would fill two blocks from one
    {"remote_host": "127.0.0.1:5600"},
    {"remote_lease_s": float("inf")},
])
def test_invalid_kv_transfer_params_prefill_locally_instead_of_waiting_forever(broken: dict, caplog) -> None:
    """Params no worker could read from must not be claimed as an asynchronous load (nothing would
    ever report it): the decode engine computes the prompt itself, says why, and leaks nothing."""
    d = PDEngine(PDCase(), "decode", "D", SIDE)
    try:
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                  "remote_engine_id": "P", "remote_request_id": "bad", "remote_host": "127.0.0.1",
                  "remote_port": 5999, "tp_size": 1, **broken}
        with caplog.at_level("WARNING", logger="nixlkv.connector"):
            d.add("bad", prompt(4, 40), 2, params)
            deadline = time.monotonic() + 30
            while "bad" not in d.outputs and time.monotonic() < deadline:
                d.step()
        assert "bad" in d.outputs, "the request waited for a load nobody would report"
        assert not d.finished_recving and not d.failed_recving
        assert any("prefills bad locally" in r.getMessage() for r in caplog.records)
        clean(d)
    finally:
        d.close()


@pytest.mark.parametrize("params", [
    ["do_remote_prefill", True],  # was AttributeError out of a scheduler hook
    "do_remote_prefill",
    {"do_remote_prefill": "false", "remote_engine_id": "P", "remote_request_id": "x", "remote_host": "127.0.0.1",
     "remote_port": 5999, "remote_block_ids": [[1, 2, 3]]},  # was counted as true
])
def test_params_that_are_not_an_object_or_have_a_non_bool_flag_serve_without_a_transfer(params, caplog) -> None:
    d = PDEngine(PDCase(), "decode", "D", SIDE)
    try:
        with caplog.at_level("WARNING", logger="nixlkv.connector"):
            d.add("odd", prompt(4, 40), 2, params)
            deadline = time.monotonic() + 30
            while "odd" not in d.outputs and time.monotonic() < deadline:
                d.step()
        assert "odd" in d.outputs
        assert not d.finished_recving and not d.failed_recving and not d.recv_blocks
        said = [r.getMessage() for r in caplog.records if "invalid kv_transfer_params" in r.getMessage()]
        assert len(said) == 1 and "serves odd without a transfer" in said[0], said
        clean(d)
    finally:
        d.close()
