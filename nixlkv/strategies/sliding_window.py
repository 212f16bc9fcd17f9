"""Sliding-window attention: stored like full attention, but only the window's blocks move.

After a prefill of N tokens vLLM's scheduler has replaced every block wholly below the window
with the null block (id 0), and its connector keeps the last ``cdiv(window, block_size) + 1``
block ids of a window group. This strategy pairs the two sides' lists by token position (tail
alignment), keeps that window, and drops every pair with a null block on either side. Storage,
head slicing and all geometry checks are the full-attention strategy's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from ..core import Region, tail_aligned
from .full_attention import MATCHING_FACTS, FullAttentionStrategy


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a decode engine needs for the next token: the window may straddle a block edge."""
    return -(-window // block_size) + 1


class SlidingWindowStrategy(FullAttentionStrategy):
    name = "sliding_window"
    spec_types = (SlidingWindowSpec,)
    matching_facts: ClassVar[Mapping[str, str]] = {**MATCHING_FACTS, "sliding_window": "sliding window (tokens)"}

    def extra_facts(self, spec: SlidingWindowSpec) -> dict[str, object]:
        return {"sliding_window": spec.sliding_window}

    def pair_blocks(
        self, local_ids: np.ndarray, remote_ids: np.ndarray, local: Region, remote: Region
    ) -> tuple[np.ndarray, np.ndarray]:
        return pair_window_blocks(local_ids, remote_ids, local)


def pair_window_blocks(local_ids: np.ndarray, remote_ids: np.ndarray, local: Region) -> tuple[np.ndarray, np.ndarray]:
    """The window's block pairs, tail-aligned, without null blocks; ``local`` must advertise
    ``sliding_window`` and ``tokens_per_block``. Shared by every windowed strategy."""
    keep = window_blocks(local.fact("sliding_window"), local.fact("tokens_per_block"))
    lp, rp = tail_aligned(local_ids[-keep:], remote_ids[-keep:])
    real = (lp != 0) & (rp != 0)
    return lp[real], rp[real]
