"""#16 point 1: the byte oracle sees each layer's own spec, as the dispatcher does, also inside a
group vLLM wraps in UniformTypeKVCacheSpecs (byte-exact rehearsals in tests/scenarios:
sw-wrapped-per-layer-window-p1-d1-blhnc, where the old oracle reported 24,474 false mismatches)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

from nixlkv.testing import oracle
from nixlkv.testing.engines import FabricatedRank


def rank_with(groups: list[tuple[list[str], object]]) -> FabricatedRank:
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)
                                              for names, spec in groups], num_blocks=4)
    return FabricatedRank("E", SimpleNamespace(tp=1), 0, config, {}, torch.zeros(1, dtype=torch.int8), {}, {})


def mamba(heads: int, spec_blocks: int = 0) -> MambaSpec:
    return MambaSpec(block_size=1024, shapes=((3, 8 * heads), (heads, 4, 8)), dtypes=(torch.bfloat16, torch.float32),
                     num_speculative_blocks=spec_blocks)


def test_a_wrapped_mamba_group_is_a_state_group() -> None:
    specs = {"m0": mamba(8), "m1": mamba(4, spec_blocks=2)}
    wrapped = UniformTypeKVCacheSpecs(block_size=1024, kv_cache_specs=specs)
    rank = rank_with([(["m0", "m1"], wrapped)])
    assert rank.is_state_group(0)  # was False: the outer spec is no MambaSpec (then a 2^20-token "attention" group)
    assert rank.state_scratch_blocks(0) == 2
    assert rank.layer_spec("m1") is specs["m1"]


def test_a_sliding_layer_inside_a_wrapped_group_keeps_its_own_window() -> None:
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=17)
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    rank = rank_with([(["sw"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"sw": sw})),
                      (["fa"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"fa": fa}))])
    assert oracle.window_of(rank, 0) is None  # the group's manager (the wrapper) keeps every block
    assert oracle.layer_window(rank, "sw") == 17 and oracle.layer_window(rank, "fa") is None
    assert not rank.is_state_group(0)


def test_decode_receives_follows_the_layer_window_and_the_prefill_nulling() -> None:
    pos = __import__("numpy").arange(4)
    # 64 tokens, window 17, 16-token blocks: the window tail is blocks 1..3; P nulled blocks 0..2
    # when its own manager is a window manager, so only block 3 arrives ...
    assert oracle.decode_receives(pos, 64, 17, 16, 16).any(axis=1).tolist() == [False, False, False, True]
    # ... and blocks 1..3 when P's manager kept every block (a wrapped group on P)
    assert oracle.decode_receives(pos, 64, 17, 16, 16, nulled_window=None).any(axis=1).tolist() == [False, True, True, True]
