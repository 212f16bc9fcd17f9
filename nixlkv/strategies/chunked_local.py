"""Chunked local attention (Llama 4's RoPE layers): stored like full attention, but a request keeps
only its current chunk.

A token at position ``t`` attends to tokens ``[floor(t/C)*C, t]`` (``C``:
``attention_chunk_size``). After a prefill of ``M`` tokens vLLM's chunked-local manager has
replaced every block wholly below ``s = floor(M/C)*C`` with the null block (id 0), and the decode
engine, told ``M`` tokens, allocates and lists only the blocks from ``s`` on. So only tokens
``[s, M)`` move; when ``M % C == 0`` nothing moves for the group (the next token starts a chunk).

The decode engine computes the last prompt token itself (:meth:`decode_recomputes` is 1): the
prefill engine publishes ``M = N - 1`` tokens, which are exactly the chunk that token reads.
Loading all ``N`` would be wrong whenever ``N % C == 0``: vLLM's manager then frees every block
on both sides, and the token the decode engine computes again gets no block of its chunk.

Storage, head slicing, layouts, TP pairs and different block sizes are the full-attention
strategy's; both engines must also agree on ``attention_chunk_size``.

This module is its own plugin (entry point ``chunked_local`` in the ``nixlkv`` group): it hands
nixlkv the strategy, and the test tooling the scenario layer kind ``chunked_local``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

from ..core import Region, RequestError, Strategy, hookimpl
from ..core.token_blocks import pair_by_tokens
from ..scenario_kinds import DTYPES, KindDef, choice, count
from .full_attention import MATCHING_FACTS, FullAttentionStrategy, tokens_per_block

CHUNK_FACT = {"attention_chunk_size": "attention chunk size (tokens)"}


class ChunkedLocalStrategy(FullAttentionStrategy):
    name = "chunked_local"
    spec_types = (ChunkedLocalAttentionSpec,)
    matching_facts: ClassVar[Mapping[str, str]] = {**MATCHING_FACTS, **CHUNK_FACT}

    def extra_facts(self, spec: ChunkedLocalAttentionSpec) -> dict[str, object]:
        return {"attention_chunk_size": int(spec.attention_chunk_size)}

    def decode_recomputes(self, spec: Any) -> int:
        """One, required: with the whole prompt of ``N`` tokens loaded, ``N % C == 0`` leaves the
        decode engine's recomputed token ``N - 1`` without any block of its chunk (vLLM frees them
        all, on both sides). Loading ``N - 1`` tokens keeps that chunk on both engines."""
        return 1

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        """The current chunk's block pairs by token position from the tail, null blocks dropped.

        The prefill list holds nulls below the chunk start, the decode list only the chunk's
        real blocks (empty when ``num_tokens % C == 0``: nothing to pair). A decode block
        straddling the chunk start (larger decode blocks) gets the chunk's tokens only."""
        ltok, rtok = tokens_per_block(local), tokens_per_block(remote)
        lp, rp, phase = pair_by_tokens(local_ids, remote_ids, ltok, rtok, num_tokens)
        if num_tokens is not None:
            check_chunk_held(local_ids, remote_ids, ltok, rtok, num_tokens, int(local.fact("attention_chunk_size")))
        elif np.any((lp != 0) & (rp == 0)):  # equal block sizes: both engines null the same positions
            raise RequestError(
                "a decode block of the current chunk is paired with a null prefill block: the prefill engine "
                "freed tokens the chunk needs (do both engines use the same attention_chunk_size?)"
            )
        real = (lp != 0) & (rp != 0)
        return lp[real], rp[real], phase[real]


def check_chunk_held(
    local_ids: np.ndarray, remote_ids: np.ndarray, ltok: int, rtok: int, num_tokens: int, chunk: int
) -> None:
    """The prefill list must hold, as real blocks, every token of the current chunk
    ``[floor(num_tokens/C)*C, num_tokens)`` the decode list still needs (a RequestError else)."""
    local_first = -(-num_tokens // ltok) - len(local_ids)
    remote_first = -(-num_tokens // rtok) - len(remote_ids)
    if local_first < 0 or remote_first < 0:
        raise RequestError(
            f"{len(local_ids)} decode and {len(remote_ids)} prefill blocks of {ltok} and {rtok} tokens are more "
            f"than {num_tokens} tokens fill"
        )
    start = max(num_tokens // chunk * chunk, local_first * ltok)  # the chunk's first token decode lacks
    if not len(local_ids) or start >= num_tokens:
        return
    first_needed = start // rtok
    if first_needed < remote_first or not np.all(remote_ids[first_needed - remote_first :]):
        raise RequestError(
            f"the current chunk of a {num_tokens}-token request starts at token {num_tokens // chunk * chunk} "
            f"(chunk size {chunk}), but the prefill engine's block list holds no real block for token {start} "
            "onwards; it must send every block of the current chunk"
        )


# ---------------------------------------------------------------------------- the plugin's hooks


@hookimpl
def nixlkv_strategies() -> list[Strategy]:
    return [ChunkedLocalStrategy()]


@hookimpl
def nixlkv_scenario_kinds() -> Mapping[str, KindDef]:
    """The scenario layer kind ``chunked_local`` (for ``nixlkv rehearse`` and the contract kit)."""
    return {"chunked_local": scenario_kind()}


@functools.cache
def scenario_kind() -> KindDef:
    """``chunked_local``: ``num_kv_heads``, ``head_size``, ``chunk`` (tokens), optional ``dtype`` and
    ``head_size_v``. One definition per process, so registering it again is a no-op."""
    return KindDef(
        fields={"num_kv_heads": count(), "head_size": count(), "chunk": count(),
                "dtype": choice(DTYPES, "bfloat16"), "head_size_v": count(None, nullable=True)},
        build=chunked_local_spec,
        skipped_tokens=chunk_start,
        interior=True,  # full attention's pages: vLLM's CPU kernels write them channel-major too
        captured_spec="ChunkedLocalAttentionSpec",
        from_capture=from_capture,
    )


def from_capture(facts: Mapping[str, Any], hints: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """The kind's parameters of a layer ``nixlkv capture`` recorded (its spec's fields)."""
    params: dict[str, Any] = {"num_kv_heads": int(hints["total_kv_heads"]), "head_size": int(facts["head_size"]),
                              "chunk": int(facts["attention_chunk_size"]), "dtype": facts["dtype"]}
    if facts.get("head_size_v") not in (None, facts["head_size"]):
        params["head_size_v"] = int(facts["head_size_v"])
    return params


def chunked_local_spec(params: Mapping[str, Any], tp: int, block_size: int) -> ChunkedLocalAttentionSpec:
    """What ``ChunkedLocalAttention.get_kv_cache_spec`` reports on one rank of a TP-``tp`` engine
    (KV heads split or replicated as vLLM's QKVParallelLinear does)."""
    import torch

    from ..core import heads_per_rank

    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads_per_rank(tp, params["num_kv_heads"]),
        head_size=params["head_size"],
        head_size_v=params["head_size_v"] if params.get("head_size_v") is not None else params["head_size"],
        dtype=getattr(torch, params["dtype"]),
        attention_chunk_size=params["chunk"],
    )


def chunk_start(params: Mapping[str, Any], num_tokens: int) -> int:
    """Tokens vLLM's ChunkedLocalAttentionManager frees once ``num_tokens`` are computed
    (``get_num_skipped_tokens``): every token left of the current chunk."""
    return num_tokens // params["chunk"] * params["chunk"]
