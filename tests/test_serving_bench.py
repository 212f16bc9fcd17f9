"""serve-bench's own arithmetic, without engines: the transfer figures read from D's metrics, the
ratios and goals, the plan's checks, the equal agent settings and the Llama-3-8B-KV model's size.
The served run itself is `make serve-bench-kv` (minutes to hours on a 2-core machine)."""

from __future__ import annotations

import math

import pytest

from nixlkv.serving import bench, models
from nixlkv.serving.bench import BenchPlan, goals, markdown, ratios, transfer_of
from nixlkv.serving.ceiling import PAUSED_AGENT, VLLM_AGENT, AgentSettings


def test_the_timing_model_holds_llama_3_8b_kv_per_token_and_stays_out_of_the_matrix() -> None:
    rec = models.recipe("tiny-llama-8b-kv")
    assert models.kv_bytes_per_token(rec) == models.LLAMA3_8B_KV_BYTES_PER_TOKEN == 128 * 1024
    assert rec.config["hidden_size"] < rec.config["num_attention_heads"] * rec.config["head_dim"]  # narrow
    assert rec.max_model_len >= 8192 + 16
    assert "tiny-llama-8b-kv" not in models.RECIPES  # no serving-matrix case, no captured scenario
    assert models.kv_bytes_per_token(models.recipe("tiny-llama")) == 2 * 2 * 64 * 2 * 2  # the helper can differ
    with pytest.raises(ValueError, match="tiny-llama-8b-kv"):
        models.recipe("no-such-model")


def test_transfer_per_request_and_per_read() -> None:
    # vLLM at P2->D1: one recorded transfer per READ, two per request
    d = {"vllm:nixl_xfer_time_seconds_count": 6.0, "vllm:nixl_xfer_time_seconds_sum": 1.2,
         "vllm:nixl_bytes_transferred_sum": 3 * 2 ** 30}
    t = transfer_of(d, "vllm", 3)
    assert t["transfers_per_request"] == 2.0
    assert t["xfer_ms_per_request"] == pytest.approx(400.0)
    assert t["xfer_ms_per_transfer"] == pytest.approx(200.0)
    assert t["bytes_per_request"] == 2 ** 30
    # nixlkv's names are its own; vLLM's keys say nothing about it
    n = transfer_of(d, "nixlkv", 3)
    assert n["transfers"] == 0 and math.isnan(n["xfer_ms_per_request"])


def test_ratios_and_goals_say_which_side_is_better() -> None:
    n = {"ttft_ms_median": 900.0, "xfer_ms_per_request": 150.0, "requests_per_s": 2.0}
    v = {"ttft_ms_median": 1000.0, "xfer_ms_per_request": 120.0, "requests_per_s": 1.0}
    r = ratios(n, v, ceiling_s=0.125)
    assert r["ttft"] == pytest.approx(0.9)
    assert r["d_transfer_time"] == pytest.approx(1.25)
    assert r["throughput_inverse"] == pytest.approx(0.5)
    assert r["nixlkv_of_ceiling"] == pytest.approx(125 / 150)
    assert r["vllm_of_ceiling"] == pytest.approx(125 / 120)
    g = goals(r)
    assert g == {"ttft": True, "d_transfer_time": False, "throughput_inverse": True,
                 "nixlkv_at_90pct_of_ceiling": False}
    assert goals(ratios(n, v, ceiling_s=0.140))["nixlkv_at_90pct_of_ceiling"] is True
    unloaded = {k: x for k, x in n.items() if k != "requests_per_s"}  # a length without a load
    assert "throughput_inverse" not in ratios(unloaded, v, None)


def test_plan_refuses_what_it_cannot_measure() -> None:
    assert BenchPlan(lengths=(128, 8192), load_lengths=(128,)).loaded == (128,)
    assert BenchPlan(lengths=(128, 8192)).loaded == (128, 8192)
    assert BenchPlan(lengths=(128,), load_lengths=()).loaded == ()
    with pytest.raises(ValueError, match="load_lengths"):
        BenchPlan(lengths=(128,), load_lengths=(8192,))
    with pytest.raises(ValueError, match="lengths"):
        BenchPlan(lengths=())
    with pytest.raises(ValueError, match="concurrency"):
        BenchPlan(concurrency=0)


