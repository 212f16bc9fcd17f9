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
    # The second engine of the layout prepares its remote lists only: one per rank it reads
    # (P TP2 -> D TP1: two), where the first also prepared D's local list.
    assert out["lists_first_engine"] == 3 and out["lists_second_engine"] == 2 and out["local_lists"] == 1
    assert math.isfinite(out["second_engine_nixl_ms"]) and out["second_engine_nixl_ms"] > 0
    assert 0 < out["handshake_lists_ms"] < out["handshake_nixl_ms"]  # a part of the NIXL work
    assert 0 < out["second_engine_lists_ms"] < out["second_engine_nixl_ms"]
    assert "handshake runs" in markdown(out) and "second prefill engine" in markdown(out)
