"""Contract cases of the built-in strategies: what nixlkv's own tests run the kit against.

Adding a strategy is one entry here (plus its layer kind in :mod:`.kinds`): a spec factory
(the kind), the sample model's parameters and the matrix limits. Placeholders in
``nixlkv.strategies.pending`` are not run through the matrix; the suite checks instead that each
refuses cleanly (:func:`nixlkv.testing.contract.check_pending_refuses`).
"""

from __future__ import annotations

from .contract import ContractCase

# Two KV heads: TP 4 replicates them, TP 1 holds both; TP pairs cover both directions.
BUILTIN_CASES: dict[str, ContractCase] = {
    "full_attention": ContractCase(
        strategy="full_attention",
        kind="full_attention",
        params={"num_kv_heads": 2, "head_size": 32},
    ),
    "sliding_window": ContractCase(
        strategy="sliding_window",
        kind="sliding_window",
        # A 32-token window over 16-token blocks keeps 3 blocks: requests of 1, 37 and 100
        # tokens put the window edge at the start, inside, and past the prefill's nulled blocks.
        params={"num_kv_heads": 2, "head_size": 32, "window": 32},
        token_counts=(1, 37, 100),
        prefix_hits=(0, 5),
    ),
}
