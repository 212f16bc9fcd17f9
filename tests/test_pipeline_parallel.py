"""Pipeline-parallel engines on either side: which stage a layer is read from, the handshake's
stage fields, and rehearsals with real NIXL READs between every (stage, TP rank)'s own caches.

Each rehearsal fabricates every stage's caches as vLLM's worker for that stage allocates them
(the whole model's KV groups narrowed to the stage's layers), plans every decode rank with every
prefill stage and checks every decode byte and every prefill rank's notification count. The
negative control reads one layer from a stage that claims it but never computed it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nixlkv.core import Dispatcher, RankGeometry
from nixlkv.core.errors import HandshakeError, IncompatibleTopology
from nixlkv.core.topology import consumers_per_remote_rank, layer_of, stage_sources
from nixlkv.testing.engines import layer_name
from nixlkv.testing.pipeline import Misplaced, rehearse_pipeline, stage_layers
from nixlkv.testing.scenario import load

SCENARIOS = Path(__file__).parent / "scenarios"


# ---------------------------------------------------------------- the topology alone (cheap)
def test_each_local_layer_is_read_from_the_one_stage_that_holds_it() -> None:
    stages = {0: ["a", "b"], 1: ["c", "d"]}
    assert stage_sources(["a", "b", "c", "d"], stages) == {0: ("a", "b"), 1: ("c", "d")}
    assert stage_sources(["c"], stages) == {1: ("c",)}  # a D stage reads from the P stages it needs only
    assert stage_sources(["b", "c"], stages) == {0: ("b",), 1: ("c",)}


def test_a_layer_no_stage_holds_or_two_stages_claim_is_refused_naming_it() -> None:
    with pytest.raises(IncompatibleTopology, match=r"no remote pipeline stage holds layers \['e'\]"):
        stage_sources(["a", "e"], {0: ["a"], 1: ["c"]})
    with pytest.raises(IncompatibleTopology, match=r"layer 'a' is claimed by remote pipeline stages 0 and 1"):
        stage_sources(["a"], {0: ["a"], 1: ["a", "c"]})


def test_every_local_stage_tells_every_remote_rank_it_covers() -> None:
    assert consumers_per_remote_rank(1, 2) == 1
    assert consumers_per_remote_rank(2, 1, local_pp=2) == 4
    assert layer_of("model.layers.3.mixer:conv") == "model.layers.3.mixer"


def _geometry(pp_size: int = 2, pp_rank: int = 1) -> RankGeometry:
    from nixlkv.core.regions import PageLayout, Region

    page = PageLayout((("token", 4), ("byte", 16)))
    regions = tuple(Region(name, 0, "full_attention", 4096 * i, 4, 64, page) for i, name in enumerate(["l2", "l3:k", "l3:v"]))
    return RankGeometry("prefill", 1, 0, regions, ((0, 1 << 16),), pp_size=pp_size, pp_rank=pp_rank)


def test_a_stage_handshake_names_its_stage_and_layers_and_is_checked() -> None:
    g = _geometry()
    wire = g.to_wire()
    assert (wire["pp_size"], wire["pp_rank"], wire["layers"]) == (2, 1, ["l2", "l3"])
    back = RankGeometry.from_dict(wire)
    assert (back.pp_size, back.pp_rank, back.layers) == (2, 1, ("l2", "l3"))
    assert "pp_size" not in _geometry(1, 0).to_wire()  # a TP-only engine's handshake is as before
    with pytest.raises(HandshakeError, match="names other layers"):
        RankGeometry.from_dict({**wire, "layers": ["l2"]})
    with pytest.raises(HandshakeError, match="pp_rank"):
        RankGeometry.from_dict({**wire, "pp_rank": 2})
    assert g.restricted(["l3"]).names == ["l3:k", "l3:v"]


def test_plan_stages_refuses_a_missing_or_mislabelled_stage() -> None:
    dispatcher = Dispatcher.from_plugins()
    g = _geometry()
    with pytest.raises(IncompatibleTopology, match="a decode rank needs every stage's handshake"):
        dispatcher.plan_stages(_geometry(1, 0), {1: {0: g}})
    with pytest.raises(IncompatibleTopology, match="given as pipeline stage 0 says it is stage 1"):
        dispatcher.plan_stages(_geometry(1, 0), {0: {0: g}, 1: {0: g}})


# ---------------------------------------------------------------- rehearsals (real NIXL, ~1-4 s each)
CASES = [
    # (scenario, prefill PP, decode PP): TP sizes are the scenario's
    ("captured-tiny-llama-p1-d1", 2, 1),
    ("captured-tiny-llama-p1-d1", 1, 2),
    ("captured-tiny-llama-p1-d1", 2, 2),
    ("captured-tiny-llama-p2-d1", 2, 1),  # PP2 x TP2 -> TP1
    ("captured-tiny-llama-p1-d2", 1, 2),  # TP1 -> PP2 x TP2
    ("captured-tiny-mamba2-hybrid-p2-d1", 2, 1),
    ("captured-tiny-mamba2-hybrid-p1-d2", 1, 2),
    ("mamba-nemotronh-like-p2-d4", 2, 1),  # mamba, attention, mamba: the stages split a shared tensor's layers
]


@pytest.mark.parametrize(("name", "prefill_pp", "decode_pp"), CASES, ids=[f"{n}-pp{a}-pp{b}" for n, a, b in CASES])
def test_pipeline_stages_are_read_byte_exact(name: str, prefill_pp: int, decode_pp: int) -> None:
    scenario = load(SCENARIOS / f"{name}.yaml")
    result = rehearse_pipeline(scenario, prefill_pp, decode_pp)
    assert result.outcome == "byte-exact", result.message
    # every decode layer came from the prefill stage vLLM gave it to
    num_layers = len(scenario.layer_kinds("prefill"))
    owner = {layer_name(i): s for s, r in enumerate(stage_layers(num_layers, prefill_pp)) for i in r}
    for agent, sources in result.sources.items():
        for stage, layers in sources.items():
            assert all(owner[layer] == stage for layer in layers), (agent, sources)
    # every prefill rank heard from every decode rank covering it, on every decode stage
    assert len(result.notifications) == prefill_pp * scenario.prefill.tp
    expected = max(1, scenario.decode.tp // scenario.prefill.tp) * decode_pp
    assert set(result.notifications.values()) == {expected}, result.notifications


@pytest.mark.parametrize(("name", "prefill_pp"), [("captured-tiny-llama-p1-d1", 2), ("captured-tiny-llama-p2-d1", 2)])
def test_a_layer_read_from_the_wrong_stage_is_caught_in_bytes(name: str, prefill_pp: int) -> None:
    """Negative control: stage 1 claims layer 0, which stage 0 computed; its copy is not the KV."""
    result = rehearse_pipeline(load(SCENARIOS / f"{name}.yaml"), prefill_pp, 1, misplaced=Misplaced(layer=0, claimed_by=1))
    assert result.outcome == "mismatch", result.message
    assert f"layer {layer_name(0)} " in result.message
    assert all(layer_name(0) in sources[1] for sources in result.sources.values())
