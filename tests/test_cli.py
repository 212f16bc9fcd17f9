"""The console script as a user runs it: exit codes and what it prints."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).parent / "scenarios"


def nixlkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nixlkv.cli", *args], capture_output=True, text=True, timeout=300)


@functools.cache
def strategies_json() -> subprocess.CompletedProcess:
    """`nixlkv strategies --json`, run once for the tests that read its rows (a CLI start imports vLLM)."""
    return nixlkv("strategies", "--json")


def test_strategies_lists_builtins_with_origin() -> None:
    out = strategies_json()
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert "vllm.v1.kv_cache_interface.AttentionSpec" in rows["full_attention"]["spec_types"]
    assert rows["full_attention"]["pending"] is None
    assert "nixlkv" in rows["full_attention"]["origin"]
    assert rows["mla"]["pending"] is None
    assert "vllm.v1.kv_cache_interface.MLAAttentionSpec" in rows["mla"]["spec_types"]
    # its own entry: SlidingWindowMLASpec subclasses SlidingWindowSpec, never head-split as GQA
    assert rows["sliding_window_mla"]["pending"] is None
    assert rows["sliding_window_mla"]["spec_types"] == ["vllm.v1.kv_cache_interface.SlidingWindowMLASpec"]
    text = nixlkv("strategies")
    assert text.returncode == 0 and "full_attention" in text.stdout


def test_strategies_lists_the_installed_example_plugin() -> None:
    """`make venv` installs examples/nixlkv-example-plugin; its entry point must show up."""
    out = strategies_json()
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert "example_attention" in rows, "install it: pip install --no-deps -e examples/nixlkv-example-plugin"
    assert "nixlkv-example-plugin" in rows["example_attention"]["origin"]
    assert rows["example_attention"]["spec_types"] == ["nixlkv_example_plugin.ExampleAttentionSpec"]


@pytest.mark.nixl
def test_rehearse_default_scenario_is_byte_exact() -> None:
    out = nixlkv("rehearse")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "byte-exact" in out.stdout
    assert "decode rank 1: reads prefill ranks [2, 3]" in out.stdout
    # it says what was proven and where the bytes went, never a speed timed with NIXL's set-up
    assert "(D0 <- P0, P1; D1 <- P2, P3)" in out.stdout
    assert "every byte of every decode rank's cache" in out.stdout
    assert "GB/s (" not in out.stdout and "nixlkv bench" in out.stdout


@pytest.mark.nixl
def test_rehearse_json_reports_figures() -> None:
    out = nixlkv("rehearse", "--scenario", str(SCENARIOS / "fa-p2-d4-h8.yaml"), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] is True and result["outcome"] == "byte-exact"
    for key in ("bytes_checked", "bytes_moved", "descriptors", "reads", "transfer_seconds"):
        assert result[key] > 0


def test_rehearse_rejected_scenario_exits_zero_when_expected() -> None:
    out = nixlkv("rehearse", "--scenario", str(SCENARIOS / "fa-reject-p3-d2.yaml"), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["outcome"] == "rejected"


def test_explain_json_gives_offsets_per_decode_rank() -> None:
    out = nixlkv("explain", "--scenario", str(SCENARIOS / "fa-p4-d2-h8.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert [p["read_ranks"] for p in plans] == [[0, 1], [2, 3]]
    segs = [s for s in plans[0]["segments"] if s["local_region"] == "model.layers.0.self_attn.attn"]
    page = 4 * 16 * 256  # 4 heads x 16 tokens x (64 K + 64 V) bf16 bytes on a D rank
    assert [(s["remote_rank"], s["local_offset"], s["remote_offset"], s["nbytes"]) for s in segs] == [
        (0, 0, 0, page // 2), (1, page // 2, 0, page // 2)
    ]
    assert plans[0]["request"]["descriptors"] > 0


def test_explain_rejected_scenario_names_the_problem() -> None:
    out = nixlkv("explain", "--scenario", str(SCENARIOS / "fa-reject-lbnhc-hetero-tp.yaml"))
    assert out.returncode == 2
    assert "heads outermost in the page" in out.stderr


def test_bad_scenario_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {layers: [{kind: warp_drive}]}\nprefill: {tp: 1}\ndecode: {tp: 1}\nrequest: {num_tokens: 1}\n")
    out = nixlkv("rehearse", "--scenario", str(bad))
    assert out.returncode == 2
    assert "kind must be one of" in out.stderr


def test_connector_is_a_vllm_hma_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

    from nixlkv.connector import NixlkvConnector

    assert issubclass(NixlkvConnector, KVConnectorBase_V1) and supports_hma(NixlkvConnector)
