"""MLA: a latent cache (and DeepSeek V3.2's indexer K cache) replicated on every TP rank, key only.

Every rank of both engines holds the same bytes for a block, so a local rank reads each whole
page exactly once, from one remote rank: the first remote rank it covers
(``core.topology.covered_remote_ranks``). For P_TP > D_TP that is P rank ``r * P_TP / D_TP``,
which spreads the reads over the prefill ranks; core sends every other covered rank a
notification only, so it can free the request's blocks. For P_TP <= D_TP the one covered rank
is read by D_TP / P_TP local ranks and waits for that many notifications.

Nothing here is specific to one page size: the latent (bf16 1152 B/token, fp8_ds_mla 656 B) and
the indexer cache (132 B) are separate regions, each copied whole, so one KV group may mix them,
and may mix them with head-split GQA regions served by the full-attention strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from ..core import (
    IncompatibleGeometry,
    LayerCache,
    OwnedTail,
    PageLayout,
    Region,
    Segment,
    Strategy,
    Topology,
    covered_remote_ranks,
)
from .full_attention import check_matching_facts, owned_tail, pair_owned_blocks

# Facts both sides must agree on, with what a mismatch means for the operator.
MATCHING_FACTS = {
    "cache_role": "MLA cache role (sparse latent or indexer)",
    "head_size": "latent width (kv_lora_rank + qk_rope_head_dim, or the indexer head size)",
    "dtype": "KV-cache dtype",
    "cache_dtype": "KV-cache dtype string (--kv-cache-dtype, e.g. auto or fp8_ds_mla)",
    "kv_quant_mode": "KV-cache quantisation",
    "content_bytes": "bytes per token",
    "tokens_per_state": "tokens per stored state (compression ratio)",
    "tokens_per_block": "tokens per block (block_size)",
    "page_bytes": "bytes per block",
}


class MLAStrategy(Strategy):
    name = "mla"
    spec_types = (MLAAttentionSpec,)
    segments_by_geometry = True  # segments read pages and facts only, never names or bases
    matching_facts: ClassVar[Mapping[str, str]] = MATCHING_FACTS

    def cache_role(self, spec: Any) -> str:
        """Latent ("sparse") or DeepSeek indexer cache: both copy the same way, never into each other."""
        return str(spec.cache_role.value)

    def extra_facts(self, spec: Any) -> dict[str, object]:
        """Facts a subclass adds to the region (e.g. a window); none for plain MLA."""
        return {}

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        spec = layer.spec
        if spec.num_kv_heads != 1 or spec.num_heads != 1 or spec.max_tp_shards not in (None, 1):
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: an MLA cache must be one replicated latent (num_kv_heads=1, "
                f"max_tp_shards=1), got num_kv_heads={spec.num_kv_heads}, head slots={spec.num_heads}, "
                f"max_tp_shards={spec.max_tp_shards}; a head-sharded cache is not MLA"
            )
        content = spec.state_content_size_bytes
        _check_token_major(layer.name, layer.page, content, spec.num_states)
        return Region.of_layer(
            layer,
            self.name,
            {
                "cache_role": self.cache_role(spec),
                "head_size": spec.head_size,
                "dtype": str(spec.dtype).removeprefix("torch."),
                "cache_dtype": spec.cache_dtype_str or "auto",
                "kv_quant_mode": int(spec.kv_quant_mode),
                "content_bytes": content,
                "tokens_per_state": str(spec.tokens_per_state),
                "tokens_per_block": spec.block_size,
                "page_bytes": layer.page.nbytes,
                **self.extra_facts(spec),
            },
        )

    def segments(
        self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int
    ) -> list[Segment]:
        for peer in remote.values():
            check_matching_facts(local, peer, self.matching_facts)
            # The peer described itself; check its page is the same dense token-major bytes.
            _check_token_major(peer.name, peer.page, peer.fact("content_bytes"), None)
        source = covered_remote_ranks(local_topology.tp_rank, local_topology.tp_size, remote_tp)[0]
        if source not in remote:
            raise IncompatibleGeometry(
                f"layer {local.name!r}: remote rank {source} (the one this rank reads MLA blocks from) "
                f"is not among the given remote regions {sorted(remote)}"
            )
        peer = remote[source]
        return [Segment(local.name, 0, source, peer.name, 0, local.page.nbytes)]

    def source_ranks(self, local: Region, local_topology: Topology, remote_tp: int) -> list[int]:
        """One rank: every rank holds the same latent bytes."""
        return [covered_remote_ranks(local_topology.tp_rank, local_topology.tp_size, remote_tp)[0]]

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        return pair_owned_blocks(local_ids, remote_ids, local, remote, num_tokens, "MLA")

    def block_pairing(self, local: Region, remote: Region) -> OwnedTail | None:
        return owned_tail(local, remote, "MLA")


def _check_token_major(name: str, page: PageLayout, content_bytes: int, num_states: int | None) -> None:
    """A replicated page must be its states in order, ``content_bytes`` each, with no gaps: then
    every layout (LBHNC, LBNHC, kernel sub-blocks...) holds the same bytes and a whole-page copy
    is exact whatever the two sides' layouts are."""
    axes = [(n, s) for n, s in page.axes if s > 1]
    names = [n for n, _ in axes]
    if "head" in names or names[-1:] != ["byte"] or page.size("byte") != content_bytes:
        raise IncompatibleGeometry(
            f"layer {name!r}: MLA page {page.describe()} is not one head of {content_bytes}-byte "
            "states; the latent cache must hold a single head slot with the state bytes innermost"
        )
    if [n for n in names if n != "byte"] not in ([], ["token"], ["kblock"], ["kblock", "token"]):
        raise IncompatibleGeometry(
            f"layer {name!r}: MLA page {page.describe()} does not store states in order "
            "(kernel sub-blocks outermost, then tokens, then bytes)"
        )
    if num_states is not None and page.nbytes != num_states * content_bytes:
        raise IncompatibleGeometry(
            f"layer {name!r}: MLA page holds {page.nbytes} B but the spec gives {num_states} states "
            f"of {content_bytes} B"
        )
