"""Fabricated engine ranks: KV caches built the way vLLM 0.33 builds them on that rank.

Per-rank specs come from the scenario's model and the rank's TP size; vLLM's own grouping
(``get_kv_cache_groups``), tensor placement (``get_kv_cache_config_from_groups``) and
allocation (``allocate_kv_cache``) then put every byte where a real engine would.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .kinds import KINDS, known_kind, takes_interior
from .scenario import LayerKind, Scenario, ScenarioError, Side

DATA = Path(__file__).parent / "data"


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


@functools.lru_cache(maxsize=1)
def planning_config() -> Any:
    """A real VllmConfig built offline from a shipped config.json (no weights, no GPU).

    Only cache-planning fields are read from it; the layout and block count are set per
    engine right before planning (see :func:`build_rank`).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=str(DATA / "tiny-llama"), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), cache_config=CacheConfig(block_size=16))


def layer_spec(kind: LayerKind, side: Side) -> Any:
    """The spec vLLM's layer of this kind would report on one rank of ``side``."""
    return KINDS[kind.kind].build(kind.params, side.tp, side.block_size)


@dataclass
class FabricatedRank:
    """One rank's KV caches: vLLM's KVCacheConfig, per-layer views and the backing buffer."""

    engine_id: str
    side: Side
    tp_rank: int
    kv_cache_config: Any
    kv_caches: dict[str, torch.Tensor]
    buffer: torch.Tensor  # the whole int8 backing allocation
    total_heads: dict[str, int]  # layer -> model KV heads (what a per-rank spec cannot tell)
    layer_index: dict[str, int]  # layer -> index in model order
    layer_kinds: dict[str, LayerKind] = field(default_factory=dict)  # layer -> its scenario kind
    hints: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer -> model facts (mamba geometry)
    params: dict[str, Any] = field(default_factory=dict)  # layer -> its scenario kind parameters

    def layer_spec(self, layer: str) -> Any:
        """The layer's own spec, as the dispatcher sees it: a group wrapped in vLLM's
        UniformTypeKVCacheSpecs holds one spec per layer, which may differ from the group's kind."""
        return kcc_spec(self.kv_cache_config, layer)

    def is_state_group(self, group: int) -> bool:
        """Whether the group holds per-request states (Mamba), not token blocks: its layers' own
        specs say so (a wrapped group's outer spec is no Mamba spec)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        return all(isinstance(self.layer_spec(n), MambaSpec) for n in self.group_layers(group))

    def fixed_blocks(self, group: int) -> int | None:
        """Blocks a request holds in the group whatever its length (``KindDef.blocks_per_request``:
        a ring's one block), or None for a group of token blocks."""
        return fixed_blocks(self.group_layers(group), self.layer_kinds)

    def state_scratch_blocks(self, group: int) -> int:
        """Speculative scratch blocks a state group appends after the running state."""
        return max(int(self.layer_spec(n).num_speculative_blocks) for n in self.group_layers(group))

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)

    def group_layers(self, group: int) -> list[str]:
        return list(self.kv_cache_config.kv_cache_groups[group].layer_names)

    def group_block_size(self, group: int) -> int:
        return int(self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size)


