"""Every scenario in tests/scenarios/ through the rehearsal: real NIXL, every decode byte checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from nixlkv.core import Dispatcher
from nixlkv.testing.rehearsal import build, rehearse, transfer_and_check_modes
from nixlkv.testing.scenario import load

SCENARIOS = sorted(p for p in (Path(__file__).parent / "scenarios").iterdir() if p.suffix in (".yaml", ".yml", ".json"))


MODES = ("direct", "staged", "auto")


@pytest.mark.nixl
@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    """Every scenario, byte-exact in every descriptor mode (one build, one oracle, three runs)."""
    scenario = load(path)
    if scenario.expect_error is not None:
        result = rehearse(scenario)
        assert result.outcome == "rejected", result.message
        assert scenario.expect_error in result.message
        return
    dispatcher = Dispatcher.from_plugins()
    engines = build(scenario, dispatcher)
    results = transfer_and_check_modes(scenario, engines, MODES)
    for mode, result in results.items():
        assert result.outcome == "byte-exact", f"{mode}: {result.message}"
        assert result.bytes_moved > 0 and result.descriptors > 0, mode
        assert all(n == result.plans[0]["consumers_per_remote_rank"] for n in result.notifications.values()), mode
        assert len(result.notifications) == scenario.prefill.tp, mode
        # NIXL's own count of what it posted: staging never posts more than the plan's READs
        assert 0 < result.posted_descriptors <= result.descriptors, mode
        assert result.posted_descriptors == result.computed_posted, mode  # the merge computation is NIXL's
    assert set(results["staged"].modes) == {"staged"}
    assert set(results["direct"].modes) == {"direct"}
    assert results["staged"].posted_descriptors <= results["direct"].posted_descriptors


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


def test_a_side_conv_layout_is_checked_and_sets_every_mamba_layer_of_that_side() -> None:
    from nixlkv.testing.scenario import ScenarioError, parse

    base = {
        "model": {"layers": [{"kind": "mamba", "mamba_type": "mamba2", "num_heads": 8, "head_dim": 4, "d_state": 8,
                              "n_groups": 1, "count": 2}, {"kind": "full_attention", "num_kv_heads": 2, "head_size": 64}]},
        "prefill": {"tp": 1, "conv_layout": "SD"}, "decode": {"tp": 1}, "request": {"num_tokens": 10},
    }
    s = parse(base)
    assert [k.params.get("conv_layout") for k in s.layer_kinds("prefill")] == ["SD", "SD", None]
    assert [k.params.get("conv_layout") for k in s.layer_kinds("decode")] == ["DS", "DS", None]
    with pytest.raises(ScenarioError, match=r"prefill: conv_layout must be one of \('DS', 'SD'\) or absent, got 'sd'"):
        parse({**base, "prefill": {"tp": 1, "conv_layout": "sd"}})
