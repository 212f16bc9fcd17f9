"""serve-bench's result as a PNG: D's transfer time (with the ceiling) and TTFT against prompt
length, both connectors, one colour per model and P/D shape. matplotlib lives in the project's
venv, not the serving one, so this reads the JSON ``serve-bench --json-out`` wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5.5))
    for i, r in enumerate(rows):
        lengths = [str(n) for n in r["plan"]["lengths"]]
        x = [int(n) for n in lengths]
        name = f"{r['model']} {r['shape'].split(' ', 1)[-1]}"
        color = f"C{i % 10}"
        for conn, style in (("nixlkv", "-o"), ("vllm", "--x")):
            per = r[conn]["lengths"]
            label = f"{name} {'nixlkv' if conn == 'nixlkv' else 'vLLM NixlConnector'}"
            a1.plot(x, [per[n]["xfer_ms_per_request"] for n in lengths], style, color=color, label=label)
            a2.plot(x, [per[n]["ttft_ms_median"] for n in lengths], style, color=color, label=label)
        ceil = [(int(n), r["ceiling"][n]["ms_p50"]) for n in lengths if r["ceiling"].get(n)]
        if ceil:
            a1.plot(*zip(*ceil), ":", color=color, alpha=0.6, label=f"{name} ceiling (raw NIXL READ)")
    for ax, what in ((a1, "D's transfer time per request (ms)"), (a2, "TTFT through the proxy, median (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(what)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = a1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title or "served transfers at Llama-3-8B's KV size: nixlkv (solid) vs vLLM's NixlConnector (dashed)")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
