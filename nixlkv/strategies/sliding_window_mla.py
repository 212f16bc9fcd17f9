"""Sliding-window MLA (DeepSeek V4's SWA latent): the mla read, the sliding_window block selection.

``SlidingWindowMLASpec`` subclasses ``SlidingWindowSpec``, not ``MLAAttentionSpec``, so without
its own entry it would fall to the sliding-window strategy and be head-split like GQA. Its cache
is a replicated latent like any MLA cache (one whole-page read from the first covered rank, the
other covered ranks notified), and only the window's blocks move, null blocks never do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

from .mla import MATCHING_FACTS, MLAStrategy
from .sliding_window import WINDOW_FACT, Windowed


class SlidingWindowMLAStrategy(Windowed, MLAStrategy):
    name = "sliding_window_mla"
    spec_types = (SlidingWindowMLASpec,)
    matching_facts: ClassVar[Mapping[str, str]] = {**MATCHING_FACTS, **WINDOW_FACT}

    def cache_role(self, spec: Any) -> str:
        return "sparse"  # SlidingWindowMLASpec has no cache_role: it is always the attention latent
