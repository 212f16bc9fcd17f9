"""A bounded memo for the immutable facts handshakes parse and plan (class descriptions, copy
runs, plans to rebase): engines of one model ask the same questions, so the answers are kept,
but never without bound."""

from __future__ import annotations

from typing import Any


def remember(memo: dict[Any, Any], key: Any, value: Any, bound: int) -> None:
    """``memo[key] = value``, emptying the memo first where it holds ``bound`` entries: bounded,
    and ``clear()`` is one atomic step for the threads that read it."""
    if len(memo) >= bound:
        memo.clear()
    memo[key] = value
