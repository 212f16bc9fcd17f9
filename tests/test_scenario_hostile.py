"""#16 point 2: malformed scenario files are a ScenarioError naming the problem, in bounded time
and memory (no traceback, no gigabytes from a few hundred bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nixlkv.testing.rehearsal import build_failure
from nixlkv.testing.scenario import MAX_FILE_BYTES, MAX_LAYERS, ScenarioError, load, parse

GOOD = {
    "model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 2, "head_size": 64}]},
    "prefill": {"tp": 1, "block_size": 16, "layout": "LBHNC", "num_blocks": 16},
    "decode": {"tp": 1, "block_size": 16, "layout": "LBHNC", "num_blocks": 16},
    "request": {"num_tokens": 40},
}


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_the_good_file_loads(tmp_path: Path) -> None:
    assert load(write(tmp_path, "ok.json", json.dumps(GOOD))).request.num_tokens == 40


def test_non_utf8_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="not UTF-8"):
        load(write(tmp_path, "bad.yaml", b"name: \xff\xfe\n"))


def test_kind_given_as_a_list(tmp_path: Path) -> None:
    bad = json.loads(json.dumps(GOOD))
    bad["model"]["layers"][0]["kind"] = ["full_attention"]
    with pytest.raises(ScenarioError, match="kind must be one of"):
        load(write(tmp_path, "k.json", json.dumps(bad)))


@pytest.mark.parametrize("suffix", ["json", "yaml"])
def test_deep_nesting(tmp_path: Path, suffix: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ScenarioError, match="nested too deeply|not valid"):
        load(write(tmp_path, f"deep.{suffix}", deep))


@pytest.mark.parametrize("suffix", ["json", "yaml"])
def test_a_five_thousand_digit_integer(tmp_path: Path, suffix: str) -> None:
    text = json.dumps(GOOD).replace('"num_tokens": 40', '"num_tokens": ' + "9" * 5000)
    with pytest.raises(ScenarioError, match="not valid|positive integer"):
        load(write(tmp_path, f"big.{suffix}", text))


def test_a_huge_integer_inline_is_refused_without_printing_it() -> None:
    bad = json.loads(json.dumps(GOOD))
    bad["request"]["num_tokens"] = 10 ** 5000
    with pytest.raises(ScenarioError, match="an integer of 16610 bits"):
        parse(bad)


@pytest.mark.parametrize("count", [MAX_LAYERS + 1, 100_000_000, 2**40])
def test_a_model_of_more_layers_than_any_is_refused_at_once(count: int) -> None:
    """A count of 100,000,000 layers parsed, then listed one entry per layer and built one spec
    per layer: the rehearsal ran until killed. Refused while parsing, naming the count."""
    bad = json.loads(json.dumps(GOOD))
    bad["model"]["layers"][0]["count"] = count
    bad["model"]["layers"].append({"kind": "full_attention", "count": 1, "num_kv_heads": 2, "head_size": 64})
    with pytest.raises(ScenarioError, match=f"{count + 1} layers; a scenario's model has at most {MAX_LAYERS}"):
        parse(bad)
    bad["model"]["layers"][0]["count"] = MAX_LAYERS - 1  # control: the most layers a scenario holds
    assert parse(bad).num_layers == MAX_LAYERS


@pytest.mark.parametrize("field", ["name", "expect"])
def test_billion_laughs(tmp_path: Path, field: str) -> None:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, (prev, cur) in enumerate(zip("abcdefgh", "bcdefghi")):
        lines.append(f"{cur}: &{cur} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]")
    value = "*i" if field == "name" else "{error: *i}"
    text = "\n".join(lines) + f"\n{field}: {value}\n"
    assert len(text) < 1000
    with pytest.raises(ScenarioError, match="aliases are not allowed"):
        load(write(tmp_path, "laughs.yaml", text))


def test_oversized_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="larger than a scenario file may be"):
        load(write(tmp_path, "huge.yaml", "# " + "x" * MAX_FILE_BYTES))


def test_a_failed_allocation_says_so() -> None:
    msg = build_failure(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert msg.startswith("could not allocate this scenario's caches") and "num_blocks" in msg
    assert build_failure(MemoryError()).startswith("could not allocate")
    assert build_failure(ValueError("x")).startswith("vLLM could not build")
