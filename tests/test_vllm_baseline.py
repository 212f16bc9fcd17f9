"""The vLLM baseline harness (smoke subset): vLLM 0.33's own NixlConnector moves plain GQA caches
byte-exact, and the same check reports wrong bytes when the harness is handed a fault.

The full comparison over tests/scenarios is slow and runs as a documented command
(docs/comparison.md), never here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nixlkv.testing import comparison
from nixlkv.testing.scenario import load, parse
from nixlkv.testing.vllm_baseline import (
    NotRunnable,
    VllmVersionError,
    check_vllm_version,
    model_config_json,
    run_baseline,
)

SCENARIOS = Path(__file__).parent / "scenarios"

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]


def gqa(p_tp: int, d_tp: int, block_size: int) -> object:
    return parse({
        "name": f"smoke-p{p_tp}-d{d_tp}-b{block_size}",
        "model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 8, "head_size": 64}]},
        "prefill": {"tp": p_tp, "block_size": block_size},
        "decode": {"tp": d_tp, "block_size": block_size},
        "request": {"num_tokens": 150, "seed": 5},
    })


@pytest.mark.parametrize(("p_tp", "d_tp", "block_size"), [(1, 1, 16), (2, 1, 32), (1, 2, 32)])
def test_vllm_moves_plain_gqa_byte_exact(p_tp: int, d_tp: int, block_size: int) -> None:
    result = run_baseline(gqa(p_tp, d_tp, block_size), timeout=90, requests=2)
    assert result.outcome == "byte-exact", result.message
    assert result.bytes_checked > 0 and result.descriptors and result.first_request_s > 0
    # block 16 needs the kernel-size lookup patched (CPU_ATTN: multiples of 32) and says so
    assert any("lookup patched" in n for n in result.notes) == (block_size % 32 != 0)


@pytest.mark.parametrize("corrupt", ["prefill-byte", "block-ids"])
def test_the_oracle_catches_what_vllm_moved_wrong(corrupt: str) -> None:
    result = run_baseline(gqa(1, 1, 32), timeout=90, requests=1, corrupt=corrupt)
    assert result.outcome == "wrong-bytes", result.message
    assert "decode rank 0" in result.message and "first at layer" in result.message
    if corrupt == "prefill-byte":
        assert result.message.startswith("decode rank 0: 1 wrong bytes")


def test_version_guard_names_the_supported_version(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_vllm_version("0.33.4") == "0.33.4"
    with pytest.raises(VllmVersionError, match=r"installed vLLM is 0\.34\.0.*vllm==0\.33\.0"):
        check_vllm_version("0.34.0")
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.32.1")
    with pytest.raises(VllmVersionError, match="0.32.1"):
        run_baseline(gqa(1, 1, 32))


def test_model_facts_vllm_reads_are_declared_as_a_real_config_would() -> None:
    gemma = load(SCENARIOS / "hetero-gemma4-like-p2-d4.yaml")
    cfg, note = model_config_json(gemma, "decode")
    assert cfg["num_key_value_heads"] == 16 and "Gemma4" in note  # the sliding layers' count, model-wide
    mla, _ = model_config_json(load(SCENARIOS / "mla-p2-d8-bf16.yaml"), "prefill")
    assert mla["model_type"] == "deepseek_v3" and mla["kv_lora_rank"] == 512
    with pytest.raises(NotRunnable, match="draft"):
        model_config_json(load(SCENARIOS / "uniform-gqa-mla-draft-p1-d2.yaml"), "prefill")
    result = run_baseline(load(SCENARIOS / "uniform-gqa-mla-draft-p1-d2.yaml"))
    assert result.outcome == "not-run" and "draft" in result.message


def test_comparison_table_lists_every_disagreement() -> None:
    rows = [
        {"scenario": "a", "pairing": "P1->D1", "expect": "ok", "agree": True,
         "nixlkv": {"outcome": "byte-exact", "message": "", "transfer_s": 0.01, "descriptors": 4},
         "vllm": {"outcome": "byte-exact", "message": "", "first_request_s": 0.1, "steady_state_s": 0.02,
                  "descriptors": 8, "notes": []}},
        {"scenario": "b", "pairing": "P1->D2", "expect": "ok", "agree": False,
         "nixlkv": {"outcome": "byte-exact", "message": "", "transfer_s": 0.01, "descriptors": 4},
         "vllm": {"outcome": "wrong-bytes", "message": "decode rank 1: 9 wrong bytes; first at layer x",
                  "first_request_s": 0.1, "steady_state_s": None, "descriptors": 8, "notes": ["n|1"]}},
    ]
    text = comparison.markdown(rows)
    assert "| a | P1->D1 | ok | byte-exact | byte-exact | yes |" in text
    assert "| b | P1->D2 | ok | byte-exact | wrong-bytes | **no** |" in text and "n\\|1" in text
    assert "**b** (P1->D2), vLLM wrong-bytes: decode rank 1: 9 wrong bytes; first at layer x" in text
    assert comparison.summary(rows) == {"vllm byte-exact": 1, "vllm wrong-bytes": 1, "disagreements": 1}


def test_cli_rehearse_baseline_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nixlkv.cli import main

    path = tmp_path / "small.json"
    path.write_text(json.dumps({
        "model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 8, "head_size": 64}]},
        "prefill": {"tp": 2, "block_size": 32}, "decode": {"tp": 1, "block_size": 32}, "request": {"num_tokens": 90},
    }))
    assert main(["rehearse", "--baseline", "vllm", "--scenario", str(path), "--json", "--timeout", "90"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outcome"] == "byte-exact" and result["descriptors"] > 0 and result["notes"] == []


def test_engine_processes_keep_stdout_clean_for_json() -> None:
    """UCX in vLLM's engine processes logs errors to file descriptor 1: it must reach stderr,
    never the parent's stdout, or `nixlkv compare --json` stops being JSON."""
    import subprocess
    import sys

    code = ("import os; from nixlkv.testing.vllm_baseline import _stdout_to_stderr; _stdout_to_stderr(); "
            "os.write(1, b'UCX ERROR from C\\n'); print('print from Python')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == ""
    assert "UCX ERROR from C" in out.stderr and "print from Python" in out.stderr


def test_unshardable_model_is_not_run_not_a_harness_error() -> None:
    """6 KV heads over TP 4: no such cache exists (vLLM's QKVParallelLinear refuses it too)."""
    result = run_baseline(load(SCENARIOS / "fa-reject-heads-unshardable.yaml"))
    assert result.outcome == "not-run", result.message
    assert "num_kv_heads=6 cannot be sharded over tp=4" in result.message


def test_cli_compare_json_out_is_only_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from nixlkv.cli import main

    row = {"scenario": "a", "pairing": "P1->D1", "expect": "ok", "agree": True,
           "nixlkv": {"outcome": "byte-exact", "message": "", "transfer_s": 0.01, "descriptors": 4},
           "vllm": {"outcome": "byte-exact", "message": "", "first_request_s": 0.1, "steady_state_s": 0.02,
                    "descriptors": 8, "notes": []}}
    monkeypatch.setattr(comparison, "compare", lambda files, timeout, progress=None: [row])
    out, table = tmp_path / "c.json", tmp_path / "c.md"
    assert main(["compare", "--scenarios", str(SCENARIOS), "--json-out", str(out), "--markdown", str(table)]) == 0
    written = json.loads(out.read_text())
    assert written == {"summary": {"vllm byte-exact": 1, "disagreements": 0}, "rows": [row]}
    printed = capsys.readouterr().out
    assert "| a | P1->D1 | ok | byte-exact | byte-exact | yes |" in printed and table.read_text() in printed
