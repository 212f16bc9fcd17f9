"""What each layer's attention backend says about the interior of its KV pages.

nixlkv reads a page's structure off the tensor view vLLM hands the connector. Most backends store
what that view says ([heads, tokens, K|V bytes] per block, token-major). vLLM's CPU attention
backend does not: under the same [blocks, heads, tokens, 2 x head_size] shape its kernels write a
head's keys channel-major ([head_size, tokens]) followed by its values token-major ([tokens,
head_size]) -- measured by writing known keys through ``cpu_attn_reshape_and_cache``. Whole
per-head runs of a block are still exact, so equal block sizes and any TP pair work; a copy of
part of a block's tokens (P and D with different block sizes) would scramble the keys. The hint
``token_major_interior: False`` tells the strategies to refuse such copies instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# backend name (AttentionBackend.get_name()) -> why its page interior is not token-major
NOT_TOKEN_MAJOR = {
    "CPU_ATTN": "vLLM's CPU attention backend stores each head's keys channel-major and its values "
                "token-major within a block, under a [heads, tokens, K|V] view",
}


def backend_names(vllm_config: Any) -> dict[str, str]:
    """Layer name -> attention backend name, for the attention layers the model registered."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


def backend_hints(names: Mapping[str, str]) -> Callable[[str], Mapping[str, Any]]:
    """``model_hints`` saying which layers' pages are not token-major inside (and why)."""
    def hints(name: str) -> Mapping[str, Any]:
        why = NOT_TOKEN_MAJOR.get(names.get(name, ""))
        return {"token_major_interior": False, "interior": why} if why else {}
    return hints


def combine(*parts: Callable[[str], Mapping[str, Any]] | None) -> Callable[[str], Mapping[str, Any]] | None:
    """One ``model_hints`` from several (None where none has anything)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return lambda name: {k: v for p in present for k, v in p(name).items()}