def request_blocks(scenario: Scenario, side: Side) -> int:
    return -(-scenario.request.num_tokens // side.block_size)


def _check_uniform_groups(scenario: Scenario, role: str, groups: list[Any]) -> None:
    """A ``uniform`` entry promises one UniformTypeKVCacheSpecs group; vLLM's own grouping decides.

    vLLM groups layers that need the same token slots (GQA + MLA, MLA latent + indexer) into one
    such group by itself, so nothing is forced here: a scenario whose members vLLM would split is
    an error in the scenario, named, not a group nixlkv invents.
    """
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for where, indices in scenario.uniform_members(role):
        names = {layer_name(i) for i in indices}
        holders = [g for g in groups if names & set(g.layer_names)]
        if len(holders) != 1 or not isinstance(holders[0].kv_cache_spec, UniformTypeKVCacheSpecs):
            got = [f"{type(g.kv_cache_spec).__name__}{sorted(names & set(g.layer_names))}" for g in holders]
            raise ScenarioError(
                f"{scenario.source}: {where} (uniform): vLLM's get_kv_cache_groups put its members in {got} "
                f"on the {role} side, not in one UniformTypeKVCacheSpecs group; use member kinds vLLM "
                "groups together (same token slots), or list them as plain layers"
            )


def build_rank(scenario: Scenario, role: str, rank: int, stage_layers: range | None = None) -> FabricatedRank:
    """Rank ``rank`` of the scenario's ``role`` engine; with ``stage_layers``, of the pipeline
    stage holding those model layers (by index): vLLM groups the whole model's layers and gives
    each stage's worker its layers of every group (one scheduler, one block ID space), so the
    groups are made from every layer and then narrowed to the stage's."""
    from vllm.v1.core.kv_cache_planning import (_project_kv_cache_groups_to_worker, get_kv_cache_config_from_groups,
                                                get_kv_cache_groups)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    side = scenario.prefill if role == "prefill" else scenario.decode
    kinds = scenario.layer_kinds(role)
    for kind in kinds:  # a plugin's kind, in a process that did not parse the scenario (a spawned worker)
        known_kind(kind.kind)
    specs = align_hybrid({layer_name(i): layer_spec(k, side) for i, k in enumerate(kinds)}, side.block_size)
    vc = planning_config()
    vc.cache_config.kv_cache_layout = side.layout
    # A model with Mamba layers needs vLLM's hybrid KV-cache manager (one group per state kind
    # beside the attention groups); NIXL P/D serving runs it so. So does a kind whose manager
    # frees blocks (KindDef.skipped_tokens: chunked local attention), which vLLM would otherwise
    # promote to full attention next to full-attention layers. Other scenarios keep the default.
    hybrid = any(_is_state(s) for s in specs.values()) or any(
        KINDS[k.kind].skipped_tokens is not None or KINDS[k.kind].blocks_per_request is not None for k in kinds
    )
    saved = vc.scheduler_config.disable_hybrid_kv_cache_manager
    try:
        if hybrid:
            vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        groups = get_kv_cache_groups(vc, specs)
    finally:
        vc.scheduler_config.disable_hybrid_kv_cache_manager = saved
    _check_uniform_groups(scenario, role, groups)
    if stage_layers is not None:
        mine = {layer_name(i): specs[layer_name(i)] for i in stage_layers}
        groups = _project_kv_cache_groups_to_worker(groups, mine)
    # Every group's blocks come from one pool: room for each group's request plus spare blocks.
    state_groups = sum(_is_state(g.kv_cache_spec) for g in groups)
    num_blocks = side.num_blocks or (
        (len(groups) + 1) * request_blocks(scenario, side) + state_groups * scenario.request.state_blocks + 8
    )
    vc.cache_config.num_gpu_blocks_override = num_blocks
    kcc = get_kv_cache_config_from_groups(vc, groups, available_memory=1)
    kernel = side.kernel_block_size
    kernel_sizes = None
    if kernel is not None:
        # Like vLLM's prepare_kernel_block_sizes: a group whose block the kernel size divides is
        # stored as block_size // kernel kernel pages per block; others keep whole blocks.
        # State (Mamba) groups and fixed per-request blocks (rings) are never split into kernel blocks.
        by_name = {layer_name(i): k for i, k in enumerate(kinds)}
        kernel_sizes = [
            kernel if g.kv_cache_spec.block_size % kernel == 0 and not _is_state(g.kv_cache_spec)
            and fixed_blocks(g.layer_names, by_name) is None else None
            for g in groups
        ]
    kv = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[side.layout], kernel_block_sizes=kernel_sizes)
    if scenario.captured is not None and stage_layers is None:  # a stage's share: checked on whole-model ranks
        _check_captured(scenario, role, kcc, kv, kinds, side)
    first = next(iter(kv.values()))
    buffer = torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())
    return FabricatedRank(
        engine_id=role,
        side=side,
        tp_rank=rank,
        kv_cache_config=kcc,
        kv_caches=kv,
        buffer=buffer,
        total_heads={layer_name(i): KINDS[k.kind].total_kv_heads(k.params) for i, k in enumerate(kinds)},
        layer_index={layer_name(i): i for i in range(len(kinds))},
        layer_kinds={layer_name(i): k for i, k in enumerate(kinds)},
        hints={layer_name(i): _hints(k, side) for i, k in enumerate(kinds)},
        params={layer_name(i): dict(k.params) for i, k in enumerate(kinds)},
    )


