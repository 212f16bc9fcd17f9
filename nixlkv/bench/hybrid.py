"""A hybrid Mamba2 + attention model (Nemotron-H-like) laid out the way vLLM 0.33 lays it out.

Planning needs no memory, but a hybrid's layout is not one region per layer: vLLM unifies the
page sizes (the attention block grows until an attention page holds a Mamba state, the Mamba
page is padded up to it), groups the layers, and lets layers of different groups alias the same
KV tensors. Rather than re-deriving that, :func:`hybrid_layout` asks vLLM's own planning code
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``: integers only, nothing allocated)
where every layer's page lives, then nixlkv's geometry and vLLM's stand-in planner are both
built from that one answer at made-up addresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import Dispatcher, LayerCache, PageLayout, RankGeometry, Topology, covered_remote_ranks
from ..testing.kinds import KINDS
from .shapes import block_ids, fake_base
from .vllm_planner import HybridVllmPlanner


@dataclass(frozen=True)
class HybridShape:
    """A hybrid model: ``pattern`` has one character per model layer, as in Nemotron-H's
    ``hybrid_override_pattern``: ``M`` a Mamba2 layer, ``*`` an attention layer, ``-`` an MLP
    layer (no cache). ``block_size`` is the attention block vLLM aligns to (checked when laid out)."""

    name: str
    pattern: str
    attention: dict[str, Any]  # full_attention kind parameters
    mamba: dict[str, Any]  # mamba kind parameters
    block_size: int
    cache_block_size: int = 16  # the configured --block-size the alignment starts from

    is_mla = False

    @property
    def cache_layers(self) -> list[tuple[int, str]]:
        """(model layer index, kind) of every layer that holds a cache."""
        kinds = {"M": "mamba", "*": "full_attention"}
        return [(i, kinds[c]) for i, c in enumerate(self.pattern) if c in kinds]

    @property
    def num_layers(self) -> int:
        return len(self.cache_layers)

    def total_kv_heads(self) -> int:
        return KINDS["full_attention"].total_kv_heads(self.attention)


# Nemotron-H-8B (public config / transformers NemotronHConfig defaults, kv-layouts.md §5.3): 52
# layers, 24 Mamba2 (128 heads x 64, d_state 128, 8 groups, conv kernel 4, bf16 conv, fp32 SSM),
# 4 attention (8 KV heads x 128, bf16), 24 MLP. Block 1,040 tokens at every TP.
NEMOTRON_H_8B = HybridShape(
    "nemotron-h-8b-like",
    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16", "head_size_v": None},
    {"mamba_type": "mamba2", "num_heads": 128, "head_dim": 64, "n_groups": 8, "d_state": 128, "conv_kernel": 4,
     "intermediate_size": None, "dtype": "bfloat16", "ssm_dtype": "float32", "conv_layout": "DS",
     "tp_replicated": False, "num_spec": None, "cache_mode": "none"},
    1040,
)


@dataclass(frozen=True)
class HybridLayer:
    """Where one layer's pages live in its rank's KV allocation (offsets from the rank's base)."""

    name: str
    group: int
    spec: Any
    offset: int
    page: PageLayout  # the bytes a block of this layer holds (a Mamba page without its padding)
    block_stride: int
    hints: dict[str, Any]


@dataclass(frozen=True)
class HybridLayout:
    """One rank's hybrid layout as vLLM plans it: groups, layers, and the allocation size."""

    tp: int
    num_blocks: int
    group_spec_types: tuple[type, ...]
    layers: tuple[HybridLayer, ...]
    nbytes: int
    mamba_spec: Any

    @property
    def unified_page(self) -> int:
        return self.layers[0].block_stride


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def hybrid_layout(shape: HybridShape, tp: int, num_blocks: int) -> HybridLayout:
    """vLLM 0.33's placement of ``shape`` on one rank of ``tp``, with ``num_blocks`` blocks."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec

    from ..testing.engines import align_hybrid, planning_config

    params = {"mamba": shape.mamba, "full_attention": shape.attention}
    specs = {layer_name(i): KINDS[k].build(params[k], tp, shape.cache_block_size) for i, k in shape.cache_layers}
    specs = align_hybrid(specs, shape.cache_block_size)
    blocks = {s.block_size for s in specs.values() if not isinstance(s, MambaSpec)}
    if blocks != {shape.block_size}:
        raise ValueError(f"{shape.name}: vLLM aligns the attention block to {sorted(blocks)} tokens at tp={tp}, "
                         f"the shape says {shape.block_size}; set block_size to vLLM's value")
    vc = planning_config()
    saved = (vc.scheduler_config.disable_hybrid_kv_cache_manager, vc.cache_config.num_gpu_blocks_override,
             vc.cache_config.kv_cache_layout)
    try:  # NIXL P/D serves hybrids with the hybrid KV-cache manager and the LBHNC layout
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        vc.cache_config.num_gpu_blocks_override = num_blocks
        vc.cache_config.kv_cache_layout = "LBHNC"
        groups = get_kv_cache_groups(vc, specs)
        kcc = get_kv_cache_config_from_groups(vc, groups, available_memory=1)
    finally:
        (vc.scheduler_config.disable_hybrid_kv_cache_manager, vc.cache_config.num_gpu_blocks_override,
         vc.cache_config.kv_cache_layout) = saved
    if kcc.num_blocks != num_blocks:
        raise ValueError(f"vLLM planned {kcc.num_blocks} blocks, {num_blocks} asked")
    group_of = {n: g for g, grp in enumerate(kcc.kv_cache_groups) for n in grp.layer_names}
    mamba_hints = KINDS["mamba"].hints(shape.mamba)
    layers, end = [], 0
    for tensor in kcc.kv_cache_tensors:
        for pos, name in enumerate(tensor.layers):
            spec = specs[name]
            offset = tensor.offset + pos * tensor.layer_stride
            if isinstance(spec, MambaSpec):
                page = PageLayout((("head", 1), ("token", 1), ("byte", int(spec.state_content_size_bytes))))
                hints = {"total_kv_heads": 1, **mamba_hints}
            else:
                page = PageLayout((("head", int(spec.num_kv_heads)), ("token", int(spec.block_size)),
                                   ("byte", int(spec.page_size_bytes // (spec.num_kv_heads * spec.block_size)))))
                hints = {"total_kv_heads": shape.total_kv_heads()}
            layers.append(HybridLayer(name, group_of[name], spec, offset, page, int(tensor.block_stride), hints))
        end = max(end, tensor.offset + tensor.size)
    layers.sort(key=lambda x: (x.group, kcc.kv_cache_groups[x.group].layer_names.index(x.name)))
    types = tuple(type(g.kv_cache_spec) for g in kcc.kv_cache_groups)
    mamba_spec = next(s for s in specs.values() if isinstance(s, MambaSpec))
    return HybridLayout(tp, num_blocks, types, tuple(layers), end, mamba_spec)


def fabricate_hybrid_rank(
    dispatcher: Dispatcher, layout: HybridLayout, engine_id: str, rank: int, base: int
) -> RankGeometry:
    """nixlkv's geometry of one rank: one LayerCache per layer, at ``base`` + vLLM's offsets."""
    caches = [
        LayerCache(name=x.name, group=x.group, spec=x.spec, base=base + x.offset, num_blocks=layout.num_blocks,
                   block_stride=x.block_stride, page=x.page, hints=x.hints)
        for x in layout.layers
    ]
    return dispatcher.local_geometry(engine_id, Topology(layout.tp, rank), caches, [(base, layout.nbytes)])


def state_group_count(layout: HybridLayout) -> int:
    from vllm.v1.kv_cache_interface import MambaSpec

    return sum(issubclass(t, MambaSpec) for t in layout.group_spec_types)


def hybrid_block_ids(layout: HybridLayout, ids: list[int], num_attention_blocks: int) -> list[list[int]]:
    """A request's block ids per group from one draw of the pool: the attention group gets the
    prompt's blocks, each Mamba group one running-state block (``mamba_cache_mode`` none), all
    distinct, since every group allocates from one block pool."""
    from vllm.v1.kv_cache_interface import MambaSpec

    need = state_group_count(layout) + num_attention_blocks
    if len(ids) < need:
        raise ValueError(f"{need} block ids needed, {len(ids)} given")
    out, at = [], 0
    for t in layout.group_spec_types:
        n = 1 if issubclass(t, MambaSpec) else num_attention_blocks
        out.append(list(ids[at : at + n]))
        at += n
    return out


def hybrid_setup(case: Any, dispatcher: Dispatcher) -> tuple[RankGeometry, dict[int, RankGeometry], Any]:
    """(decode rank geometry, covered prefill ranks' geometry, vLLM's planner) of one planning
    case, both sides built from the same vLLM layout at the same made-up addresses."""
    nb = case.num_blocks
    local_layout = hybrid_layout(case.shape, case.d_tp, nb)
    remote_layout = hybrid_layout(case.shape, case.p_tp, nb)
    local_base = fake_base("decode", case.d_rank)
    remote_bases = {r: fake_base("prefill", r) for r in covered_remote_ranks(case.d_rank, case.d_tp, case.p_tp)}
    local = fabricate_hybrid_rank(dispatcher, local_layout, "decode", case.d_rank, local_base)
    remote = {r: fabricate_hybrid_rank(dispatcher, remote_layout, "prefill", r, b) for r, b in remote_bases.items()}
    vllm = HybridVllmPlanner(case.shape, case.p_tp, case.d_tp, case.d_rank, nb, local_layout, remote_layout,
                             local_base, remote_bases)
    return local, remote, vllm


def hybrid_request_ids(case: Any, layout: HybridLayout, rng: Any) -> tuple[list[list[int]], list[list[int]]]:
    """(prefill, decode) block ids per group of one request, each side drawn from its own pool."""
    n = case.num_request_blocks
    k = state_group_count(layout)
    p_ids = hybrid_block_ids(layout, block_ids(case.pattern, n + k, case.num_blocks, rng), n)
    d_ids = hybrid_block_ids(layout, block_ids(case.pattern, n + k, case.num_blocks, rng), n)
    return p_ids, d_ids
