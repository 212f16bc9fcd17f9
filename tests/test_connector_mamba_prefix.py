"""Mamba prefix caching (vLLM's ``mamba_cache_mode`` "align") through vLLM's real scheduler, with D
hitting a prefix in its own cache (``pd_harness.run_pd``: P and D as separate processes, one
worker-role connector per TP rank, real NIXL, every decode byte checked by the oracle).

In "align" mode a request's state list holds one entry per block of B tokens: entry ``i`` is the
state after ``(i + 1) * B`` tokens, and the state after ``c`` tokens lives in entry
``(c - 1) // B`` (vLLM's ``preprocess_mamba``: the entry it copies the running state from when the
request next runs). vLLM keeps the entries that end on a block boundary in its prefix cache and
nulls, in the request's list, those the request has gone past. P prefills ``n - 1`` tokens (D
computes the last one again), so P's list is ``cdiv(n - 1, B)`` entries, nulls then its running
state. D, holding the first ``h`` blocks in its own cache, takes ``n - 1 - h * B`` tokens from P:
it goes on from P's state after ``n - 1`` tokens, not from its own state after ``h * B``, so vLLM
allocates a fresh entry at ``(n - 2) // B`` and drops the hit entry from the request's list at
once (the hit state stays in D's prefix cache, shared, and must stay untouched). So D receives one
entry per Mamba layer, the fresh one, and nothing else of the state groups changes.
"""

from __future__ import annotations

import dataclasses

import pytest

from pd_harness import PDCase, run_pd

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

# prompt -> tokens; D first computes the start of prompts 0, 1 and 2 itself (D_WARM: prompt index ->
# tokens), so that its cache holds whole blocks of them. B is 32 here (vLLM raises the hybrid's
# attention block until its page holds a Mamba state; the Mamba entries follow it).
PROMPTS = {"h-0": 150, "h-1": 161, "h-2": 129, "h-3": 40}
D_WARM = {0: 100, 1: 70, 2: 130}
# D's hit in tokens per prompt: the warm's last block boundary its chunks ended on (vLLM caches a
# Mamba state where a chunk ends on a block boundary). h-1's n - 1 = 160 ends a block: D's loaded
# entry becomes a cached boundary state. h-2 (129 tokens) hits the 128 P holds: D loads nothing
# and computes its last token from its own state.
HITS = {"h-0": 96, "h-1": 64, "h-3": 0}
LOCAL = {"h-2"}
BLOCK = 32


