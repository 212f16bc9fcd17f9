"""Layer kinds a scenario can name, and the per-rank vLLM spec each becomes.

One entry per kind: its parameters (required, optional with defaults) and how to build the spec
vLLM's layer would report on one rank. vLLM is imported only when a spec is built, so scenario
files can be parsed and validated without it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..core.topology import heads_per_rank
from ..scenario_kinds import DTYPES, Field, KindDef, choice, count, flag  # KindDef named here too: contract cases import it with the kinds



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


# Each kind's declared fields (nixlkv.scenario_kinds.check_params checks a scenario against them).
ATTENTION_FIELDS: dict[str, Field] = {
    "num_kv_heads": count(), "head_size": count(), "dtype": choice(DTYPES, "bfloat16"),
    "head_size_v": count(None, nullable=True),  # None: head_size
}

# Bytes per token of vLLM's packed DeepSeek MLA cache formats (MLAAttention.get_kv_cache_spec:
# fp8_ds_mla = 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE); "auto" is (rank + rope) x dtype size.
DS_MLA_STATE_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
MLA_CACHE_DTYPES = ("auto", *DS_MLA_STATE_BYTES)
INDEXER_QUANT_BLOCK = 128  # DeepSeek V3.2 Indexer: one fp32 scale per 128 fp8 values


def _mla(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    """Like MLAAttention.get_kv_cache_spec: one latent head, replicated (the same on every rank).
    ``compress_ratio`` > 1 is DeepSeek V4's compressed latent (one state per that many tokens:
    ``tokens_per_state``), ``alignment`` its page padding, as DeepseekV4 attention's spec sets them."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    cache = p["cache_dtype"]
    ratio, alignment = p.get("compress_ratio", 1), p.get("alignment")
    v4 = {"tokens_per_state": ratio, "alignment": alignment, "model_version": "deepseek_v4"} if ratio > 1 or alignment else {}
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=p["kv_lora_rank"] + p["qk_rope_head_dim"],
        dtype=getattr(torch, p["dtype"]) if cache == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache],
        cache_dtype_str=cache,
        kv_quant_mode=get_kv_quant_mode(cache),
        state_content_bytes=DS_MLA_STATE_BYTES.get(cache),
        **v4,
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


MLA_FIELDS: dict[str, Field] = {
    "kv_lora_rank": count(512), "qk_rope_head_dim": count(64), "dtype": choice(DTYPES, "bfloat16"),
    "cache_dtype": choice(MLA_CACHE_DTYPES, "auto"),
}


def _check_mla(p: Mapping[str, Any]) -> list[str]:
    """Relations between an MLA layer's fields (each field's type and range: MLA_FIELDS)."""
    errors = []
    if p["cache_dtype"] != "auto" and (p["kv_lora_rank"], p["qk_rope_head_dim"]) != (512, 64):
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


# ---------------------------------------------------------------- mamba
MAMBA_TYPES = {"mamba2": "MAMBA2", "gdn": "GDN_ATTN", "mamba1": "MAMBA1"}
MAMBA_STATE_TOKENS = 1 << 20  # mamba_cache_mode "none": one state block per request (block = max_model_len)
# vLLM's mamba_cache_mode: "none", one state block per request; "align" (Mamba prefix caching),
# one state entry per block of tokens, the attention block (see engines.align_hybrid).
MAMBA_CACHE_MODES = ("none", "align")
SSM_DTYPES = ("float32", "bfloat16", "float16")


def mamba_geometry(p: Mapping[str, Any]) -> dict[str, Any]:
    """The layer's model geometry, normalised: Mamba1 has no heads or groups (its unit is one
    channel); Mamba2 / GDN have intermediate_size = num_heads x head_dim."""
    if p["mamba_type"] == "mamba1":
        return {"num_heads": 1, "head_dim": 1, "n_groups": 1, "d_state": p["d_state"],
                "intermediate_size": p["intermediate_size"], "conv_kernel": p["conv_kernel"]}
    return {"num_heads": p["num_heads"], "head_dim": p["head_dim"], "n_groups": p["n_groups"], "d_state": p["d_state"],
            "intermediate_size": p["num_heads"] * p["head_dim"], "conv_kernel": p["conv_kernel"]}


def num_spec(p: Mapping[str, Any]) -> int:
    """Speculative tokens: extra conv rows and as many speculative scratch state blocks."""
    return int(p["num_spec"] or 0)


