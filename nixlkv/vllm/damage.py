"""Graded negative controls for the in-serving byte check: damage one small thing of a load, on D.

A test hook, off unless the engine's environment sets ``NIXLKV_TEST_DAMAGE=1`` *and* a request's
``kv_transfer_params`` name a control under ``nixlkv_test_damage``: when that request's READs
complete, decode rank 0 zeroes, in its own KV cache, exactly one of

- ``block``: one block of one layer (the first block the layer needs), every head;
- ``head``: one KV head of one layer (the rank's first), every token the layer needs;
- ``last_block``: the filled slots of the last block D goes on from, one layer;
- ``token``: one token slot of one layer (midway through what it needs), every head;
- ``conv_channel``: one channel of one Mamba layer's running conv state;
- ``ssm_group``: one head of one Mamba layer's running SSM state;

(bytes that were zero already are flipped instead, so the damage always changes them). The byte
check must reject each of these loads, and the serving check reports whether the answers showed
it too. Positions come from the capture record and the request's block ids, read the way the
judge reads them (``kvdump.token_rows``), so "one token" is one token in every page interior.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .kvdump import as_pages, element_size, is_state, needed_from, running_row, token_rows

ENV = "NIXLKV_TEST_DAMAGE"
PARAMS_KEY = "nixlkv_test_damage"
ATTENTION_KINDS = ("block", "head", "last_block", "token")
STATE_KINDS = ("conv_channel", "ssm_group")
KINDS = ATTENTION_KINDS + STATE_KINDS
NO_HEADS = "an MLA latent is one vector per token, shared by every head: there is no KV head to damage"


def enabled() -> bool:
    """The hook is armed in this engine (the serving check sets the variable on D only)."""
    return os.environ.get(ENV) == "1"


def requested(params: Mapping[str, Any] | None) -> str | None:
    """The control a request asks for, or None; an unknown name is a ValueError naming the key."""
    kind = (params or {}).get(PARAMS_KEY)
    if kind is None:
        return None
    if kind not in KINDS:
        raise ValueError(f"kv_transfer_params {PARAMS_KEY}={kind!r}: expected one of {', '.join(KINDS)}")
    return str(kind)


def _spoil(flat: np.ndarray, where: np.ndarray) -> int:
    """Zero ``flat[where]`` (flip it where it was all zero already); the bytes changed."""
    if flat[where].any():
        flat[where] = 0
    else:
        flat[where] ^= 0xA5
    return int(where.size)


def damage_load(kind: str, record: Mapping[str, Any], kv_caches: Mapping[str, torch.Tensor],
                block_ids: Sequence[Sequence[int]], num_tokens: int) -> dict[str, Any]:
    """Damage one thing of a load in place (``block_ids``: the loaded blocks per group, the tail of
    the request's list for ``num_tokens`` tokens); returns what was damaged, or why nothing was."""
    state = kind in STATE_KINDS
    skipped = f"no {'Mamba state' if state else 'attention'} layer with loaded tokens it needs"
    for name, layer in record["layers"].items():
        if is_state(layer) != state or name not in kv_caches:
            continue
        ids = list(block_ids[layer["group"]]) if layer["group"] < len(block_ids) else []
        if not ids:
            continue
        if kind == "head" and "MLA" in layer.get("spec", ""):
            skipped = NO_HEADS
            continue
        raw = kv_caches[name].view(torch.uint8) if kv_caches[name].dtype != torch.uint8 else kv_caches[name]
        ratio = int(raw.shape[0]) // int(record["num_blocks"])
        rows = (torch.tensor(ids, dtype=torch.long)[:, None] * ratio + torch.arange(ratio)).reshape(-1)
        pages = raw.index_select(0, rows).cpu().numpy()
        done = (_state(kind, layer, pages, ratio) if state
                else _attention(kind, layer, pages, ids, num_tokens))
        if done is None:
            continue
        raw.index_copy_(0, rows.to(raw.device), torch.from_numpy(pages).to(raw.device))
        return {"kind": kind, "layer": name, **done}
    return {"kind": kind, "skipped": skipped}


def _attention(kind: str, layer: Mapping[str, Any], pages: np.ndarray, ids: list[int], loaded: int) -> dict[str, Any] | None:
    view = as_pages(pages)
    per_block = view.shape[0] // len(ids) * view.shape[2]  # tokens per block
    first = (-(-loaded // per_block) - len(ids)) * per_block  # the token block 0 of the list starts at
    # D goes on from ``loaded`` tokens, or one fewer where the load holds the prompt's last token (D
    # computes it again). The control stays inside what either needs: from the later start of the
    # two (a window's or chunk's start only moves forward with q), up to the earlier end.
    q = loaded - 1
    lo = max(needed_from(layer, loaded), first)
    if lo >= q:
        return None
    element = pages.shape[-1] // int(layer["view"]["shape"][-1])
    interior = (layer.get("hints") or {}).get("page_interior")
    places = token_rows(np.arange(view.size).reshape(view.shape), interior, element)  # [tokens, H, C]
    heads = slice(None)
    if kind == "block":
        start = lo // per_block * per_block
        tokens = range(max(start, lo), min(start + per_block, q))
    elif kind == "last_block":
        tokens = range(max((q - 1) // per_block * per_block, lo), q)
    elif kind == "token":
        tokens = range((lo + q - 1) // 2, (lo + q - 1) // 2 + 1)
    else:  # head
        tokens, heads = range(lo, q), slice(0, 1)
    where = places[np.asarray(tokens) - first][:, heads].reshape(-1)
    spoiled = _spoil(pages.reshape(-1), where)
    return {"tokens": [tokens.start, tokens.stop], "heads": "all" if kind != "head" else [0], "bytes": spoiled}


def _state(kind: str, layer: Mapping[str, Any], pages: np.ndarray, ratio: int) -> dict[str, Any] | None:
    facts = layer.get("facts", {})
    if len(facts.get("shapes") or ()) != 2:
        return None
    row = running_row(layer, pages.shape[0] // ratio)
    page = pages[row * ratio: (row + 1) * ratio].reshape(-1)
    (conv_shape, ssm_shape), (conv_dt, ssm_dt) = facts["shapes"], facts["dtypes"]
    conv_n = int(np.prod(conv_shape)) * element_size(conv_dt)
    ssm_n = int(np.prod(ssm_shape)) * element_size(ssm_dt)
    places = np.arange(page.size) + row * page.size  # the running state's bytes' places in pages.reshape(-1)
    if kind == "conv_channel":
        model = (layer.get("hints") or {}).get("mamba") or {}
        conv = places[:conv_n].reshape(list(conv_shape) + [element_size(conv_dt)])
        keep = int(model.get("conv_kernel", conv_shape[-1] + 1)) - 1
        sd = model.get("conv_state_layout", "DS") == "SD"  # [columns, channels]
        where = (conv[:keep, 0] if sd else conv[0, :keep]).reshape(-1)
        what: dict[str, Any] = {"conv_channel": 0, "columns": keep}
    else:
        where = places[conv_n: conv_n + ssm_n].reshape(int(ssm_shape[0]), -1)[0]
        what = {"ssm_head": 0}
    return {**what, "bytes": _spoil(pages.reshape(-1), where)}
