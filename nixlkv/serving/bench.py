"""``nixlkv serve-bench``: serving performance of NixlkvConnector against vLLM's NixlConnector,
measured in one run on the same model, prompts and machine; reported as ratios (nixlkv / vLLM).

Per connector: P, D and the proxy are started, warmed up, then
- **TTFT**: streamed requests one at a time through the proxy; time from sending to the first
  token the client receives (P's prefill + hand-over + D's load + D's first step);
- **D's transfer time** per request, from D's own connector metric (``*_xfer_time_seconds``);
- **throughput** under a concurrent load: a bounded number of requests at a fixed concurrency
  through the proxy, requests and generated tokens per second.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from . import models
from .check import FIRST_ID, Case, Options, Servers
from .client import complete, delta, scrape


def _prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    return [rng.integers(FIRST_ID, models.VOCAB_SIZE, size=length).tolist() for _ in range(n)]


def measure(case: Case, opts: Options, prompt_len: int, requests: int, load_requests: int,
            concurrency: int, max_tokens: int) -> dict[str, Any]:
    rng = np.random.default_rng(case.seed + 11)
    with Servers(case, opts, tag="-bench", references=False) as srv:
        srv.start()
        model = str(srv.model_dir)
        for p in _prompts(rng, 2, prompt_len):  # warm-up: first handshake, first forward passes
            complete(srv.proxy_url, model, p, max_tokens, stream=True)
        before = scrape(srv.d_url)
        ttft = []
        for p in _prompts(rng, requests, prompt_len):
            c = complete(srv.proxy_url, model, p, max_tokens, stream=True)
            ttft.append(c.ttft_s or float("nan"))
        d = delta(scrape(srv.d_url), before)
        prefix = "vllm:nixlkv_" if case.connector == "nixlkv" else "vllm:nixl_"
        n_xfer = d.get(f"{prefix}xfer_time_seconds_count", 0.0)
        xfer_ms = 1000 * d.get(f"{prefix}xfer_time_seconds_sum", 0.0) / n_xfer if n_xfer else float("nan")
        load = _prompts(rng, load_requests, prompt_len)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            done = list(pool.map(lambda p: complete(srv.proxy_url, model, p, max_tokens), load))
        wall = time.perf_counter() - t0
    return {
        "ttft_ms_median": 1000 * statistics.median(ttft), "ttft_ms": [round(1000 * t, 1) for t in ttft],
        "xfer_ms_per_request": xfer_ms, "transfers": n_xfer,
        "load_requests": load_requests, "concurrency": concurrency, "load_wall_s": wall,
        "requests_per_s": load_requests / wall, "tokens_per_s": sum(len(c.token_ids) for c in done) / wall,
    }


def run(case: Case, opts: Options, prompt_len: int = 512, requests: int = 10, load_requests: int = 24,
        concurrency: int = 4, max_tokens: int = 16) -> dict[str, Any]:
    out: dict[str, Any] = {"model": case.model, "shape": case.label.rsplit(" ", 1)[0], "prompt_len": prompt_len,
                           "max_tokens": max_tokens}
    for conn in ("nixlkv", "vllm"):
        out[conn] = measure(replace(case, connector=conn), opts, prompt_len, requests, load_requests, concurrency,
                            max_tokens)
    n, v = out["nixlkv"], out["vllm"]
    out["ratios"] = {  # nixlkv / vLLM: <= 1 is as fast or faster for times, >= 1 for rates
        "ttft": n["ttft_ms_median"] / v["ttft_ms_median"],
        "d_transfer_time": n["xfer_ms_per_request"] / v["xfer_ms_per_request"],
        "throughput_inverse": v["requests_per_s"] / n["requests_per_s"],
    }
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | P/D | prompt | TTFT median ms (nixlkv / vLLM) | ratio | D transfer ms/request | ratio | "
             "requests/s at concurrency | 1/ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n, v, q = r["nixlkv"], r["vllm"], r["ratios"]
        lines.append(
            f"| {r['model']} | {r['shape']} | {r['prompt_len']} | {n['ttft_ms_median']:.1f} / {v['ttft_ms_median']:.1f} | "
            f"{q['ttft']:.2f} | {n['xfer_ms_per_request']:.2f} / {v['xfer_ms_per_request']:.2f} | {q['d_transfer_time']:.2f} | "
            f"{n['requests_per_s']:.2f} / {v['requests_per_s']:.2f} (x{n['concurrency']}) | {q['throughput_inverse']:.2f} |")
    return "\n".join(lines) + "\n"
