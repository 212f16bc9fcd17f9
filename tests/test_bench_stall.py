"""``nixlkv bench-handshake`` runs and reports every figure (the figures themselves are
benchmarks, not asserted bounds)."""

from __future__ import annotations

import math

import pytest

from nixlkv.bench.stall import markdown, run

pytestmark = pytest.mark.nixl


def test_bench_handshake_reports_every_figure() -> None:
    out = run(layers=4, p_tp=2, d_tp=1, num_blocks=16, reps=1)
    for key in ("max_step_during_handshake_ms", "median_step_during_handshake_ms", "post_step_ms",
                "handshake_nixl_ms", "post_step_before_ms"):
        assert math.isfinite(out[key]) and out[key] >= 0, key
    assert out["handshake_nixl_ms"] > 0 and out["post_step_before_ms"] > out["post_step_ms"]
    assert "handshake runs" in markdown(out)
