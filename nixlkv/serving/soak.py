"""``nixlkv serve-soak``: a bounded soak of real P/D serving, with failures injected mid-run.

Two prefill and two decode engines behind the proxy (by default each on a host of its own,
:mod:`nixlkv.serving.netns`), and a client that keeps ``in_flight`` requests going until it has
sent ``requests`` of them or the soak's deadline passes. The prompts are a small pool of lengths
either side of block edges (each one's reference computed once, on each decode engine alone,
before the loop), asked for 4 to 16 tokens, whole or streamed; every ``cancel_every``-th request
is streamed and closed by its client at one of several moments (P still prefilling, D loading or
decoding). Mid-run, P0 is killed (SIGKILL to its process group) and restarted on its address (the
client waits for it at ``resume_at`` so that the new P serves part of the run), and one host's
link is dropped for ``link_down_s`` seconds and restored.

What must hold, else the soak fails (:meth:`SoakReport.faults`):

* every request answered as D alone would (the exact rule, or, batched with the others, the
  drift rule against D alone teacher-forced on the answer: :mod:`nixlkv.serving.compare`), failed
  cleanly (an HTTP error status), or was cancelled by its client; none hung (no answer within
  ``request_timeout_s``) and none broke (a connection reset or a malformed answer);
* with nixlkv, every load D made judged byte for byte against P's (D's dumps,
  :func:`nixlkv.serving.bytecheck.judge_dir`), and every answered request of more than one
  token has a judged load or a failed one (then D recomputed it);
* at the end, every engine's ``vllm:kv_cache_usage_perc`` settles to 0, and each engine's memory
  (the RSS of all its processes) is within ``memory_tolerance`` of what it was after warm-up
  (the restarted P: after ``warmup`` requests served since it came back);
* the failures did happen (P killed and back, the link down and up, clients that cancelled),
  or the soak tested nothing.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import models
from .bytecheck import judge_dir, read_notes
from .check import FIRST_ID, Case, Options, Servers, format_bytes
from .client import Completion, CompletionError, complete, forced, request_body, settled_kv_usage
from .compare import judge
from .drills import hang_up
from .launch import Process, ServeError

ANSWERED = ("exact", "drift")  # answered as D alone would (exactly, or within the drift rule when batched)
STATUSES = (*ANSWERED, "wrong", "failed", "cancelled", "hung", "broken")
MAX_TOKENS = (4, 8, 16)  # what a request asks for; references are taken at the largest
CANCEL_AFTER_S = tuple(np.geomspace(0.005, 10.0, 8).round(3).tolist())  # a cancelling client's moments (10 s: into D's answer under load)
REQUEST_ID = "soak-{:05d}"  # each request's X-Request-Id: its loads in D's dumps are found by it
_ID_IN = re.compile(r"soak-(\d{5})")
PAGE = os.sysconf("SC_PAGE_SIZE")
# where a cancelling client closed its connection (drills.hang_up): before the answer began, during
# it, or after the whole answer had come (too late: nothing was cancelled)
CANCELLED_AT = {"before": "before the answer began", "during": "during the answer", "whole": "after the whole answer"}


@dataclass(frozen=True)
class SoakPlan:
    """How long the soak runs and what it does to the engines."""

    requests: int = 1000
    in_flight: int = 16
    deadline_s: float = 3600.0  # the loop issues nothing after this; the soak then reports how far it got
    request_timeout_s: float = 180.0  # no answer (no byte) within this: the request hung
    cancel_every: int = 8  # every n-th request is cancelled by its client
    kill_at: float = 0.2  # P0 killed when this share of the requests has been issued...
    resume_at: float = 0.4  # ...and the client waits here for it to be back
    link_at: float = 0.6  # the link of ``link_host`` dropped here...
    link_down_s: float = 8.0  # ...for this long
    link_host: str = "prefill1"
    warmup: int = 24  # requests through the proxy before the memory baseline (and after P's restart)
    lease_s: float = 30.0  # P's lease (nixlkv lease_s, vLLM kv_lease_duration): blocks no decode reads go then
    policy: str = "recompute"  # D's kv_load_failure_policy
    memory_tolerance: float = 0.10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "in_flight", "cancel_every", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"soak {name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.kill_at < self.resume_at < self.link_at < 1:
            raise ValueError(f"soak moments must satisfy 0 < kill_at < resume_at < link_at < 1, got "
                             f"{self.kill_at}, {self.resume_at}, {self.link_at}")
        if self.policy not in ("recompute", "fail"):
            raise ValueError(f"soak policy must be recompute or fail, got {self.policy!r}")
        for name in ("deadline_s", "request_timeout_s", "link_down_s", "lease_s", "memory_tolerance"):
            if getattr(self, name) <= 0:
                raise ValueError(f"soak {name} must be positive, got {getattr(self, name)}")


@dataclass
class Outcome:
    """One request of the loop: what was asked and what came of it (``status``: one of STATUSES)."""

    index: int
    prompt: int  # index into the prompt pool
    prompt_len: int
    max_tokens: int
    mode: str  # whole | stream | cancel
    start_s: float  # since the loop began
    seconds: float = 0.0
    status: str = ""
    detail: str = ""  # the error, the wrong answer's reason, or where a cancelled client got
    cancelled_at: str = ""  # a cancelled request: where its client closed (CANCELLED_AT)
    answer: Completion | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Event:
    """A failure the soak injected (or its end), when, and what came of it."""

    name: str
    at_s: float  # since the loop began
    issued: int  # requests issued by then
    detail: str = ""


@dataclass(frozen=True)
class Memory:
    """One engine's memory: the RSS of all its processes after warm-up, at the end and at its peak."""

    warm: int | None  # None: never warmed up (a restarted engine that served too few requests)
    end: int
    peak: int

    def growth(self) -> float | None:
        return None if not self.warm else self.end / self.warm - 1.0


