"""Every vLLM 0.33 KV-cache spec type has a strategy or a stated reason (docs/spec-types.md), and
the reasons that rest on vLLM's own behaviour are checked against vLLM itself."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import vllm.v1.kv_cache_interface as kci

from nixlkv.core import StrategyRegistry
from nixlkv.core.registry import NoStrategyError
from nixlkv.strategies.pending import PENDING, PendingStrategy

DOC = Path(__file__).resolve().parents[1] / "docs" / "spec-types.md"

# What the registry must pick for each spec class: a strategy name, or None (no strategy at all).
EXPECTED = {
    "AttentionSpec": "full_attention",
    "FullAttentionSpec": "full_attention",
    "RSWASpec": "full_attention",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MLAAttentionSpec": "mla",
    "SlidingWindowMLASpec": "sliding_window_mla",
    "MambaSpec": "mamba",
    "CircularBufferSpec": "circular_buffer",
    "SinkFullAttentionSpec": "sink_full_attention",
    "CrossAttentionSpec": "cross_attention",
    "EncoderOnlyAttentionSpec": "cross_attention",
    "HiddenStateCacheSpec": "hidden_state_cache",
    "HiSparseHotSpec": None,
    "HiSparseResidentSpec": None,
    "KVCacheSpec": None,
}
WRAPPERS = {"UniformTypeKVCacheSpecs"}  # unwrapped by the dispatcher, never planned itself


def _spec_classes() -> dict[str, type]:
    return {
        name: klass for name, klass in inspect.getmembers(kci, inspect.isclass)
        if issubclass(klass, kci.KVCacheSpec) and klass.__module__ == kci.__name__
    }


def test_every_vllm_spec_type_is_named_here_and_in_the_docs() -> None:
    """Fails when vLLM adds a spec type nobody has decided about."""
    names = set(_spec_classes())
    assert names == set(EXPECTED) | WRAPPERS, f"undecided: {sorted(names - set(EXPECTED) - WRAPPERS)}"
    doc = DOC.read_text()
    missing = [n for n in names if not re.search(rf"`{n}`", doc)]
    assert not missing, f"docs/spec-types.md does not list {missing}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_registry_picks_the_documented_strategy(name: str) -> None:
    registry = StrategyRegistry.from_plugins()
    klass = _spec_classes()[name]
    if EXPECTED[name] is None:
        with pytest.raises(NoStrategyError, match=name):
            registry.for_type(klass)
    else:
        assert registry.for_type(klass).name == EXPECTED[name]


def test_refusals_fail_loudly_naming_layer_type_and_reason() -> None:
    from nixlkv.core import LayerCache

    for strategy in PENDING:
        assert isinstance(strategy, PendingStrategy) and len(strategy.reason) > 40
        layer = LayerCache.__new__(LayerCache)
        object.__setattr__(layer, "name", "model.layers.3.attn")
        object.__setattr__(layer, "spec", object.__new__(strategy.spec_types[0]))
        with pytest.raises(NotImplementedError) as info:
            strategy.local_region(layer, None)  # type: ignore[arg-type]
        text = str(info.value)
        assert "model.layers.3.attn" in text and strategy.spec_types[0].__name__ in text
        assert strategy.reason in text


def test_hidden_state_cache_is_not_planned_as_mla_through_the_mro() -> None:
    registry = StrategyRegistry.from_plugins()
    assert issubclass(kci.HiddenStateCacheSpec, kci.MLAAttentionSpec)
    assert registry.for_type(kci.HiddenStateCacheSpec).name != "mla"


# ---------------------------------------------------------------------------- vLLM's own behaviour


def _manager(spec: kci.KVCacheSpec, block_size: int):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    config = kci.KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[kci.KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=block_size, hash_block_size=block_size,
                          max_in_flight_tokens=2048, enable_caching=False)


def test_vllm_cannot_schedule_a_static_sink_model() -> None:
    """The reason sink_full_attention is refused: vLLM 0.33's coordinator passes an argument the
    sink manager does not take, so no engine with such a layer starts. When vLLM fixes this, this
    test fails: then write the strategy (the request's blocks as full attention, sinks never move)."""
    spec = kci.SinkFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sink_len=16)
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        _manager(spec, 16)
    plain = kci.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    _manager(plain, 16)  # the control: the same call builds a full-attention manager


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tokens", [1, 31, 64, 100, 257, 1000])
@pytest.mark.parametrize("window", [16, 64])
def test_rswa_holds_every_prompt_block_at_hand_off(tokens: int, block_size: int, window: int) -> None:
    """Why RSWASpec rides on full attention: after a prefill, vLLM's RSWA manager has freed no
    block of the prompt (it evicts only generated tokens beyond its window), so P's list is every
    prompt block, exactly what the full-attention strategy moves. The control: a sliding window of
    the same size does free prompt blocks (where the prompt outgrows it)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def prefill_list(spec: kci.KVCacheSpec) -> list[int]:
        manager = _manager(spec, block_size)
        req = Request("p", list(range(1, tokens + 1)), SamplingParams(max_tokens=1), None)
        assert manager.allocate_slots(req, tokens) is not None
        req.num_computed_tokens = tokens
        manager.remove_skipped_blocks(req.request_id, tokens, num_prompt_tokens=tokens)
        return list(manager.get_block_ids_for_computed_tokens(req.request_id, tokens)[0])

    common = dict(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    rswa = prefill_list(kci.RSWASpec(**common, rswa_window=window))
    assert len(rswa) == -(-tokens // block_size) and 0 not in rswa
    windowed = prefill_list(kci.SlidingWindowSpec(**common, sliding_window=window))
    assert (0 in windowed) == (tokens - window + 1 >= block_size)
