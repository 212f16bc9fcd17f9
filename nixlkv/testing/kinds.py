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
    # Errors in a kind's parameter values the field checks cannot see, as messages naming the field.
    check: Callable[[Mapping[str, Any]], list[str]] | None = None
    replicated: bool = False  # one cache on every rank (MLA): the oracle's "global head 0"
    coordinates: Callable[..., Mapping[str, Any]] | None = None  # see oracle.Coordinates

    def total_kv_heads(self, params: Mapping[str, Any]) -> int:
        if self.replicated:
            return 1
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

# Bytes per token of vLLM's packed DeepSeek MLA cache formats (MLAAttention.get_kv_cache_spec:
# fp8_ds_mla = 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE); "auto" is (rank + rope) x dtype size.
DS_MLA_STATE_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
MLA_CACHE_DTYPES = ("auto", *DS_MLA_STATE_BYTES)
INDEXER_QUANT_BLOCK = 128  # DeepSeek V3.2 Indexer: one fp32 scale per 128 fp8 values


def _mla(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    """Like MLAAttention.get_kv_cache_spec: one latent head, replicated (the same on every rank)."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    cache = p["cache_dtype"]
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=p["kv_lora_rank"] + p["qk_rope_head_dim"],
        dtype=getattr(torch, p["dtype"]) if cache == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache],
        cache_dtype_str=cache,
        kv_quant_mode=get_kv_quant_mode(cache),
        state_content_bytes=DS_MLA_STATE_BYTES.get(cache),
    )


def _sliding_window_mla(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    """Like MLAAttention.get_kv_cache_spec for a layer with a sliding window (DeepSeek V4 SWA)."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    mla = _mla(p, tp, block_size)
    return SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=mla.head_size,
        dtype=mla.dtype,
        cache_dtype_str=mla.cache_dtype_str,
        kv_quant_mode=mla.kv_quant_mode,
        state_content_bytes=mla.state_content_bytes,
        sliding_window=p["window"],
    )


def _check_mla(p: Mapping[str, Any]) -> list[str]:
    errors = []
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        if not isinstance(p[key], int) or isinstance(p[key], bool) or p[key] < 1:
            errors.append(f"{key} must be a positive integer, got {p[key]!r}")
    if p["cache_dtype"] not in MLA_CACHE_DTYPES:
        errors.append(f"cache_dtype must be one of {MLA_CACHE_DTYPES}, got {p['cache_dtype']!r}")
    elif p["cache_dtype"] != "auto" and (p["kv_lora_rank"], p["qk_rope_head_dim"]) != (512, 64):
        errors.append(
            f"cache_dtype {p['cache_dtype']} packs DeepSeek's 512 + 64 latent; set kv_lora_rank: 512 and "
            f"qk_rope_head_dim: 64 (got {p['kv_lora_rank']} + {p['qk_rope_head_dim']}) or use cache_dtype: auto"
        )
    return errors


def _mla_indexer(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    """Like DeepseekV32IndexerCache.get_kv_cache_spec: fp8 keys + fp32 scales as uint8, replicated."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    d = p["index_head_dim"]
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=d + d // INDEXER_QUANT_BLOCK * 4,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )


def _check_indexer(p: Mapping[str, Any]) -> list[str]:
    d = p["index_head_dim"]
    if not isinstance(d, int) or isinstance(d, bool) or d < 1 or d % INDEXER_QUANT_BLOCK:
        return [f"index_head_dim must be a positive multiple of {INDEXER_QUANT_BLOCK}, got {d!r}"]
    return []


UNIFORM = "uniform"  # not a layer: its `members` become layers vLLM must put in one uniform group

KINDS: dict[str, KindDef] = {
    "full_attention": KindDef(("num_kv_heads", "head_size"), _ATTENTION_OPTIONAL, _full_attention),
    "sliding_window": KindDef(("num_kv_heads", "head_size", "window"), _ATTENTION_OPTIONAL, _sliding_window),
    "mla": KindDef(
        (),
        {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16", "cache_dtype": "auto"},
        _mla,
        check=_check_mla,
        replicated=True,
    ),
    "sliding_window_mla": KindDef(
        ("window",),
        {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bfloat16", "cache_dtype": "auto"},
        _sliding_window_mla,
        check=_check_mla,
        replicated=True,
    ),
    "mla_indexer": KindDef((), {"index_head_dim": 128}, _mla_indexer, check=_check_indexer, replicated=True),
    UNIFORM: KindDef(("members",)),
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