def test_both_connectors_get_vllms_own_agent_settings() -> None:
    """The run's one setting, as each connector spells it: nixlkv's keys, vLLM's num_threads."""
    assert VLLM_AGENT == AgentSettings(progress_delay_us=0, num_threads=4, telemetry=True)
    assert VLLM_AGENT.nixlkv_config() == {"nixl_progress_delay_us": 0, "nixl_num_threads": 4, "nixl_telemetry": True}
    assert VLLM_AGENT.vllm_config() == {"num_threads": 4}
    from nixlkv.vllm.config import ConnectorConfig
    cfg = ConnectorConfig.parse(VLLM_AGENT.nixlkv_config(), env={})
    assert (cfg.nixl_progress_delay_us, cfg.nixl_num_threads, cfg.nixl_telemetry) == (0, 4, True)
    assert VLLM_AGENT.engine_env() == {}  # NIXL's own progress thread, untouched
    # a pause reaches vLLM's agents through the engines' environment (the agent_pause plugin), so
    # both connectors run with it; a setting vLLM's connector cannot be given is refused
    from nixlkv.serving import agent_pause
    assert PAUSED_AGENT.engine_env() == {agent_pause.ENV: "1000"}
    assert PAUSED_AGENT.vllm_config() == {"num_threads": 4}
    assert ConnectorConfig.parse(PAUSED_AGENT.nixlkv_config(), env={}).nixl_progress_delay_us == 1000
    with pytest.raises(ValueError, match="telemetry"):
        AgentSettings(progress_delay_us=0, num_threads=4, telemetry=False).vllm_config()


def test_both_connectors_engines_get_the_pause_in_their_environment(monkeypatch) -> None:
    from nixlkv.serving import agent_pause
    from nixlkv.serving.check import Case, Options

    seen = []

    class Stop(Exception):
        pass

    def servers(case, opts, tag, references):  # type: ignore[no-untyped-def]
        seen.append((case.connector, opts.extra_env))
        raise Stop

    monkeypatch.setattr(bench, "Servers", servers)
    for variant in ("nixlkv", "vllm"):
        for agent in (PAUSED_AGENT, VLLM_AGENT):
            case = bench.variant_case(Case(model="tiny-llama"), variant, agent)
            with pytest.raises(Stop):
                bench.measure(case, Options(extra_env={"VLLM_CPU_KVCACHE_SPACE": "2"}), BenchPlan(agent=agent))
    assert seen == [("nixlkv", {"VLLM_CPU_KVCACHE_SPACE": "2", agent_pause.ENV: "1000"}),
                    ("nixlkv", {"VLLM_CPU_KVCACHE_SPACE": "2"}),
                    ("vllm", {"VLLM_CPU_KVCACHE_SPACE": "2", agent_pause.ENV: "1000"}),
                    ("vllm", {"VLLM_CPU_KVCACHE_SPACE": "2"})]


def test_the_engines_get_the_settings_over_launchs_defaults() -> None:
    from nixlkv.serving.launch import EngineSpec
    from pathlib import Path
    spec = EngineSpec(Path("m"), "kv_consumer", 1, 2, "nixlkv", extra_config=VLLM_AGENT.nixlkv_config())
    extra = spec.kv_transfer_config()["kv_connector_extra_config"]
    assert extra["nixl_progress_delay_us"] == 0  # launch's CPU default (1000) overridden
    v = EngineSpec(Path("m"), "kv_consumer", 1, 2, "vllm", extra_config=VLLM_AGENT.vllm_config())
    assert v.kv_transfer_config()["kv_connector_extra_config"] == {"num_threads": 4}