def _check_mamba(p: Mapping[str, Any]) -> list[str]:
    """Relations between a Mamba layer's fields (each field's type, range and names: MAMBA_FIELDS)."""
    errors = []
    if p["cache_mode"] == "align" and p.get("state_tokens"):
        errors.append("state_tokens applies to cache_mode none only (in align mode a state entry stands for one block)")
    if num_spec(p) and (p["mamba_type"] == "mamba1" or p["tp_replicated"]):
        errors.append("num_spec applies to mamba2 and gdn states only (vLLM's Mamba1 conv state has no speculative rows)")
    if p["mamba_type"] == "mamba1":
        if p["intermediate_size"] is None:
            errors.append("mamba1 needs intermediate_size (its conv and SSM states are sharded by channel)")
    else:
        for key in ("num_heads", "head_dim", "n_groups"):
            if p[key] is None:
                errors.append(f"{p['mamba_type']} needs {key}")
        if not errors and p["intermediate_size"] not in (None, p["num_heads"] * p["head_dim"]):
            errors.append(
                f"intermediate_size {p['intermediate_size']} must be num_heads x head_dim = "
                f"{p['num_heads'] * p['head_dim']} for {p['mamba_type']}"
            )
    return errors


def _mamba_shapes(p: Mapping[str, Any], tp: int) -> tuple[tuple[tuple[int, ...], ...], tuple[Any, ...]]:
    """Per-rank (shapes, dtypes) from vLLM's MambaStateShapeCalculator, under the scenario's conv
    layout (vLLM reads it from VLLM_SSM_CONV_STATE_LAYOUT once and caches it)."""
    import torch
    from vllm.model_executor.layers.mamba import mamba_utils

    from ..core.topology import check_units_shardable

    g = mamba_geometry(p)
    kind = p["mamba_type"]
    conv_dtype, ssm_dtype = getattr(torch, p["dtype"]), getattr(torch, p["ssm_dtype"])
    calc = mamba_utils.MambaStateShapeCalculator
    with vllm_conv_state_layout(p["conv_layout"]):
        if p["tp_replicated"]:  # e.g. a PLE conv state: the whole state on every rank
            return (calc._orient_conv_shape(g["intermediate_size"], g["conv_kernel"] - 1),), (conv_dtype,)
        if kind == "mamba2":
            # vLLM's MambaMixer2 asserts this; its shape calculator alone would silently extend the groups.
            check_units_shardable(tp, g["n_groups"], "n_groups", replicate_single=True)
            shapes = calc.mamba2_state_shape(tp, g["intermediate_size"], g["n_groups"], g["num_heads"], g["head_dim"],
                                             g["d_state"], g["conv_kernel"], num_spec(p))
        elif kind == "gdn":
            check_units_shardable(tp, g["n_groups"], "n_groups", replicate_single=False)
            shapes = calc.gated_delta_net_state_shape(tp, g["n_groups"], g["num_heads"], g["d_state"], g["head_dim"],
                                                      g["conv_kernel"], num_spec(p))
        else:
            check_units_shardable(tp, g["intermediate_size"], "intermediate_size", replicate_single=False)
            shapes = calc.mamba1_state_shape(tp, g["intermediate_size"], g["d_state"], g["conv_kernel"])
    return tuple(tuple(s) for s in shapes), (conv_dtype, ssm_dtype)


@contextlib.contextmanager
def vllm_conv_state_layout(layout: str) -> Iterator[None]:
    """Set vLLM's conv state layout (its env var and the lru_cache that reads it) for a block."""
    from vllm.model_executor.layers.mamba import mamba_utils

    saved = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = layout
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
        else:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = saved
        mamba_utils.get_conv_state_layout.cache_clear()