def _check_lists(run, case: PDCase) -> None:
    from nixlkv.testing.engines import build_rank

    rank = build_rank(case.scenario(), "decode", 0)
    attention = [g for g in range(rank.num_groups) if g not in run.state_groups]
    assert len(run.state_groups) == 2 and len(attention) == 1
    assert all(rank.group_block_size(g) == BLOCK for g in range(rank.num_groups))
    assert set(run.recv_blocks) == set(HITS)
    for rid, hit in HITS.items():
        n = PROMPTS[rid]
        entries = -(-(n - 1) // BLOCK)
        assert run.params[rid]["remote_num_tokens"] == n - 1 == run.loaded_tokens[rid] == run.computes_from[rid]
        held, recv = run.held_blocks[rid], run.recv_blocks[rid]
        # D loaded only what its cache did not hold: the attention blocks after the hit.
        assert len(recv[attention[0]]) == entries - hit // BLOCK, (rid, recv)
        for g in run.state_groups:
            p_list = run.params[rid]["remote_block_ids"][g]
            # Several state entries per request on P: nulls, then the running state.
            assert len(p_list) == entries and p_list[-1] != 0 and not any(p_list[:-1]), (rid, g, p_list)
            # D's list: nulls (its hit entry, if any, already dropped), then the fresh entry its
            # worker reads the state after n - 1 tokens from; that entry alone is received.
            assert len(held[g]) == entries and not any(held[g][:-1]), (rid, g, held[g])
            running = held[g][(run.computes_from[rid] - 1) // BLOCK]
            assert recv[g] == [running] and running != 0, (rid, g, held[g], recv[g])
        # The attention blocks of the hit are D's own (not received: the oracle checks them untouched).
        assert held[attention[0]][hit // BLOCK:] == recv[attention[0]], (rid, held, recv)

@pytest.mark.parametrize(("p_tp", "d_tp", "p_layout", "d_layout"), [(2, 1, "SD", "SD"), (1, 2, "SD", "DS")])
def test_mamba_prefix_hit_on_decode_is_byte_exact(p_tp: int, d_tp: int, p_layout: str, d_layout: str) -> None:
    """Both engines in "align" mode with prefix caching; D holds 2 to 4 blocks of most prompts:
    D receives P's running state (after n - 1 tokens) in the one entry its worker goes on from,
    its cached hit state and every other byte stay as they were, nothing leaks on either side."""
    case = PDCase("nemotron-h-align", p_tp, d_tp, p_conv_layout=p_layout, d_conv_layout=d_layout)
    run = run_pd(case, PROMPTS, local=LOCAL, d_warm=D_WARM)
    assert run.transfers["failed_transfers"] == 0
    _check_lists(run, case)


def _conv_read_one_element_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """D's plan reads the first conv run of each Mamba layer one element further into P's page."""
    from nixlkv.strategies.mamba import MambaStrategy

    original = MambaStrategy.segments

    def shifted(self, local, remote, topology, remote_tp):  # type: ignore[no-untyped-def]
        segs = original(self, local, remote, topology, remote_tp)
        if local.facts["part"] != "conv":
            return segs
        return [dataclasses.replace(segs[0], remote_offset=segs[0].remote_offset + local.page.size("byte")), *segs[1:]]

    monkeypatch.setattr(MambaStrategy, "segments", shifted)


def _state_from_a_neighbouring_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """D's plan takes each Mamba layer's running state from the P block before the right one."""
    import nixlkv.strategies.mamba as mamba

    original = mamba.MambaStrategy.pair_blocks

    def off_by_one(self, local_ids, remote_ids, local, remote, num_tokens=None):  # type: ignore[no-untyped-def]
        lp, rp = original(self, local_ids, remote_ids, local, remote, num_tokens=num_tokens)
        return lp, rp - 1

    monkeypatch.setattr(mamba.MambaStrategy, "pair_blocks", off_by_one)
    monkeypatch.setattr(mamba.MambaStrategy, "block_pairing", lambda self, local, remote: None)


@pytest.mark.parametrize("control", [_conv_read_one_element_off, _state_from_a_neighbouring_block], ids=lambda f: f.__name__)
def test_mamba_prefix_hit_controls_fail(control, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: one conv run of each layer read one element off, or each layer's running
    state read from the wrong P block: the oracle names a Mamba layer."""
    control(monkeypatch)
    with pytest.raises(AssertionError, match=r"model\.layers\.[02]\."):
        run_pd(PDCase("nemotron-h-align", 1, 1, p_conv_layout="SD", d_conv_layout="SD"), PROMPTS, local=LOCAL,
               d_warm=D_WARM)


@pytest.mark.parametrize("unit", [None, 32, 16])
def test_hits_finer_than_a_state_entry_are_refused_naming_the_setting(unit: int | None) -> None:
    """Prefix-cache keys every 16 tokens with Mamba entries of 32 (vLLM's fine-grained hits, which
    copy a hit entry into the request's own around the load): refused at start-up, naming
    prefix_match_unit and the fix; keys every 32 tokens (or vLLM's default) are served."""
    from nixlkv.testing.engines import build_rank
    from nixlkv.vllm import compat
    from pd_harness import vllm_config

    case = PDCase("nemotron-h-align", 1, 1)
    kcc = build_rank(case.scenario(), "decode", 0).kv_cache_config
    vc = vllm_config("kv_consumer", "D", 1, 16, {}, case.model)
    vc.cache_config.prefix_match_unit = unit
    if unit == 16:
        with pytest.raises(ValueError, match=r"prefix-cache keys every 16 tokens, finer than the Mamba state entry "
                                             r"of 32 tokens.*unset --prefix-match-unit or set it to 32"):
            compat.check_mamba_prefix_caching(vc, kcc)
    else:
        compat.check_mamba_prefix_caching(vc, kcc)