def test_markdown_has_a_row_per_length() -> None:
    length = {"ttft_ms_median": 100.0, "ttft_ms": [99.0, 100.0, 101.0], "xfer_ms_per_request": 10.0,
              "bytes_per_request": 1e7}
    loaded = {**length, "requests_per_s": 2.0, "concurrency": 8}
    row = {"model": "m", "shape": "m P1->D1 b32", "plan": {"lengths": [128, 8192]},
           "nixlkv": {"lengths": {"128": loaded, "8192": length}}, "vllm": {"lengths": {"128": loaded, "8192": length}},
           "ceiling": {"128": {"gbps": 2.0}, "8192": None},
           "ratios": {"128": ratios(loaded, loaded, 0.005), "8192": ratios(length, length, None)}}
    text = markdown([row])
    lines = text.strip().splitlines()
    assert len(lines) == 4
    assert "| 128 |" in lines[2] and "0.50 / 0.50" in lines[2] and "(x8)" in lines[2]
    assert "| 8192 |" in lines[3] and lines[3].count("| - |") >= 2
    assert bench.GOAL_OF_CEILING == 0.9 and bench.GOAL_RATIO == 1.0



def test_push_variants_get_their_connector_and_the_same_agent_settings() -> None:
    """With ``push``, four variants on one set of agent settings: nixlkv's push mode is its
    transfer_mode, vLLM's is its NixlPushConnector; TTFT ratios say push against pull and against vLLM."""
    from nixlkv.serving.check import Case
    from nixlkv.serving.launch import EngineSpec
    from pathlib import Path

    assert BenchPlan().variants == ("nixlkv", "vllm")
    assert BenchPlan(push=True).variants == ("nixlkv", "vllm", "nixlkv-push", "vllm-push")
    case = Case(model="tiny-llama")
    push = dict(bench.variant_case(case, "nixlkv-push", VLLM_AGENT).connector_config)
    assert push == {**VLLM_AGENT.nixlkv_config(), "transfer_mode": "push"}
    assert "transfer_mode" not in dict(bench.variant_case(case, "nixlkv", VLLM_AGENT).connector_config)
    vp = bench.variant_case(case, "vllm-push", VLLM_AGENT)
    assert vp.connector == "vllm-push" and dict(vp.connector_config) == VLLM_AGENT.vllm_config()
    spec = EngineSpec(Path("m"), "kv_consumer", 1, 2, vp.connector, extra_config=VLLM_AGENT.vllm_config())
    assert spec.kv_transfer_config()["kv_connector"] == "NixlPushConnector"
    r = bench.push_ratios({"nixlkv": {"ttft_ms_median": 200.0}, "nixlkv-push": {"ttft_ms_median": 150.0},
                           "vllm": {"ttft_ms_median": 250.0}, "vllm-push": {"ttft_ms_median": 300.0}})
    assert r == {"ttft_push_over_pull": pytest.approx(0.75), "ttft_push_over_vllm_push": pytest.approx(0.5)}
    length = {"ttft_ms_median": 100.0, "ttft_ms": [99.0, 101.0]}
    row = {"model": "m", "shape": "m P1->D1 b32", "plan": {"lengths": [128]},
           **{k: {"lengths": {"128": length}} for k in BenchPlan(push=True).variants},
           "ratios": {"128": {"ttft_push_over_pull": 1.0, "ttft_push_over_vllm_push": 1.0}}}
    lines = bench.push_markdown([row]).strip().splitlines()
    assert len(lines) == 3 and lines[2].count("100 (99-101)") == 4


