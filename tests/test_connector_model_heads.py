"""The connector takes each layer's KV head count from the model config, per layer where declared."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nixlkv.vllm.model_heads import kv_heads_by_layer


def model_config(total: int, per_layer: list[int] | None = None) -> SimpleNamespace:
    text = SimpleNamespace(per_layer_config=[SimpleNamespace(num_key_value_heads=n) for n in per_layer] if per_layer else None)
    return SimpleNamespace(get_total_num_kv_heads=lambda: total, hf_text_config=text)


def test_uniform_model_uses_the_model_wide_count() -> None:
    assert kv_heads_by_layer(model_config(8)) == 8


def test_gemma4_like_config_gives_each_layer_its_own_count() -> None:
    heads = kv_heads_by_layer(model_config(16, [16, 16, 16, 16, 16, 4]))
    assert heads("model.layers.0.self_attn.attn") == 16
    assert heads("model.language_model.layers.5.self_attn.attn") == 4


def test_a_layer_name_outside_the_declared_layers_is_an_error() -> None:
    heads = kv_heads_by_layer(model_config(16, [16, 4]))
    with pytest.raises(ValueError, match="per-layer KV head counts for 2 layers"):
        heads("model.layers.7.self_attn.attn")


def test_the_worker_plans_gemma4_like_heads_per_layer() -> None:
    """With per-layer counts a TP16 replicated full-attention layer maps rank r to head r // 4
    (4 heads), not head r (16 heads): the mapping a model-wide count would get wrong."""
    from nixlkv.core import heads_held

    heads = kv_heads_by_layer(model_config(16, [16, 4]))
    assert heads_held(5, 16, heads("model.layers.1.self_attn.attn")) == range(1, 2)
    assert heads_held(5, 16, heads("model.layers.0.self_attn.attn")) == range(5, 6)
