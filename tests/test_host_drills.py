"""serve-drill --hosts netns: how each drill across separate hosts is judged (the served run is
opt-in, tests/test_serving_host_drills.py), and the CLI that selects the group."""

from __future__ import annotations

from pathlib import Path

import pytest

from nixlkv.serving import host_drills as hd
from nixlkv.serving.check import Case
from nixlkv.serving.client import Completion
from nixlkv.serving.compare import judge


def test_a_faulted_request_is_judged_by_its_policy() -> None:
    fine = dict(exact=True, loaded=False, elapsed_s=6.0, bound_s=25.0, named=True, held=0.0)
    assert hd.judge_outcome("recompute", answered=True, **fine) == []
    assert hd.judge_outcome("fail", answered=False, **{**fine, "exact": False}) == []
    # the controls: each requirement, broken alone, is a fault
    assert hd.judge_outcome("recompute", answered=False, **{**fine, "exact": False}) == ["failed under recompute"]
    assert hd.judge_outcome("fail", answered=True, **fine) == [
        "answered under fail without a load: D recomputed what it should have failed"]
    assert hd.judge_outcome("recompute", answered=True, **{**fine, "exact": False}) == ["D answered, but not as D alone"]
    assert hd.judge_outcome("recompute", answered=True, readable=True, **{**fine, "exact": False, "loaded": True}) == [
        "D answered from its load, but not as the same prompt loaded with no fault"]
    assert hd.judge_outcome("recompute", answered=True, **{**fine, "loaded": True}) == [
        "D answered from a load it could not have made (the fault did not bite)"]
    assert hd.judge_outcome("recompute", answered=True, **{**fine, "elapsed_s": 25.5}) == [
        "D took 25.5 s, past its bound of 25 s"]
    assert hd.judge_outcome("recompute", answered=True, **{**fine, "named": False}) == [
        "D's log does not name the setting or the peer"]
    assert hd.judge_outcome("recompute", answered=True, **{**fine, "held": 0.01}) == ["D still holds KV (0.0100)"]
    assert hd.judge_outcome("recompute", answered=True, **{**fine, "named": None}) == []  # not checked: vLLM's


def test_a_link_back_in_time_may_be_read_under_either_policy() -> None:
    fine = dict(answered=True, exact=True, loaded=True, elapsed_s=4.0, bound_s=30.0, named=None, held=0.0)
    assert hd.judge_outcome("fail", readable=True, **fine) == []
    assert hd.judge_outcome("recompute", readable=True, **fine) == []
    assert hd.judge_outcome("fail", readable=True, **{**fine, "answered": False, "exact": False, "loaded": False}) == []
    assert hd.judge_outcome("fail", readable=True, **{**fine, "loaded": False}) != []  # recomputed under fail


# Drill 12's request as served (2026-11-28, tiny-llama P1->D1): D alone's answer, and D's answer from the
# load (the link dropped for 3 s, or not at all: the same logprobs). Token 0 is 0.0459 apart, one bf16
# step of its logit: D computed the last prompt token in a one-token step over the loaded KV.
D_ALONE = [-1.4737, -1.0383, -1.332, -1.1315, -1.2119, -1.3022, -1.571, -0.9135, -2.4993, -2.3639, -1.8448, -1.0193]
LOADED = [-1.4278, -1.0376, -1.332, -1.1315, -1.2119, -1.3022, -1.571, -0.913, -2.4993, -2.3639, -1.841, -1.0193]
TOKENS = [149, 27, 206, 52, 75, 297, 479, 244, 392, 232, 73, 491]


def _answer(logprobs: list[float], tokens: list[int] = TOKENS) -> Completion:
    return Completion(token_ids=list(tokens), logprobs=list(logprobs), top=[{} for _ in tokens], total_s=1.0)


def test_an_answer_from_a_load_is_judged_against_the_same_load_with_no_fault() -> None:
    got, alone = _answer(LOADED), _answer(D_ALONE)
    # what drill 12 did: the loaded answer against D alone's, a failure though nothing went wrong
    assert not judge(alone, got, "exact").ok
    judged = hd.answer_reference(got, alone, unfaulted=_answer(LOADED))
    assert judged.verdict.ok and judged.reference == "the same prompt loaded from P with no fault", judged
    assert not judged.d_alone.ok  # still reported
    # the controls: a load the fault changed fails, by one logprob or by one token ...
    bent = LOADED[:5] + [LOADED[5] - 0.03] + LOADED[6:]
    assert not hd.answer_reference(_answer(bent), alone, unfaulted=_answer(LOADED)).verdict.ok
    other = TOKENS[:3] + [TOKENS[3] + 1] + TOKENS[4:]
    assert not hd.answer_reference(_answer(LOADED, other), alone, unfaulted=_answer(LOADED)).verdict.ok
    # ... and an answer D recomputed (nothing loaded) is D alone's, exactly
    assert hd.answer_reference(_answer(D_ALONE), alone, unfaulted=None).verdict.ok
    recomputed = hd.answer_reference(got, alone, unfaulted=None)
    assert not recomputed.verdict.ok and recomputed.reference == "D alone"


