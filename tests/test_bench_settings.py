"""``nixlkv bench-settings`` runs every setting on real NIXL and reports each (the figures are
benchmarks, not asserted bounds); the settings reach the NIXL agents."""

from __future__ import annotations

import math

import pytest

from nixlkv.bench.settings import SETTINGS, markdown, run

pytestmark = pytest.mark.nixl


def test_bench_settings_reports_every_setting() -> None:
    out = run(layers=2, blocks=4, rounds=1)
    assert set(out["settings"]) == set(SETTINGS)
    for row in out["settings"].values():
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0
    assert out["settings"][next(iter(SETTINGS))]["ratio_vs_default"] == 1.0
    assert "telemetry on" in markdown(out)


def test_telemetry_setting_reaches_the_agent() -> None:
    from nixlkv.bench.settings import _Pair
    from nixlkv.bench.stall import scenario
    from nixlkv.vllm.config import ConnectorConfig

    pair = _Pair(scenario(2, 1, 1, 8), ConnectorConfig(nixl_telemetry=True, nixl_num_threads=2), "t")
    try:
        assert all(w.nixl.capture_telemetry for w in pair.d + pair.p)
        assert pair.request(4) > 0
    finally:
        pair.close()