def _check_captured(scenario: Scenario, role: str, kcc: Any, kv: dict[str, torch.Tensor],
                    kinds: list[LayerKind], side: Side) -> None:
    """The groups and pages this rehearsal built must be the captured engine's (nixlkv capture)."""
    from ..vllm.kv_views import page_of
    from .captured import check_built

    pages = {}
    for i, kind in enumerate(kinds):
        name = layer_name(i)
        if name in kv and not _is_state(kcc_spec(kcc, name)):
            pages[i] = page_of(kv[name], kcc.num_blocks, _hints(kind, side).get("page_interior"))[0].describe()
    check_built(scenario.name, role, scenario.captured[role], kcc.kv_cache_groups, pages)


def fixed_blocks(layers: list[str], kinds: Mapping[str, LayerKind]) -> int | None:
    """The ``blocks_per_request`` the layers' kinds share, or None (token blocks)."""
    counts = {KINDS[kinds[n].kind].blocks_per_request if n in kinds else None for n in layers}
    return counts.pop() if len(counts) == 1 else None


def kcc_spec(kcc: Any, layer: str) -> Any:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for g in kcc.kv_cache_groups:
        if layer in g.layer_names:
            spec = g.kv_cache_spec
            return spec.kv_cache_specs[layer] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    raise KeyError(f"layer {layer!r} is in no KV group")


def _hints(kind: LayerKind, side: Side) -> dict[str, Any]:
    """A layer's model facts, plus the page interior its side's attention backend writes."""
    hints = dict(KINDS[kind.kind].hints(kind.params)) if KINDS[kind.kind].hints else {}
    if side.interior is not None and takes_interior(kind.kind):
        hints["page_interior"] = side.interior
    return hints


def _is_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


# FlashAttention's kernels run on multiples of 16 tokens: vLLM's smallest kernel block alignment.
KERNEL_BLOCK_ALIGNMENT = 16


def align_hybrid(specs: dict[str, Any], cache_block_size: int) -> dict[str, Any]:
    """Hybrid attention + Mamba models: page sizes made equal, as vLLM's
    ``Platform._align_hybrid_block_size`` does before the specs are built.

    That helper needs a registered model class, so it is reproduced here: the attention block
    grows to ``align * cdiv(mamba_page, align * attention_bytes_per_token)`` tokens (align = max(16,
    the configured block size)), and every Mamba page is padded up to that attention page. Without
    attention layers the Mamba pages are used as they are. (Nemotron-H-8B at TP1: 16 * cdiv(4,255,744,
    16 * 4,096) = 1,040 tokens, matching kv-layouts.md §5.3.) A Mamba spec in ``mamba_cache_mode``
    "align" takes the attention block as its own: one state entry per block of tokens.
    """
    mamba = {n: s for n, s in specs.items() if _is_state(s)}
    attention = {n: s for n, s in specs.items() if not _is_state(s)}
    if not mamba or not attention:
        return specs
    mamba_page = max(s.page_size_bytes for s in mamba.values())
    per_token = max(replace(s, block_size=1).page_size_bytes for s in attention.values())
    align = max(KERNEL_BLOCK_ALIGNMENT, cache_block_size)
    block = max(cache_block_size, align * -(-mamba_page // (align * per_token)))
    attn_page = block * per_token
    out = {n: replace(s, block_size=block) for n, s in attention.items()}
    # mamba_cache_mode "align": a state entry per attention block (vLLM sets mamba_block_size to it).
    mamba = {n: replace(s, block_size=block) if s.mamba_cache_mode == "align" else s for n, s in mamba.items()}
    out.update({n: replace(s, page_size_padded=attn_page) if attn_page != s.page_size_bytes else s for n, s in mamba.items()})
    return {n: out[n] for n in specs}
