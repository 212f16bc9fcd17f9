"""Model shapes, P/D cases and block-id patterns the benchmark runs, and fabricated rank geometry.

Geometry is fabricated from integers the way vLLM 0.33 lays out an LBHNC cache: one region per
layer, ``num_blocks`` pages of ``heads x tokens x bytes`` back to back (K and V packed in the
innermost axis), regions of one rank side by side in one registered range. Planning needs only
these numbers, so no memory is allocated unless a caller passes a real ``base`` address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..core import Dispatcher, LayerCache, PageLayout, RankGeometry, Topology
from ..testing.kinds import KINDS

FAKE_BASE = 1 << 44  # planning-only geometry lives at made-up addresses; nothing is dereferenced
RANK_SPAN = 1 << 40  # address distance between fabricated ranks, so no two ranks overlap
SPARE_BLOCKS = 16  # free blocks beyond what the request needs (contiguous pattern)


@dataclass(frozen=True)
class Shape:
    """A model's KV cache, as the scenario kinds describe it (``kind`` + ``params``)."""

    name: str
    kind: str  # a nixlkv.testing.kinds kind: full_attention | mla
    num_layers: int
    params: dict[str, Any]
    block_size: int

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    def total_kv_heads(self) -> int:
        return KINDS[self.kind].total_kv_heads(self.params)

    def spec(self, tp: int) -> Any:
        """The per-rank vLLM spec a layer reports at this TP size."""
        return KINDS[self.kind].build(self.params, tp, self.block_size)

    def page(self, tp: int) -> PageLayout:
        """One block's page on one rank: heads held x tokens x bytes per head and token."""
        spec = self.spec(tp)
        return PageLayout((("head", int(spec.num_kv_heads)), ("token", self.block_size), ("byte", int(spec.state_content_size_bytes))))


LLAMA_8B = Shape("llama-8b-like", "full_attention", 32, {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16", "head_size_v": None}, 16)
LLAMA_70B = Shape("llama-70b-like", "full_attention", 80, {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16", "head_size_v": None}, 16)
DEEPSEEK_MLA = Shape(
    "deepseek-mla-like",
    "mla",
    61,
    {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "cache_dtype": "auto", "dtype": "bfloat16"},
    64,
)
PATTERNS = ("contiguous", "fragmented")


class ModelShape(Protocol):
    """What a planning case reads of its model: a :class:`Shape` here, or a hybrid model
    (:class:`nixlkv.bench.hybrid.HybridShape`), which lays its layers out through vLLM."""

    name: str
    block_size: int

    @property
    def is_mla(self) -> bool: ...

    def total_kv_heads(self) -> int: ...


@dataclass(frozen=True)
class Case:
    """One planning measurement: a shape, a P->D TP pair, a prompt length and a block-id pattern."""

    shape: ModelShape
    p_tp: int
    d_tp: int
    num_tokens: int
    pattern: str
    d_rank: int = 0  # the decode rank measured (every decode rank runs the same code)

    @property
    def label(self) -> str:
        return f"{self.shape.name} P{self.p_tp}->D{self.d_tp} {self.num_tokens // 1024}k {self.pattern}"

    @property
    def num_request_blocks(self) -> int:
        return -(-self.num_tokens // self.shape.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks per region on both sides: the request plus spares, twice that when fragmented
        (a fragmented request's blocks are scattered over a pool it shares with others)."""
        n = self.num_request_blocks + SPARE_BLOCKS
        return 2 * n if self.pattern == "fragmented" else n


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def rank_layout(shape: Shape, tp: int, num_blocks: int, num_layers: int | None = None) -> tuple[int, int]:
    """(bytes per page, bytes one rank registers) for ``num_layers`` regions of ``num_blocks`` pages."""
    page = shape.page(tp).nbytes
    return page, page * num_blocks * (num_layers or shape.num_layers)


def fake_base(engine_id: str, rank: int) -> int:
    """The made-up address a planning-only rank's KV allocation starts at (no two overlap)."""
    return FAKE_BASE + (2 if engine_id == "decode" else 1) * 64 * RANK_SPAN + rank * RANK_SPAN


def fabricate_rank(
    dispatcher: Dispatcher,
    shape: Shape,
    engine_id: str,
    tp: int,
    rank: int,
    num_blocks: int,
    base: int | None = None,
    num_layers: int | None = None,
) -> RankGeometry:
    """One rank's geometry as nixlkv's strategies describe it, regions at ``base`` (fake by default).

    ``num_layers`` scales the model down (same per-layer geometry) for real transfers.
    """
    layers = num_layers or shape.num_layers
    page = shape.page(tp)
    stride = page.nbytes
    if base is None:
        base = fake_base(engine_id, rank)
    spec = shape.spec(tp)
    total = shape.total_kv_heads()
    caches = [
        LayerCache(
            name=layer_name(i),
            group=0,
            spec=spec,
            base=base + i * num_blocks * stride,
            num_blocks=num_blocks,
            block_stride=stride,
            page=page,
            hints={"total_kv_heads": total},
        )
        for i in range(layers)
    ]
    memory = [(base, layers * num_blocks * stride)]
    return dispatcher.local_geometry(engine_id, Topology(tp, rank), caches, memory)


def block_ids(pattern: str, n: int, num_blocks: int, rng: np.random.Generator) -> list[int]:
    """``n`` block ids of one request, as a list (what vLLM's scheduler hands the connector).

    ``contiguous``: ``1..n`` (block 0 is vLLM's null block). ``fragmented``: a realistic
    allocator mix, i.e. runs of consecutive free blocks of geometric length (mean 4) taken from a
    shuffled free list, the way a block pool looks after many requests came and went.
    """
    if n + 1 > num_blocks:
        raise ValueError(f"{n} blocks requested from a pool of {num_blocks} (block 0 is reserved)")
    if pattern == "contiguous":
        return list(range(1, n + 1))
    if pattern != "fragmented":
        raise ValueError(f"unknown block-id pattern {pattern!r}; use one of {PATTERNS}")
    free = np.arange(1, num_blocks)
    cuts = np.cumsum(rng.geometric(0.25, size=num_blocks))
    runs = np.split(free, cuts[cuts < free.size])
    order = rng.permutation(len(runs))
    ids = np.concatenate([runs[i] for i in order])[:n]
    return ids.tolist()
