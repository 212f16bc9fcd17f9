"""The example strategy through nixlkv's contract suite: the few lines a plugin author writes.

The suite fabricates engines whose layers report ``ExampleAttentionSpec`` (from the kind
below), checks every invariant at every point of its matrix (TP pairs both ways, replication,
layouts, block sizes, request lengths, prefix hits), and moves the bytes through real NIXL.
The pytest plugin comes with nixlkv (entry point ``pytest11``); from a source checkout of
nixlkv without installing it, add ``-p nixlkv.testing``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nixlkv.core import heads_per_rank
from nixlkv.testing.contract import ContractCase
from nixlkv.testing.kinds import KindDef
from nixlkv.testing.suite import StrategyContract


def example_spec(params: Mapping[str, Any], tp: int, block_size: int) -> Any:
    """The spec one rank of a TP-``tp`` engine reports for an example layer: the sample-spec
    factory the suite fabricates every rank from (vLLM then groups and allocates it)."""
    import torch

    from nixlkv_example_plugin import ExampleAttentionSpec

    return ExampleAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads_per_rank(tp, params["num_kv_heads"]),
        head_size=params["head_size"],
        dtype=torch.bfloat16,
        tag="example",
    )


# Stored like full attention, so the oracle's default (attention) coordinates apply.
EXAMPLE_KIND = KindDef(required=("num_kv_heads", "head_size"), build=example_spec)


class TestExampleAttentionContract(StrategyContract):
    case = ContractCase(
        strategy="example_attention",
        kind="example_attention",
        kind_def=EXAMPLE_KIND,
        params={"num_kv_heads": 2, "head_size": 32},
    )