@dataclass
class SoakReport:
    label: str
    connector: str
    hosts: str
    plan: dict[str, Any]
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    kv_usage_end: dict[str, float] = field(default_factory=dict)
    memory: dict[str, Memory] = field(default_factory=dict)
    bytes: dict[str, Any] | None = None  # nixlkv: judge_dir's summary; None: not checked (and why in notes)
    unchecked: list[int] = field(default_factory=list)  # answered requests with neither a judged nor a failed load
    references_agree: bool | None = None  # every decode engine alone answers every pool prompt alike
    wall_s: float = 0.0  # the loop, first request to last answer
    total_s: float = 0.0  # start-up to the end, engines stopped and bytes judged
    startup_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def counts(self) -> dict[str, int]:
        return {s: sum(o.status == s for o in self.outcomes) for s in STATUSES}

    def faults(self) -> list[str]:
        """Everything that fails the soak, each in words; empty: it passed."""
        if self.error is not None:
            return [f"the soak could not run: {self.error}"]
        out: list[str] = []
        counts = self.counts()
        for status, why in (("hung", "hung (no answer within the per-request bound)"),
                            ("broken", "broke (a reset connection or a malformed answer, not an error status)"),
                            ("wrong", "answered otherwise than D alone")):
            if counts[status]:
                shown = [f"#{o.index} {o.detail}" for o in self.outcomes if o.status == status][:3]
                out.append(f"{counts[status]} request(s) {why}: {'; '.join(shown)}")
        if not sum(counts[s] for s in ANSWERED):
            out.append("no request was answered: the soak tested nothing")
        if not any(o.cancelled_at in ("before", "during") for o in self.outcomes):
            out.append("no client closed its request before the answer ended: the soak tested no cancellation")
        unjudged = [o.index for o in self.outcomes if not o.status]
        if unjudged:
            out.append(f"{len(unjudged)} request(s) never judged: {unjudged[:5]}")
        held = {name: u for name, u in self.kv_usage_end.items() if not u == 0}  # NaN counts as held
        if held:
            out.append(f"KV blocks still held at the end: {held}")
        if not self.kv_usage_end:
            out.append("no engine's KV usage was read at the end")
        for name, mem in self.memory.items():
            growth = mem.growth()
            if growth is None:
                out.append(f"{name}'s memory was never measured after warm-up")
            elif abs(growth) > self.plan["memory_tolerance"]:
                out.append(f"{name}'s memory moved {growth:+.1%} from after warm-up ({mem.warm / 2**20:.0f} MiB) to "
                           f"the end ({mem.end / 2**20:.0f} MiB): beyond {self.plan['memory_tolerance']:.0%}")
        if not self.memory:
            out.append("no engine's memory was measured")
        if self.bytes is not None and not self.bytes.get("ok"):
            out.append("bytes D loaded differ from P's: " + format_bytes(self.bytes))
        if self.unchecked:
            out.append(f"{len(self.unchecked)} answered request(s) with no load judged and none failed (bytes not "
                       f"checked): {self.unchecked[:5]}")
        seen = {e.name for e in self.events}
        wanted = ["P0 killed", "P0 back"] + (["link down", "link up"] if self.hosts == "netns" else [])
        missing = [name for name in wanted if name not in seen]
        if missing:
            out.append(f"the soak did not inject {missing}: it tested less than it says")
        return out

    @property
    def ok(self) -> bool:
        return not self.faults()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for o in out["outcomes"]:
            o.pop("answer", None)
        out["counts"] = self.counts()
        out["faults"] = self.faults()
        out["ok"] = not out["faults"]
        out["memory"] = {k: {**asdict(m), "growth": m.growth()} for k, m in self.memory.items()}
        return out


