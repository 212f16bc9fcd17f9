"""kv_transfer_params are checked strictly in one place (nixlkv.vllm.params): every malformed
value the attack campaign of #16 found is a ParamsError naming the field, never a coercion."""

from __future__ import annotations

import pytest

from nixlkv.vllm.params import MAX_LEASE_S, ParamsError, flags, remote

GOOD = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "10.0.0.7",
        "remote_port": 5600, "remote_block_ids": [[1, 2, 3], [0, 0, 9]], "tp_size": 2, "remote_num_tokens": 40,
        "remote_lease_s": 30, "remote_generation": "g1"}


def test_good_params_read_back() -> None:
    r = remote(GOOD)
    assert (r.engine_id, r.request_id, r.host, r.port) == ("P", "r", "10.0.0.7", 5600)
    assert r.block_ids == ([1, 2, 3], [0, 0, 9])  # the null block may repeat (a window's placeholders)
    assert (r.tp_size, r.num_tokens, r.lease_s, r.generation) == (2, 40, 30.0, "g1")
    assert remote({**GOOD, "remote_block_ids": [4, 5]}).block_ids == ([4, 5],)  # vLLM's flat single-group form
    assert remote({**GOOD, "remote_host": "[::1]"}).host == "::1"
    assert remote({**GOOD, "remote_host": "prefill-0.svc.cluster.local"}).host == "prefill-0.svc.cluster.local"
    assert flags(GOOD) == (True, False) and flags(None) == (False, False) and flags({}) == (False, False)
    assert flags({"do_remote_prefill": None, "do_remote_decode": True}) == (False, True)


@pytest.mark.parametrize(("field", "value"), [
    ("remote_port", float("inf")), ("remote_port", 0), ("remote_port", -1), ("remote_port", 65536),
    ("remote_port", "5600"), ("remote_port", 5600.7), ("remote_port", True),
    ("remote_block_ids", [[1.0, 2]]), ("remote_block_ids", ["1", 2]), ("remote_block_ids", "123"),
    ("remote_block_ids", [[True, 2]]), ("remote_block_ids", [[5, 6, 5]]), ("remote_block_ids", [[-1]]),
    ("remote_block_ids", [[2**40]]), ("remote_block_ids", None), ("remote_block_ids", {"0": [1]}),
    ("remote_host", "a b"), ("remote_host", "host\n"), ("remote_host", "host:5600"), ("remote_host", "http://h"),
    ("remote_host", ""), ("remote_host", 7),
    ("remote_engine_id", 7), ("remote_engine_id", ""), ("remote_engine_id", "P\nX"), ("remote_request_id", "r\n"),
    ("remote_request_id", ["r"]), ("remote_request_id", None),
    ("remote_lease_s", float("inf")), ("remote_lease_s", float("nan")), ("remote_lease_s", 0),
    ("remote_lease_s", MAX_LEASE_S * 2), ("remote_lease_s", "30"),
    ("remote_num_tokens", -3), ("remote_num_tokens", "40"), ("remote_num_tokens", 4.0),
    ("tp_size", 0), ("tp_size", "2"), ("tp_size", 4097), ("tp_size", 1 << 16),
    ("remote_held_until", float("inf")), ("remote_held_until", float("nan")), ("remote_held_until", 0),
    ("remote_held_until", -1.0), ("remote_held_until", "1795000000"), ("remote_held_until", True), ("remote_generation", 7), ("remote_generation", ""),
])
def test_each_malformed_field_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ParamsError, match=field):
        remote({**GOOD, field: value})


@pytest.mark.parametrize("params", [["do_remote_prefill"], "x", 7, {"do_remote_prefill": "false"},
                                    {"do_remote_prefill": 1}, {"do_remote_decode": "true"}])
def test_flags_are_bools_of_an_object(params: object) -> None:
    with pytest.raises(ParamsError):
        flags(params)
