"""vLLM 0.33's own push connector (``NixlPushConnector``) with a pipeline-parallel prefill engine,
run beside nixlkv on the same fabricated caches and judged by the same byte oracle.

vLLM's push connector accepts a prefill engine at pipeline_parallel_size 2 for an attention-only
model: each P stage's worker (over only its stage's layers, under their real names) WRITEs its
layers into D's whole-model caches, and D waits for one notification per stage. The harness
(``vllm_baseline.run_baseline`` with an ``EngineLayout``) drives vLLM's scheduler- and
worker-role connectors with the hooks its model runner calls, in its order; nixlkv's side is the
pipeline rehearsal (``pipeline.rehearse_pipeline``, pull: nixlkv's push has no rehearsal of its
own; it is proven with pipeline stages under vLLM's real scheduler in test_connector_push.py).

Each vLLM case builds a P and a D engine in two processes (6 to 50 s each on the loaded 2-core
machine): the default run takes P PP 2 -> D PP 1 and its negative controls (40 to 85 s together, by load); the
others, including the cases vLLM refuses and its pull connector, with NIXLKV_PIPELINE=all
(``make test-pipeline``, about 4 min).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nixlkv.testing.engines import layer_name
from nixlkv.testing.pipeline import rehearse_pipeline, stage_layers
from nixlkv.testing.scenario import load
from nixlkv.testing.vllm_baseline import EngineLayout, run_baseline

SCENARIOS = Path(__file__).parent / "scenarios"
ALL = os.environ.get("NIXLKV_PIPELINE") == "all"

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

TINY_LLAMA = "captured-tiny-llama-p1-d1"  # GQA full attention, 2 layers: stage 0 holds layer 0, stage 1 layer 1


def test_vllm_push_with_a_pp2_prefill_is_byte_exact_and_so_is_nixlkv() -> None:
    scenario = load(SCENARIOS / f"{TINY_LLAMA}.yaml")
    vllm = run_baseline(scenario, timeout=90, requests=2, layout=EngineLayout("push", prefill_pp=2, decode_pp=1))
    assert vllm.outcome == "byte-exact", vllm.message
    assert vllm.bytes_checked > 0 and vllm.first_request_s > 0
    nixlkv = rehearse_pipeline(scenario, 2, 1)
    assert nixlkv.outcome == "byte-exact", nixlkv.message
    assert nixlkv.bytes_checked == vllm.bytes_checked  # the same D caches judged


@pytest.mark.parametrize("corrupt", ["last-stage-byte", "idle-last-stage"])
def test_a_prefill_stage_with_wrong_kv_is_caught(corrupt: str) -> None:
    """Negative controls: after the fill, one byte of the request's first block in the first layer
    of P's last stage is flipped; or that stage is never filled (it computed nothing). vLLM WRITEs
    what the stage holds, and the oracle names the stage's layer."""
    scenario = load(SCENARIOS / f"{TINY_LLAMA}.yaml")
    result = run_baseline(scenario, timeout=90, requests=1, corrupt=corrupt,
                          layout=EngineLayout("push", prefill_pp=2, decode_pp=1))
    assert result.outcome == "wrong-bytes", result.message
    last_stage_first_layer = layer_name(stage_layers(2, 2)[1][0])
    assert f"first at layer {last_stage_first_layer} " in result.message, result.message
    if corrupt == "last-stage-byte":
        assert result.message.startswith("decode rank 0: 1 wrong bytes"), result.message


if ALL:  # defined only for `make test-pipeline` (not collected, rather than skipped, by default)
    MORE = [
        # (scenario, vLLM connector, P PP, D PP, vLLM's outcome, in vLLM's message); TP sizes are the scenario's
        ("captured-tiny-llama-p2-d1", "push", 2, 1, "byte-exact", ""),  # P PP 2 x TP 2 -> D TP 1
        ("captured-tiny-llama-p1-d2", "push", 2, 1, "byte-exact", ""),  # P PP 2 -> D TP 2
        ("captured-tiny-llama-p2-d2", "push", 2, 1, "byte-exact", ""),  # P PP 2 x TP 2 -> D TP 2
        ("captured-tiny-llama4-p1-d1", "push", 2, 1, "byte-exact", ""),  # chunked-local + full attention (two groups)
        (TINY_LLAMA, "push", 1, 2, "rejected", "consumer (decode) does not support pipeline_parallel_size > 1"),
        # Gemma4-like P TP 2 -> D TP 1 (P's sliding group has 64-token blocks, D's 32): at PP 1 vLLM
        # fails the request on D; at P PP 2, P's workers refuse on their handshake thread and D,
        # never told, waits (vLLM's registration watchdog, 480 s by default, only drops the registration)
        ("cpu-gemma4-tiny-p2-d1", "push", 1, 1, "rejected", "is not divisible by remote block size"),
        ("cpu-gemma4-tiny-p2-d1", "push", 2, 1, "hang", "Attention-HMA push requires identical P/D block sizes"),
        ("captured-tiny-mamba2-hybrid-p1-d1", "push", 2, 1, "rejected", "Mamba/SSM hybrid"),
        # vLLM's pull connector: a PP prefill engine fails the first request at D's handshake (one
        # stage's layers against D's whole model); a PP decode engine is refused at start-up, with
        # the push connector's message (the check is in the base worker both share)
        (TINY_LLAMA, "pull", 2, 1, "rejected", "Number of KV layers must match between prefill and decode"),
        (TINY_LLAMA, "pull", 1, 2, "rejected", "consumer (decode) does not support pipeline_parallel_size > 1"),
    ]

    @pytest.mark.parametrize(("name", "connector", "prefill_pp", "decode_pp", "outcome", "says"), MORE,
                             ids=[f"{m[1]}-{m[0]}-pp{m[2]}-pp{m[3]}" for m in MORE])
    def test_vllm_beside_nixlkv_across_pipeline_stages(name: str, connector: str, prefill_pp: int, decode_pp: int,
                                                        outcome: str, says: str) -> None:
        scenario = load(SCENARIOS / f"{name}.yaml")
        vllm = run_baseline(scenario, timeout=30, requests=1,  # the transfers' allowance: a hang costs 30 s
                            layout=EngineLayout(connector, prefill_pp=prefill_pp, decode_pp=decode_pp))
        assert vllm.outcome == outcome, vllm.message
        said = " | ".join([vllm.message, *vllm.notes])  # a reason P's workers logged is in the notes
        assert says in said, said
        assert rehearse_pipeline(scenario, prefill_pp, decode_pp).outcome == "byte-exact"
