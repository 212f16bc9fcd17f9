"""Sliding-window attention: stored like full attention, but only the window's blocks move.

After a prefill of N tokens vLLM's scheduler has replaced every block wholly below the window
with the null block (id 0), and its connector keeps the last ``cdiv(window, block_size) + 1``
block ids of a window group. This strategy pairs the two sides' lists by token position (tail
alignment), keeps that window, and drops every pair with a null block on either side. Storage,
head slicing and all geometry checks are the full-attention strategy's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from ..core import Region, RequestError
from ..core.token_blocks import pair_by_tokens
from .full_attention import MATCHING_FACTS, FullAttentionStrategy, tokens_per_block


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a decode engine needs for the next token: the window may straddle a block edge."""
    return -(-window // block_size) + 1


WINDOW_FACT = {"sliding_window": "sliding window (tokens)"}


class Windowed:
    """Mixin for a strategy whose storage is its base's but whose request keeps only a window:
    advertises the window (both sides must agree on it) and pairs only the window's blocks.
    Compose it in front of the storage strategy: ``class X(Windowed, FullAttentionStrategy)``."""

    def extra_facts(self, spec: SlidingWindowSpec) -> dict[str, object]:
        return {**super().extra_facts(spec), "sliding_window": spec.sliding_window}  # type: ignore[misc]

    def decode_recomputes(self, spec: Any) -> int:
        """One: the decode engine computes the last prompt token itself, so it must load the
        window of that token, ``[N - W, N - 1)``. vLLM's window manager frees from the count it
        is told: a decode engine told all N tokens frees the block holding token N - W whenever
        N - W + 1 ends a block (served tiny-gemma3, W 64, blocks of 32: N = 127 answered a wrong
        first token, N = 95, 159, 191 wrong logprobs; N = 94, 96 exact), and a prefill engine
        that computed all N freed it too. Stopping P one token short and loading N - 1 keeps
        it on both sides. Bounded replay (DeepSeek V4's SWA) needs the same for its own reason:
        vLLM does not replay the window after a P/D load."""
        return 1

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        return pair_window_blocks(local_ids, remote_ids, local, remote, num_tokens)


class SlidingWindowStrategy(Windowed, FullAttentionStrategy):
    name = "sliding_window"
    spec_types = (SlidingWindowSpec,)
    matching_facts: ClassVar[Mapping[str, str]] = {**MATCHING_FACTS, **WINDOW_FACT}


def pair_window_blocks(
    local_ids: np.ndarray, remote_ids: np.ndarray, local: Region, remote: Region, num_tokens: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window's block pairs by token range from the tail, without null blocks; ``local``
    must advertise ``sliding_window``. Shared by every windowed strategy."""
    window, ltok, rtok = local.fact("sliding_window"), tokens_per_block(local), tokens_per_block(remote)
    local_ids, remote_ids = local_ids[-window_blocks(window, ltok) :], remote_ids[-window_blocks(window, rtok) :]
    if ltok != rtok and num_tokens is not None:
        # The two tails start at different tokens; only the window's own tokens must be there.
        remote_start = (-(-num_tokens // rtok) - len(remote_ids)) * rtok
        if len(local_ids) and remote_start > max(0, num_tokens - window):
            raise RequestError(
                f"the remote window starts at token {remote_start}, but the window needs tokens from "
                f"{max(0, num_tokens - window)}: the remote engine must send its whole window"
            )
    lp, rp, phase = pair_by_tokens(local_ids, remote_ids, ltok, rtok, num_tokens, strict=ltok == rtok)
    real = (lp != 0) & (rp != 0)
    return lp[real], rp[real], phase[real]