def prompt_lengths(block: int, room: int) -> list[int]:
    """Prompt lengths either side of block edges, up to as long as the engine takes with room for
    the answer: one token (D computes it whole), a block less one, one, one more, two blocks
    either side, and several blocks with a partial last one."""
    lengths = [1, block - 1, block, block + 1, 2 * block - 1, 2 * block, 2 * block + 1, 3 * block + 5,
               5 * block + 17, 8 * block + 5, 16 * block - 1, room]
    return sorted({n for n in lengths if 1 <= n <= room})


def prompt_pool(case: Case, seed: int) -> list[list[int]]:
    rec = models.recipe(case.model)
    block = max(case.p_block or rec.block_size, case.d_block or rec.block_size)
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist()
            for n in prompt_lengths(block, rec.max_model_len - max(MAX_TOKENS))]


@dataclass(frozen=True)
class Ask:
    """What request ``index`` asks: a pool prompt, an answer length, whole, streamed or cancelled."""

    index: int
    prompt: int
    max_tokens: int
    mode: str
    cancel_after_s: float = 0.0


def schedule(plan: SoakPlan, pool_size: int) -> list[Ask]:
    """Every request of the soak, drawn from ``plan.seed``: each prompt and answer length as often
    as the others, every ``cancel_every``-th request cancelled, a cancelling client's moment taken
    in turn from CANCEL_AFTER_S."""
    rng = np.random.default_rng(plan.seed + 1)
    asks = []
    for i in range(plan.requests):
        cancel = i % plan.cancel_every == plan.cancel_every - 1
        mode = "cancel" if cancel else ("stream" if rng.random() < 0.5 else "whole")
        after = CANCEL_AFTER_S[(i // plan.cancel_every) % len(CANCEL_AFTER_S)] if cancel else 0.0
        asks.append(Ask(i, int(rng.integers(pool_size)), int(MAX_TOKENS[rng.integers(len(MAX_TOKENS))]), mode, after))
    return asks


def failure_status(exc: BaseException) -> str:
    """A request's failure, classified: ``failed`` (the server answered an error status: a clean
    failure), ``hung`` (no answer, no byte, within the bound) or ``broken`` (anything else: a reset
    connection, a cut or malformed answer)."""
    if isinstance(exc, CompletionError):
        return "failed"
    if isinstance(exc, TimeoutError) or (isinstance(exc, urllib.error.URLError)
                                         and isinstance(exc.reason, TimeoutError)):
        return "hung"
    return "broken"


def truncated(ref: Completion, n: int) -> Completion:
    """D alone's answer to its first ``n`` tokens: a greedy answer of ``n`` tokens is that prefix."""
    return Completion(ref.token_ids[:n], ref.logprobs[:n], ref.top[:n], ref.total_s)


def answer_status(refs: list[Completion], got: Completion,
                  forced_on: Callable[[list[int]], Completion | None]) -> tuple[str, str]:
    """``exact`` if ``got`` equals some decode engine's own answer by the exact rule; else ``drift``
    if it passes the drift rule against the first engine's (past a parting, against it teacher-forced
    on the answer: ``forced_on(tokens)``); else ``wrong``, with the reason."""
    n = len(got.token_ids)
    mine = [truncated(r, n) for r in refs]
    if any(judge(r, got, "exact").ok for r in mine):
        return "exact", ""
    ref = mine[0]
    on_path = forced_on(list(got.token_ids)) if list(ref.token_ids) != list(got.token_ids) and n == len(ref.token_ids) else None
    v = judge(ref, got, "drift", None, on_path)
    return ("drift", "") if v.ok else ("wrong", v.reason)


def group_rss(pgid: int) -> int:
    """Bytes resident in every process of process group ``pgid`` (an engine: its API server, engine
    core and workers), from /proc."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # field 5 (pgrp); field 24 (rss, pages) is fields[21]
            total += int(fields[21]) * PAGE
    return total


def engines(srv: Servers) -> dict[str, tuple[str, Process | None]]:
    """Every engine of ``srv`` by name (prefill0.., decode0..): its URL and its current process."""
    procs = {"prefill": [srv.p, *srv.more_p], "decode": [srv.d, *srv.more_d]}
    urls = {"prefill": srv.p_urls, "decode": srv.d_urls}
    return {f"{kind}{i}": (url, proc) for kind in ("prefill", "decode")
            for i, (url, proc) in enumerate(zip(urls[kind], procs[kind]))}


class _Sampler(threading.Thread):
    """Every engine's memory every ``every_s`` seconds, with its pid and the requests done by then."""

    def __init__(self, srv: Servers, done: Callable[[], int], every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.srv, self.done, self.every_s = srv, done, every_s
        self.samples: list[tuple[int, dict[str, tuple[int, int]]]] = []  # (requests done, {engine: (pid, rss)})
        self.stop = threading.Event()

    def sample(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, (_, proc) in engines(self.srv).items():
            if proc is not None and proc.proc is not None and proc.alive():
                out[name] = (proc.proc.pid, group_rss(proc.proc.pid))
        self.samples.append((self.done(), out))
        return out

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def first_after(self, name: str, pid: int, done: int) -> int | None:
        """The engine's RSS in the first sample of process ``pid`` taken once ``done`` requests were done."""
        for n, sample in self.samples:
            if n >= done and sample.get(name, (0, 0))[0] == pid:
                return sample[name][1]
        return None

    def peak(self, name: str, pid: int) -> int:
        return max((s[name][1] for _, s in self.samples if s.get(name, (0, 0))[0] == pid), default=0)


class Soak:
    """One soak over started servers: references, warm-up, the loop with its injected failures."""

    def __init__(self, srv: Servers, plan: SoakPlan, report: SoakReport,
                 progress: Callable[[str], None] = lambda m: None) -> None:
        self.srv, self.plan, self.report, self.progress = srv, plan, report, progress
        self.model = str(srv.model_dir)
        self.pool = prompt_pool(srv.case, plan.seed)
        self.asks = schedule(plan, len(self.pool))
        self.refs: list[list[Completion]] = []
        self.done = 0
        self.issued = 0  # requests the loop has sent so far
        self.t0 = 0.0
        self.restart: threading.Thread | None = None
        self.restart_error: BaseException | None = None
        self.link_timer: threading.Timer | None = None
        self.restarted_at_done: int | None = None  # requests done when the restarted P0 was back
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ before the loop
    def references(self) -> None:
        """Each pool prompt on each decode engine alone, one at a time (nothing else running)."""
        top = max(MAX_TOKENS)
        self.refs = [[complete(url, self.model, p, top) for url in self.srv.d_urls] for p in self.pool]
        self.report.references_agree = all(judge(rs[0], r, "exact").ok for rs in self.refs for r in rs[1:])

    def warm_up(self) -> None:
        """``warmup`` requests through the proxy, ``in_flight`` at once: every pool prompt on every pair."""
        prompts = [self.pool[i % len(self.pool)] for i in range(self.plan.warmup)]
        with ThreadPoolExecutor(self.plan.in_flight) as pool:
            list(pool.map(lambda p: complete(self.srv.proxy_url, self.model, p, max(MAX_TOKENS), timeout_s=600), prompts))

    # ------------------------------------------------------------------ the loop
    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _event(self, name: str, issued: int, detail: str = "") -> None:
        with self.lock:
            self.report.events.append(Event(name, round(self._now(), 1), issued, detail))
        self.progress(f"{name} at request {issued} ({self._now():.0f} s){': ' + detail if detail else ''}")

    def _one(self, ask: Ask) -> Outcome:
        prompt = self.pool[ask.prompt]
        out = Outcome(ask.index, ask.prompt, len(prompt), ask.max_tokens, ask.mode, round(self._now(), 3))
        t = time.monotonic()
        try:
            if ask.mode == "cancel":
                body = request_body(self.model, prompt, max(MAX_TOKENS), stream=True)
                out.cancelled_at = hang_up(self.srv.proxy_url, body, ask.cancel_after_s)
                out.status, out.detail = "cancelled", f"closed after {ask.cancel_after_s} s, {CANCELLED_AT[out.cancelled_at]}"
            else:
                out.answer = complete(self.srv.proxy_url, self.model, prompt, ask.max_tokens,
                                      stream=ask.mode == "stream", timeout_s=self.plan.request_timeout_s,
                                      headers={"X-Request-Id": REQUEST_ID.format(ask.index)})
        except Exception as exc:  # every failure is classified, none ends the loop
            out.status, out.detail = failure_status(exc), f"{type(exc).__name__}: {str(exc)[:300]}"
        out.seconds = round(time.monotonic() - t, 3)
        if out.answer is not None and out.seconds > self.plan.request_timeout_s:
            out.status, out.detail = "hung", f"answered after {out.seconds:.0f} s"
        with self.lock:
            self.done += 1
        return out

    def _inject(self, issued: int) -> None:
        """The failures due once ``issued`` requests have been issued."""
        n = self.plan.requests
        if issued == int(self.plan.kill_at * n) and self.restart is None:
            self.srv.kill_prefill()
            self._event("P0 killed", issued, "SIGKILL to its process group; restarting on the same address")

            def restart() -> None:
                try:
                    self.srv.restart_prefill()
                except BaseException as exc:  # raised at the resume gate
                    self.restart_error = exc

            self.restart = threading.Thread(target=restart, daemon=True)
            self.restart.start()
        if issued == int(self.plan.resume_at * n) and self.restart is not None:
            self.progress(f"waiting for P0 at request {issued}")
            self.restart.join(self.srv.opts.start_timeout_s + 30)
            if self.restart_error is not None or self.restart.is_alive():
                raise ServeError(f"P0 did not come back: {self.restart_error or 'still starting'}")
            ready = self.srv.p.ready_s if self.srv.p is not None else None
            self._event("P0 back", issued, f"ready {ready:.0f} s after its restart" if ready else "")
            self.restarted_at_done = self.done
        if issued == int(self.plan.link_at * n) and self.srv.network is not None and self.link_timer is None:
            self.srv.network.set_link(self.plan.link_host, False)
            self._event("link down", issued, f"{self.plan.link_host}'s interface down for {self.plan.link_down_s} s")
            self.link_timer = threading.Timer(self.plan.link_down_s, self._link_up)
            self.link_timer.start()

    def _link_up(self) -> None:
        if self.srv.network is not None:
            self.srv.network.set_link(self.plan.link_host, True)
        self._event("link up", self.issued, self.plan.link_host)

    def loop(self) -> None:
        plan, report = self.plan, self.report
        self.t0 = time.monotonic()
        deadline = self.t0 + plan.deadline_s
        running: dict[Future[Outcome], Ask] = {}
        pool = ThreadPoolExecutor(plan.in_flight)
        issued = 0
        step = max(1, plan.requests // 10)

        def collect(finished: set[Future[Outcome]]) -> None:
            for fut in finished:
                running.pop(fut)
                report.outcomes.append(fut.result())
        try:
            while issued < plan.requests and time.monotonic() < deadline:
                if len(running) >= plan.in_flight:
                    finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    collect(finished)
                    continue
                self._inject(issued)
                running[pool.submit(self._one, self.asks[issued])] = self.asks[issued]
                issued += 1
                self.issued = issued
                if issued % step == 0:
                    c = report.counts()
                    self.progress(f"{issued} issued, {self._now():.0f} s: " + ", ".join(f"{k} {v}" for k, v in c.items() if v))
            if issued < plan.requests:
                report.notes.append(f"the deadline ({plan.deadline_s:.0f} s) stopped the loop after {issued} of "
                                    f"{plan.requests} requests")
            finished, _ = wait(running, timeout=plan.request_timeout_s + 30)
            collect(finished)
            for fut, ask in list(running.items()):  # a thread past every socket bound: hung
                report.outcomes.append(Outcome(ask.index, ask.prompt, len(self.pool[ask.prompt]), ask.max_tokens, ask.mode,
                                               -1.0, status="hung", detail="no answer by the end of the loop"))
                running.pop(fut)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            if self.link_timer is not None:
                self.link_timer.join(plan.link_down_s + 5)
            report.wall_s = round(self._now(), 1)
            report.outcomes.sort(key=lambda o: o.index)
            self._event("loop ended", issued)

    # ------------------------------------------------------------------ after the loop
    def judge_answers(self) -> None:
        """Every answer against D alone (quiet now: the teacher-forced references are one at a time)."""
        d_url = self.srv.d_url
        cache: dict[tuple[int, tuple[int, ...]], Completion] = {}
        for o in self.report.outcomes:
            if o.answer is None or o.status:
                continue
            prompt = self.pool[o.prompt]

            def forced_on(tokens: list[int], o: Outcome = o, prompt: list[int] = prompt) -> Completion:
                key = (o.prompt, tuple(tokens))
                if key not in cache:
                    cache[key] = forced(d_url, self.model, prompt, tokens)
                return cache[key]

            try:
                o.status, o.detail = answer_status(self.refs[o.prompt], o.answer, forced_on)
            except (CompletionError, OSError) as exc:
                o.status, o.detail = "wrong", f"the teacher-forced reference failed: {exc}"


def attribute_loads(dump_dir: Path, verdict_loads: list[Any], outcomes: list[Outcome]) -> list[int]:
    """The answered requests of more than one token (D had KV to load) with neither a judged load
    nor a failed one in D's dumps, found by the request id the client sent (REQUEST_ID)."""
    judged = {int(m.group(1)) for v in verdict_loads if (m := _ID_IN.search(v.request))}
    _, failures = read_notes(dump_dir)
    failed = {int(m.group(1)) for n in failures if (m := _ID_IN.search(str(n.get("prefill_request_id", ""))))}
    return [o.index for o in outcomes
            if o.status in (*ANSWERED, "wrong") and o.prompt_len > 1 and o.index not in judged | failed]


LOST_WINDOW_S = 15.0  # how long before P0's kill a request may have ended with P0's copy not yet written


def lost_with_killed_p(missing: list[str], outcomes: list[Outcome], killed_at_s: float | None) -> list[str]:
    """The loads with no prefill dump that P0 took with it: P writes its copy of a request's blocks
    at one of its own later engine steps, not when D reads them (measured under the soak's load:
    six loads D made 7 to 10 s before P0's kill had no P copy yet), so a request that ended shortly
    before the kill, or was in flight at it, may have none; its answer is still judged.
    Only a load named by its request id alone (no P dump at all, not a rank missing) and of a
    request in that window is excused; every other missing dump fails the soak."""
    if killed_at_s is None:
        return []
    window = {o.index for o in outcomes
              if o.start_s <= killed_at_s and o.start_s + o.seconds >= killed_at_s - LOST_WINDOW_S}
    return [m for m in missing if " " not in m and (i := _ID_IN.search(m)) and int(i.group(1)) in window]


def run_soak(case: Case, opts: Options, plan: SoakPlan,
             progress: Callable[[str], None] = lambda m: None) -> SoakReport:
    if case.prefills < 2 or case.decodes < 1:
        raise ValueError("the soak kills one of at least two prefill engines: prefills must be at least 2")
    lease_key = "lease_s" if case.connector == "nixlkv" else "kv_lease_duration"
    report = SoakReport(case.label, case.connector, case.hosts, asdict(plan))
    if case.hosts != "netns":
        report.notes.append("loopback: no link to drop (the link event needs --hosts netns)")
    if plan.link_host not in ["proxy", *(f"prefill{i}" for i in range(case.prefills)),
                              *(f"decode{i}" for i in range(case.decodes))]:
        raise ValueError(f"soak link_host {plan.link_host!r} is not a host of the case (prefill0.., decode0.., proxy)")
    t_start = time.monotonic()
    srv = Servers(case, opts, p_extra={lease_key: plan.lease_s}, d_policy=plan.policy, tag="-soak")
    try:
        with srv:
            report.startup_s = {k: round(v, 1) for k, v in srv.start().items()}
            progress(f"servers ready {report.startup_s}; logs {srv.log_dir}")
            soak = Soak(srv, plan, report, progress)
            soak.references()
            soak.warm_up()
            sampler = _Sampler(srv, lambda: soak.done)
            warm = sampler.sample()
            sampler.start()
            try:
                soak.loop()
            finally:
                sampler.stop.set()
                sampler.join()
            settle_s = 2 * plan.lease_s + 60  # blocks no decode reads (a cancelled or cut request) go at the lease
            report.kv_usage_end = {name: settled_kv_usage(url, timeout_s=settle_s)
                                   for name, (url, _) in engines(srv).items()}
            end = sampler.sample()
            restarted = soak.restarted_at_done
            for name, (pid, rss) in end.items():
                if warm.get(name, (0, 0))[0] == pid:
                    base: int | None = warm[name][1]
                elif restarted is not None:  # the new P0: after as many requests since it came back
                    base = sampler.first_after(name, pid, restarted + plan.warmup)
                else:
                    base = None
                report.memory[name] = Memory(base, rss, max(sampler.peak(name, pid), rss))
            for name in engines(srv):
                if name not in end:
                    report.notes.append(f"{name} was not running at the end")
                    report.memory[name] = Memory(None, 0, 0)
            progress("judging the answers")
            soak.judge_answers()
        if srv.dump_dir is not None:  # every engine stopped: every dump written
            progress("judging the bytes")
            judge_bytes(report, srv.dump_dir)
        else:
            report.notes.append("bytes not checked: " + ("vLLM's connector writes no dumps" if case.connector != "nixlkv"
                                                         else "--no-verify-bytes"))
    except (ServeError, CompletionError, OSError) as exc:
        report.error = f"{type(exc).__name__}: {exc}"
    report.notes.append(f"logs: {srv.log_dir}")
    report.total_s = round(time.monotonic() - t_start, 1)
    return report


def judge_bytes(report: SoakReport, dump_dir: Path) -> None:
    """Every load in D's dumps judged against P's (:func:`judge_dir`, loads that failed listed), but
    those P0 took with it (:func:`lost_with_killed_p`: reported, not judged); and the answered
    requests none of whose loads was judged or failed (:func:`attribute_loads`)."""
    verdict = judge_dir(dump_dir, allow_failed=True)
    killed = next((e.at_s for e in report.events if e.name == "P0 killed"), None)
    lost = lost_with_killed_p(verdict.missing, report.outcomes, killed)
    verdict.missing = [m for m in verdict.missing if m not in lost]
    report.bytes = {**verdict.summary(), "lost_with_killed_p": lost}
    excused = {int(m.group(1)) for r in lost if (m := _ID_IN.search(r))}
    report.unchecked = [i for i in attribute_loads(dump_dir, verdict.loads, report.outcomes) if i not in excused]


def format_soak(report: SoakReport) -> str:
    faults = report.faults()
    c = report.counts()
    lines = [f"== soak: {report.label}  {'PASS' if not faults else 'FAIL'}",
             f"   {len(report.outcomes)} requests in {report.wall_s:.0f} s (total with start-up and judging "
             f"{report.total_s:.0f} s): " + ", ".join(f"{k} {v}" for k, v in c.items()),
             f"   references: every decode engine alone agrees: {report.references_agree}"]
    for e in report.events:
        lines.append(f"   {e.at_s:>7.1f} s  request {e.issued:>5}  {e.name}" + (f": {e.detail}" if e.detail else ""))
    cancelled = [o.cancelled_at for o in report.outcomes if o.status == "cancelled"]
    if cancelled:
        lines.append("   cancelled: " + ", ".join(f"{cancelled.count(k)} {w}" for k, w in CANCELLED_AT.items()))
    failed = [o for o in report.outcomes if o.status == "failed"]
    if failed:
        lines.append(f"   failed cleanly, e.g.: {failed[0].detail[:200]}")
    lines.append(f"   KV usage at the end: {report.kv_usage_end}")
    for name, m in report.memory.items():
        g = m.growth()
        lines.append(f"   {name} memory: after warm-up {m.warm / 2**20 if m.warm else float('nan'):.0f} MiB, end "
                     f"{m.end / 2**20:.0f} MiB, peak {m.peak / 2**20:.0f} MiB"
                     + (f" ({g:+.1%})" if g is not None else ""))
    if report.bytes is not None:
        lines.append("   " + format_bytes(report.bytes))
        if report.bytes.get("lost_with_killed_p"):
            lines.append(f"   not judged: {len(report.bytes['lost_with_killed_p'])} load(s) whose P copy P0 took with it "
                         f"(answered within {LOST_WINDOW_S:.0f} s of its kill; their answers are judged)")
    for note in report.notes:
        lines.append(f"   note: {note}")
    for f in faults:
        lines.append(f"   FAULT: {f}")
    return "\n".join(lines)


def to_json(reports: list[SoakReport]) -> str:
    return json.dumps([r.to_dict() for r in reports], indent=1, default=float)
