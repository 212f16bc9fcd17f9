"""Sliding window: only the window's blocks move, null blocks never do, prefix hits trim the rest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nixlkv.core import Dispatcher
from nixlkv.testing.rehearsal import build, rehearse
from nixlkv.testing.scenario import load, parse

SCENARIOS = Path(__file__).parent / "scenarios"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_bytes(scenario, window_positions) -> int:
    """Bytes every decode rank must receive, from the model geometry alone: full-attention
    layers get every uncached block; window layers get ``window_positions`` blocks."""
    d = scenario.decode
    n_blocks = cdiv(scenario.request.num_tokens, d.block_size)
    total = 0
    for kind in scenario.layer_kinds():
        p = kind.params
        heads = max(1, p["num_kv_heads"] // d.tp)
        page = heads * d.block_size * 2 * p["head_size"] * 2  # K and V, bf16
        blocks = window_positions if kind.kind == "sliding_window" else n_blocks - scenario.request.cached_blocks
        total += blocks * page * d.tp
    return total


@pytest.mark.nixl
@pytest.mark.parametrize(
    "name, window_blocks",
    [
        # 5,000 tokens, window 128, block 16: 313 blocks; cdiv(128, 16) + 1 = 9 move.
        ("sw-gptoss-like-p2-d4", 9),
        ("sw-gptoss-like-p4-d2", 9),
        # decode already holds 250 blocks: below the window, so the window still moves whole.
        ("sw-gptoss-like-p2-d4-prefix-hit", 9),
        # decode holds 308 of 313: only positions 308..312 of the window are missing.
        ("sw-gptoss-like-p2-d4-prefix-hit-in-window", 5),
        # window 1,024: 100 tokens = 7 blocks, all in the window; 1,024 tokens = 64 blocks, all;
        # 5,000 tokens: the last cdiv(1024, 16) + 1 = 65 blocks, none nulled by the prefill yet
        # (the prefill nulls positions below (5000 - 1023) // 16 = 248 = 313 - 65).
        ("sw-gemma3-like-p1-d2-t100", 7),
        ("sw-gemma3-like-p1-d2-t1024", 64),
        ("sw-gemma3-like-p1-d2-t5000", 65),
    ],
)
def test_bytes_moved_are_the_window_blocks_only(name: str, window_blocks: int) -> None:
    scenario = load(SCENARIOS / f"{name}.yaml")
    result = rehearse(scenario)
    assert result.outcome == "byte-exact", result.message
    assert result.bytes_moved == expected_bytes(scenario, window_blocks)


def _scenario(window: int, tokens: int):
    return parse({
        "name": "sw-unit",
        "model": {"layers": [{"kind": "sliding_window", "count": 2, "num_kv_heads": 4, "head_size": 64, "window": window}]},
        "prefill": {"tp": 2, "block_size": 16, "layout": "LBHNC"},
        "decode": {"tp": 1, "block_size": 16, "layout": "LBHNC"},
        "request": {"num_tokens": tokens},
    })


def moved_block_pairs(plan, resolved) -> set[tuple[int, int]]:
    """(local block, remote block) of every byte move, recovered from addresses alone."""
    local = list(plan.local.regions)
    remote = [r for g in plan.remote.values() for r in g.regions]

    def block(addr: int, regions) -> int:
        (region,) = [r for r in regions if r.base <= addr < r.end]
        return (addr - region.base) // region.block_stride

    return {(block(la, local), block(ra, remote)) for la, _, ra, _ in plan.byte_moves(resolved)}


def test_null_blocks_never_move_on_either_side() -> None:
    plan = build(_scenario(64, 200), Dispatcher.from_plugins()).plans[0]
    # 200 tokens -> 13 blocks; window 64 keeps cdiv(64, 16) + 1 = 5. Nulls inside the window on
    # both sides must be skipped, the rest paired by position from the tail.
    local = np.array([9, 10, 11, 12, 13, 14, 15, 16, 17, 0, 19, 20, 21])
    remote = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 25, 26, 0, 28])
    assert moved_block_pairs(plan, plan.resolve([local], [remote])) == {(19, 26), (21, 28)}


def test_window_pairs_by_tail_when_decode_holds_a_prefix() -> None:
    plan = build(_scenario(32, 160), Dispatcher.from_plugins()).plans[0]
    # 160 tokens = 10 blocks; the window keeps 3 (positions 7, 8, 9). Decode holds the first 8.
    remote = np.arange(11, 21)
    local = np.array([18, 19])  # positions 8 and 9
    assert moved_block_pairs(plan, plan.resolve([local], [remote])) == {(18, 19), (19, 20)}


def test_window_mismatch_between_engines_is_rejected() -> None:
    scenario = _scenario(64, 200)
    engines = build(scenario, Dispatcher.from_plugins())
    decode_geometry = engines.plans[0].local
    import dataclasses

    tampered = dataclasses.replace(
        decode_geometry,
        regions=tuple(dataclasses.replace(r, facts={**r.facts, "sliding_window": 128}) for r in decode_geometry.regions),
    )
    from nixlkv.core import IncompatibleGeometry

    with pytest.raises(IncompatibleGeometry, match="sliding window"):
        Dispatcher.from_plugins().plan(tampered, engines.plans[0].remote)
