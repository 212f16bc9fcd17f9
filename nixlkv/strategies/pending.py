"""Spec types whose strategies have not landed yet: planning them fails loudly, never silently.

Each of these stores or schedules its blocks differently from plain full attention (a latent
replicated on every rank, a window of blocks with null entries, a state instead of tokens), so
letting the full-attention strategy take them through the MRO would move wrong bytes.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    SinkFullAttentionSpec,
)

from ..core import LayerCache, Region, Strategy, Topology


class PendingStrategy(Strategy):
    reason: str = ""

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        raise NotImplementedError(
            f"layer {layer.name!r} has a {type(layer.spec).__name__} cache; the {self.name!r} strategy is "
            f"not implemented yet: {self.reason}"
        )


def pending(name: str, types: tuple[type, ...], reason: str) -> PendingStrategy:
    klass = type(f"Pending_{name}", (PendingStrategy,), {"name": name, "spec_types": types, "reason": reason})
    return klass()


PENDING = [
    pending("circular_buffer", (CircularBufferSpec,), "a compressor ring is one scratch block per request"),
    pending("sink_full_attention", (SinkFullAttentionSpec,), "where static sink KV lives and whether it transfers is unverified"),
    pending("cross_attention", (CrossAttentionSpec, EncoderOnlyAttentionSpec), "encoder caches are not part of P/D decode transfer"),
]