def test_a_push_connector_that_does_not_serve_is_reported_and_the_rest_measured(monkeypatch) -> None:
    """vLLM's NixlPushConnector may not start on a vLLM build: its variant records why, the other
    variants are measured, the ratio against it is left out; a pull variant failing still fails."""
    from nixlkv.serving.check import Case
    from nixlkv.serving.launch import ServeError

    def fake_measure(case, opts, plan, progress=None):  # type: ignore[no-untyped-def]
        if case.connector == "vllm-push":
            raise ServeError("decode exited with 1 before it was ready")
        push = dict(case.connector_config).get("transfer_mode") == "push"
        ttft = {"nixlkv": 200.0, "vllm": 250.0}[case.connector] * (0.5 if push else 1.0)
        return {"lengths": {"128": {"ttft_ms_median": ttft, "ttft_ms": [ttft], "xfer_ms_per_request": 1.0,
                                    "bytes_per_request": 0.0}}}

    monkeypatch.setattr(bench, "measure", fake_measure)
    out = bench.run(Case(model="tiny-llama"), None, BenchPlan(lengths=(128,), push=True))
    assert "ServeError" in out["vllm-push"]["error"]
    assert out["ratios"]["128"]["ttft_push_over_pull"] == pytest.approx(0.5)
    assert "ttft_push_over_vllm_push" not in out["ratios"]["128"]
    line = bench.push_markdown([out]).strip().splitlines()[2]
    assert "did not serve: ServeError" in line and "| 0.50 | - |" in line

    def pull_fails(case, opts, plan, progress=None):  # type: ignore[no-untyped-def]
        raise ServeError("prefill exited")

    monkeypatch.setattr(bench, "measure", pull_fails)
    with pytest.raises(ServeError):
        bench.run(Case(model="tiny-llama"), None, BenchPlan(lengths=(128,), push=True))


def test_servers_on_separate_hosts_get_a_ceiling_across_hosts(monkeypatch) -> None:
    """``--hosts netns``: the servers run across hosts, and so does each length's ceiling (NIXL over
    TCP); on loopback it stays in one process. The row says where it ran."""
    from nixlkv.serving.check import Case, Options
    from nixlkv.cli import build_parser

    def fake_measure(case, opts, plan, progress=None):  # type: ignore[no-untyped-def]
        return {"lengths": {"128": {"ttft_ms_median": 1.0, "ttft_ms": [1.0], "xfer_ms_per_request": 4.0,
                                    "bytes_per_request": 1e6}}}

    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "read_ceiling", lambda n, p, reps, s: calls.append(("one process", n, p)) or [0.002])
    monkeypatch.setattr(bench, "read_ceiling_across_hosts",
                        lambda n, p, reps, s, python: calls.append(("across hosts", n, p)) or [0.003])
    opts = Options(python="py")
    out = bench.run(Case(model="tiny-llama", p_tp=2, hosts="netns"), opts, BenchPlan(lengths=(128,)))
    assert calls == [("across hosts", 1000000, 2)] and out["hosts"] == "netns" and "netns" in out["shape"]
    assert out["ratios"]["128"]["nixlkv_of_ceiling"] == pytest.approx(3 / 4)
    calls.clear()
    out = bench.run(Case(model="tiny-llama"), opts, BenchPlan(lengths=(128,)))
    assert calls == [("one process", 1000000, 1)] and out["hosts"] == "loopback"
    args = build_parser().parse_args(["serve-bench", "--hosts", "netns", "--progress-delay-us", "1000"])
    assert args.hosts == "netns" and args.progress_delay_us == 1000
    args = build_parser().parse_args(["serve-bench"])
    assert args.hosts == "loopback" and args.progress_delay_us == 0


def test_a_run_stopped_after_its_first_row_keeps_that_row(monkeypatch, tmp_path) -> None:
    """serve-bench writes its JSON after each row (a P TP size), so a long run stopped in its second
    row keeps what the first measured."""
    import json as _json

    from nixlkv import cli

    def fake_run(case, opts, plan, progress=None):  # type: ignore[no-untyped-def]
        if case.p_tp == 2:
            raise KeyboardInterrupt
        return {"model": case.model, "p_tp": case.p_tp}

    monkeypatch.setattr(bench, "run", fake_run)
    out = tmp_path / "kv.json"
    with pytest.raises(KeyboardInterrupt):
        cli.main(["serve-bench", "--model", "tiny-llama-8b-kv", "--p-tp", "1", "--p-tp", "2", "--json-out", str(out)])
    assert _json.loads(out.read_text()) == [{"model": "tiny-llama-8b-kv", "p_tp": 1}]