def test_ds_log_must_name_the_cause_after_the_mark(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    old = "nixlkv handshake failed engine=P remote=127.0.0.1:8110 error=HandshakeError: ... is a loopback address ... side_channel_host\n"
    log.write_text(old)
    mark = log.stat().st_size
    assert hd.named_in_log(log, 0, "loopback address", "side_channel_host")
    assert not hd.named_in_log(log, mark, "loopback address", "side_channel_host")  # an earlier drill's line
    with log.open("a") as f:
        f.write("nixlkv recv failed req=x reason=READs from 10.231.16.3 not done\nafter transfer_timeout_s=10 s\n")
    assert not hd.named_in_log(log, mark, "10.231.16.3", "transfer_timeout_s")  # both on one line, or not named
    with log.open("a") as f:
        f.write("nixlkv recv failed req=y reason=READs from 10.231.16.3 not done after transfer_timeout_s=10 s\n")
    assert hd.named_in_log(log, mark, "10.231.16.3", "transfer_timeout_s")
    assert not hd.named_in_log(tmp_path / "none.log", 0, "x")


def test_the_drills_case_is_across_hosts_with_ds_timeouts() -> None:
    case = hd.host_case(Case(connector_config=(("descriptor_mode", "staged"),)))
    assert case.hosts == "netns"
    assert dict(case.connector_config) == {"descriptor_mode": "staged", "handshake_timeout_s": hd.HANDSHAKE_TIMEOUT_S,
                                           "transfer_timeout_s": hd.TRANSFER_TIMEOUT_S}
    assert hd.host_case(Case(connector="vllm")).connector_config == ()  # vLLM's connector has no such keys
    assert hd.LINK_DOWN_S < hd.TRANSFER_TIMEOUT_S < hd.UNREACHABLE_S  # 12: back in time; 11: past the timeout


def test_serve_drill_hosts_netns_selects_the_separate_hosts_group(monkeypatch) -> None:
    from nixlkv import cli
    from nixlkv.serving import drills

    seen: list = []

    def fake_run(case, opts, policies, drills_of):
        seen.append((case.connector, policies, drills_of))
        return {"case": case.label, "policies": {}, "ok": True}

    monkeypatch.setattr(drills, "run", fake_run)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # serve- commands set a SIGTERM handler
    assert cli.main(["serve-drill", "--hosts", "netns", "--policy", "recompute", "--python", "python"]) == 0
    assert cli.main(["serve-drill", "--python", "python"]) == 0
    assert seen[0][2] is hd.run_host_drills and seen[0][1] == ("recompute",)
    assert seen[1][2] is drills.run_drills and seen[1][1] == ("recompute", "fail")
    with pytest.raises(SystemExit):
        cli.main(["serve-drill", "--hosts", "cluster"])


def test_a_request_d_never_answers_fails_its_drill_and_the_others_still_run(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """A decode engine that hangs (the client's timeout ends the request) fails that drill, past
    its bound, instead of ending the whole group as a set-up error (served in push mode across
    hosts before the fix: every drill's verdict was lost to one hung request)."""
    from types import SimpleNamespace

    from nixlkv.serving import check

    calls = []

    def complete(url, model, prompt, max_tokens, kv_transfer_params=None, timeout_s=None):  # noqa: ANN001, ANN202
        calls.append(kv_transfer_params)
        if kv_transfer_params is not None:
            raise TimeoutError("timed out")
        return _answer(D_ALONE)

    monkeypatch.setattr(hd, "complete", complete)
    monkeypatch.setattr(hd, "scrape", lambda url: {})
    monkeypatch.setattr(hd, "settled_kv_usage", lambda url: 0.0)
    monkeypatch.setattr(hd, "named_in_log", lambda *a: True)
    clock = iter(range(0, 10_000, 145))  # the client gives up at the bound plus 120 s
    monkeypatch.setattr(hd, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    log = tmp_path / "decode.log"
    log.write_text("")
    srv = SimpleNamespace(model_dir=tmp_path, d_url="http://d", d=SimpleNamespace(log=log), network=object(),
                          recipe=SimpleNamespace(block_size=32))
    drills = hd._Drills(srv, check.Case(model="tiny-llama", hosts="netns"), "fail")
    facts, faults = drills.faulted({"remote_host": "10.0.0.3"}, [1, 2, 3], 25.0, ())
    assert calls == [None, {"remote_host": "10.0.0.3"}]
    assert facts["answered"] is False and facts["status"] == "none (the client gave up)"
    assert faults == ["D took 145.0 s, past its bound of 25 s"], faults
