"""The connector reads each Mamba layer's geometry back from the unsharded state shapes the model
class computes, and the request's token count travels to the plan with P's and D's counts checked."""

from __future__ import annotations

import pytest

from nixlkv.core import IncompatibleGeometry, RequestError
from nixlkv.vllm.metadata import recv_from_params
from nixlkv.vllm.model_mamba import geometry

PARAMS = {"remote_engine_id": "P", "remote_request_id": "r", "remote_host": "h", "remote_port": 1,
          "remote_block_ids": [[1, 2]]}


def test_mamba2_geometry_from_unsharded_shapes() -> None:
    # Nemotron-H-8B: 128 heads x 64, 8 groups, d_state 128, kernel 4: conv 8192 + 2 x 8 x 128 channels.
    got = geometry("MAMBA2", (10240, 3), (128, 64, 128), "DS")
    assert got == {"num_heads": 128, "head_dim": 64, "n_groups": 8, "d_state": 128, "intermediate_size": 8192,
                   "conv_kernel": 4}
    assert geometry("MAMBA2", (3, 10240), (128, 64, 128), "SD") == got


def test_gdn_key_heads_are_the_groups_and_mamba1_has_channels() -> None:
    # Qwen3-Next-like GDN: 16 key heads x 128, 32 value heads x 128, kernel 4.
    gdn = geometry("GDN_ATTN", (2 * 16 * 128 + 32 * 128, 3), (32, 128, 128), "DS")
    assert (gdn["n_groups"], gdn["num_heads"], gdn["head_dim"], gdn["d_state"]) == (16, 32, 128, 128)
    m1 = geometry("MAMBA1", (8192, 3), (8192, 16), "DS")
    assert (m1["intermediate_size"], m1["d_state"], m1["conv_kernel"], m1["n_groups"]) == (8192, 16, 4, 1)


def test_a_conv_state_that_is_not_heads_plus_groups_is_refused() -> None:
    with pytest.raises(IncompatibleGeometry, match="cannot tell this model's B/C groups"):
        geometry("MAMBA2", (8192 + 100, 3), (128, 64, 128), "DS")


def test_token_counts_of_prefill_and_decode_must_agree() -> None:
    req = recv_from_params({**PARAMS, "remote_num_tokens": 40}, [[5, 6]], report=True, num_tokens=40)
    assert req.tokens_to_pair() == 40
    assert recv_from_params(PARAMS, [[5, 6]], report=True, num_tokens=33).tokens_to_pair() == 33
    bad = recv_from_params({**PARAMS, "remote_num_tokens": 48}, [[5, 6]], report=True, num_tokens=40)
    with pytest.raises(RequestError, match="remote_num_tokens=48 but the decode engine holds 40 tokens"):
        bad.tokens_to_pair()
    with pytest.raises(ValueError, match="remote_num_tokens"):
        recv_from_params({**PARAMS, "remote_num_tokens": "40"}, [[5, 6]], report=True)
