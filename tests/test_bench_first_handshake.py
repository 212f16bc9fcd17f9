"""The whole-first-handshake bench's arithmetic: connectors alternate, the first handshake is the
first request less a later one, ratios are nixlkv's over vLLM's medians (the bench itself runs real
NIXL and vLLM's connector: `nixlkv bench-handshake --whole`)."""

from __future__ import annotations

import pytest

from nixlkv.bench import first_handshake as fh


def test_the_first_handshake_is_the_first_request_less_a_later_one(monkeypatch) -> None:
    order = []

    class Prefill:
        def __init__(self, *a) -> None:
            order.append("prefill")

        def close(self) -> None:
            order.append("closed")

    monkeypatch.setattr(fh, "Prefill", Prefill)
    ours = iter([(0.030, 0.010), (0.050, 0.010), (0.040, 0.020)])
    theirs = iter([(0.060, 0.020), (0.070, 0.010), (0.080, 0.030)])

    def mine(sc, prefill, tag, requests):
        order.append(f"nixlkv{tag}")
        first, steady = next(ours)
        return {"first_request_s": first, "steady_request_s": steady}

    def vllm(sc, requests):
        order.append("vllm")
        first, steady = next(theirs)
        return {"first_request_s": first, "steady_request_s": steady}

    monkeypatch.setattr(fh, "nixlkv_once", mine)
    monkeypatch.setattr(fh, "vllm_once", vllm)
    out = fh.run(layers=2, reps=3)
    assert order == ["prefill", "nixlkv0", "vllm", "nixlkv1", "vllm", "nixlkv2", "vllm", "closed"]
    assert out["nixlkv"]["first_handshake_s"] == pytest.approx(0.020)  # median of 0.020, 0.040, 0.020
    assert out["vllm"]["first_handshake_s"] == pytest.approx(0.050)  # median of 0.040, 0.060, 0.050
    assert out["first_handshake_ratio"] == pytest.approx(0.4)
    assert out["first_request_ratio"] == pytest.approx(0.040 / 0.070)
    assert out["nixlkv"]["first_request_s_range"] == [0.030, 0.050]
    assert "| the first handshake (their difference) | 20.0 (20.0-40.0) | 50.0 (40.0-60.0) |" in fh.markdown(out)


def test_a_connector_that_did_not_load_stops_the_bench(monkeypatch) -> None:
    class Res:
        outcome, message, first_request_s, steady_state_s = "rejected", "vLLM refused", None, None

    monkeypatch.setattr(fh, "run_baseline", lambda sc, timeout, requests: Res())
    with pytest.raises(RuntimeError, match="did not load the bench requests: rejected: vLLM refused"):
        fh.vllm_once(fh.scenario(2, 1, 1, 8), 3)
