"""The ``nixlkv`` command: plan, prove, serve and measure (``nixlkv --help``; commands grouped in COMMANDS)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_SCENARIO = "default.yaml"


def _default_scenario() -> Path:
    return Path(str(resources.files("nixlkv.testing") / "scenarios" / DEFAULT_SCENARIO))


def _quiet() -> None:
    """vLLM and NIXL log at INFO on import; keep the CLI's output readable."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout
    logging.getLogger("nixl").setLevel(logging.WARNING)


def cmd_strategies(args: argparse.Namespace) -> int:
    from .core import StrategyRegistry

    registry = StrategyRegistry.from_plugins()
    rows = [
        {
            "name": r.strategy.name,
            "spec_types": [f"{t.__module__}.{t.__qualname__}" for t in r.strategy.spec_types],
            "origin": r.origin,
            "pending": getattr(r.strategy, "reason", None),
        }
        for r in registry.registered()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        types = ", ".join(t.rsplit(".", 1)[-1] for t in row["spec_types"])
        status = f"  [refused: {row['pending']}]" if row["pending"] else ""
        print(f"{row['name']:<18} {types:<48} from {row['origin']}{status}")
    return 0


def _load(path: str | None):
    from .testing.scenario import load

    return load(path or _default_scenario())


def cmd_explain(args: argparse.Namespace) -> int:
    import numpy as np

    from .core import NixlkvError
    from .core.dispatcher import Dispatcher
    from .testing.oracle import id_lists
    from .testing.rehearsal import build, choose_blocks

    scenario = _load(args.scenario)
    try:
        engines = build(scenario, Dispatcher.from_plugins())
        rng = np.random.default_rng(scenario.request.seed)
        req = scenario.request
        p_blocks = choose_blocks(engines.prefill[0], req.num_tokens, 0, rng)
        d_blocks = choose_blocks(engines.decode[0], req.num_tokens, req.cached_blocks, rng, peer=engines.prefill[0])
        resolved_all = [
            plan.resolve(id_lists(d_blocks), id_lists(p_blocks), req.num_tokens) for plan in engines.plans
        ]
    except (NixlkvError, NotImplementedError) as exc:
        print(f"rejected: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # vLLM's planner refusing the model
        from .testing.rehearsal import build_failure

        print(f"error: {build_failure(exc)}", file=sys.stderr)
        return 2
    out = []
    for plan, resolved in zip(engines.plans, resolved_all):
        d = plan.to_dict()
        d["request"] = {
            "num_tokens": scenario.request.num_tokens,
            "descriptors": resolved.num_descriptors,
            "reads": {f"remote_rank_{r.remote_rank}": r.num_descriptors for r in resolved.reads},
            "notify_only": list(resolved.notify_only),
        }
        out.append(d)
    if args.json:
        print(json.dumps({"scenario": scenario.name, "plans": out}, indent=2))
        return 0
    print(f"scenario {scenario.name}: prefill tp={scenario.prefill.tp} -> decode tp={scenario.decode.tp}")
    for d in out:
        _print_plan(d)
    return 0


def _print_plan(d: dict[str, Any]) -> None:
    print(
        f"\ndecode rank {d['local_rank']}: reads prefill ranks {d['read_ranks']} "
        f"(covers {d['covered_remote_ranks']}; each waits for {d['consumers_per_remote_rank']} notification(s))"
    )
    for g in d["groups"]:
        print(f"  KV group {g['local_group']} <- remote group {g['remote_group']} via {g['strategy']}")
    patterns: dict[tuple, list[str]] = {}
    for s in d["segments"]:
        patterns.setdefault((s["local_region"],), []).append(
            f"[{s['local_offset']}, {s['local_offset'] + s['nbytes']}) <- P{s['remote_rank']} "
            f"[{s['remote_offset']}, {s['remote_offset'] + s['nbytes']})"
        )
    by_text: dict[str, list[str]] = {}
    for (region,), parts in patterns.items():
        by_text.setdefault("; ".join(parts), []).append(region)
    print("  segments (byte offsets within a block's page of each layer region):")
    for text, regions in by_text.items():
        who = regions[0] if len(regions) == 1 else f"{regions[0]} .. {regions[-1]} ({len(regions)} layers)"
        print(f"    {who}: {text}")
    regd = d["registered_descriptors"]
    print(f"  descriptors registered: {', '.join(f'{k} {v}' for k, v in regd.items())}")
    r = d["request"]
    print(
        f"  request of {r['num_tokens']} tokens: {r['descriptors']} descriptors in {len(r['reads'])} READ(s) "
        f"{r['reads']}, notify-only ranks {r['notify_only']}"
    )


def cmd_rehearse(args: argparse.Namespace) -> int:
    from .testing.rehearsal import rehearse

    scenario = _load(args.scenario)
    if args.baseline == "vllm":
        return _rehearse_vllm(scenario, args)
    result = rehearse(scenario, descriptor_mode=args.descriptor_mode)
    if args.json:
        d = result.to_dict()
        if not args.plans:
            d.pop("plans")
        print(json.dumps(d, indent=2))
        return 0 if result.ok else 1
    print(f"scenario {scenario.name}: prefill tp={scenario.prefill.tp} {scenario.prefill.layout} -> "
          f"decode tp={scenario.decode.tp} {scenario.decode.layout}, {scenario.num_layers} layers, "
          f"{scenario.request.num_tokens} tokens")
    for d in result.plans:
        print(f"  decode rank {d['local_rank']}: reads prefill ranks {d['read_ranks']}, "
              f"{len(d['segments'])} segments, strategies {sorted({g['strategy'] for g in d['groups']})}")
    if result.outcome == "byte-exact":
        # What was proven, not a speed: this one request's READs include NIXL's set-up, so a GB/s from them
        # would say nothing about the transport (nixlkv bench measures a warm one beside a memcpy).
        where = "; ".join(f"D{d['local_rank']} <- {', '.join(f'P{r}' for r in d['read_ranks'])}"
                          for d in result.plans)
        print(f"moved {result.bytes_moved} bytes of the request's KV over real NIXL ({where}) in "
              f"{result.descriptors} descriptors / {result.reads} READs; prefill ranks notified "
              f"{result.notifications}")
        print(f"descriptor mode {result.descriptor_mode}: ran as {result.modes} per decode rank; "
              f"NIXL posted {result.posted_descriptors} descriptors after its merge")
        print(f"byte-exact: {result.message}: every byte of every decode rank's cache equals what P's pattern "
              f"puts there (the request's blocks) or was left untouched (everything else)")
        print("no speed shown: one request's first READs time NIXL's set-up, not the transport; "
              "warm GB/s beside a same-run memcpy: nixlkv bench --quick (docs/performance.md)")
    else:
        print(f"{result.outcome}: {result.message}")
    return 0 if result.ok else 1


def _rehearse_vllm(scenario, args: argparse.Namespace) -> int:
    """The same rehearsal with vLLM 0.33's own NixlConnector planning and moving the bytes."""
    from .testing.vllm_baseline import run_baseline

    result = run_baseline(scenario, timeout=args.timeout)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.ok else 1
    print(f"scenario {scenario.name} through vLLM's NixlConnector: prefill tp={scenario.prefill.tp} -> "
          f"decode tp={scenario.decode.tp}, {scenario.request.num_tokens} tokens")
    for note in result.notes:
        print(f"  note: {note}")
    if result.outcome == "byte-exact":
        steady = "" if result.steady_state_s is None else f", steady state {result.steady_state_s * 1e3:.1f} ms"
        print(f"first request {result.first_request_s * 1e3:.1f} ms (with handshake){steady}; "
              f"{result.descriptors} descriptors per request")
    print(f"{result.outcome}: {result.message}")
    return 0 if result.ok else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from .testing.comparison import compare, markdown, scenario_files, summary

    def progress(msg: str) -> None:
        print(f"[compare] {msg}", file=sys.stderr, flush=True)

    rows = compare(scenario_files(args.scenarios), timeout=args.timeout, progress=progress)
    table = markdown(rows)
    result = json.dumps({"summary": summary(rows), "rows": rows}, indent=2)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json_out:
        Path(args.json_out).write_text(result + "\n")
    if args.json:
        print(result)
    else:
        print(table)
        print(json.dumps(summary(rows)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.report import markdown, plot
    from .bench.run import headline_ok, run

    def progress(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    out = run(quick=args.quick, with_transfers=not args.no_transfer, transfer_reps=args.transfer_reps, progress=progress,
              shape=args.shape, progress_delay_us=args.progress_delay_us, nixl_num_threads=args.nixl_threads)
    if args.markdown:
        Path(args.markdown).write_text(markdown(out))
    if args.plot:
        plot(out, args.plot)
    bad = [] if args.shape else headline_ok(out)  # one shape's cases need not include the headline's
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(markdown(out))
        headline = {k: v for k, v in out.items() if not isinstance(v, (list, dict))}
        for k, v in headline.items():
            print(f"{k:<40} {v:.4g}" if isinstance(v, float) else f"{k:<40} {v}")
    if bad:
        print(f"error: headline figures missing or not finite and positive: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def cmd_bench_handshake(args: argparse.Namespace) -> int:
    if args.whole:
        from .bench import first_handshake

        out = first_handshake.run(layers=args.layers, p_tp=args.p_tp, d_tp=args.d_tp, reps=args.reps)
        print(json.dumps(out, indent=1) if args.json else first_handshake.markdown(out))
        return 0
    from .bench.stall import markdown, run

    out = run(layers=args.layers, p_tp=args.p_tp, d_tp=args.d_tp, reps=args.reps)
    print(json.dumps(out, indent=1) if args.json else markdown(out))
    return 0


def cmd_bench_settings(args: argparse.Namespace) -> int:
    from .bench.settings import markdown, run

    out = run(layers=args.layers, p_tp=args.p_tp, d_tp=args.d_tp, blocks=args.blocks, rounds=args.rounds,
              progress_delay_us=args.progress_delay_us)
    print(json.dumps(out, indent=1) if args.json else markdown(out))
    return 0


def cmd_serve_check(args: argparse.Namespace) -> int:
    from .serving.check import Case, Options, format_table, run_case, to_json

    opts = Options(python=args.python, models_dir=Path(args.models_dir), work_dir=Path(args.work_dir),
                   proxy_cmd=args.proxy_cmd,
                   port=args.port, start_timeout_s=args.start_timeout, negative_control=not args.no_negative_control,
                   quick=args.quick, verify_bytes=args.verify_bytes)
    results = []
    for connector in args.connector or ["nixlkv"]:
        case = Case(model=args.model, connector=connector, p_tp=args.p_tp, d_tp=args.d_tp, p_block=args.p_block,
                    d_block=args.d_block, max_tokens=args.max_tokens, concurrency=args.concurrency, rule=args.rule,
                    prefix_caching=args.prefix_caching, prefills=args.prefills, decodes=args.decodes,
                    kv_cache_dtype=args.kv_cache_dtype, p_args=tuple(args.prefill_arg or ()),
                    d_args=tuple(args.decode_arg or ()), kv_both=args.kv_both,
                    connector_config=tuple(_connector_config(args.connector_config or ())), hosts=args.hosts)
        print(f"[serve-check] {case.label}: starting P and D (logs under {opts.work_dir})", file=sys.stderr, flush=True)
        results.append(run_case(case, opts))
    print(to_json(results) if args.json else format_table(results))
    return 0 if all(r.ok for r in results) else 1


def _connector_config(items: Sequence[str]) -> list[tuple[str, Any]]:
    """``KEY=VALUE`` items as kv_connector_extra_config entries: VALUE read as JSON where it is
    JSON (``1000``, ``true``), else as the string it is (``staged``)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--connector-config takes KEY=VALUE (e.g. descriptor_mode=staged), got {item!r}")
        try:
            out.append((key, json.loads(value)))
        except json.JSONDecodeError:
            out.append((key, value))
    return out


def cmd_serve_drill(args: argparse.Namespace) -> int:
    from .serving.check import Case, Options
    from .serving.drills import format_drills, run, run_drills

    opts = Options(python=args.python, models_dir=Path(args.models_dir), work_dir=Path(args.work_dir),
                   proxy_cmd=args.proxy_cmd,
                   port=args.port, start_timeout_s=args.start_timeout, verify_bytes=args.verify_bytes)
    config = tuple(_connector_config(args.connector_config or ()))
    group = run_drills
    if args.hosts == "netns":  # the separate-hosts drills (9-12), not the loopback ones
        from .serving.host_drills import run_host_drills as group
    outs = [run(Case(model=args.model, connector=c, connector_config=config), opts,
                tuple(args.policy or ("recompute", "fail")), group)
            for c in (args.connector or ["nixlkv"])]
    print(json.dumps(outs, indent=1, default=float) if args.json else "\n".join(format_drills(o) for o in outs))
    return 0 if all(o["ok"] for o in outs) else 1


def cmd_serve_soak(args: argparse.Namespace) -> int:
    from .serving.check import Case, Options
    from .serving.soak import SoakPlan, format_soak, run_soak, to_json

    opts = Options(python=args.python, models_dir=Path(args.models_dir), work_dir=Path(args.work_dir),
                   proxy_cmd=args.proxy_cmd, port=args.port, start_timeout_s=args.start_timeout,
                   verify_bytes=args.verify_bytes)
    plan = SoakPlan(requests=args.requests, in_flight=args.in_flight, deadline_s=args.deadline,
                    request_timeout_s=args.request_timeout, link_host=args.drop_link, link_down_s=args.link_down,
                    policy=args.policy, seed=args.seed)
    reports = []
    for connector in args.connector or ["nixlkv"]:
        case = Case(model=args.model, connector=connector, prefills=2, decodes=2, hosts=args.hosts)
        print(f"[serve-soak] {case.label}: {plan.requests} requests, {plan.in_flight} in flight",
              file=sys.stderr, flush=True)
        reports.append(run_soak(case, opts, plan, progress=lambda m: print(f"[serve-soak] {m}", file=sys.stderr,
                                                                           flush=True)))
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(to_json(reports) + "\n")
    print(to_json(reports) if args.json else "\n".join(format_soak(r) for r in reports))
    return 0 if all(r.ok for r in reports) else 1


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from .serving.bench import BenchPlan, markdown, push_markdown, run
    from .serving.ceiling import VLLM_AGENT
    from .serving.check import Case, Options

    extra_env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)} if args.kv_cache_gib else {}
    # timings: no dumps (the byte check copies every request's blocks to disk on the engines' threads)
    opts = Options(python=args.python, models_dir=Path(args.models_dir), work_dir=Path(args.work_dir),
                   proxy_cmd=args.proxy_cmd, extra_env=extra_env,
                   port=args.port, start_timeout_s=args.start_timeout, verify_bytes=False)
    lengths = tuple(args.prompt_len or [512])
    plan = BenchPlan(lengths=lengths, requests=args.requests, load_requests=args.load_requests,
                     concurrency=args.concurrency, ceiling_reps=args.ceiling_reps, max_tokens=args.max_tokens,
                     warm_each_length=args.warm_each_length, push=args.push,
                     agent=replace(VLLM_AGENT, progress_delay_us=args.progress_delay_us),
                     load_lengths=None if args.load_len is None else tuple(args.load_len))
    rows = []
    for m in args.model or ["tiny-llama"]:
        for p_tp in args.p_tp or [1]:
            rows.append(run(Case(model=m, p_tp=p_tp, d_tp=args.d_tp, hosts=args.hosts), opts, plan,
                            progress=lambda msg: print(f"[serve-bench] {msg}", file=sys.stderr, flush=True)))
            if args.json_out:  # after each row: a run stopped later keeps what it measured
                Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json_out).write_text(json.dumps(rows, indent=1, default=float) + "\n")
    table = markdown(rows) + (push_markdown(rows) if args.push else "")
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(json.dumps(rows, indent=1, default=float) if args.json else table)
    return 0


def cmd_serve_bench_plot(args: argparse.Namespace) -> int:
    from .serving.bench_plot import plot

    print(plot(json.loads(Path(args.json_in).read_text()), args.out, args.title or ""))
    return 0


def cmd_serve_matrix(args: argparse.Namespace) -> int:
    from .serving.check import Options
    from .serving.matrix import (default_cases, failed_cells, markdown, merge, merged_facts, rows_of, run_matrix,
                                 select, to_json)

    facts = None  # this run's date, commit and CPU; merged files keep their own runs'

    def save(rows: list) -> None:
        if args.json_out:
            Path(args.json_out).write_text(to_json(rows, facts) + "\n")

    if args.merge:
        files = [json.loads(Path(p).read_text()) for p in args.merge]
        rows = merge(rows_of(f) for f in files)
        facts = merged_facts(files)
    else:
        opts = Options(python=args.python, models_dir=Path(args.models_dir), work_dir=Path(args.work_dir),
                       proxy_cmd=args.proxy_cmd, port=args.port, start_timeout_s=args.start_timeout,
                       quick=args.quick)
        cases = [replace(c, hosts=args.hosts) for c in select(default_cases(), args.model, args.shape)]
        connectors = tuple(args.connector or ("nixlkv", "vllm"))
        rows = run_matrix(cases, opts, connectors, after_row=save,
                          progress=lambda m: print(f"[serve-matrix] {m}", file=sys.stderr, flush=True))
    table = markdown(rows, facts)
    if args.markdown:
        Path(args.markdown).write_text(table)
    save(rows)
    print(to_json(rows, facts) if args.json else table)
    failed = failed_cells(rows)
    if failed:
        print(f"[serve-matrix] {len(failed)} nixlkv cell(s) failed: {'; '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def cmd_capture(args: argparse.Namespace) -> int:
    from .serving import models
    from .serving.capture import run

    names = args.model or list(models.RECIPES)
    written = run(names, args.tp or [1, 2], args.python, Path(args.models_dir), Path(args.work_dir), Path(args.out),
                  args.port, args.block_size, args.start_timeout)
    for path in written:
        print(path)
    return 0


def _serving_args(p: argparse.ArgumentParser) -> None:
    """Where the serving commands find their environment and put their servers."""
    from .serving.launch import default_python

    p.add_argument("--python", default=default_python(), help="python of the serving environment "
                   "(default: $NIXLKV_SERVE_PYTHON, else .serve-venv/bin/python)")
    p.add_argument("--models-dir", default=".serve-models", help="where tiny models are built (reused)")
    p.add_argument("--work-dir", default=".serve-runs", help="server logs")
    p.add_argument("--port", type=int, default=8100, help="P's port; D, the proxy and side channels use the next ones")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to become ready")
    p.add_argument("--proxy-cmd", metavar="CMD",
                   help="run your own P/D proxy instead of nixlkv's: its command line, with {port} (where the "
                   "client sends requests), {python}, and the engines as {prefill_urls} {decode_urls} or "
                   "{prefill_hosts} {prefill_ports} {decode_hosts} {decode_ports} (space-separated); e.g. "
                   "\"{python} toy_proxy_server.py --port {port} --prefiller-hosts {prefill_hosts} "
                   "--prefiller-ports {prefill_ports} --decoder-hosts {decode_hosts} --decoder-ports {decode_ports}\"")


# What a user wants -> the commands that do it, each with its one-line summary and the page that explains
# it (`nixlkv --help` prints this table; each command's --help names its page; tests/test_cli_help.py
# checks every page exists).
COMMANDS: dict[str, list[tuple[str, str, str]]] = {
    "plan (offline, no engines)": [
        ("strategies", "installed strategies, the spec types each serves, where it comes from", "docs/spec-types.md"),
        ("explain", "the transfer plan of a scenario, per decode rank: what moves where", "docs/architecture.md"),
    ],
    "prove (real NIXL, fabricated engines, every byte checked)": [
        ("rehearse", "run a scenario through real NIXL and check every byte of D against P",
         "docs/scenarios.md"),
        ("compare", "nixlkv and vLLM 0.33's NixlConnector over a directory of scenarios: one table",
         "docs/comparison.md"),
    ],
    "serve (real vLLM servers, proxy and client)": [
        ("serve-check", "real P and D vLLM servers, proxy and client: D's KV checked byte for byte against P's, "
         "D's answers judged against D computing the prompts itself", "docs/serving.md"),
        ("serve-drill", "failures in real serving: P killed while D waits, P restarted on the same port, a decode "
         "that never came, the same params twice, clients that hang up, D short of KV blocks, P with another "
         "--kv-cache-dtype; with --hosts netns, misconfiguration and link faults between separate hosts",
         "docs/serving.md"),
        ("serve-soak", "a bounded soak: 2 prefill and 2 decode engines behind the proxy, many requests in flight, "
         "clients that cancel, a prefill engine killed and restarted and a link dropped mid-run; every answer, "
         "every loaded byte, the engines' KV usage and memory judged", "docs/serving.md"),
        ("serve-matrix", "serve-check over every tiny model, TP pair and block-size pair, both connectors side by "
         "side", "docs/serving.md"),
        ("capture", "start real vLLM engines (one per TP size) that write the KV cache geometry they built; write a "
         "scenario per P/D pair of them that the rehearsal replays and checks", "docs/scenarios.md"),
    ],
    "measure (timings: ratios within one run)": [
        ("bench", "nixlkv against vLLM 0.33's own planner: planning time, descriptors, NIXL GB/s beside a memcpy",
         "docs/performance.md"),
        ("bench-handshake", "the longest decode-engine step while it handshakes a new prefill engine, against the "
         "NIXL work the handshake does (fabricated engines, real NIXL)", "docs/performance.md"),
        ("bench-settings", "NIXL progress threads and telemetry (nixlkv's defaults vs vLLM's) measured on the "
         "connector's READ path (fabricated engines, real NIXL)", "docs/configuration.md"),
        ("serve-bench", "serving performance, nixlkv vs vLLM's NixlConnector in one run with the same NIXL agent "
         "settings: TTFT through the proxy, D's transfer time against a raw NIXL READ's ceiling, throughput under "
         "a concurrent load (ratios), per prompt length", "docs/performance.md"),
        ("serve-bench-plot", "a PNG of serve-bench's JSON: D's transfer time and TTFT against prompt length, both "
         "connectors (needs matplotlib: the project's venv)", "docs/performance.md"),
    ],
}
COMMAND_DOCS = {name: (summary, page) for group in COMMANDS.values() for name, summary, page in group}


def _short(summary: str) -> str:
    for stop in (":", ";", ", against", " ("):
        summary = summary.split(stop)[0]
    return summary


def _overview() -> str:
    lines = ["KV-cache transfer plans for vLLM prefill/decode serving over NIXL. Start at README.md; "
             "deploying with vLLM: docs/deploying.md.", ""]
    for group, cmds in COMMANDS.items():
        lines.append(f"{group}:")
        for name, summary, page in cmds:
            lines.append(f"  {name:<16} {_short(summary)} ({page})")
        lines.append("")
    lines.append("`nixlkv COMMAND --help` for a command's options.")
    return "\n".join(lines)


def _command(sub: Any, name: str) -> argparse.ArgumentParser:
    summary, page = COMMAND_DOCS[name]
    # no help= on purpose: the overview above lists the commands grouped, argparse's own list would not
    return sub.add_parser(name, description=f"{summary}. Explained in {page}.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nixlkv", description=_overview(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _command(sub, "strategies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_strategies)
    p = _command(sub, "explain")
    p.add_argument("--scenario", help="scenario file (YAML or JSON); default: the built-in one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)
    p = _command(sub, "rehearse")
    p.add_argument("--scenario", help="scenario file (YAML or JSON); default: the built-in one")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")
    p.add_argument("--plans", action="store_true", help="include the full plans in the --json output (needs --json)")
    p.add_argument("--baseline", choices=["vllm"], help="let vLLM 0.33's own NixlConnector move the bytes instead")
    p.add_argument("--timeout", type=float, default=90.0, help="--baseline: seconds before the run counts as a hang")
    p.add_argument("--descriptor-mode", choices=("auto", "direct", "staged"), default="auto",
                   help="how READs are posted: the plan's descriptors, whole pages through a staging buffer, "
                        "or chosen per request (default)")
    p.set_defaults(func=cmd_rehearse)
    p = _command(sub, "compare")
    p.add_argument("--scenarios", required=True, help="directory of scenario files (YAML or JSON)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the Markdown table")
    p.add_argument("--markdown", metavar="PATH", help="also write the Markdown table to PATH")
    p.add_argument("--json-out", metavar="PATH", help="also write the JSON (summary and rows) to PATH; nothing else "
                   "writes there, unlike stdout")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per vLLM scenario before it counts as a hang")
    p.set_defaults(func=cmd_compare)
    p = _command(sub, "bench")
    p.add_argument("--quick", action="store_true", help="Llama-8B-like subset (under ~3 minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object (headline keys first)")
    p.add_argument("--no-transfer", action="store_true", help="planning only: no NIXL transfers, no memcpy")
    p.add_argument("--transfer-reps", type=int, help="repetitions per real transfer (default 5 quick, 9 full)")
    p.add_argument("--progress-delay-us", type=int, default=1000,
                   help="pause of every NIXL agent's progress thread between polls, in the real transfers "
                        "(default 1000; 0: NIXL's busy poll, a core per agent)")
    p.add_argument("--nixl-threads", type=int, default=4,
                   help="the decode agent's NIXL num_threads in the real transfers (default 4, vLLM's own; 0: NIXL's "
                        "default, every READ posted by the calling thread)")
    p.add_argument("--shape", help="planning cases of this shape only (e.g. nemotron-h-8b-like); headline keys may be absent")
    p.add_argument("--markdown", metavar="PATH", help="also write the result tables as Markdown")
    p.add_argument("--plot", metavar="PATH", help="also write a PNG of planning time and descriptors vs prompt length")
    p.set_defaults(func=cmd_bench)
    p = _command(sub, "bench-handshake")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--p-tp", type=int, default=2)
    p.add_argument("--d-tp", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="handshakes measured (a fresh decode engine each)")
    p.add_argument("--whole", action="store_true",
                   help="the whole first handshake as D feels it (first request to loaded, less a later "
                   "request), nixlkv against vLLM's NixlConnector in one run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_handshake)
    p = _command(sub, "bench-settings")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--p-tp", type=int, default=1)
    p.add_argument("--d-tp", type=int, default=1)
    p.add_argument("--blocks", type=int, default=48, help="blocks per request")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--progress-delay-us", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_settings)
    p = _command(sub, "serve-check")
    p.add_argument("--model", default="tiny-llama", help="a tiny model recipe (nixlkv.serving.models.RECIPES)")
    p.add_argument("--connector", action="append", choices=("nixlkv", "vllm", "vllm-push"),
                   help="nixlkv's NixlkvConnector, vLLM's NixlConnector or vLLM's NixlPushConnector (repeatable; "
                        "default nixlkv; nixlkv's push mode: --connector-config transfer_mode=push)")
    p.add_argument("--p-tp", type=int, default=1)
    p.add_argument("--d-tp", type=int, default=1)
    p.add_argument("--p-block", type=int, help="P's --block-size (default: the model's)")
    p.add_argument("--d-block", type=int, help="D's --block-size (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rule", choices=("exact", "drift"), help="how answers are judged (default: exact at equal TP)")
    p.add_argument("--quick", action="store_true", help="fewer prompts (the CI smoke case)")
    p.add_argument("--prefills", type=int, default=1,
                   help="prefill engines behind the proxy, taken in turn (D plans each after the first by rebasing)")
    p.add_argument("--decodes", type=int, default=1,
                   help="decode engines behind the proxy, taken in turn (P serves each one's reads)")
    p.add_argument("--no-negative-control", action="store_true")
    p.add_argument("--prefix-caching", action="store_true",
                   help="both engines cache prefixes (vLLM's default): adds prompts whose prefix D already holds")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="both engines' --kv-cache-dtype (e.g. fp8: one byte per KV element; default auto)")
    p.add_argument("--prefill-arg", action="append", metavar="ARG",
                   help="a further `vllm serve` argument for the prefill engine(s), repeatable "
                   "(e.g. --prefill-arg=--max-num-batched-tokens=64)")
    p.add_argument("--decode-arg", action="append", metavar="ARG",
                   help="a further `vllm serve` argument for the decode engine(s), repeatable")
    p.add_argument("--kv-both", action="store_true",
                   help="start every engine with kv_role kv_both, as vLLM's own P/D test does (each request's "
                   "kv_transfer_params decide whether an engine prefills for a remote decode or loads)")
    p.add_argument("--no-verify-bytes", dest="verify_bytes", action="store_false",
                   help="skip the byte check (on by default: the engines dump every request's blocks, D's loaded "
                   "KV is judged per token and head against P's, and graded controls damaged on D must be "
                   "rejected; nixlkv's connector only)")
    p.add_argument("--verify-bytes", dest="verify_bytes", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--connector-config", action="append", metavar="KEY=VALUE",
                   help="a kv_connector_extra_config entry for every engine, repeatable (e.g. "
                   "--connector-config descriptor_mode=staged; VALUE is read as JSON where it is JSON)")
    p.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                   help="netns: P, D and the proxy each on a host of its own (a network namespace the check makes "
                   "and removes; root), NIXL over TCP between them (docs/serving.md, separate hosts)")
    _serving_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_check)
    p = _command(sub, "serve-drill")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--connector", action="append", choices=("nixlkv", "vllm", "vllm-push"), help="default: nixlkv")
    p.add_argument("--policy", action="append", choices=("recompute", "fail"),
                   help="D's kv_load_failure_policy (repeatable; default both)")
    p.add_argument("--no-verify-bytes", dest="verify_bytes", action="store_false",
                   help="skip the byte check (on by default: the engines dump every request's blocks; after the "
                   "drills every load that completed is judged per token and head against P's; nixlkv only)")
    p.add_argument("--verify-bytes", dest="verify_bytes", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--connector-config", action="append", metavar="KEY=VALUE",
                   help="a kv_connector_extra_config entry for every engine, repeatable (e.g. "
                   "--connector-config descriptor_mode=staged)")
    p.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                   help="netns: the drills across separate hosts instead (network namespaces the drill makes; root): "
                   "P advertising a loopback side channel, a closed side-channel port, P unreachable mid-request, a "
                   "link dropped for seconds (docs/serving.md, failure drills)")
    _serving_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_drill)
    p = _command(sub, "serve-soak")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--connector", action="append", choices=("nixlkv", "vllm"),
                   help="repeatable; one soak each, in turn (default nixlkv)")
    p.add_argument("--requests", type=int, default=1000, help="requests the loop sends (default 1000)")
    p.add_argument("--in-flight", type=int, default=16, help="requests at once (default 16)")
    p.add_argument("--deadline", type=float, default=3600.0,
                   help="seconds after which the loop sends nothing more and the soak reports how far it got")
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="a request with no answer within this many seconds hung (the soak then fails)")
    p.add_argument("--hosts", choices=("loopback", "netns"), default="netns",
                   help="netns (default): every engine and the proxy on a host of its own (root); loopback: no "
                   "link to drop")
    p.add_argument("--drop-link", default="prefill1", metavar="HOST",
                   help="the host whose link goes down mid-run (prefill0, prefill1, decode0, decode1, proxy)")
    p.add_argument("--link-down", type=float, default=8.0, help="seconds the link stays down")
    p.add_argument("--policy", choices=("recompute", "fail"), default="recompute",
                   help="the decode engines' kv_load_failure_policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify-bytes", dest="verify_bytes", action="store_false",
                   help="skip the byte check (nixlkv only; on by default)")
    _serving_args(p)
    p.add_argument("--json-out", metavar="PATH", help="also write the reports as JSON to PATH (after each connector)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_soak)
    p = _command(sub, "serve-bench")
    p.add_argument("--model", action="append", help="tiny model(s) (default tiny-llama)")
    p.add_argument("--p-tp", type=int, action="append", help="P's TP size (repeatable: a row each; default 1)")
    p.add_argument("--d-tp", type=int, default=1)
    p.add_argument("--prompt-len", type=int, action="append",
                   help="prompt length in tokens (repeatable: every length on the same servers; default 512)")
    p.add_argument("--requests", type=int, default=10, help="sequential streamed requests per length (TTFT, transfer)")
    p.add_argument("--load-requests", type=int, default=24, help="requests of the concurrent load per length")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight during the load")
    p.add_argument("--load-len", type=int, action="append",
                   help="only these lengths get the load (repeatable; default every length)")
    p.add_argument("--no-load", dest="load_len", action="store_const", const=[], help="no load at any length")
    p.add_argument("--ceiling-reps", type=int, default=5, help="timed raw NIXL READs per length for the ceiling")
    p.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                   help="netns: P, D and the proxy each on a host of its own (as serve-check --hosts; root), NIXL "
                   "over TCP between them; the ceiling too, each agent on a host of its own")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    p.add_argument("--warm-each-length", action="store_true", help="an untimed request before each length's")
    p.add_argument("--push", action="store_true",
                   help="also measure push mode: nixlkv's transfer_mode push and vLLM's NixlPushConnector (TTFT "
                        "against pull, in the same run)")
    p.add_argument("--kv-cache-gib", type=int, default=None,
                   help="VLLM_CPU_KVCACHE_SPACE of every engine, GiB (default: the environment's, else 1)")
    p.add_argument("--progress-delay-us", type=int, default=0,
                   help="every NIXL agent's pause between progress polls, both connectors' and the ceiling's "
                   "(default 0: NIXL's busy poll, vLLM's own; 1000 on a machine with few cores, where each "
                   "busy-polling agent takes a core from the engines)")
    _serving_args(p)
    p.add_argument("--json-out", metavar="PATH", help="also write the rows as JSON to PATH (after each row)")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_bench)
    p = _command(sub, "serve-bench-plot")
    p.add_argument("json_in", metavar="JSON", help="what serve-bench --json-out wrote")
    p.add_argument("out", metavar="PNG")
    p.add_argument("--title", help="the figure's title (e.g. its date, commit and machine)")
    p.set_defaults(func=cmd_serve_bench_plot)
    p = _command(sub, "serve-matrix")
    p.add_argument("--model", action="append", help="only these models (repeatable)")
    p.add_argument("--shape", action="append", help="only this shape, exactly, e.g. 'P1->D1', 'P2->D1', "
                   "'P1->D1 b32/b64' (repeatable)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="no run: merge earlier --json-out files into one table")
    p.add_argument("--connector", action="append", choices=("nixlkv", "vllm"), help="default: both")
    p.add_argument("--quick", action="store_true", help="each case's quick prompt set (as serve-check --quick)")
    p.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                   help="netns: every cell with P, D and the proxy each on a host of its own (as serve-check --hosts)")
    _serving_args(p)
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--json-out", metavar="PATH")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_serve_matrix)
    p = _command(sub, "capture")
    p.add_argument("--model", action="append", help="tiny model(s) (default: every model of the serving matrix)")
    p.add_argument("--tp", type=int, action="append", help="TP sizes to capture (repeatable; default 1 and 2)")
    p.add_argument("--block-size", type=int, help="--block-size of the engines (default: the model's)")
    p.add_argument("--out", default="tests/scenarios", help="where the scenarios are written")
    _serving_args(p)
    p.set_defaults(func=cmd_capture)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "plans", False) and not args.json:
        parser.error("--plans needs --json")
    if getattr(args, "baseline", None) and args.plans:
        parser.error("--plans shows nixlkv's plans; vLLM's baseline has none to show")
    _quiet()
    if args.command.startswith("serve-"):
        # a stopped run stops the servers it started (their `with` blocks run on SystemExit)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from .core.errors import NixlkvError
    from .testing.scenario import ScenarioError

    try:
        return args.func(args)
    except (ScenarioError, NixlkvError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a serving case that cannot be run as asked (nixlkv.serving.check.Case)
        if not args.command.startswith("serve"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `nixlkv strategies | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
