"""The example third-party plugin (examples/nixlkv-example-plugin), installed like any plugin.

It proves the plugin path end to end: entry-point discovery, MRO dispatch to the most specific
strategy (and back to full attention when the plugin is disabled or not allowed), vLLM planning
and allocation of the new spec type, and real NIXL READs that land byte-exact. The invariants at every TP pair and layout are the
contract suite's job (test_example_contract.py); these tests cover what is specific to it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from types import ModuleType

import pytest

DIST = "nixlkv-example-plugin"
PLUGIN_NAME = "example"
MODULE = "nixlkv_example_plugin"
INSTALL = "pip install --no-deps -e examples/nixlkv-example-plugin"


@pytest.fixture(scope="module")
def plugin() -> ModuleType:
    """The installed plugin module; a clear failure (never a skip) when it is not installed."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        pytest.fail(
            f"the example plugin {DIST!r} is not installed in this environment: run `make venv`, "
            f"or `{INSTALL}` with this environment's pip",
            pytrace=False,
        )
    eps = [ep for ep in dist.entry_points if ep.group == "nixlkv"]
    if [(ep.name, ep.value) for ep in eps] != [(PLUGIN_NAME, MODULE)]:
        pytest.fail(
            f"{DIST} is installed but its 'nixlkv' entry points are {[(ep.name, ep.value) for ep in eps]}, "
            f"expected [{(PLUGIN_NAME, MODULE)}]: reinstall it with `{INSTALL}`",
            pytrace=False,
        )
    return importlib.import_module(MODULE)


def _full_spec(**overrides):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    fields = dict(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    return FullAttentionSpec(**{**fields, **overrides})


def _as_example(spec, plugin: ModuleType, tag: str = "example"):
    """``spec`` (a FullAttentionSpec) as an ExampleAttentionSpec with the same fields."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return plugin.ExampleAttentionSpec(**fields, tag=tag)


# ------------------------------------------------------------------ discovery


def test_entry_point_is_loaded_by_the_plugin_manager(plugin):
    from nixlkv.core.registry import plugin_manager

    pm = plugin_manager()
    assert pm.get_plugin(PLUGIN_NAME) is plugin
    dists = {pm.get_name(p): d.project_name for p, d in pm.list_plugin_distinfo()}
    assert dists.get(PLUGIN_NAME) == DIST


def test_registry_lists_the_strategy_with_its_distribution(plugin):
    from nixlkv.core import StrategyRegistry

    registered = {r.strategy.name: r for r in StrategyRegistry.from_plugins().registered()}
    assert "example_attention" in registered, sorted(registered)
    r = registered["example_attention"]
    assert isinstance(r.strategy, plugin.ExampleAttentionStrategy)
    assert r.strategy.spec_types == (plugin.ExampleAttentionSpec,)
    assert PLUGIN_NAME in r.origin and DIST in r.origin, r.origin
    assert "full_attention" in registered  # the built-ins are still there, unchanged


def test_entry_points_can_be_turned_off():
    from nixlkv.core import StrategyRegistry
    from nixlkv.core.registry import plugin_manager

    names = {r.strategy.name for r in StrategyRegistry.from_plugins(plugin_manager(load_entry_points=False)).registered()}
    assert "example_attention" not in names and "full_attention" in names


# ------------------------------------------------------------------ dispatch


def test_mro_dispatch_picks_the_most_specific_strategy(plugin):
    from nixlkv.core import Dispatcher

    dispatcher = Dispatcher.from_plugins()
    example = dispatcher.strategy_for(_as_example(_full_spec(), plugin), "layer")
    assert example.name == "example_attention"
    assert isinstance(example, plugin.ExampleAttentionStrategy)
    assert dispatcher.strategy_for(_full_spec(), "layer").name == "full_attention"


def test_the_example_spec_falls_back_to_full_attention_through_the_mro(plugin):
    from nixlkv.core import Dispatcher

    spec = _as_example(_full_spec(), plugin)
    assert Dispatcher.from_plugins(disabled=["example_attention"]).strategy_for(spec, "layer").name == "full_attention"
    # `allow` keeps the built-ins only: same fallback, by plugin name instead of strategy name.
    assert Dispatcher.from_plugins(allow=[]).strategy_for(spec, "layer").name == "full_attention"


def test_vllm_keeps_the_tag_in_the_group_spec(plugin):
    """nixlkv dispatches on the group's merged spec: the subclass and its field must survive merging."""
    spec = _as_example(_full_spec(), plugin, tag="t1")
    merged = spec.merge([spec, spec])
    assert type(merged) is plugin.ExampleAttentionSpec and merged.tag == "t1"
    assert merged.page_size_bytes == _full_spec().page_size_bytes  # storage is full attention's
    with pytest.raises(ValueError, match="same tag"):
        spec.merge([spec, _as_example(_full_spec(), plugin, tag="t2")])


# ------------------------------------------------------------------ end to end over real NIXL


def _scenario(prefill_tp: int, decode_tp: int, expect: object = "ok"):
    from nixlkv.testing.scenario import parse

    return parse(
        {
            "name": f"example-plugin-p{prefill_tp}-d{decode_tp}",
            "model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 8, "head_size": 64}]},
            "prefill": {"tp": prefill_tp, "block_size": 16, "layout": "LBHNC"},
            "decode": {"tp": decode_tp, "block_size": 16, "layout": "LBHNC"},
            "request": {"num_tokens": 200, "seed": 3},
            "expect": expect,
        }
    )


def _fabricate_example_specs(monkeypatch, plugin: ModuleType, tag_of=lambda side: "example") -> None:
    """Make the fabricated engines report ExampleAttentionSpec wherever they would report full attention."""
    from nixlkv.testing import engines

    builtin = engines.layer_spec

    def layer_spec(kind, side):
        return _as_example(builtin(kind, side), plugin, tag=tag_of(side))

    monkeypatch.setattr(engines, "layer_spec", layer_spec)


@pytest.mark.nixl
@pytest.mark.vllm
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 4), (4, 2)], ids=["P2-D4", "P4-D2"])
def test_rehearsal_moves_the_example_cache_byte_exact(plugin, monkeypatch, prefill_tp, decode_tp):
    from nixlkv.testing.rehearsal import rehearse

    _fabricate_example_specs(monkeypatch, plugin)
    result = rehearse(_scenario(prefill_tp, decode_tp))

    assert result.outcome == "byte-exact", result.message
    assert len(result.plans) == decode_tp
    for plan in result.plans:
        assert plan["segments"], plan
        assert {s["strategy"] for s in plan["segments"]} == {"example_attention"}
        assert {g["strategy"] for g in plan["groups"]} == {"example_attention"}
    assert result.bytes_moved > 0


@pytest.mark.vllm
def test_rehearsal_refuses_engines_whose_tags_differ(plugin, monkeypatch):
    """The strategy's own fact is checked at planning time, and the refusal names it."""
    from nixlkv.testing.rehearsal import rehearse

    scenario = _scenario(4, 2, expect={"error": "example tag (tag)"})
    _fabricate_example_specs(monkeypatch, plugin, tag_of=lambda side: "p" if side is scenario.prefill else "d")
    result = rehearse(scenario)

    assert result.outcome == "rejected", result.message
    assert "IncompatibleGeometry" in result.message and "'d' here but 'p'" in result.message, result.message
