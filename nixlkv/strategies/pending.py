"""Spec types nixlkv refuses: planning them fails loudly (NotImplementedError naming the reason).

Each subclasses a spec a real strategy serves, so without an entry here the MRO would hand it to
that strategy and move bytes of the wrong meaning. The reasons are vLLM 0.33's own behaviour;
docs/spec-types.md lists every spec type with its strategy or its reason.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    HiddenStateCacheSpec,
    SinkFullAttentionSpec,
)

from ..core import LayerCache, Region, Strategy, Topology


class PendingStrategy(Strategy):
    reason: str = ""

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        raise NotImplementedError(
            f"layer {layer.name!r} has a {type(layer.spec).__name__} cache, which nixlkv does not transfer "
            f"(strategy {self.name!r} not implemented, by design or yet): {self.reason}"
        )


def pending(name: str, types: tuple[type, ...], reason: str) -> PendingStrategy:
    klass = type(f"Pending_{name}", (PendingStrategy,), {"name": name, "spec_types": types, "reason": reason})
    return klass()


PENDING = [
    pending(
        "sink_full_attention", (SinkFullAttentionSpec,),
        "vLLM 0.33 cannot schedule such a model: its SinkFullAttentionManager rejects the "
        "needs_kv_cache_zeroing argument its coordinator passes (TypeError), so no engine of it starts",
    ),
    pending(
        "cross_attention", (CrossAttentionSpec, EncoderOnlyAttentionSpec),
        "encoder-decoder models cannot use KV connectors in vLLM 0.33 (its scheduler asserts so), and "
        "encoder-only layers hold no KV cache",
    ),
    pending(
        "hidden_state_cache", (HiddenStateCacheSpec,),
        "hidden-state cache layers exist only in vLLM's extract_hidden_states model, whose own connector "
        "writes them out; they are no decode engine's KV (without this entry the MRO would plan them as MLA)",
    ),
]
