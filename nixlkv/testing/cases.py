"""Contract cases of the built-in strategies: what nixlkv's own tests run the kit against.

Adding a strategy is one entry here (plus its layer kind in :mod:`.kinds`): a spec factory
(the kind), the sample model's parameters and the matrix limits. Placeholders in
``nixlkv.strategies.pending`` are not run through the matrix; the suite checks instead that each
refuses cleanly (:func:`nixlkv.testing.contract.check_pending_refuses`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import ContractCase, Point

# P and D with different tokens per block (one a multiple of the other): blocks pair by token range.
BLOCK_SIZE_POINTS = (
    Point(2, 4, prefill_block_size=16, decode_block_size=32, num_tokens=100),
    Point(4, 2, prefill_block_size=32, decode_block_size=16, num_tokens=100, cached_blocks=2),
)


def replicated_refusals(point: Point, params: Mapping[str, Any]) -> str | None:
    """A replicated latent (MLA) is one head in any layout and moves as whole pages, so it plans at
    every TP pair and layout; its block size must match on both sides (latent pages are fixed by
    the attention kernel)."""
    return "IncompatibleGeometry" if point.prefill_block_size != point.decode_block_size else None


# Two KV heads: TP 4 replicates them, TP 1 holds both; TP pairs cover both directions.
BUILTIN_CASES: dict[str, ContractCase] = {
    "full_attention": ContractCase(
        wrapped_points=True,
        strategy="full_attention",
        kind="full_attention",
        params={"num_kv_heads": 2, "head_size": 32},
        extra_points=BLOCK_SIZE_POINTS,
    ),
    "sliding_window": ContractCase(
        wrapped_points=True,
        strategy="sliding_window",
        kind="sliding_window",
        # A 32-token window over 16-token blocks keeps 3 blocks: requests of 1, 37 and 100
        # tokens put the window edge at the start, inside, and past the prefill's nulled blocks.
        params={"num_kv_heads": 2, "head_size": 32, "window": 32},
        token_counts=(1, 37, 100),
        prefix_hits=(0, 5),
        extra_points=BLOCK_SIZE_POINTS,
    ),
    "mla": ContractCase(
        wrapped_points=True,
        strategy="mla",
        kind="mla",
        params={"kv_lora_rank": 64, "qk_rope_head_dim": 32},
        tp_pairs=((2, 2), (1, 2), (4, 2), (2, 8)),
        refuses=replicated_refusals,
        extra_points=(Point(2, 2, prefill_block_size=16, decode_block_size=32),),
    ),
    "mamba": ContractCase(
        wrapped_points=True,
        strategy="mamba",
        kind="mamba",
        # Mamba2 with two B/C groups: sharded at TP 2, replicated at TP 1, and a model vLLM cannot
        # run at TP 4 (n_groups % tp != 0 and n_groups != 1) — the refusal probe. n_groups = 1
        # (where vLLM's own connector mis-reads B/C) runs in tests/scenarios/mamba2-g1-*.
        params={"mamba_type": "mamba2", "num_heads": 4, "head_dim": 8, "d_state": 8, "n_groups": 2, "conv_kernel": 4},
        tp_pairs=((2, 2), (1, 2), (2, 1), (1, 1), (4, 2)),
        layouts=("LBHNC",),
        block_sizes=(16,),
        token_counts=(100,),
        prefix_hits=(0,),
        refuses=lambda point, params: "IncompatibleTopology" if 4 in (point.prefill_tp, point.decode_tp) else None,
        refuses_longer_local_list=False,
    ),
    "sliding_window_mla": ContractCase(
        wrapped_points=True,
        strategy="sliding_window_mla",
        kind="sliding_window_mla",
        params={"kv_lora_rank": 64, "qk_rope_head_dim": 32, "window": 32},
        tp_pairs=((2, 2), (4, 2), (1, 2)),
        token_counts=(1, 37, 100),
        refuses=replicated_refusals,
        extra_points=(Point(2, 2, prefill_block_size=16, decode_block_size=32, num_tokens=100),),
    ),
}
