"""nixlkv against vLLM 0.33's own NixlConnector, scenario by scenario: one table.

Each row runs nixlkv's rehearsal and the vLLM baseline (``vllm_baseline.run_baseline``) on the
same scenario file; the table says what each did, how long it took and how many descriptors it
posted. Rendering is kept apart from the harness so the harness stays the one vLLM-specific module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .scenario import ScenarioError, load

SUFFIXES = (".yaml", ".yml", ".json")


def scenario_files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise ScenarioError(f"--scenarios {d}: not a directory of scenario files")
    files = sorted(p for p in d.iterdir() if p.suffix in SUFFIXES)
    if not files:
        raise ScenarioError(f"--scenarios {d}: no {'/'.join(SUFFIXES)} files in it")
    return files


def compare(files: Sequence[Path], timeout: float, requests: int = 4,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per scenario file, in order."""
    from .vllm_baseline import check_vllm_version, compare_scenario

    check_vllm_version()
    rows = []
    for i, path in enumerate(files):
        try:
            scenario = load(path)
        except ScenarioError as exc:
            rows.append({"scenario": path.stem, "error": str(exc)})
            continue
        row = compare_scenario(scenario, timeout=timeout, requests=requests)
        rows.append(row)
        if progress is not None:
            progress(f"{i + 1}/{len(files)} {row['scenario']}: nixlkv {row['nixlkv']['outcome']}, "
                     f"vLLM {row['vllm']['outcome']}")
    return rows


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table, then every disagreement with the oracle's first mismatch or vLLM's message."""
    head = ("| scenario | pairing | expect | nixlkv | vLLM | agree | nixlkv ms | nixlkv desc | vLLM 1st ms | "
            "vLLM steady ms | vLLM desc | vLLM set-up |")
    lines = [head, "|" + "|".join("---" for _ in range(12)) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | | | scenario error: {_cell(r['error'])} | | | | | | | | |")
            continue
        n, v = r["nixlkv"], r["vllm"]
        agree = {True: "yes", False: "**no**", None: "n/a"}[r["agree"]]
        lines.append(
            f"| {r['scenario']} | {r['pairing']} | {r['expect']} | {n['outcome']} | {v['outcome']} | {agree} | "
            f"{_ms(n['transfer_s'])} | {n['descriptors'] or ''} | {_ms(v['first_request_s'])} | "
            f"{_ms(v['steady_state_s'])} | {v['descriptors'] or ''} | {_cell('; '.join(v['notes']))} |"
        )
    out = ["\n".join(lines), ""]
    details = [r for r in rows if "error" not in r and (r["agree"] is False or r["vllm"]["outcome"] != "byte-exact")]
    if details:
        out.append("### Where vLLM did not move the bytes byte-exact\n")
        for r in details:
            v = r["vllm"]
            out.append(f"- **{r['scenario']}** ({r['pairing']}), vLLM {v['outcome']}: {_cell(v['message'], 600)}"
                       + (f" — nixlkv: {r['nixlkv']['outcome']}" if r["agree"] is False else ""))
        out.append("")
    return "\n".join(out)


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        key = "scenario error" if "error" in r else f"vllm {r['vllm']['outcome']}"
        counts[key] = counts.get(key, 0) + 1
    counts["disagreements"] = sum(1 for r in rows if r.get("agree") is False)
    return counts
