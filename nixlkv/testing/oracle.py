"""The byte oracle: what every byte of every rank must hold, from the physics, not the planner.

Each byte of a prefill cache encodes (layer, token, global KV head, byte within the head's
K|V content) through a 64-bit mix, so a swapped layer, token, head or K/V half differs from the
right value in almost every byte (a whole head's content matches by chance with odds 256^-C).
Prefill blocks outside the request hold unrelated random bytes; decode starts as a sentinel.
After the transfer, decode must hold the pattern in its request blocks and the sentinel
everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .engines import FabricatedRank

SENTINEL = 0x5A
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_K = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9), np.uint64(0x27D4EB2F165667C5))


def model_heads(rank: int, tp: int, num_heads: int) -> list[int]:
    """Global KV heads on a rank, as vLLM's QKVParallelLinear shards them: an even contiguous
    slice when tp <= heads, else one head replicated on tp/heads consecutive ranks."""
    if tp <= num_heads:
        n = num_heads // tp
        return [rank * n + i for i in range(n)]
    return [rank * num_heads // tp]


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def pattern(layer: int, tokens: np.ndarray, heads: Sequence[int], content_bytes: int, seed: int) -> np.ndarray:
    """Pattern bytes ``[nb, H, N, C]`` for token positions ``tokens[nb, N]``, global ``heads`` and
    ``content_bytes`` bytes per head and token, in one layer."""
    with np.errstate(over="ignore"):
        t = tokens.astype(np.uint64)[:, None, :, None]
        h = np.asarray(heads, dtype=np.uint64)[None, :, None, None]
        c = np.arange(content_bytes, dtype=np.uint64)[None, None, None, :]
        key = _mix(np.uint64(layer + 1) * _K[0] + np.uint64(seed) * _K[1])
        x = _mix(key ^ (t * _K[2]) ^ _mix(h * _K[3] + c))
        return (x >> np.uint64(56)).astype(np.uint8)


def bytes_view(view: torch.Tensor) -> np.ndarray:
    """A layer's ``[B, H, N, C]`` view as uint8 numpy sharing its memory (C in bytes)."""
    return view.view(torch.uint8).numpy()


@dataclass(frozen=True)
class GroupBlocks:
    """A request's block IDs of one KV group on one side, and the token positions they hold.

    ``holds`` marks the blocks that hold the request's KV after the step being rehearsed: on
    prefill, every block but the null ones; on decode, only what the transfer must deliver.
    """

    ids: np.ndarray
    first_position: int  # block position of ids[0] in the request (skipped prefix blocks)
    holds: np.ndarray  # bool per id


def window_of(rank: FabricatedRank, group: int) -> int | None:
    """The group's sliding window in tokens, or None (every block is attended)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = rank.kv_cache_config.kv_cache_groups[group].kv_cache_spec
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def prefill_null_positions(num_tokens: int, window: int | None, block_size: int) -> int:
    """Leading block positions a prefill engine has already nulled: once N tokens are computed,
    vLLM's window manager frees every block wholly below token N - window + 1."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def decode_needs(positions: np.ndarray, num_tokens: int, window: int | None, block_size: int) -> np.ndarray:
    """Which block positions a decode engine must receive: all of them for full attention; for
    a window, the last cdiv(window, block_size) + 1 blocks that the prefill engine still holds."""
    if window is None:
        return np.ones(positions.shape, dtype=bool)
    n_blocks = -(-num_tokens // block_size)
    tail = n_blocks - (-(-window // block_size) + 1)
    return (positions >= tail) & (positions >= prefill_null_positions(num_tokens, window, block_size))


def fill_prefill(rank: FabricatedRank, blocks: Sequence[GroupBlocks], seed: int) -> None:
    rng = np.random.default_rng(seed ^ 0x5EED)
    buf = rank.buffer.numpy().view(np.uint8)
    buf[:] = rng.integers(0, 256, size=buf.size, dtype=np.uint8)
    _write_expected(rank, rank.buffer, blocks, seed)


def fill_decode(rank: FabricatedRank) -> None:
    rank.buffer.numpy().view(np.uint8)[:] = SENTINEL


def expected_decode(rank: FabricatedRank, blocks: Sequence[GroupBlocks], seed: int) -> torch.Tensor:
    expected = torch.full_like(rank.buffer, SENTINEL)  # 0x5A fits int8
    _write_expected(rank, expected, blocks, seed)
    return expected


def write_pattern(rank: FabricatedRank, target: torch.Tensor, blocks: Sequence[GroupBlocks], seed: int) -> None:
    """Write one request's pattern (``seed`` tells requests apart) into ``target``: the rank's own
    buffer (a prefill engine computing the request) or an expectation built by the caller."""
    _write_expected(rank, target, blocks, seed)


def _write_expected(rank: FabricatedRank, target: torch.Tensor, blocks: Sequence[GroupBlocks], seed: int) -> None:
    tp = rank.side.tp
    for group in range(rank.num_groups):
        gb = blocks[group]
        if gb.ids.size == 0:
            continue
        for name in rank.group_layers(group):
            view = _alias(rank.kv_caches[name], rank.buffer, target)
            arr = bytes_view(view)
            n_tokens = arr.shape[2]
            positions = (gb.first_position + np.arange(gb.ids.size))[gb.holds]
            tokens = positions[:, None] * n_tokens + np.arange(n_tokens)[None, :]
            heads = model_heads(rank.tp_rank, tp, rank.total_heads[name])
            arr[gb.ids[gb.holds]] = pattern(rank.layer_index[name], tokens, heads, arr.shape[3], seed)


def _alias(view: torch.Tensor, buffer: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same view over ``target`` (a buffer shaped like ``buffer``)."""
    if target is buffer:
        return view
    v8 = view.view(torch.uint8)
    t8 = target.view(torch.uint8)
    offset = v8.data_ptr() - buffer.data_ptr()
    return t8.as_strided(v8.size(), v8.stride(), offset)


@dataclass(frozen=True)
class Mismatch:
    rank: int
    where: str
    expected: int
    actual: int
    wrong_bytes: int

    def __str__(self) -> str:
        return (
            f"decode rank {self.rank}: {self.wrong_bytes} wrong bytes; first at {self.where}: "
            f"expected {self.expected:#04x}, got {self.actual:#04x}"
        )


def compare(rank: FabricatedRank, expected: torch.Tensor) -> Mismatch | None:
    """None when every byte of the rank equals the expectation; else the first difference,
    located as (layer, block, head slot, token slot, byte) when it falls inside a layer's page."""
    actual_np = rank.buffer.numpy().view(np.uint8)
    expected_np = expected.numpy().view(np.uint8)
    diff = actual_np != expected_np
    wrong = int(diff.sum())
    if not wrong:
        return None
    first = int(np.argmax(diff))
    for name, view in rank.kv_caches.items():
        a = bytes_view(view)
        e = bytes_view(_alias(view, rank.buffer, expected))
        bad = np.argwhere(a != e)
        if bad.size:
            b, h, n, c = (int(x) for x in bad[0])
            heads = model_heads(rank.tp_rank, rank.side.tp, rank.total_heads[name])
            where = f"layer {name} block {b} head slot {h} (global head {heads[h] if h < len(heads) else '?'}) token slot {n} byte {c}"
            return Mismatch(rank.tp_rank, where, int(e[b, h, n, c]), int(a[b, h, n, c]), wrong)
    return Mismatch(rank.tp_rank, f"buffer offset {first} (outside every layer page)", int(expected_np[first]), int(actual_np[first]), wrong)
