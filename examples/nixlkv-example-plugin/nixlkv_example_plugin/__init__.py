"""An example nixlkv plugin: a new vLLM KV-cache spec type and the strategy that moves it.

A plugin is three things, all in this module:

1. the spec type its engine reports (here :class:`ExampleAttentionSpec`, a tagged
   full-attention cache);
2. a :class:`~nixlkv.core.Strategy` that names the spec types it serves and turns a layer of
   that type into regions and segments (here :class:`ExampleAttentionStrategy`, which reuses the
   built-in full-attention strategy);
3. a ``nixlkv_strategies`` hook implementation that hands nixlkv an instance, found through the
   ``nixlkv`` entry-point group declared in ``pyproject.toml``.

Dispatch walks a spec type's MRO and takes the most specific strategy: without this plugin an
``ExampleAttentionSpec`` is served by the built-in ``full_attention`` strategy (it *is* a
``FullAttentionSpec``); with it installed, by ``example_attention``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from vllm.v1.kv_cache_interface import FullAttentionSpec

from nixlkv.core import LayerCache, Region, Segment, Strategy, Topology, hookimpl
from nixlkv.strategies.full_attention import FullAttentionStrategy, check_matching_facts

# Facts this strategy adds to full attention's, with what a mismatch means for the operator.
EXAMPLE_FACTS = {"tag": "example tag"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExampleAttentionSpec(FullAttentionSpec):
    """A full-attention KV cache marked with a ``tag``.

    Only a field is added, never storage: page size and head layout stay FullAttentionSpec's,
    so vLLM groups, places and allocates it like full attention and its bytes sit exactly where
    the full-attention strategy expects them. A spec that stores bytes differently needs a
    strategy of its own, not a subclass of an existing one.
    """

    tag: str = "example"

    @classmethod
    def merge(cls, specs: Sequence[ExampleAttentionSpec]) -> ExampleAttentionSpec:
        """Merge a KV group's layer specs, keeping ``tag``.

        vLLM builds the group's spec with ``cls(...)`` from FullAttentionSpec's fields only, and
        nixlkv dispatches on that group spec: a subclass field not carried through here would
        silently fall back to its default.
        """
        tags = {spec.tag for spec in specs}
        if len(tags) != 1:
            raise ValueError(f"all layers of a KV cache group must have the same tag, got {sorted(tags)}")
        return dataclasses.replace(super().merge(specs), tag=tags.pop())


class ExampleAttentionStrategy(FullAttentionStrategy):
    """Moves :class:`ExampleAttentionSpec` caches: full-attention bytes, plus a tag both sides agree on.

    Subclassing the built-in strategy reuses its geometry (head slicing across TP sizes, layout
    checks, block pairing); only what differs is overridden. ``name`` must be new and stable: it
    travels in the handshake, and both engines must resolve every layer to the same strategy.
    """

    name = "example_attention"
    spec_types = (ExampleAttentionSpec,)

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        """The full-attention region, advertising the tag so the peer can check it."""
        region = super().local_region(layer, topology)
        return dataclasses.replace(region, facts={**region.facts, "tag": layer.spec.tag})

    def segments(
        self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int
    ) -> list[Segment]:
        """Refuse a peer with another tag (by name, with both values), then pair bytes as full attention does."""
        for peer in remote.values():
            check_matching_facts(local, peer, EXAMPLE_FACTS)
        return super().segments(local, remote, local_topology, remote_tp)


@hookimpl
def nixlkv_strategies() -> list[Strategy]:
    """This plugin's strategies; nixlkv calls it once, when it builds its strategy registry."""
    return [ExampleAttentionStrategy()]
