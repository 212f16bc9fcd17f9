"""The short soak across hosts in CI (issue #46; docs/serving.md, "The soak across hosts"): two
prefill and two decode vLLM servers behind nixlkv's proxy, each engine and the proxy on a network
namespace of its own, 100 requests with 16 in flight, some closed by their clients, P0 killed and
restarted and P1's link dropped for 8 s mid-run. ``serve-soak`` judges it (every answer as D alone
answers it or a clean failure, nothing hung or broken, every loaded byte P's, KV usage 0 and
memory within 10% at the end); its own negative controls are in tests/test_serving_soak.py. About
4 minutes on a quiet 2-core machine.

The servers run in the serving environment (``make serve-venv``; NIXLKV_SERVE_PYTHON), as
tests/test_serving_smoke.py; without it this test fails and says how to make it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from test_serving_smoke import ROOT, serve_python

REQUESTS = 100


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict:
    py = serve_python()
    work = tmp_path_factory.mktemp("soak")
    report = work / "soak.json"
    cmd = [py, "-m", "nixlkv.cli", "serve-soak", "--requests", str(REQUESTS), "--connector", "nixlkv",
           "--deadline", "1200", "--json-out", str(report), "--python", py, "--models-dir", str(work / "models"),
           "--work-dir", str(work / "runs"), "--port", "18300", "--start-timeout", "900"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, cwd=ROOT)
    if not report.exists():
        pytest.fail(f"serve-soak wrote no report (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return {"returncode": out.returncode, "report": json.loads(report.read_text())[0],
            "stdout": out.stdout, "stderr": out.stderr}


def test_the_short_soak_across_hosts_passes(soak: dict) -> None:
    rep = soak["report"]
    assert rep["error"] is None, rep["error"]
    assert rep["faults"] == [], "\n".join(rep["faults"]) + "\n" + soak["stdout"][-4000:]
    assert rep["ok"] and soak["returncode"] == 0, soak["stdout"][-4000:]


def test_the_short_soak_tested_what_it_says(soak: dict) -> None:
    """What a pass stands on, read from the report rather than its verdict: every request sent and
    accounted for, the faults injected, loads judged byte for byte, every engine's blocks back."""
    rep = soak["report"]
    counts = rep["counts"]
    assert sum(counts.values()) == REQUESTS == len(rep["outcomes"]), counts
    assert counts["hung"] == 0 and counts["broken"] == 0 and counts["wrong"] == 0, counts
    assert counts["exact"] + counts["drift"] > 0 and counts["cancelled"] > 0, counts
    events = " ".join(e["name"] if isinstance(e, dict) else str(e) for e in rep["events"])
    for event in ("P0 killed", "P0 back", "link down", "link up"):
        assert event in events, rep["events"]
    assert rep["bytes"]["ok"] and rep["bytes"]["mismatches"] == 0 and rep["bytes"]["loads"] > 0, rep["bytes"]
    assert rep["kv_usage_end"] and all(v == 0 for v in rep["kv_usage_end"].values()), rep["kv_usage_end"]
    assert rep["hosts"] == "netns"
