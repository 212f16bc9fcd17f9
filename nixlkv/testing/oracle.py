"""The byte oracle: what every byte of every rank must hold, from the physics, not the planner.

Each byte of a prefill cache encodes (layer, token, global KV head, byte within the head's
K|V content) through a 64-bit mix, so a swapped layer, token, head or K/V half differs from the
right value in almost every byte (a whole head's content matches by chance with odds 256^-C).
Prefill blocks outside the request hold unrelated random bytes; decode starts as a sentinel.
After the transfer, decode must hold the pattern in its request blocks and the sentinel
everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .engines import FabricatedRank
from .kinds import KINDS

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


def bytes_view(view: torch.Tensor, num_blocks: int) -> np.ndarray:
    """A layer's cache as uint8 numpy ``[B, K, H, k, C]`` sharing its memory (C in bytes).

    vLLM's view is ``[B*K, H, k, C]`` when a logical block of ``K*k`` tokens is stored as ``K``
    consecutive kernel pages of ``k`` tokens each (K = 1 otherwise)."""
    return _by_block(view.view(torch.uint8), num_blocks)


def page_pieces(
    view: torch.Tensor, num_blocks: int, interior: str | None, element_size: int
) -> list[tuple[slice, np.ndarray]]:
    """Where the logical ``[B, K, H, k, C]`` bytes of a layer really are, as (slice of C, array
    ``[B, K, H, k, ...]`` over the memory whose trailing axes flatten to that slice).

    Token-major pages are the view itself. ``k_channel_major`` (vLLM's CPU attention kernels,
    ISA vec/vec16) keeps, per head, keys as [channel, token] elements then values as [token,
    channel] of ``element_size`` bytes: written here from that statement with strides, not from
    nixlkv's page parts."""
    if interior is None:
        return [(slice(None), bytes_view(view, num_blocks))]
    if interior != "k_channel_major":
        raise ValueError(f"the oracle knows no page interior {interior!r}")
    v8 = view.view(torch.uint8)
    pages, h, n, c = v8.shape
    e, half = element_size, c // 2
    s0, sh = v8.stride(0), v8.stride(1)
    at = v8.storage_offset()
    keys = v8.as_strided((pages, h, n, half // e, e), (s0, sh, e, n * e, 1), at)
    values = v8.as_strided((pages, h, n, half), (s0, sh, half, 1), at + n * half)
    return [(slice(0, half), _by_block(keys, num_blocks)), (slice(half, c), _by_block(values, num_blocks))]


def _by_block(t: torch.Tensor, num_blocks: int) -> np.ndarray:
    """A ``[B*K, ...]`` uint8 tensor as numpy ``[B, K, ...]`` sharing its memory."""
    arr = t.numpy()
    per = arr.shape[0] // num_blocks
    return np.lib.stride_tricks.as_strided(arr, (num_blocks, per, *arr.shape[1:]), (arr.strides[0] * per, *arr.strides))


def as_kernel_pages(values: np.ndarray, per: int) -> np.ndarray:
    """Logical ``[nb, H, N, C]`` values laid out as ``[nb, K, H, N/K, C]`` kernel pages."""
    nb, h, n, c = values.shape
    return values.reshape(nb, h, per, n // per, c).transpose(0, 2, 1, 3, 4)


@dataclass(frozen=True)
class CoordinateQuery:
    """What an element-coordinate function is asked: one layer's blocks on one rank.

    ``shape`` is the layer view's per-block shape ``(H, N, C)`` with C in bytes; ``positions``
    are the request's block positions being written (one per block). ``params`` are the
    scenario kind's parameters (head counts, sizes...).
    """

    layer_index: int
    tp_rank: int
    tp_size: int
    params: Mapping[str, Any]
    total_kv_heads: int
    positions: np.ndarray
    shape: tuple[int, int, int]


# (query) -> {coordinate name: integer array broadcastable to (len(positions), H, N, C)}
Coordinates = Callable[[CoordinateQuery], Mapping[str, np.ndarray]]


def attention_coordinates(q: CoordinateQuery) -> dict[str, np.ndarray]:
    """Attention physics: slot h of a page holds global KV head ``model_heads(...)[h]``, token
    slot n of block position b holds token ``b * N + n``, byte c is byte c of that head's K|V."""
    h, n, c = q.shape
    heads = np.asarray(model_heads(q.tp_rank, q.tp_size, q.total_kv_heads), dtype=np.int64)
    return {
        "token": (q.positions[:, None] * n + np.arange(n))[:, None, :, None],
        "head": heads[None, :, None, None],
        "byte": np.arange(c)[None, None, None, :],
    }


def element_pattern(layer: int, coords: Mapping[str, np.ndarray], shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Pattern bytes of shape ``shape`` from named coordinates: every coordinate is mixed in, so
    a byte landing at another token, head, channel or state part differs from the right value."""
    with np.errstate(over="ignore"):
        x = np.full(shape, _mix(np.uint64(layer + 1) * _K[0] + np.uint64(seed) * _K[1]), dtype=np.uint64)
        for i, name in enumerate(sorted(coords)):
            salt = np.uint64(sum(ord(ch) << (8 * (j % 7)) for j, ch in enumerate(name)) + 1)
            value = np.broadcast_to(np.asarray(coords[name]).astype(np.uint64), shape)
            x = _mix(x ^ (value * _K[(i + 2) % 4] + salt * _K[(i + 3) % 4]))
        return (x >> np.uint64(56)).astype(np.uint8)


@dataclass(frozen=True)
class GroupBlocks:
    """A request's block IDs of one KV group on one side, and the token positions they hold.

    ``holds[i, n]`` says whether token slot ``n`` of block ``ids[i]`` holds the request's KV
    after the step being rehearsed: on prefill, every slot of every block but the null ones; on
    decode, only what the transfer must deliver.
    """

    ids: np.ndarray
    first_position: int  # block position of ids[0] in the request (skipped prefix blocks)
    holds: np.ndarray  # bool [len(ids), tokens per block]; 1-D (per block) means whole blocks
    # Layers of a wrapped group (UniformTypeKVCacheSpecs) whose own spec moves other slots than
    # the group's (a sliding-window layer in a group vLLM manages as full attention).
    layer_holds: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        holds = np.asarray(self.holds, dtype=bool)
        object.__setattr__(self, "holds", holds[:, None] if holds.ndim == 1 else holds)

    def holds_of(self, layer: str) -> np.ndarray:
        return self.layer_holds.get(layer, self.holds)


def id_lists(blocks: Sequence[GroupBlocks]) -> list[list[int]]:
    """A request's block ids per group as Python lists: what vLLM hands a connector (and what
    ``TransferPlan.resolve`` converts on its fastest path)."""
    return [g.ids.tolist() for g in blocks]


def window_of(rank: FabricatedRank, group: int) -> int | None:
    """The sliding window of the group's block manager in tokens (what vLLM's scheduler frees
    below), or None (every block is kept)."""
    return _window(rank.kv_cache_config.kv_cache_groups[group].kv_cache_spec)


def layer_window(rank: FabricatedRank, layer: str) -> int | None:
    """The layer's own sliding window, from its own spec as the dispatcher sees it (inside a
    wrapped group it may differ from the group's)."""
    return _window(rank.layer_spec(layer))


def _window(spec: Any) -> int | None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def skipped_tokens(rank: FabricatedRank, group: int, num_tokens: int) -> int:
    """Leading tokens the group's block manager has freed once ``num_tokens`` are computed, as the
    scenario kind of its layers states it (``KindDef.skipped_tokens``; chunked local attention:
    every token left of the current chunk); 0 for a kind that keeps its blocks."""
    counts = set()
    for name in rank.group_layers(group):
        kind = rank.layer_kinds.get(name)
        rule = KINDS[kind.kind].skipped_tokens if kind is not None and kind.kind in KINDS else None
        counts.add(int(rule(kind.params, num_tokens)) if rule is not None else 0)
    if len(counts) > 1:
        raise ValueError(f"group {group}: its layers free different token counts {sorted(counts)}; vLLM manages a group as one")
    return counts.pop() if counts else 0


def prefill_null_positions(num_tokens: int, window: int | None, block_size: int) -> int:
    """Leading block positions a prefill engine has already nulled: once N tokens are computed,
    vLLM's window manager frees every block wholly below token N - window + 1."""
    if window is None:
        return 0
    return max(0, num_tokens - window + 1) // block_size


def window_tail(num_tokens: int, window: int, block_size: int) -> int:
    """First block position vLLM's connector exchanges for a window group: it keeps the last
    cdiv(window, block_size) + 1 block ids (the window may straddle a block edge)."""
    return -(-num_tokens // block_size) - (-(-window // block_size) + 1)


def decode_receives(
    positions: np.ndarray, num_tokens: int, window: int | None, decode_block: int, prefill_block: int,
    nulled_window: int | None | str = "same", prefill_skipped: int = 0,
) -> np.ndarray:
    """bool ``[len(positions), decode_block]``: which token slots of the decode blocks at these
    positions the transfer must fill. A slot is filled when the prefill block holding that token
    exists and is exchanged: for a layer with a window, both engines exchange only their own
    window tail, and prefill has nulled what fell below the window of its block manager
    (``nulled_window``: the layer's own unless its group is managed otherwise), and every block
    wholly below ``prefill_skipped`` tokens (:func:`skipped_tokens`)."""
    tokens = positions[:, None] * decode_block + np.arange(decode_block)[None, :]
    source = tokens // prefill_block
    filled = source < -(-num_tokens // prefill_block)
    filled &= source >= prefill_skipped // prefill_block
    if window is not None:
        filled &= positions[:, None] >= window_tail(num_tokens, window, decode_block)
        filled &= source >= window_tail(num_tokens, window, prefill_block)
    nulled = window if nulled_window == "same" else nulled_window
    if nulled is not None:
        filled &= source >= prefill_null_positions(num_tokens, nulled, prefill_block)
    return filled


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
        if rank.is_state_group(group):
            for name in rank.group_layers(group):
                block = running_state(gb.ids, rank.params[name]["num_spec"] or 0)
                _write_state(rank, _alias(rank.kv_caches[name], rank.buffer, target), name, block, seed)
            continue
        for name in rank.group_layers(group):
            view = _alias(rank.kv_caches[name], rank.buffer, target)
            arr = bytes_view(view, rank.kv_cache_config.num_blocks)
            per = arr.shape[1]
            n_tokens = per * arr.shape[3]
            rows = gb.holds.any(axis=1)
            positions = (gb.first_position + np.arange(gb.ids.size))[rows]
            tokens = positions[:, None] * n_tokens + np.arange(n_tokens)[None, :]
            kind = rank.layer_kinds.get(name)
            custom = KINDS[kind.kind].coordinates if kind is not None and kind.kind in KINDS else None
            if custom is None:
                heads = model_heads(rank.tp_rank, tp, rank.total_heads[name])
                fresh = pattern(rank.layer_index[name], tokens, heads, arr.shape[4], seed)
            else:
                logical = (arr.shape[2], n_tokens, arr.shape[4])  # (H, N, C) of a logical block
                query = CoordinateQuery(
                    layer_index=rank.layer_index[name], tp_rank=rank.tp_rank, tp_size=tp, params=kind.params,
                    total_kv_heads=rank.total_heads[name], positions=positions, shape=logical,
                )
                fresh = element_pattern(rank.layer_index[name], custom(query), (positions.size, *logical), seed)
            held = slot_holds(gb.holds_of(name)[rows], n_tokens)
            mask = np.broadcast_to(held[:, None, :, None], fresh.shape)
            ids = gb.ids[rows]
            fresh, mask = as_kernel_pages(fresh, per), as_kernel_pages(mask, per)
            element = rank.kv_caches[name].element_size()
            for part, mem in page_pieces(view, rank.kv_cache_config.num_blocks, interior_of(rank, name), element):
                want = fresh[..., part].reshape(mem[ids].shape)
                keep = mask[..., part].reshape(want.shape)
                mem[ids] = want if keep.all() else np.where(keep, want, mem[ids])


def slot_holds(holds: np.ndarray, slots: int) -> np.ndarray:
    """``holds`` (per block, per token) as per block, per page slot: a page of compressed states
    (DeepSeek V4: one state per ``tokens / slots`` tokens) holds a state where it holds any of its
    tokens; a page of several states per token repeats each token's."""
    tokens = holds.shape[1]
    if tokens == slots or tokens == 1:
        return holds if tokens == slots else np.repeat(holds, slots, axis=1)
    if tokens % slots == 0:
        return holds.reshape(holds.shape[0], slots, tokens // slots).any(axis=2)
    if slots % tokens == 0:
        return np.repeat(holds, slots // tokens, axis=1)
    raise ValueError(f"a page of {slots} slots for blocks of {tokens} tokens: neither divides the other")


def interior_of(rank: FabricatedRank, layer: str) -> str | None:
    """The page interior the scenario says the layer's backend writes (None: the view's order)."""
    return rank.hints.get(layer, {}).get("page_interior")


# "Token" codes that tell a conv row from an SSM unit in the pattern (no token reaches them).
CONV_CODE, SSM_CODE = 1 << 40, (1 << 40) + 1
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def mamba_state_coordinates(p: dict, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """(global conv channels, global SSM units) a rank holds, in the order it stores them.

    Written from vLLM's weight sharding (``mamba_v2_sharded_weight_loader``, the GDN / Mamba1
    column-parallel conv), independently of the strategy: a global conv channel indexes the
    model's unsharded ``[x | B | C]`` (GDN ``[Q | K | V]``, Mamba1 ``[x]``). x and the SSM heads
    split evenly; the groups of B / C split evenly, except that a single group is held whole by
    every rank (vLLM replicates it when ``n_groups = 1``).
    """
    kind = p["mamba_type"]
    if p["tp_replicated"]:  # the whole conv state on every rank
        return list(range(p["intermediate_size"] or p["num_heads"] * p["head_dim"])), []
    if kind == "mamba1":
        n = p["intermediate_size"] // tp
        channels = list(range(rank * n, (rank + 1) * n))
        return channels, channels
    h, hd, g, d = p["num_heads"], p["head_dim"], p["n_groups"], p["d_state"]
    heads = list(range(rank * h // tp, (rank + 1) * h // tp))
    groups = list(range(rank * g // tp, (rank + 1) * g // tp)) if g % tp == 0 else [0]
    if kind == "mamba2":
        x = [hh * hd + j for hh in heads for j in range(hd)]
        b = [h * hd + gg * d + j for gg in groups for j in range(d)]
        c = [h * hd + g * d + gg * d + j for gg in groups for j in range(d)]
        return x + b + c, heads
    q = [gg * d + j for gg in groups for j in range(d)]  # gdn: [Q | K | V]
    k = [g * d + gg * d + j for gg in groups for j in range(d)]
    v = [2 * g * d + hh * hd + j for hh in heads for j in range(hd)]
    return q + k + v, heads


def running_state(ids: np.ndarray, num_spec: int) -> int:
    """The block of a state list that holds the running state: vLLM's scheduler appends
    ``num_spec`` speculative scratch blocks after it (``clip_ssm_state_blocks`` drops them)."""
    return int(ids[len(ids) - 1 - min(num_spec, len(ids) - 1)])


def _write_state(rank: FabricatedRank, view: torch.Tensor, name: str, block: int, seed: int) -> None:
    """Write the request's running state into ``block`` of a Mamba layer: every conv element and
    every SSM unit carries its global coordinate (a conv element the same bytes in either layout:
    channel-major DS, row-major SD); padding after the states is left alone."""
    p = rank.params[name]
    channels, units = mamba_state_coordinates(p, rank.side.tp, rank.tp_rank)
    row = (p["conv_kernel"] - 1 + (p["num_spec"] or 0)) * DTYPE_BYTES[p["dtype"]]
    if p["mamba_type"] == "mamba1":
        unit = p["d_state"] * DTYPE_BYTES[p["ssm_dtype"]]
    else:
        unit = p["head_dim"] * p["d_state"] * DTYPE_BYTES[p["ssm_dtype"]]
    layer = rank.layer_index[name]
    conv = pattern(layer, np.array([[CONV_CODE]]), channels, row, seed)  # channel x (rows x element): DS
    if p["conv_layout"] == "SD":
        # state-first: row r holds element r of every channel (vLLM's VLLM_SSM_CONV_STATE_LAYOUT=SD)
        element = DTYPE_BYTES[p["dtype"]]
        conv = conv.reshape(len(channels), -1, element).transpose(1, 0, 2)
    conv = np.ascontiguousarray(conv).reshape(-1)
    ssm = pattern(layer, np.array([[SSM_CODE]]), units, unit, seed).reshape(-1) if units else np.zeros(0, np.uint8)
    page = view.view(torch.uint8).numpy().reshape(view.shape[0], -1)
    if conv.size + ssm.size != page.shape[1]:
        raise ValueError(
            f"{name}: physics gives {conv.size} conv + {ssm.size} SSM bytes per rank, the page holds {page.shape[1]}"
        )
    page[block, : conv.size] = conv
    page[block, conv.size :] = ssm


def same_view(view: torch.Tensor, buffer: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``view`` (a layer's cache over ``buffer``) over ``target``, a buffer shaped like ``buffer``:
    how a caller edits an expectation built by :func:`expected_decode` layer by layer."""
    return _alias(view, buffer, target)


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
        interior = interior_of(rank, name)
        expected_view = _alias(view, rank.buffer, expected)
        nb, element = rank.kv_cache_config.num_blocks, view.element_size()
        pieces = zip(page_pieces(view, nb, interior, element), page_pieces(expected_view, nb, interior, element))
        for (part, a), (_, e) in pieces:
            bad = np.argwhere(a != e)
            if not bad.size:
                continue
            b, kb, h, n, *inner = (int(x) for x in bad[0])
            c = (part.start or 0) + int(np.ravel_multi_index(inner, a.shape[4:]))
            heads = model_heads(rank.tp_rank, rank.side.tp, rank.total_heads[name])
            where = (
                f"layer {name} block {b} head slot {h} (global head {heads[h] if h < len(heads) else '?'}) "
                f"token slot {kb * a.shape[3] + n} byte {c}"
            )
            return Mismatch(rank.tp_rank, where, int(e[tuple(bad[0])]), int(a[tuple(bad[0])]), wrong)
    return Mismatch(rank.tp_rank, f"buffer offset {first} (outside every layer page)", int(expected_np[first]), int(actual_np[first]), wrong)
