"""The soak's judge (nixlkv/serving/soak.py), without servers: a passing report, and each thing the
soak must catch (a hung request, a wrong answer, a broken connection, a leaked block, memory growth
beyond the tolerance, bytes that differ, an answered request whose bytes were never checked, a
failure never injected) flips its verdict. Then how requests are drawn, failures classified and
answers judged; and, opt-in (NIXLKV_SOAK=1: real servers, minutes), the short soak itself."""

from __future__ import annotations

import json
import os
import urllib.error
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from nixlkv.serving import soak
from nixlkv.serving.client import Completion, CompletionError
from nixlkv.serving.soak import Event, Memory, Outcome, SoakPlan, SoakReport

MIB = 2**20


def _passing() -> SoakReport:
    report = SoakReport("tiny-llama 2xP1->2xD1 b32 netns nixlkv", "nixlkv", "netns", asdict(SoakPlan(requests=4)))
    report.outcomes = [Outcome(0, 0, 33, 8, "whole", 0.0, 1.0, "exact"),
                       Outcome(1, 1, 65, 8, "stream", 0.1, 1.0, "drift"),
                       Outcome(2, 2, 31, 4, "whole", 0.2, 0.1, "failed", "CompletionError: 500"),
                       Outcome(3, 0, 33, 16, "cancel", 0.3, 0.5, "cancelled", "closed after 0.005 s", cancelled_at="before")]
    report.events = [Event(n, float(i), i) for i, n in enumerate(("P0 killed", "P0 back", "link down", "link up"))]
    report.kv_usage_end = {"prefill0": 0.0, "prefill1": 0.0, "decode0": 0.0, "decode1": 0.0}
    report.memory = {name: Memory(1000 * MIB, 1040 * MIB, 1100 * MIB) for name in report.kv_usage_end}
    report.bytes = {"ok": True, "loads": 3}
    return report


def test_a_clean_soak_passes() -> None:
    report = _passing()
    assert report.faults() == [] and report.ok
    assert report.counts()["exact"] == 1 and report.counts()["failed"] == 1
    out = report.to_dict()
    assert out["ok"] and "answer" not in out["outcomes"][0] and out["memory"]["decode0"]["growth"] == pytest.approx(0.04)
    assert "PASS" in soak.format_soak(report)


@pytest.mark.parametrize("status, words", [("hung", "hung"), ("wrong", "otherwise than D alone"), ("broken", "broke"),
                                           ("", "never judged")])
def test_a_request_that_hung_answered_wrong_or_broke_fails_the_soak(status: str, words: str) -> None:
    report = _passing()
    report.outcomes[0].status, report.outcomes[0].detail = status, "token 3 differs"
    faults = report.faults()
    assert len(faults) == 1 and words in faults[0], faults
    assert "FAIL" in soak.format_soak(report)


def test_a_block_still_held_at_the_end_fails_the_soak() -> None:
    report = _passing()
    report.kv_usage_end["prefill1"] = 0.0003  # one block of thousands
    assert any("still held" in f and "prefill1" in f for f in report.faults())
    report.kv_usage_end["prefill1"] = float("nan")  # an engine that reports no usage proves nothing
    assert any("still held" in f for f in report.faults())


@pytest.mark.parametrize("end_mib, fails", [(1099, False), (1101, True), (901, False), (899, True)])
def test_memory_beyond_the_tolerance_either_way_fails_the_soak(end_mib: int, fails: bool) -> None:
    report = _passing()
    report.memory["decode1"] = Memory(1000 * MIB, end_mib * MIB, end_mib * MIB)
    assert bool([f for f in report.faults() if "decode1's memory" in f]) is fails


def test_memory_never_measured_after_warm_up_fails_the_soak() -> None:
    report = _passing()
    report.memory["prefill0"] = Memory(None, 1000 * MIB, 1000 * MIB)
    assert any("never measured" in f for f in report.faults())


def test_bytes_that_differ_or_were_never_checked_fail_the_soak() -> None:
    report = _passing()
    report.bytes = {"ok": False, "loads": 3, "mismatches": 7}
    assert any("differ from P's" in f for f in report.faults())
    report = _passing()
    report.unchecked = [0]
    assert any("bytes not checked" in f for f in report.faults())


def test_a_failure_not_injected_or_nothing_answered_fails_the_soak() -> None:
    report = _passing()
    report.events = [e for e in report.events if e.name != "link down"]
    assert any("did not inject ['link down']" in f for f in report.faults())
    loop = replace(report, hosts="loopback", events=[e for e in _passing().events if not e.name.startswith("link")])
    assert loop.faults() == []  # no link to drop on loopback
    report = _passing()
    for o in report.outcomes:
        if o.status in soak.ANSWERED:
            o.status = "failed"
    assert any("tested nothing" in f for f in report.faults())
    report = _passing()
    report.outcomes[3].cancelled_at = "whole"  # the client closed after its answer had come: nothing cancelled
    assert any("tested no cancellation" in f for f in report.faults())


def test_plan_refuses_settings_that_cannot_run() -> None:
    with pytest.raises(ValueError, match="in_flight must be at least 1"):
        SoakPlan(in_flight=0)
    with pytest.raises(ValueError, match="kill_at < resume_at < link_at"):
        SoakPlan(kill_at=0.5, resume_at=0.4)
    with pytest.raises(ValueError, match="policy"):
        SoakPlan(policy="retry")


