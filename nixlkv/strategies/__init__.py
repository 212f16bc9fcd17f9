"""Built-in strategies, registered through the same hooks and entry point as third-party plugins."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

from ..core import Strategy, hookimpl
from .full_attention import FullAttentionStrategy
from .mamba import MambaStrategy
from .mla import MLAStrategy
from .pending import PENDING
from .sliding_window import SlidingWindowStrategy
from .sliding_window_mla import SlidingWindowMLAStrategy


@hookimpl
def nixlkv_strategies() -> list[Strategy]:
    return [FullAttentionStrategy(), MLAStrategy(), SlidingWindowStrategy(), SlidingWindowMLAStrategy(), MambaStrategy(), *PENDING]


@hookimpl
def nixlkv_unwrap_spec(spec: Any, layer_name: str) -> Any | None:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return None
