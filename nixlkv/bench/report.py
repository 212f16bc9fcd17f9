"""The benchmark's result as Markdown tables and a PNG plot (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def markdown(out: dict[str, Any]) -> str:
    """Tables of one run: planning per case, then real transfers; every ratio is ours / vLLM."""
    lines = [
        f"Run: `{out.get('mode')}` mode, {out.get('runtime_s', 0):.0f} s, {out.get('machine', '')}.",
        "",
        "| case | plan µs p50 ours / vLLM (ratio) | ID floor / vLLM | plan µs p99 ours / vLLM | READs ours / vLLM "
        "| desc ids ours / vLLM | posted after merge ours / vLLM (ratio) | registered ours / vLLM | handshake ms ours / vLLM (ratio) "
        "| the layout's first handshake ms ours / vLLM (ratio) | other block counts ms ours (ratio) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out.get("cases", []):
        lines.append(
            f"| {r['label']} | {r['plan_us_ours_p50']:.0f} / {r['plan_us_vllm_p50']:.0f} ({r['plan_time_ratio']:.2f}) "
            f"| {'—' if r.get('plan_floor_ratio') is None else format(r['plan_floor_ratio'], '.2f')} "
            f"| {r['plan_us_ours_p99']:.0f} / {r['plan_us_vllm_p99']:.0f} | {r['reads_ours']} / {r['reads_vllm']} "
            f"| {r['descs_ids_ours']} / {r['descs_ids_vllm']} "
            f"| {r['descs_posted_ours']} / {r['descs_posted_vllm']} ({r['descs_ratio']:.3f}) "
            f"| {r['registered_ours']} / {r['registered_vllm']} "
            f"| {r['handshake_ms_ours']:.2f} / {r['handshake_ms_vllm']:.2f} ({r['handshake_ratio']:.2f}) "
            f"| {r['handshake_ms_first_ours']:.2f} / {r['handshake_ms_first_vllm']:.2f} ({r['handshake_first_ratio']:.2f}) "
            f"| {r['handshake_ms_other_blocks_ours']:.2f} ({r['handshake_other_blocks_ratio']:.2f}) |"
        )
    if out.get("transfers"):
        lines += [
            "",
            "| transfer (decode rank 0) | layers | MB | memcpy GB/s | nixlkv GB/s (vs memcpy) | vLLM-style GB/s (vs memcpy) "
            "| one descriptor per rank GB/s (vs memcpy) | vs that ceiling: auto (mode) / direct / staged / vLLM-style "
            "| posted ours: NIXL / computed | posted vLLM: NIXL / computed | two passes (READ + copy at once) vs ceiling "
            "| direct µs per descriptor beyond the ceiling (for 90% of it) | reps |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in out["transfers"]:
            lines.append(
                f"| {t['label']} | {t['layers']} of {t['model_layers']} | {t['bytes'] / 1e6:.0f} | {t['memcpy_gbps']:.2f} "
                f"| {t['ours_gbps']:.2f} ({t['ours_vs_memcpy']:.2f}) | {t['vllm_gbps']:.2f} ({t['vllm_vs_memcpy']:.2f}) "
                f"| {t['ceiling_gbps']:.2f} ({t['ceiling_vs_memcpy']:.2f}) "
                f"| {t['ours_vs_ceiling']:.2f} ({t['descriptor_mode']}) / {t['ours_direct_vs_ceiling']:.2f} "
                f"/ {t['ours_staged_vs_ceiling']:.2f} / {t['vllm_vs_ceiling']:.2f} "
                f"| {t['descs_posted_ours_nixl']} / {t['descs_posted_ours_computed']} "
                f"| {t['descs_posted_vllm_nixl']} / {t['descs_posted_vllm_computed']} | {t['two_pass_vs_ceiling']:.2f} "
                f"| {t['direct_extra_us_per_descriptor']:.2f} ({t['direct_us_per_descriptor_for_90pct']:.2f}) | {t['reps']} |"
            )
    if out.get("not_measured"):
        lines += ["", "Not measured:"]
        lines += [f"- {k}: {v}" for k, v in out["not_measured"].items()]
    return "\n".join(lines) + "\n"


def plot(out: dict[str, Any], path: str | Path) -> Path:
    """Planning time (p50) and descriptors posted vs prompt length, ours vs vLLM, one line per
    (shape, TP pair) with contiguous block ids."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = {}
    for r in out.get("cases", []):
        if r["pattern"] == "contiguous":
            series.setdefault(f"{r['shape']} P{r['p_tp']}->D{r['d_tp']}", []).append(r)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 6))
    for i, (name, rows) in enumerate(sorted(series.items())):
        rows = sorted(rows, key=lambda r: r["tokens"])
        if len(rows) < 2:
            continue
        x = [r["tokens"] for r in rows]
        color = f"C{i % 10}"
        a1.plot(x, [r["plan_us_ours_p50"] for r in rows], "-o", color=color, label=f"{name} nixlkv")
        a1.plot(x, [r["plan_us_vllm_p50"] for r in rows], "--x", color=color, label=f"{name} vLLM")
        a2.plot(x, [r["descs_posted_ours"] for r in rows], "-o", color=color, label=f"{name} nixlkv")
        a2.plot(x, [r["descs_posted_vllm"] for r in rows], "--x", color=color, label=f"{name} vLLM")
    for ax, title in ((a1, "per-request planning time, p50 (µs)"), (a2, "descriptors posted per request (after NIXL merge)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = a2.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"nixlkv (solid) vs vLLM 0.33 planner (dashed), decode rank 0, contiguous block ids ({out.get('mode')} run)")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
