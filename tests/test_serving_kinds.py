"""One real P/D serving case per KV kind in CI, each proven in bytes inside the engines.

Beside the tiny-llama case (test_serving_smoke.py): sliding windows with per-layer KV heads
(tiny-gemma4, P2 -> D1), chunked local attention (tiny-llama4, P1 -> D2), Mamba2 state beside
attention (tiny-mamba2-hybrid, P2 -> D1) and MLA latents (tiny-deepseek-v2, P1 -> D1): TP
mismatches both ways. In each, both engines dump every request's blocks as vLLM's KV managers
hold them and D's loaded bytes must equal P's wherever D needs them, every load D claimed must be
judged, and every graded control (one block, one KV head, the last partial block, one token slot
of one layer, one conv channel or SSM head of one Mamba layer, damaged on D after its load) must
be rejected by the byte check. ~2-5 minutes a case on 2 cores.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from test_serving_smoke import ROOT, serve_python

# model, P's TP, D's TP, the graded controls its layers admit
CASES = {
    "tiny-gemma4 P2->D1": ("tiny-gemma4", 2, 1, {"block", "head", "last_block", "token"}),
    "tiny-llama4 P1->D2": ("tiny-llama4", 1, 2, {"block", "head", "last_block", "token"}),
    "tiny-mamba2-hybrid P2->D1": ("tiny-mamba2-hybrid", 2, 1,
                                  {"block", "head", "last_block", "token", "conv_channel", "ssm_group"}),
    "tiny-deepseek-v2 P1->D1": ("tiny-deepseek-v2", 1, 1, {"block", "last_block", "token"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model, p_tp, d_tp, kinds = CASES[request.param]
    py = serve_python()
    work = tmp_path_factory.mktemp("kinds")
    port = 18200 + 30 * list(CASES).index(request.param)
    cmd = [py, "-m", "nixlkv.cli", "serve-check", "--model", model, "--p-tp", str(p_tp), "--d-tp", str(d_tp),
           "--connector", "nixlkv", "--quick", "--json", "--python", py, "--models-dir", str(work / "models"),
           "--work-dir", str(work / "runs"), "--port", str(port), "--start-timeout", "900"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, cwd=ROOT)
    try:
        results = json.loads(out.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"serve-check printed no JSON (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return {"name": request.param, "returncode": out.returncode, "result": results[0], "kinds": kinds}


def _explain(result: dict) -> str:
    rows = [{k: r.get(k) for k in ("name", "prompt_len", "ok", "moved", "loads", "bytes_ok", "error")}
            | {"verdict": r.get("verdict", {}).get("reason")} for r in result.get("rows", [])]
    keys = ("error", "bytes", "controls", "notes", "negative_control")
    return json.dumps({"rows": rows, **{k: result.get(k) for k in keys},
                       "concurrent": {k: result.get("concurrent", {}).get(k) for k in ("ok", "moved", "bytes_ok",
                                                                                      "errors")}},
                      indent=1, default=str)[:12000]


def test_the_case_passes(served: dict) -> None:
    res = served["result"]
    assert res["error"] is None and res["ok"] and served["returncode"] == 0, _explain(res)


def test_every_load_is_byte_exact_and_every_layer_judged(served: dict) -> None:
    res = served["result"]
    b = res["bytes"]
    assert b is not None and b["ok"] and b["mismatches"] == 0, _explain(res)
    assert not b["unjudged"] and not b["missing"] and not b["failed"], b
    assert b["token_heads"] > 0 and b["control"]["bites"], b
    if "conv_channel" in served["kinds"]:
        assert b["state_units"] > 0, b
    assert all(r["bytes_ok"] for r in res["rows"]), _explain(res)
    # bytes, not counters: every row with tokens D cannot compute alone claimed a load, judged exact
    loading = [r for r in res["rows"] if r["prompt_len"] - 1 - r["facts"].get("hit_tokens", 0) > 0]
    assert loading and all(r["loads"] for r in loading), _explain(res)


def test_every_graded_control_is_rejected_by_the_bytes(served: dict) -> None:
    controls = served["result"]["controls"]
    run = {c["kind"] for c in controls if "not_applicable" not in c}
    assert run == served["kinds"], controls
    for c in controls:
        if "not_applicable" in c:
            continue
        assert c["bytes_rejected"] and c["damaged"] and not c["damaged"].get("skipped"), c
        assert c["damaged"]["bytes"] > 0, c