def test_requests_cover_the_pool_modes_and_cancel_moments() -> None:
    plan = SoakPlan(requests=200, cancel_every=8)
    asks = soak.schedule(plan, 12)
    assert asks == soak.schedule(plan, 12)  # drawn from the seed: the same soak every time
    assert {a.prompt for a in asks} == set(range(12)) and {a.max_tokens for a in asks} == set(soak.MAX_TOKENS)
    cancelled = [a for a in asks if a.mode == "cancel"]
    assert len(cancelled) == 25 and {a.cancel_after_s for a in cancelled} == set(soak.CANCEL_AFTER_S)
    assert {a.mode for a in asks} == {"whole", "stream", "cancel"}
    lengths = soak.prompt_lengths(32, 1008)
    assert {31, 32, 33, 63, 64, 65, 1008} <= set(lengths) and lengths[0] == 1


def test_failures_are_classified_clean_hung_or_broken() -> None:
    assert soak.failure_status(CompletionError("u", 500, "boom")) == "failed"
    assert soak.failure_status(TimeoutError("timed out")) == "hung"
    assert soak.failure_status(urllib.error.URLError(TimeoutError("timed out"))) == "hung"
    assert soak.failure_status(ConnectionResetError()) == "broken"
    assert soak.failure_status(json.JSONDecodeError("x", "", 0)) == "broken"


def _c(ids: list[int], lps: list[float]) -> Completion:
    return Completion(ids, lps, [{t: lp, 99: lp - 3.0} for t, lp in zip(ids, lps)], 0.0)


def test_answers_are_judged_against_d_alone_exact_drift_or_wrong() -> None:
    ref = _c([5, 6, 7, 8], [-1.0, -1.1, -1.2, -1.3])
    never = lambda tokens: pytest.fail("no teacher-forced reference where the tokens agree")  # noqa: E731
    assert soak.answer_status([ref], _c([5, 6], [-1.0, -1.1]), never) == ("exact", "")  # a shorter answer: a prefix
    assert soak.answer_status([ref], _c([5, 6, 7, 8], [-1.0, -1.1, -1.25, -1.3]), never) == ("drift", "")  # batched
    other = _c([5, 6, 7, 8], [-1.0, -1.1, -1.2, -1.3 - 1.0])  # a logprob 1.0 off: beyond the drift rule
    status, why = soak.answer_status([ref], other, never)
    assert status == "wrong" and why
    wrong = _c([5, 9, 7, 8], [-1.0, -1.1, -1.2, -1.3])  # another token where D alone had no near-tie
    status, _ = soak.answer_status([ref], wrong, lambda tokens: _c(tokens, [-1.0, -4.1, -1.2, -1.3]))
    assert status == "wrong"
    assert soak.answer_status([_c([1, 2, 3, 4], [-1.0] * 4), ref], _c([5, 6, 7, 8], [-1.0, -1.1, -1.2, -1.3]),
                              never)[0] == "exact"  # the other decode engine's own answer


def test_an_engines_memory_is_every_process_of_its_group() -> None:
    own = soak.group_rss(os.getpgid(0))
    assert own > 10 * MIB  # this interpreter at least
    assert soak.group_rss(2**22 + 12345) == 0  # no such group


def test_loads_are_found_by_the_request_id_the_client_sent(tmp_path: Path) -> None:
    class Load:
        def __init__(self, request: str) -> None:
            self.request = request

    (tmp_path / "requests" / "cmpl-soak-00002-0-ab").mkdir(parents=True)
    (tmp_path / "requests" / "cmpl-soak-00002-0-ab" / "x.failed.json").write_text(
        json.dumps({"prefill_request_id": "cmpl-soak-00002-0-ab", "why": "the load failed"}))
    outcomes = [Outcome(0, 0, 33, 8, "whole", 0.0, status="exact"), Outcome(1, 0, 33, 8, "whole", 0.0, status="drift"),
                Outcome(2, 0, 33, 8, "whole", 0.0, status="exact"), Outcome(3, 0, 1, 8, "whole", 0.0, status="exact"),
                Outcome(4, 0, 33, 8, "whole", 0.0, status="failed")]
    unchecked = soak.attribute_loads(tmp_path, [Load("cmpl-soak-00000-0-cd")], outcomes)
    assert unchecked == [1]  # 0 judged, 2 failed (recomputed), 3 one token (nothing to load), 4 not answered


def test_only_loads_p0_took_with_it_are_excused_from_the_bytes() -> None:
    outcomes = [Outcome(0, 0, 33, 8, "whole", 10.0, 2.0, "exact"),  # ended 88 s before the kill
                Outcome(1, 0, 33, 8, "whole", 95.0, 3.0, "exact"),  # ended 2 s before it: P0's copy not yet written
                Outcome(2, 0, 33, 8, "whole", 99.0, 4.0, "exact"),  # in flight at the kill
                Outcome(3, 0, 33, 8, "whole", 101.0, 1.0, "exact")]  # sent after it (to the other P)
    missing = [f"cmpl-soak-0000{i}-0-ab" for i in range(4)] + ["cmpl-soak-00001-0-cd (decode e: dumps of ranks [] of 1)"]
    assert soak.lost_with_killed_p(missing, outcomes, 100.0) == ["cmpl-soak-00001-0-ab", "cmpl-soak-00002-0-ab"]
    assert soak.lost_with_killed_p(missing, outcomes, None) == []  # no P killed: every missing dump fails
