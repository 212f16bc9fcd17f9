"""The graded controls' hook (``nixlkv.vllm.damage``): each damages exactly the one thing it names,
in every page interior, and the byte check rejects each one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nixlkv.vllm import damage
from nixlkv.vllm.kvdump import as_pages, token_rows

H, N, D = 2, 8, 4  # KV heads per rank, tokens per kernel block, head size (bfloat16)
C = 2 * D * 2  # bytes per token and head: K then V


def _attention(interior: str | None, spec: str = "FullAttentionSpec", facts: dict | None = None,
               heads: int = H) -> tuple[dict, torch.Tensor]:
    blocks, ratio = 16, 2  # logical blocks of 16 tokens, two kernel blocks each
    shape = (blocks * ratio, heads, N, 2 * D) if heads else (blocks * ratio, N, 2 * D)
    view = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    record = {"num_blocks": blocks, "layers": {
        "l0": {"group": 0, "spec": spec, "facts": facts or {}, "view": {"shape": list(shape)},
               "hints": {"page_interior": interior, "total_kv_heads": max(heads, 1)}}}}
    return record, view


def _tokens(view: torch.Tensor, ids: list[int], interior: str | None) -> np.ndarray:
    raw = view.view(torch.uint8)
    rows = (torch.tensor(ids)[:, None] * 2 + torch.arange(2)).reshape(-1)
    pages = as_pages(raw.index_select(0, rows).numpy())
    return token_rows(pages, interior, 2)  # [tokens, heads, bytes]


def _changed(record: dict, view: torch.Tensor, kind: str, ids: list[int], q: int) -> tuple[dict, set]:
    interior = record["layers"]["l0"]["hints"]["page_interior"]
    before = _tokens(view, ids, interior)
    done = damage.damage_load(kind, record, {"l0": view}, [ids], q)
    after = _tokens(view, ids, interior)
    return done, {(int(t), int(h)) for t, h in zip(*np.nonzero((before != after).any(axis=2)))}


@pytest.mark.parametrize("interior", [None, "k_channel_major"])
def test_each_attention_control_damages_exactly_what_it_names(interior: str | None) -> None:
    # 55 tokens loaded in blocks of 16, the last one partial (48..54); D goes on from 54 (the prompt's
    # last token, if the load holds it, is one D computes again)
    ids, q = [5, 9, 3, 7], 55
    for kind, expect in (("block", {(t, h) for t in range(16) for h in range(H)}),
                         ("head", {(t, 0) for t in range(q - 1)}),
                         ("last_block", {(t, h) for t in range(48, q - 1) for h in range(H)}),
                         ("token", {(26, h) for h in range(H)})):
        record, view = _attention(interior)
        done, changed = _changed(record, view, kind, ids, q)
        assert changed == expect, (kind, done, sorted(changed - expect)[:5], sorted(expect - changed)[:5])
        assert done["layer"] == "l0" and done["bytes"] == len(expect) * C


def test_controls_land_where_the_layer_needs_them() -> None:
    # a window of 16: D going on from 54 or 55 needs 39..53 or 40..54; the control stays in both
    ids, q = [0, 0, 3, 7], 55
    record, view = _attention(None, "SlidingWindowSpec", {"sliding_window": 16})
    done, changed = _changed(record, view, "block", ids, q)
    assert {t for t, _ in changed} == set(range(40, 48)) and done["tokens"] == [40, 48]
    record, view = _attention(None, "SlidingWindowSpec", {"sliding_window": 16})
    done, changed = _changed(record, view, "token", ids, q)
    assert {t for t, _ in changed} == {46}
    # chunked local attention of 32, D going on from 64: nothing of its chunk is loaded, no control lands
    record, view = _attention(None, "ChunkedLocalAttentionSpec", {"attention_chunk_size": 32})
    assert damage.damage_load("token", record, {"l0": view}, [[5, 9, 3, 7, 8]], 65)["skipped"]
    # MLA: one latent per token, no head to damage; the other controls still land
    record, view = _attention(None, "MLAAttentionSpec", heads=0)
    assert damage.damage_load("head", record, {"l0": view}, [[5, 9]], 20) == {"kind": "head", "skipped": damage.NO_HEADS}
    assert damage.damage_load("token", record, {"l0": view}, [[5, 9]], 21)["tokens"] == [9, 10]


def test_zeroed_bytes_are_flipped_so_a_control_always_changes_them() -> None:
    record, view = _attention(None)
    view.zero_()
    done, changed = _changed(record, view, "token", [5, 9], 21)
    assert changed == {(9, 0), (9, 1)} and done["bytes"] == 2 * C


def _mamba(layout: str) -> tuple[dict, torch.Tensor]:
    conv, kernel, heads, ssm = (6, 3), 4, 3, (3, 2, 4)  # conv [channels, kernel-1] (DS), SSM [heads, dim, state]
    conv_shape = list(conv) if layout == "DS" else list(conv[::-1])
    page = (int(np.prod(conv)) + int(np.prod(ssm))) * 4  # float32 states
    view = torch.randint(1, 255, (16, page), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    record = {"num_blocks": 16, "layers": {"m0": {
        "group": 0, "spec": "MambaSpec", "view": {"shape": [16, page]},
        "facts": {"shapes": [conv_shape, list(ssm)], "dtypes": ["float32", "float32"], "mamba_type": "MAMBA2"},
        "hints": {"mamba": {"conv_kernel": kernel, "conv_state_layout": layout}}}}}
    return record, view


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_state_controls_damage_one_conv_channel_or_one_ssm_head(layout: str) -> None:
    for kind in ("conv_channel", "ssm_group"):
        record, view = _mamba(layout)
        before = view.clone()
        done = damage.damage_load(kind, record, {"m0": view}, [[4, 11]], 30)  # the running state: block 11
        assert torch.equal(view[4], before[4])  # an earlier entry of the list is not the running state
        row = (view[11] != before[11]).numpy()
        conv = row[: 6 * 3 * 4].reshape([6, 3, 4] if layout == "DS" else [3, 6, 4])
        ssm = row[6 * 3 * 4:].reshape(3, 2 * 4 * 4)
        if kind == "conv_channel":
            channel0 = conv[0] if layout == "DS" else conv[:, 0]
            assert channel0.all() and conv.sum() == 3 * 4 and not ssm.any(), done
        else:
            assert ssm[0].all() and ssm.sum() == ssm.shape[1] and not conv.any(), done


def test_the_hook_is_off_unless_armed_and_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(damage.ENV, raising=False)
    assert not damage.enabled()
    monkeypatch.setenv(damage.ENV, "1")
    assert damage.enabled()
    assert damage.requested({"other": 1}) is None and damage.requested({damage.PARAMS_KEY: "token"}) == "token"
    with pytest.raises(ValueError, match="nixlkv_test_damage='blocks': expected one of block, head"):
        damage.requested({damage.PARAMS_KEY: "blocks"})
