"""Circular buffers (``CircularBufferSpec``): one ring block per request, copied whole.

A ring holds the raw rows of the token group a compressor is still pooling (DeepSeek-V4.1's CSA
compressor, GLM-5-Next's indexer tail, Step-5's CSA tail, Qwen-4's QSA ring). vLLM's
``CircularBufferManager`` gives a request exactly one block for its whole life, never frees or
prefix-caches it, and the model writes the row of position ``p`` at a slot chosen from ``p``
alone (``p % capacity``) before any read of it. So after a prefill the ring is the request's
state, keyed by position:

* **what moves**: the request's one ring block, every byte (the whole page): rows the prefill
  never wrote are rows the decode engine writes before it reads them, as vLLM's own connector
  assumes when it copies the block whole;
* **TP**: every producer keeps the ring whole on every rank (DeepSeek builds it with
  ``disable_tp``, GLM keeps the full tail on every rank), so a decode rank reads its block from one
  prefill rank, spread like MLA (``covered_remote_ranks``); a ring split over TP would have
  another page size at another TP size and is refused by the page check;
* **no hold-back**: a token computed again rewrites its own row with the same bytes, nothing
  accumulates (:meth:`decode_recomputes` is 0, unlike a Mamba state);
* **both engines must size the ring alike**: the capacity comes from the speculative settings
  (DeepSeek: a power of two >= drafts + 2), and the slot of a row depends on it. Where a row
  lives inside the page is the model's business (Step-5 packs 1 KiB rows unrelated to
  ``block_size``), so rows are never remapped between capacities: a different ring is refused,
  naming the fact.

This module is its own plugin (entry point ``circular_buffer`` in the ``nixlkv`` group), like
``chunked_local``: it hands nixlkv the strategy and the test tooling the scenario kind
``circular_buffer``; nothing in ``nixlkv.core``, the connector or ``nixlkv.vllm`` knows it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_cache_interface import CircularBufferSpec

from ..core import (
    IncompatibleGeometry,
    LayerCache,
    PageLayout,
    Region,
    RequestError,
    Segment,
    Strategy,
    Topology,
    covered_remote_ranks,
    hookimpl,
)
from ..scenario_kinds import KindDef, choice, count
from .full_attention import check_matching_facts

# Facts both sides must agree on, with what a mismatch means for the operator.
MATCHING_FACTS = {
    "dtype": "ring dtype",
    "num_kv_heads": "ring head slots per rank",
    "head_size": "ring row width (head_size)",
    "head_size_v": "ring value width (head_size_v)",
    "capacity": "ring capacity (block_size: vLLM sizes it from num_speculative_tokens; start both engines "
                "with the same speculative settings)",
    "page_bytes": "bytes per ring block",
    "page_shape": "ring page shape (axes larger than one, outermost first)",
}


def page_shape(page: PageLayout) -> list[list[Any]]:
    """The page's axes larger than one, outermost first, with kernel sub-blocks folded into the
    token axis: two dense pages of the same shape hold the same bytes in the same order."""
    axes = [[name, size] for name, size in page.axes if size > 1]
    if len(axes) > 1 and axes[0][0] == "kblock" and axes[1][0] == "token":
        axes = [["token", axes[0][1] * axes[1][1]], *axes[2:]]
    return axes


class CircularBufferStrategy(Strategy):
    name = "circular_buffer"
    spec_types = (CircularBufferSpec,)
    segments_by_geometry = True  # one whole-page segment from a rank chosen by topology alone
    matching_facts: ClassVar[Mapping[str, str]] = MATCHING_FACTS

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        spec = layer.spec
        if layer.page.parts:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: ring page {layer.page.describe()} declares a kernel interior; a ring "
                "is the model's own rows, moved as one whole page, and has none"
            )
        return Region.of_layer(
            layer,
            self.name,
            {
                "dtype": str(spec.dtype).removeprefix("torch."),
                "num_kv_heads": int(spec.num_kv_heads),
                "head_size": int(spec.head_size),
                "head_size_v": int(spec.head_size_v),
                "capacity": int(spec.block_size),
                "page_bytes": int(layer.page.nbytes),
                "page_shape": page_shape(layer.page),
            },
        )

    def segments(
        self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int
    ) -> list[Segment]:
        for peer in remote.values():
            check_matching_facts(local, peer, self.matching_facts)
            if peer.page.nbytes != local.page.nbytes:  # what the peer's page says, whatever it advertised
                raise IncompatibleGeometry(
                    f"layer {local.name!r}: the remote ring page holds {peer.page.nbytes} B, this one "
                    f"{local.page.nbytes} B; both engines must build the same ring"
                )
        source = covered_remote_ranks(local_topology.tp_rank, local_topology.tp_size, remote_tp)[0]
        if source not in remote:
            raise IncompatibleGeometry(
                f"layer {local.name!r}: remote rank {source} (the one this rank reads its ring from) is not "
                f"among the given remote regions {sorted(remote)}"
            )
        return [Segment(local.name, 0, source, remote[source].name, 0, local.page.nbytes)]

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        """The request's one ring block on each side, whatever the request's length."""
        if local_ids.size == 0:
            return local_ids[:0], remote_ids[:0]
        if local_ids.size != 1 or remote_ids.size != 1:
            raise RequestError(
                f"a circular-buffer group holds one block per request (vLLM's CircularBufferManager); got "
                f"{local_ids.size} local and {remote_ids.size} remote block ids"
            )
        if local_ids[0] == 0 or remote_ids[0] == 0:
            side = "local" if local_ids[0] == 0 else "remote"
            raise RequestError(f"the {side} ring block is vLLM's null block 0: the request holds no ring to move")
        return local_ids, remote_ids

    def decode_recomputes(self, spec: Any) -> int:
        """Zero: rows are keyed by position, so the decode engine computing a prompt token again
        rewrites that token's row with the same bytes; nothing is applied twice."""
        return 0


