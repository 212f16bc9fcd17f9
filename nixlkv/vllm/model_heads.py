"""The model's KV head count of each layer, from vLLM's model config.

A per-rank spec cannot tell it when heads are replicated (one head per rank whatever the model
has), and some models vary it per layer: Gemma4's config carries ``per_layer_config[i]``
with each layer's ``num_key_value_heads``. A model-wide count for such a model would map heads
wrongly wherever TP reaches the largest head count.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def kv_heads_by_layer(model_config: Any) -> Callable[[str], int] | int:
    """Per-layer KV head counts where the model declares them, else the model-wide count."""
    default = int(model_config.get_total_num_kv_heads())
    text = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    per_layer = getattr(text, "per_layer_config", None)
    if not per_layer:
        return default
    counts = [int(getattr(layer, "num_key_value_heads", None) or default) for layer in per_layer]

    def heads(layer_name: str) -> int:
        match = _LAYER_INDEX.search(layer_name)
        if match is None or int(match.group(1)) >= len(counts):
            raise ValueError(
                f"layer {layer_name!r}: the model declares per-layer KV head counts for {len(counts)} layers "
                "but this name carries no layer index among them"
            )
        return counts[int(match.group(1))]

    return heads
