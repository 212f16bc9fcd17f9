"""Acceptance per strategy and per block-size pairing: P and D as separate processes through the
whole connector lifecycle (``pd_harness.run_pd``: vLLM's real Scheduler on each side built from a
tiny model's config.json, one worker-role connector per TP rank, the side-channel handshake, real
NIXL), every decode byte checked by the oracle, nothing leaked on either side."""

from __future__ import annotations

import logging

import pytest

from nixlkv.core import RankGeometry
from pd_harness import PDCase, run_pd

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

PROMPTS = {"k-0": 150, "k-1": 40, "k-2": 17}


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_mla_latent_is_byte_exact(p_tp: int, d_tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V2-like MLA: each D rank reads every latent page once, from one P rank; every
    other P rank it covers gets a notification alone, and P frees all of them. D parses the
    geometry of the P rank it reads only (Strategy.source_ranks), never that of a rank only told."""
    parsed: list[tuple[str, int]] = []
    from_dict = RankGeometry.from_dict.__func__

    def counting(cls, d):  # type: ignore[no-untyped-def]
        geo = from_dict(cls, d)
        parsed.append((geo.engine_id, geo.tp_rank))
        return geo

    monkeypatch.setattr(RankGeometry, "from_dict", classmethod(counting))
    run = run_pd(PDCase("deepseek-mla", p_tp, d_tp), PROMPTS)
    assert sorted({r for e, r in parsed if e == "P"}) == [0]  # P1 (P2->D1) is only told
    assert run.transfers["transfers"] == len(PROMPTS) * d_tp and run.transfers["failed_transfers"] == 0
    latent_page = 16 * (64 + 32) * 2  # 16 tokens x (kv_lora_rank + qk_rope_head_dim) x bfloat16
    once = sum(-(-n // 16) for n in PROMPTS.values()) * 4 * latent_page  # 4 layers
    assert run.transfers["bytes"] == d_tp * once  # every D rank reads each page once, never twice


# Mamba prompts: block-1 and block+1 tokens (P then holds exactly one block), and one token (D computes it).
MAMBA_PROMPTS = {**PROMPTS, "k-3": 16, "k-4": 1}


@pytest.mark.parametrize(("p_tp", "d_tp", "p_layout", "d_layout"),
                         [(2, 1, "SD", "SD"), (1, 2, "DS", "DS"), (1, 2, "SD", "DS")])
def test_mamba_hybrid_is_byte_exact(p_tp: int, d_tp: int, p_layout: str, d_layout: str) -> None:
    """Nemotron-H-like Mamba2 + attention hybrid: the connector reads each Mamba layer's geometry
    from the model class (one B/C group, replicated on every rank) and moves the running state,
    in each engine's conv state layout: vLLM's default SD on both, DS on both, and SD on P with DS
    on D (D's plan places every conv element; DS -> SD: the rehearsal scenarios mamba-conv-ds-sd-*).

    D computes the last prompt token again for its logits, so the state it holds then must be the
    state after N - 1 tokens, not N (that token would be applied twice): P prefills N - 1 tokens
    and publishes that count, D loads exactly those (attention KV included) and computes the last
    one. The oracle knows the state after every prefix length, so a state after N fails here. A
    one-token prompt leaves nothing to load: D computes it and P frees its blocks on notification."""
    case = PDCase("nemotron-h", p_tp, d_tp, p_conv_layout=p_layout, d_conv_layout=d_layout)
    run = run_pd(case, MAMBA_PROMPTS, local={"k-4"})
    assert len(run.state_groups) == 2 and run.decode_groups == 3 and run.transfers["failed_transfers"] == 0
    for blocks in run.recv_blocks.values():  # the oracle checked a running state in each
        assert all(blocks[g] and blocks[g][-1] != 0 for g in run.state_groups), blocks
    loaded = {rid: n - 1 for rid, n in MAMBA_PROMPTS.items() if n > 1}
    assert {rid: p["remote_num_tokens"] for rid, p in run.params.items()} == {**loaded, "k-4": 1}
    assert run.loaded_tokens == loaded
    assert run.computes_from == {**loaded, "k-4": 0}


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_compressor_rings_move_whole_through_vllms_scheduler(p_tp: int, d_tp: int) -> None:
    """GQA + compressor rings: vLLM's scheduler gives each request one ring block per ring group on
    both engines (its CircularBufferManager), the connector moves it whole from one P rank, holds
    no token back, and the oracle checks every D byte (the ring pages and the attention blocks)."""
    run = run_pd(PDCase("llama-ring", p_tp, d_tp), PROMPTS)
    assert run.transfers["failed_transfers"] == 0
    assert {rid: p["remote_num_tokens"] for rid, p in run.params.items()} == PROMPTS  # nothing held back
    d = PDCase("llama-ring", p_tp, d_tp).scenario()
    from nixlkv.testing.engines import build_rank

    rank = build_rank(d, "decode", 0)
    rings = [g for g in range(rank.num_groups) if rank.fixed_blocks(g) == 1]
    assert len(rings) == 1 and len(rank.group_layers(rings[0])) == 2
    for blocks in run.recv_blocks.values():  # one ring block per request, never the null block
        assert len(blocks[rings[0]]) == 1 and blocks[rings[0]][0] != 0, blocks


def test_attention_only_loads_the_whole_prompt() -> None:
    """No running state, no window: P prefills every prompt token, D loads all of them and computes
    the last one again for its logits (unchanged from before state kinds held tokens back)."""
    run = run_pd(PDCase("llama", 1, 1), PROMPTS)
    assert {rid: p["remote_num_tokens"] for rid, p in run.params.items()} == PROMPTS
    assert run.loaded_tokens == PROMPTS
    assert run.computes_from == {rid: n - 1 for rid, n in PROMPTS.items()}


def test_a_window_holds_back_the_last_token() -> None:
    """A sliding window: P prefills N - 1 tokens and publishes that count, D loads exactly those
    and computes the last one, so the window of the token D computes is held on both sides
    (vLLM's managers free it from a count of N at some lengths: served wrong, docs/vllm.md)."""
    run = run_pd(PDCase("llama-sw", 1, 1), PROMPTS)
    held = {rid: n - 1 for rid, n in PROMPTS.items()}
    assert {rid: p["remote_num_tokens"] for rid, p in run.params.items()} == held
    assert run.loaded_tokens == held
    assert run.computes_from == held


def test_gemma4_like_per_layer_heads_are_byte_exact() -> None:
    """Gemma4-like: sliding layers with 8 KV heads, a full layer with 2 (per_layer_config); at D TP 4
    the full layer's heads are replicated, and its blocks hold 32 tokens on P but 16 on D."""
    run = run_pd(PDCase("gemma4", 2, 4), PROMPTS)
    assert run.decode_groups > 1 and run.transfers["failed_transfers"] == 0


@pytest.mark.parametrize("p_tp,p_block,d_tp,d_block", [(2, 16, 4, 32), (4, 32, 2, 16)])
def test_different_block_sizes_pair_by_tokens(p_tp: int, p_block: int, d_tp: int, d_block: int) -> None:
    run = run_pd(PDCase("llama", p_tp, d_tp, p_block=p_block, d_block=d_block), PROMPTS)
    assert run.transfers["transfers"] == len(PROMPTS) * d_tp and run.transfers["failed_transfers"] == 0


def test_block_sizes_that_do_not_divide_fail_only_the_requests(caplog: pytest.LogCaptureFixture) -> None:
    """16-token P blocks against 24-token D blocks: the handshake's plan refuses them, naming both
    sizes and the fix; the requests bound to that P fail (nothing written), P frees its blocks
    when the lease ends, and neither scheduler leaks."""
    caplog.set_level(logging.ERROR, logger="nixlkv.connector")
    prompts = {"x-0": 40, "x-1": 64}
    run = run_pd(PDCase("llama", 1, 1, p_block=16, d_block=24), prompts, fail=set(prompts), lease_s=3.0)
    assert run.transfers["failed_handshakes"] == 1 and run.transfers["bytes"] == 0
    assert "tokens per block is 24 here and 16 on the remote engine: one must be a multiple of the other" in caplog.text
