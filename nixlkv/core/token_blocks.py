"""Pairing token blocks when P and D hold a different number of tokens per block.

A request's block list on each side is the tail of that engine's full list for the request's
``num_tokens`` tokens (a prefix the decode engine already holds, or a window, cuts the front),
so entry ``i`` of a list of ``n`` blocks of ``t`` tokens sits at block position
``cdiv(num_tokens, t) - n + i``. When one side's blocks are ``m`` times larger, each pair of a
large and a small block is one of ``m`` *phases*: the small block's token range inside the
large one. Strategies emit one set of segments per phase (:func:`token_phases`); the plan
applies a pair's segments by its phase.
"""

from __future__ import annotations

import numpy as np

from .errors import IncompatibleGeometry, RequestError
from .strategy import tail_aligned

Phase = tuple[int, int, int]  # (local first token, remote first token, tokens) within the pages
# Phases of pairs that are all in phase 0 are views of this (read-only) array: no allocation per
# request, and the plan tells them apart without counting.
PHASE_ZERO = np.zeros(1 << 16, dtype=np.int64)
PHASE_ZERO.flags.writeable = False


def phase_zero(n: int) -> np.ndarray:
    """``n`` zero phases (a read-only view where ``n`` is not huge)."""
    return PHASE_ZERO[:n] if n <= PHASE_ZERO.size else np.zeros(n, dtype=np.int64)


def token_phases(local_tokens: int, remote_tokens: int) -> list[Phase]:
    """The token sub-ranges a pair of blocks copies, one entry per phase."""
    if local_tokens == remote_tokens:
        return [(0, 0, local_tokens)]
    if local_tokens % remote_tokens == 0:
        return [(j * remote_tokens, 0, remote_tokens) for j in range(local_tokens // remote_tokens)]
    if remote_tokens % local_tokens == 0:
        return [(0, j * local_tokens, local_tokens) for j in range(remote_tokens // local_tokens)]
    raise IncompatibleGeometry(
        f"tokens per block is {local_tokens} here and {remote_tokens} on the remote engine: one must be a "
        f"multiple of the other (e.g. {remote_tokens} or {2 * remote_tokens} here)"
    )


def pair_by_tokens(
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
    local_tokens: int,
    remote_tokens: int,
    num_tokens: int | None,
    strict: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local ids, remote ids, phases) of every pair of blocks that share tokens (vectorised).

    ``strict``: every local block must be filled, so the remote list must start at or before
    the local list's first token (a request error otherwise). Not strict (a window): local
    tokens the remote list does not hold are left alone.
    """
    if local_tokens == remote_tokens:
        if not strict and len(local_ids) > len(remote_ids):  # a window: the remote holds only its tail
            local_ids = local_ids[len(local_ids) - len(remote_ids) :]
        local_ids, remote = tail_aligned(local_ids, remote_ids)
        return local_ids, remote, phase_zero(len(local_ids))
    if len(local_ids) == 0:  # nothing to fill here (the decode engine computes it): no pairs
        return local_ids, remote_ids[:0], np.zeros(0, dtype=np.int64)
    if num_tokens is None:
        raise RequestError(
            f"blocks of {local_tokens} tokens here and {remote_tokens} on the remote engine can only be "
            "paired knowing the request's number of tokens (num_tokens)"
        )
    token_phases(local_tokens, remote_tokens)  # raises for sizes that do not divide
    local_first = _first_position(len(local_ids), local_tokens, num_tokens, "local")
    remote_first = _first_position(len(remote_ids), remote_tokens, num_tokens, "remote")
    if strict and len(local_ids) and remote_first * remote_tokens > local_first * local_tokens:
        raise RequestError(
            f"local blocks start at token {local_first * local_tokens} but the remote list starts at token "
            f"{remote_first * remote_tokens}: the remote engine must send every block the local ones need"
        )
    if local_tokens > remote_tokens:
        m = local_tokens // remote_tokens
        remote_pos = remote_first + np.arange(len(remote_ids))
        local_pos = remote_pos // m
        keep = local_pos >= local_first
        return local_ids[local_pos[keep] - local_first], remote_ids[keep], remote_pos[keep] % m
    m = remote_tokens // local_tokens
    local_pos = local_first + np.arange(len(local_ids))
    remote_pos = local_pos // m
    keep = remote_pos >= remote_first
    return local_ids[keep], remote_ids[remote_pos[keep] - remote_first], local_pos[keep] % m


def _first_position(n: int, tokens: int, num_tokens: int, side: str) -> int:
    total = -(-num_tokens // tokens)
    if n > total:
        raise RequestError(
            f"{side} list has {n} blocks but {num_tokens} tokens fill only {total} blocks of {tokens} tokens"
        )
    return total - n
