"""Every scenario in tests/scenarios/ through the rehearsal: real NIXL, every decode byte checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from nixlkv.testing.rehearsal import rehearse
from nixlkv.testing.scenario import load

SCENARIOS = sorted(p for p in (Path(__file__).parent / "scenarios").iterdir() if p.suffix in (".yaml", ".yml", ".json"))


@pytest.mark.nixl
@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    scenario = load(path)
    result = rehearse(scenario)
    if scenario.expect_error is None:
        assert result.outcome == "byte-exact", result.message
        assert result.bytes_moved > 0 and result.descriptors > 0
        assert all(n == result.plans[0]["consumers_per_remote_rank"] for n in result.notifications.values())
        assert len(result.notifications) == scenario.prefill.tp
    else:
        assert result.outcome == "rejected", result.message
        assert scenario.expect_error in result.message


def test_scenario_directory_covers_the_foundation_matrix() -> None:
    names = {p.stem for p in SCENARIOS}
    for required in (
        "fa-p1-d1-h8", "fa-p2-d2-h8", "fa-p4-d4-h8", "fa-p2-d4-h8", "fa-p4-d2-h8",
        "fa-p1-d4-h2-replicated", "fa-p4-d1-h2-replicated", "fa-p8-d2-h4", "fa-p2-d4-h8-blhnc",
        "fa-reject-p3-d2", "fa-reject-lbnhc-hetero-tp",
    ):
        assert required in names


def test_scenario_parameters_are_type_checked() -> None:
    from nixlkv.testing.scenario import ScenarioError, parse

    base = {
        "model": {"layers": [{"kind": "full_attention", "num_kv_heads": "8", "head_size": 64}]},
        "prefill": {"tp": 1}, "decode": {"tp": 1}, "request": {"num_tokens": 10},
    }
    with pytest.raises(ScenarioError, match=r"model.layers\[0\].num_kv_heads: must be a positive integer"):
        parse(base)