# ---------------------------------------------------------------------------- the plugin's hooks


@hookimpl
def nixlkv_strategies() -> list[Strategy]:
    return [CircularBufferStrategy()]


@hookimpl
def nixlkv_scenario_kinds() -> Mapping[str, KindDef]:
    """The scenario layer kind ``circular_buffer`` (for ``nixlkv rehearse`` and the contract kit)."""
    return {"circular_buffer": scenario_kind()}


@functools.cache
def scenario_kind() -> KindDef:
    """``circular_buffer``: ``capacity`` (rows, the spec's block_size), ``head_size``, optional
    ``num_kv_heads`` (head slots, each rank holds all) and ``dtype``. Defaults are DeepSeek-V4.1's
    compressor ring without speculative tokens: 8 rows of 1024 fp32 ([kv | score])."""
    return KindDef(
        fields={"capacity": count(8), "head_size": count(1024), "num_kv_heads": count(1),
                "dtype": choice(RING_DTYPES, "float32")},  # a ring holds float rows
        build=ring_spec,
        replicated=True,
        coordinates=ring_coordinates,
        blocks_per_request=1,
    )


def ring_coordinates(q: Any) -> dict[str, np.ndarray]:
    """The byte oracle's element identity in a ring page ``[H, N, C]``: (head slot, row slot, byte),
    the same on every rank (the ring is never split over TP) and whatever the request's length."""
    h, n, c = q.shape
    return {
        "head_slot": np.arange(h)[None, :, None, None],
        "slot": np.arange(n)[None, None, :, None],
        "byte": np.arange(c)[None, None, None, :],
    }


def ring_spec(params: Mapping[str, Any], tp: int, block_size: int) -> CircularBufferSpec:
    """What a ring layer reports on every rank, whatever the TP size (it is never split) and the
    engine's block size (the ring's own capacity is its block size)."""
    import torch

    return CircularBufferSpec(
        block_size=params["capacity"],
        num_kv_heads=params["num_kv_heads"],
        head_size=params["head_size"],
        head_size_v=0,
        dtype=getattr(torch, params["dtype"]),
    )


RING_DTYPES = ("float32", "bfloat16", "float16")