def _mamba(p: Mapping[str, Any], tp: int, block_size: int) -> Any:
    """Like MambaBase.get_kv_cache_spec: with ``cache_mode`` "none" one state block per request
    (a block of ``state_tokens``), with "align" one state entry per ``block_size`` tokens (vLLM's
    Mamba prefix caching; a hybrid's block is then the attention block). The page padding and
    a hybrid's block size are set by the engine (see engines.align_hybrid)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes, dtypes = _mamba_shapes(p, tp)
    return MambaSpec(
        block_size=block_size if p["cache_mode"] == "align" else p.get("state_tokens") or MAMBA_STATE_TOKENS,
        mamba_cache_mode=p["cache_mode"],
        shapes=shapes,
        dtypes=dtypes,
        mamba_type=MambaAttentionBackendEnum[MAMBA_TYPES[p["mamba_type"]]],
        tp_replicated=p["tp_replicated"],
        num_speculative_blocks=num_spec(p),
    )


def _mamba_hints(p: Mapping[str, Any]) -> dict[str, Any]:
    return {"mamba": {**mamba_geometry(p), "conv_state_layout": p["conv_layout"]}}


MAMBA_FIELDS: dict[str, Field] = {
    "d_state": count(),
    "mamba_type": choice(MAMBA_TYPES, "mamba2"),
    # None where the Mamba type has none (Mamba1: heads and groups; Mamba2 / GDN: heads x head_dim)
    "num_heads": count(None, nullable=True), "head_dim": count(None, nullable=True),
    "n_groups": count(None, nullable=True), "intermediate_size": count(None, nullable=True),
    "conv_kernel": count(4),
    "dtype": choice(DTYPES, "bfloat16"), "ssm_dtype": choice(SSM_DTYPES, "float32"),
    "conv_layout": choice(("DS", "SD"), "DS"), "tp_replicated": flag(False),
    "num_spec": count(None, nullable=True),
    # tokens a state block stands for (vLLM sets max_model_len); a captured engine's value
    "state_tokens": count(None, nullable=True),
    "cache_mode": choice(MAMBA_CACHE_MODES, "none"),
}
MAMBA_OPTIONAL = {name: f.default for name, f in MAMBA_FIELDS.items() if not f.required}

UNIFORM = "uniform"  # not a layer: its `members` become layers vLLM must put in one uniform group

KINDS: dict[str, KindDef] = {
    "full_attention": KindDef(fields=ATTENTION_FIELDS, build=_full_attention, interior=True),
    "sliding_window": KindDef(fields={**ATTENTION_FIELDS, "window": count()}, build=_sliding_window, interior=True),
    "mla": KindDef(
        fields={**MLA_FIELDS, "compress_ratio": count(1), "alignment": count(None, nullable=True)},
        build=_mla,
        check=_check_mla,
        replicated=True,
    ),
    "sliding_window_mla": KindDef(fields={"window": count(), **MLA_FIELDS}, build=_sliding_window_mla, check=_check_mla,
                                  replicated=True),
    "mla_indexer": KindDef(fields={"index_head_dim": count(128, multiple_of=INDEXER_QUANT_BLOCK)}, build=_mla_indexer,
                           replicated=True),
    "mamba": KindDef(fields=MAMBA_FIELDS, build=_mamba, check=_check_mamba, hints=_mamba_hints),
    UNIFORM: KindDef(("members",)),  # not a layer: the parser reads its members (each checked as its own kind)
}


def takes_interior(name: str) -> bool:
    """Whether a side's page ``interior`` applies to layers of kind ``name`` (``KindDef.interior``)."""
    return known_kind(name) and KINDS[name].interior


def load_plugin_kinds(plugins: tuple[Any, ...] = ()) -> None:
    """Register the layer kinds the installed nixlkv plugins declare (hook ``nixlkv_scenario_kinds``,
    :mod:`nixlkv.scenario_kinds`), and those of ``plugins`` (extra plugin objects or modules).

    A plugin that serves a new spec type ships the kind its engines report with it, so scenario
    files (and ``nixlkv rehearse``) name it without any edit here. A kind already registered
    with another definition is an error (:func:`register_kind`).
    """
    from .. import scenario_kinds
    from ..core.registry import plugin_manager

    pm = plugin_manager()
    for plugin in plugins:
        if not pm.is_registered(plugin):
            pm.register(plugin, name=getattr(plugin, "__name__", None) or f"kinds-{type(plugin).__name__}-{id(plugin)}")
    pm.add_hookspecs(scenario_kinds)
    for declared in pm.hook.nixlkv_scenario_kinds():
        for name, kind in (declared or {}).items():
            register_kind(name, kind)


def known_kind(name: str) -> bool:
    """Whether ``name`` is a layer kind, asking the installed plugins when it is not built in."""
    if name not in KINDS:
        load_plugin_kinds()
    return name in KINDS


def register_kind(name: str, kind: KindDef) -> None:
    """Make ``name`` a layer kind scenarios (and contract cases) can use.

    Registering the same definition twice is a no-op, so a contract case may register its kind
    from every test; a different definition under a taken name is an error, never a silent swap.
    """
    if not isinstance(kind, KindDef):
        raise TypeError(f"layer kind {name!r} must be a nixlkv.scenario_kinds.KindDef, got {type(kind).__name__}")
    if kind.build is None:
        raise ValueError(f"layer kind {name!r} needs a build(params, tp, block_size) spec factory")
    taken = KINDS.get(name)
    if taken is not None and taken != kind:
        raise ValueError(f"layer kind {name!r} is already registered with another definition: {taken}")
    KINDS[name] = kind
