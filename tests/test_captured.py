"""Captured scenarios: what a worker records of its engine (``capture_dir``), the scenario made
of it, and the rehearsal's check that it builds exactly the captured groups and pages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from nixlkv.testing.captured import scenario_from_captures
from nixlkv.testing.engines import build_rank
from nixlkv.testing.rehearsal import rehearse
from nixlkv.testing.scenario import ScenarioError, load, parse
from nixlkv.vllm.config import ConfigError, ConnectorConfig
from nixlkv.vllm.worker import NixlkvWorker

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = sorted((ROOT / "tests" / "scenarios").glob("captured-*.yaml"))
GEMMA4_LIKE = {
    "name": "g4",
    "model": {"layers": [
        {"kind": "sliding_window", "count": 2, "num_kv_heads": 2, "head_size": 64, "window": 64},
        {"kind": "full_attention", "count": 1, "num_kv_heads": 1, "head_size": 128},
    ]},
    "prefill": {"tp": 1, "block_size": 32, "interior": "k_channel_major"},
    "decode": {"tp": 2, "block_size": 32, "interior": "k_channel_major"},
    "request": {"num_tokens": 200, "seed": 1},
}


def _capture(tmp_path: Path, role: str) -> list[dict]:
    """Each rank of a fabricated engine registered through a real NixlkvWorker with capture on."""
    scenario = parse(GEMMA4_LIKE)
    side = scenario.prefill if role == "prefill" else scenario.decode
    out = tmp_path / role
    records = []
    for r in range(side.tp):
        rank = build_rank(scenario, role, r)
        worker = NixlkvWorker(role, r, side.tp, rank.kv_cache_config, ConnectorConfig(capture_dir=str(out)), "c",
                              lambda name, rank=rank: rank.total_heads[name],
                              model_hints=lambda name, rank=rank: rank.hints.get(name, {}),
                              model_facts={"name": "g4", "block_size": side.block_size})
        worker.register_kv_caches(rank.kv_caches)
        worker.shutdown()
        records.append(json.loads((out / f"{role}-tp{r}.json").read_text()))
    return records


@pytest.mark.nixl
def test_a_workers_capture_replays_byte_exact_and_a_different_build_is_named(tmp_path: Path) -> None:
    p, d = _capture(tmp_path, "prefill"), _capture(tmp_path, "decode")
    assert [r["tp_rank"] for r in d] == [0, 1]
    # what the decode engine built at TP 2: the window groups unified to 64-token blocks
    assert {(g["spec"], g["block_size"]) for g in d[0]["groups"]} == {("SlidingWindowSpec", 64), ("FullAttentionSpec", 32)}
    assert all(rec["hints"]["page_interior"] == "k_channel_major" for rec in d[0]["layers"].values())
    data = scenario_from_captures(p, d, "replayed", 200, seed=1)
    text = yaml.safe_dump(data, sort_keys=False)
    scenario = parse(yaml.safe_load(text), "replayed.yaml")
    assert scenario.decode.interior == "k_channel_major" and scenario.captured["decode"]["groups"]
    result = rehearse(scenario)
    assert result.outcome == "byte-exact", result.message

    # negative controls: a captured engine that built other blocks or pages than this rehearsal does
    wrong_block = yaml.safe_load(text)
    wrong_block["captured"]["decode"]["groups"][0]["block_size"] = 32
    with pytest.raises(ScenarioError, match="built KV groups"):
        build_rank(parse(wrong_block, "wrong.yaml"), "decode", 0)
    wrong_page = yaml.safe_load(text)
    wrong_page["captured"]["prefill"]["pages"][0] = "head2xtoken32xbyte256"  # the view without its interior
    with pytest.raises(ScenarioError, match="layer 0 on the prefill side"):
        build_rank(parse(wrong_page, "wrong.yaml"), "prefill", 0)


def test_captured_section_is_checked_for_shape() -> None:
    base = {**GEMMA4_LIKE, "captured": {"prefill": {"groups": []}, "decode": {"groups": []}}}
    with pytest.raises(ScenarioError, match="groups must be a non-empty list"):
        parse(base)
    bad = {**GEMMA4_LIKE, "captured": {"prefill": {"groups": [{"spec": "X", "block_size": -1, "layers": [0]}]},
                                       "decode": {"groups": [{"spec": "X", "block_size": 32, "layers": [0]}]}}}
    with pytest.raises(ScenarioError, match="block_size"):
        parse(bad)


@pytest.mark.parametrize("key", ["capture_dir", "dump_kv_dir"])
def test_capture_and_dump_dirs_are_checked_settings(key: str) -> None:
    assert getattr(ConnectorConfig.parse({key: "/tmp/x"}), key) == "/tmp/x"
    assert getattr(ConnectorConfig.parse({}), key) is None
    for bad in ("", 5, ["/tmp"]):
        with pytest.raises(ConfigError, match=key):
            ConnectorConfig.parse({key: bad})


def test_every_tiny_serving_model_is_captured_at_tp_1_and_2() -> None:
    """The captured set covers the serving matrix (docs/scenarios.md says which files are captured)."""
    from nixlkv.serving.models import RECIPES

    names = {p.stem for p in CAPTURED}
    for model in RECIPES:
        for p_tp in (1, 2):
            for d_tp in (1, 2):
                assert f"captured-{model}-p{p_tp}-d{d_tp}" in names, (model, p_tp, d_tp)
    for path in CAPTURED:
        assert load(path).captured is not None, path
