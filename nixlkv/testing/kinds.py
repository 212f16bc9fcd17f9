"""Layer kinds a scenario can name, and the per-rank vLLM spec each becomes.

One entry per kind: its parameters (required, optional with defaults) and how to build the spec
vLLM's layer would report on one rank. vLLM is imported only when a spec is built, so scenario
files can be parsed and validated without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.topology import heads_per_rank


@dataclass(frozen=True)
class KindDef:
    """A scenario layer kind: its parameters and the per-rank spec factory.

    ``build(params, tp, block_size)`` returns the spec one rank of an engine with that TP size
    and block size reports for a layer of this kind: the "sample spec factory" a strategy's
    contract suite fabricates engines from. ``coordinates`` (optional) tells the byte oracle
    which logical element each byte of a layer's ``[B, H, N, C]`` view holds; leave it out
    when the layout is attention-like (``nixlkv.testing.oracle.attention_coordinates``).
    """

    required: tuple[str, ...]
    optional: Mapping[str, Any] = field(default_factory=dict)
    build: Callable[[Mapping[str, Any], int, int], Any] | None = None  # (params, tp, block_size) -> spec
    coordinates: Callable[..., Mapping[str, Any]] | None = None  # see oracle.Coordinates

    def total_kv_heads(self, params: Mapping[str, Any]) -> int:
        return int(params.get("num_kv_heads", 1))


def _attention_fields(p: Mapping[str, Any], tp: int, block_size: int) -> dict[str, Any]:
    import torch

    return {
        "block_size": block_size,
        "num_kv_heads": heads_per_rank(tp, p["num_kv_heads"]),
        "head_size": p["head_size"],
        "head_size_v": p["head_size_v"] if p["head_size_v"] is not None else p["head_size"],
        "dtype": getattr(torch, p["dtype"]),
    }


def _full_attention(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(**_attention_fields(p, tp, block_size))


def _sliding_window(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(**_attention_fields(p, tp, block_size), sliding_window=p["window"])


_ATTENTION_OPTIONAL = {"dtype": "bfloat16", "head_size_v": None}

KINDS: dict[str, KindDef] = {
    "full_attention": KindDef(("num_kv_heads", "head_size"), _ATTENTION_OPTIONAL, _full_attention),
    "sliding_window": KindDef(("num_kv_heads", "head_size", "window"), _ATTENTION_OPTIONAL, _sliding_window),
}


def register_kind(name: str, kind: KindDef) -> None:
    """Make ``name`` a layer kind scenarios (and contract cases) can use.

    Registering the same definition twice is a no-op, so a contract case may register its kind
    from every test; a different definition under a taken name is an error, never a silent swap.
    """
    if not isinstance(kind, KindDef):
        raise TypeError(f"layer kind {name!r} must be a nixlkv.testing.kinds.KindDef, got {type(kind).__name__}")
    if kind.build is None:
        raise ValueError(f"layer kind {name!r} needs a build(params, tp, block_size) spec factory")
    taken = KINDS.get(name)
    if taken is not None and taken != kind:
        raise ValueError(f"layer kind {name!r} is already registered with another definition: {taken}")
    KINDS[name] = kind
