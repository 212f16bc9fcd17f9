"""``nixlkv serve-drill``: failures in real serving, each judged by what the client sees and by what
the engines' own metrics say about their KV blocks.

1. **P killed while D waits for its KV**: a request prefilled on P, P killed (SIGKILL to its whole
   process group), then the request sent to D. Under ``kv_load_failure_policy=recompute`` D must
   answer it exactly as it would alone; under ``fail`` it must fail that request only. Either
   way D then serves the next request from a live P exactly, and holds no blocks afterwards.
2. **P restarted on the same port**: a request prefilled by the P that died must not be read from
   the new P (its block ids now hold other data): D fails or recomputes it, never decodes from
   it; requests prefilled by the new P decode exactly.
3. **Prefill done, decode never came**: P must free the request's blocks when its lease ends
   (``lease_s``; vLLM's connector: ``kv_lease_duration``), seen in P's ``kv_cache_usage_perc``.
4. **The same params sent twice**: a request decoded from P's KV, then sent to D again with the
   same ``kv_transfer_params``; P freed those blocks on the first read's notification, so the
   second must not read them: nixlkv computes it on D (no transfer), and it must answer right.
5. **D short of KV blocks**: D restarted with room for one longest request and a few blocks more;
   concurrent requests through the proxy then preempt each other on D after their loads. Every
   answer must pass the drift rule against D alone, D must have preempted (else the drill tested
   nothing), each request must have been read once (a preempted request recomputes, it never
   reads P's freed blocks again), and neither engine holds blocks afterwards.
6. **P started with another --kv-cache-dtype**: the handshake refuses P; the request is recomputed
   exactly (``recompute``) or fails (``fail``), D's log names the setting (nixlkv), D holds no
   blocks and P frees its blocks when the lease ends.
7. **Clients that hang up** (run before 5 and 6, with P and D as started): streamed requests through
   the proxy at once, each client closing its connection at another moment, from a few ms (P still
   prefilling) to well into D's answer (D waiting for, reading or decoding from P's KV). Wherever
   the abort lands, both engines must hold no blocks afterwards (P's freed by D's notification or at
   the lease), both must still serve, and a request through the proxy must answer as D alone.
8. **P short of KV blocks** (run before 5, P then restarted as it was): P restarted with room for
   two of six concurrent requests, each prefilled on P and sent to D a second after P answered (a
   slow decode leg, played by the drill itself rather than the proxy: P holds each answered prompt
   that long whatever the machine's speed, where D's prompt reads let a fast P hold one at a
   time); each holds its blocks for D's read, so P must wait for D's reads to free room before it
   prefills the next. Every answer must pass the drift rule
   against D alone, P must have filled (its usage seen near full, else the drill tested nothing),
   each request must have been read once, and neither engine holds blocks afterwards. With nixlkv,
   D must have handshaken the restarted P once, its plan recounted: the segments D had for P's
   layout, with the new block count (D's ``nixlkv_handshakes_*`` counters).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import models
from .bytecheck import judge_dir
from .check import (FIRST_ID, Case, Options, Servers, default_rule, forced_reference, format_bytes, prefill_on,
                    transfer_facts)
from .client import Completion, CompletionError, complete, delta, kv_usage, request_body, scrape, settled_kv_usage
from .compare import judge
from .launch import ServeError, host_port

LEASE_S = 4  # the drills' P lease: short, so that drill 3 ends in seconds
LEASE_WAIT_S = LEASE_S * 6 + 30  # how long P may take to free blocks its lease holds (steps are slow here)


@dataclass
class Drill:
    name: str
    ok: bool
    facts: dict[str, Any] = field(default_factory=dict)
    why: str = ""


def _still_held(srv: Servers, facts: dict[str, Any], p_timeout_s: float = 20.0) -> bool:
    """Whether P or D still holds KV blocks once their frees settle (each one's usage into ``facts``)."""
    facts["p_kv_usage_after"] = settled_kv_usage(srv.p_url, timeout_s=p_timeout_s)
    facts["d_kv_usage_after"] = settled_kv_usage(srv.d_url)
    return facts["p_kv_usage_after"] > 0 or facts["d_kv_usage_after"] > 0


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` token ids drawn from the tiny models' vocabulary (past the special ids)."""
    return rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist()


def run_drills(case: Case, opts: Options, policy: str = "recompute") -> list[Drill]:
    rule = default_rule(case)
    rec = models.recipe(case.model)
    lease_key = "lease_s" if case.connector == "nixlkv" else "kv_lease_duration"
    srv = Servers(case, opts, p_extra={lease_key: LEASE_S}, d_policy=policy, tag=f"-drill-{policy}")
    model = str(srv.model_dir)
    rng = np.random.default_rng(case.seed + 7)
    n = 3 * rec.block_size + 5
    drills: list[Drill] = []
    with srv:
        srv.start()
        # 1. P killed while D waits for the KV
        dead = random_prompt(rng, n)
        stale = random_prompt(rng, n)  # prefilled by the P that dies; decoded after its restart (drill 2)
        ref_dead = complete(srv.d_url, model, dead, case.max_tokens)
        params_dead = prefill_on(srv.p_url, model, dead)
        params_stale = prefill_on(srv.p_url, model, stale)  # D never sees these before drill 2
        srv.kill_prefill()
        facts: dict[str, Any] = {"policy": policy}
        try:
            got = complete(srv.d_url, model, dead, case.max_tokens, kv_transfer_params=params_dead, timeout_s=120)
            verdict = judge(ref_dead, got, rule)
            facts["answered"] = True
            facts["verdict"] = verdict.to_dict()
            ok = policy == "recompute" and verdict.ok
            why = "" if ok else f"policy {policy}: D answered ({verdict.reason})"
        except CompletionError as exc:
            facts["answered"], facts["status"] = False, exc.status
            ok = policy == "fail"
            why = "" if ok else f"policy {policy} but D failed the request: {exc}"
        facts["d_kv_usage_after"] = settled_kv_usage(srv.d_url)
        if facts["d_kv_usage_after"] > 0:
            ok, why = False, (why + "; " if why else "") + f"D still holds KV ({facts['d_kv_usage_after']:.4f})"
        drills.append(Drill("P killed while D waits for its KV", ok, facts, why))

        # 2. P restarted on the same port; the dead P's request and a new one
        facts = {"restart_s": round(srv.restart_prefill(), 1)}
        live = random_prompt(rng, n)
        ref_live = complete(srv.d_url, model, live, case.max_tokens)
        try:
            got_live = complete(srv.d_url, model, live, case.max_tokens, kv_transfer_params=prefill_on(srv.p_url, model, live))
            v_live = judge(ref_live, got_live, rule)
            facts["new_p_verdict"] = v_live.to_dict()
            ok, why = v_live.ok, "" if v_live.ok else f"request from the restarted P: {v_live.reason}"
        except CompletionError as exc:
            ok, why = False, f"request from the restarted P failed: {exc}"
        # the old P's params with another prompt of the same length: reading them would decode from
        # whatever the new P now holds at those block ids
        ref_stale = complete(srv.d_url, model, stale, case.max_tokens)
        try:
            got_stale = complete(srv.d_url, model, stale, case.max_tokens, kv_transfer_params=params_stale, timeout_s=120)
            v_stale = judge(ref_stale, got_stale, rule)
            facts["stale_verdict"] = v_stale.to_dict()
            if policy == "fail" or not v_stale.ok:
                ok, why = False, (why + "; " if why else "") + f"stale request answered under {policy}: {v_stale.reason}"
        except CompletionError as exc:
            facts["stale_status"] = exc.status
            if policy == "recompute":
                ok, why = False, (why + "; " if why else "") + f"stale request failed under recompute: {exc}"
        if _still_held(srv, facts):
            ok, why = False, (why + "; " if why else "") + "blocks still held after the requests ended"
        drills.append(Drill("P restarted on the same port", ok, facts, why))

        # 3. prefill done, decode never came: P frees the blocks when the lease ends
        orphan = random_prompt(rng, n)
        prefill_on(srv.p_url, model, orphan)
        held = kv_usage(srv.p_url)
        t0 = time.monotonic()
        freed = settled_kv_usage(srv.p_url, timeout_s=LEASE_WAIT_S)
        facts = {"lease_s": LEASE_S, "p_kv_usage_held": held, "p_kv_usage_after": freed,
                 "freed_after_s": round(time.monotonic() - t0, 1)}
        ok = held > 0 and freed == 0
        why = "" if ok else ("P held no blocks after the prefill" if held <= 0 else "P never freed the blocks")
        drills.append(Drill("prefill done, decode never came", ok, facts, why))

        # 4. the same params sent twice
        twice = random_prompt(rng, n)
        ref_twice = complete(srv.d_url, model, twice, case.max_tokens)
        params_twice = prefill_on(srv.p_url, model, twice)
        facts = {}
        try:
            first = complete(srv.d_url, model, twice, case.max_tokens, kv_transfer_params=dict(params_twice))
            settled_kv_usage(srv.p_url)  # P freed the blocks on the first read's notification
            before = scrape(srv.d_url)
            again = complete(srv.d_url, model, twice, case.max_tokens, kv_transfer_params=dict(params_twice))
            reads = transfer_facts(delta(scrape(srv.d_url), before)).get("transfers", 0.0)
            v_first, v_again = judge(ref_twice, first, rule), judge(ref_twice, again, rule)
            facts.update({"first_verdict": v_first.to_dict(), "again_verdict": v_again.to_dict(), "again_reads": reads})
            faults = [f"first: {v_first.reason}"] if not v_first.ok else []
            faults += [f"again: {v_again.reason}"] if not v_again.ok else []
            if reads and case.connector == "nixlkv":
                faults.append(f"read P's freed blocks again ({reads:.0f} transfers)")
            ok, why = not faults, "; ".join(faults)
        except CompletionError as exc:
            ok, why = False, f"a request failed: {exc}"
        facts["p_kv_usage_after"] = settled_kv_usage(srv.p_url)
        drills.append(Drill("the same params sent twice", ok, facts, why))

        drills.append(attempt("clients that hang up", lambda: _hang_ups(srv, case, rng)))
        drills.append(attempt("P short of KV blocks", lambda: _short_prefill(srv, case, rng)))
        drills.append(attempt("D short of KV blocks", lambda: _short_decode(srv, case, rng)))
        drills.append(attempt(f"P with another --kv-cache-dtype ({OTHER_CACHE_DTYPE})",
                              lambda: _other_cache_dtype(srv, case, rng, policy)))
    if srv.dump_dir is not None:  # --verify-bytes: every load of every drill, the engines stopped
        # loads the drills fail on purpose (P killed, a lapsed hold) are listed, not judged; every load
        # that completed must be exact, and a dump that could not be written fails the drill
        verdict = judge_dir(srv.dump_dir, allow_failed=True).summary()
        drills.append(Drill("bytes D loaded vs P's", verdict["ok"], {"bytes": verdict},
                            "" if verdict["ok"] else format_bytes(verdict)))
    return drills


HANG_UPS = 8  # concurrent requests of drill 7, each abandoned by its client at another moment
HANG_UP_AFTER_S = (0.005, 1.5)  # the first client hangs up after this long, the last after that
HANG_UP_TOKENS = 200  # each asks for this many: the late hang-ups land in D's answer
FINISHED = "vllm:request_success_total"  # an engine's finished requests, per finish reason


def hang_up(url: str, body: dict[str, Any], after_s: float) -> str:
    """Send ``body`` streamed and close the connection ``after_s`` seconds later, or when the answer
    ends first: what a client that gives up does. Where it got: ``before`` the answer began,
    ``during`` it, or the ``whole`` answer. An error status answered first is a failed request, not
    a hang-up: it raises ``CompletionError``."""
    conn = http.client.HTTPConnection(*host_port(url), timeout=after_s)
    t0 = time.monotonic()
    got = 0
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        sock = conn.sock  # an answer that closes its connection takes it from conn: keep our hold
        resp = conn.getresponse()
        if resp.status != 200:
            raise CompletionError(url, resp.status, resp.read(4096).decode(errors="replace"))
        while (left := after_s - (time.monotonic() - t0)) > 0:
            sock.settimeout(left)
            chunk = resp.read1(4096)
            if not chunk:
                return "whole"
            got += len(chunk)
    except (TimeoutError, OSError):
        pass
    finally:
        conn.close()
    return "during" if got else "before"


def attempt(name: str, drill: Callable[[], Drill]) -> Drill:
    """Run one drill; a server that cannot be (re)started for it or a request that breaks fails that
    drill, naming why, and the drills before it keep their verdicts (the report says both)."""
    try:
        return drill()
    except (ServeError, CompletionError, OSError) as exc:
        return Drill(name, False, why=f"could not be run: {type(exc).__name__}: {str(exc)[:600]}")


def _hang_ups(srv: Servers, case: Case, rng: np.random.Generator) -> Drill:
    """Drill 7: clients that hang up at every moment of a P/D request."""
    model, block = str(srv.model_dir), srv.recipe.block_size
    room = srv.recipe.max_model_len - HANG_UP_TOKENS
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(2 * block, min(8 * block, room), size=HANG_UPS)]
    delays = np.geomspace(*HANG_UP_AFTER_S, HANG_UPS).tolist()
    bodies = [request_body(model, p, HANG_UP_TOKENS, stream=True) for p in prompts]
    before = {"p": scrape(srv.p_url), "d": scrape(srv.d_url)}
    with ThreadPoolExecutor(HANG_UPS) as pool:
        seen = list(pool.map(hang_up, [srv.proxy_url] * HANG_UPS, bodies, delays))
    facts: dict[str, Any] = {"hung_up_after_s": [round(d, 3) for d in delays], "clients": seen}
    faults = []
    if "before" not in seen or "during" not in seen:  # else the drill missed a phase of the request
        faults.append(f"the hang-ups did not land both before and during the answers: {seen}")
    time.sleep(1.0)  # the engines notice closed connections on their next step
    # each engine's own count of the requests it finished (vLLM counts no client abort there)
    p_done, d_done = (sum(v for k, v in delta(scrape(url), before[side]).items() if k.startswith(FINISHED))
                      for side, url in (("p", srv.p_url), ("d", srv.d_url)))
    facts["stopped_while_p_prefilled"] = HANG_UPS - p_done
    facts["stopped_after_p"] = p_done - d_done  # at the proxy, or on D waiting for, reading or decoding the KV
    facts["answered_whole"] = d_done
    if p_done + d_done == 2 * HANG_UPS:
        faults.append("every request finished on both engines: no hang-up stopped one, the drill tested nothing")
    if _still_held(srv, facts, p_timeout_s=LEASE_WAIT_S):
        faults.append("blocks still held after every client hung up")
    prompt = random_prompt(rng, 3 * block + 5)
    try:
        ref = complete(srv.d_url, model, prompt, case.max_tokens)
        got = complete(srv.proxy_url, model, prompt, case.max_tokens, timeout_s=120)
        verdict = judge(ref, got, default_rule(case))
        facts["after_verdict"] = verdict.to_dict()
        if not verdict.ok:
            faults.append(f"the request after: {verdict.reason}")
    except CompletionError as exc:
        faults.append(f"the request after failed: {exc}")
    return Drill("clients that hang up", not faults, facts, "; ".join(faults))


P_FULL = 0.75  # drill 8's control: P's KV usage must reach this at some point of the run


def _least_room(srv: Servers, block: int) -> int:
    """The fewest KV blocks vLLM starts an engine with: one longest request, and 4 blocks."""
    return -(-srv.recipe.max_model_len // block) + 4


def _judged_at_once(srv: Servers, prompts: list[list[int]], refs: list[Completion],
                    ask: Callable[[list[int]], Completion]) -> list[str]:
    """``ask(prompt)`` for every prompt at once, each answer judged against its reference by the
    drift rule (batched: other GEMM shapes than the one-at-a-time references), past a parting
    against D alone teacher-forced on the answer, as the serving check judges; what went wrong,
    per request."""
    faults = []
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        answers = []
        for i, fut in enumerate(futures):
            try:
                answers.append(fut.result())
            except (CompletionError, ServeError) as exc:
                answers.append(None)
                faults.append(f"request {i} failed: {exc}")
    for i, (prompt, ref, got) in enumerate(zip(prompts, refs, answers)):
        if got is None:
            continue
        try:
            v = judge(ref, got, "drift", None, forced_reference(srv, "drift", prompt, ref, got))
            if not v.ok:
                faults.append(f"request {i}: {v.reason}")
        except (CompletionError, ServeError, OSError) as exc:
            faults.append(f"request {i}: the teacher-forced reference failed: {exc}")
    return faults


def _through_proxy(srv: Servers, max_tokens: int) -> Callable[[list[int]], Completion]:
    """A prompt through the proxy."""
    return lambda prompt: complete(srv.proxy_url, str(srv.model_dir), prompt, max_tokens, timeout_s=600)


SLOW_DECODE_S = 1.0  # drill 8: how long after P's answer each decode leg reaches D (well inside LEASE_S)


def _with_slow_decode(srv: Servers, max_tokens: int, delay_s: float) -> Callable[[list[int]], Completion]:
    """A prompt prefilled on P (the proxy's first leg) and sent to D ``delay_s`` after P answered:
    P holds every answered prompt's blocks at least that long, so its room fills whatever the
    machine's speed."""
    model = str(srv.model_dir)

    def ask(prompt: list[int]) -> Completion:
        params = prefill_on(srv.p_url, model, prompt)
        time.sleep(delay_s)
        return complete(srv.d_url, model, prompt, max_tokens, kv_transfer_params=params, timeout_s=600)

    return ask


def _short_prefill(srv: Servers, case: Case, rng: np.random.Generator) -> Drill:
    """Drill 8: P with room for two of six concurrent requests, each holding its blocks for D."""
    model = str(srv.model_dir)
    block = srv.p_spec.block_size
    room = _least_room(srv, block)
    length = (room // 2 - 3) * block  # two of the requests fit at once (with their last, partial blocks), three do not
    extra = srv.p_spec.extra_args
    facts: dict[str, Any] = {"p_blocks": room,
                             "restart_s": round(srv.restart_prefill((*extra, "--num-gpu-blocks-override", str(room))), 1)}
    prompts = [random_prompt(rng, length + 7 * i) for i in range(SHORT_REQUESTS)]
    refs = [complete(srv.d_url, model, p, case.max_tokens) for p in prompts]
    before = scrape(srv.d_url)
    peak = [0.0]
    done = threading.Event()

    def watch() -> None:  # P's own usage, polled while the requests run
        while not done.is_set():
            try:
                peak[0] = max(peak[0], kv_usage(srv.p_url))
            except OSError:
                pass
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    faults = _judged_at_once(srv, prompts, refs, _with_slow_decode(srv, case.max_tokens, SLOW_DECODE_S))
    done.set()
    watcher.join()
    facts["p_peak_kv_usage"] = round(peak[0], 3)
    moved = delta(scrape(srv.d_url), before)
    facts["transfers"] = transfer_facts(moved).get("transfers", 0.0)
    if case.connector == "nixlkv":  # how D planned the restarted P: its layout's segments, its own block count
        plans = {kind: sum(v for k, v in moved.items() if k.startswith(f"vllm:nixlkv_handshakes_{kind}"))
                 for kind in ("planned", "rebased", "recounted")}
        facts["d_handshakes"] = ", ".join(f"{kind} {n:.0f}" for kind, n in plans.items())
        if plans != {"planned": 0, "rebased": 0, "recounted": 1}:
            faults.append(f"D handshook the restarted P as ({facts['d_handshakes']}): one handshake, its plan "
                          "recounted from the segments D had, was expected")
    if peak[0] < P_FULL:
        faults.append(f"P's KV usage peaked at {peak[0]:.2f} (< {P_FULL}): it was never short, the drill tested nothing")
    if case.connector == "nixlkv" and facts["transfers"] != len(prompts):
        faults.append(f"{facts['transfers']:.0f} transfers for {len(prompts)} requests")
    if _still_held(srv, facts, p_timeout_s=LEASE_WAIT_S):
        faults.append("blocks still held after the requests ended")
    facts["restored_s"] = round(srv.restart_prefill(extra), 1)  # P as it was, for the drills after
    return Drill("P short of KV blocks", not faults, facts, "; ".join(faults))


SHORT_REQUESTS = 6  # concurrent requests of drill 5, each a fifth of max_model_len long, asking for 3/10 more


def _short_decode(srv: Servers, case: Case, rng: np.random.Generator) -> Drill:
    """Drill 5: D with room for one longest request (and 4 blocks) serves six that need three times that."""
    model, rec = str(srv.model_dir), srv.recipe
    block = srv.d_spec.block_size
    room = _least_room(srv, block)
    restart_s = srv.restart_decode(("--num-gpu-blocks-override", str(room)))
    facts: dict[str, Any] = {"d_blocks": room, "restart_s": round(restart_s, 1)}
    length, answer = rec.max_model_len // 5, 3 * rec.max_model_len // 10
    prompts = [random_prompt(rng, length + 7 * i) for i in range(SHORT_REQUESTS)]
    refs = [complete(srv.d_url, model, p, answer) for p in prompts]  # one at a time: each fits
    before = scrape(srv.d_url)
    faults = _judged_at_once(srv, prompts, refs, _through_proxy(srv, answer))
    moved = delta(scrape(srv.d_url), before)
    facts["preemptions"] = moved.get("vllm:num_preemptions_total", 0.0)
    facts["transfers"] = transfer_facts(moved).get("transfers", 0.0)
    if not facts["preemptions"]:
        faults.append("D preempted nothing: the drill tested nothing")
    if case.connector == "nixlkv" and facts["transfers"] != len(prompts):
        faults.append(f"{facts['transfers']:.0f} transfers for {len(prompts)} requests: a preempted request read P again")
    if _still_held(srv, facts):
        faults.append("blocks still held after the requests ended")
    return Drill("D short of KV blocks (preemption)", not faults, facts, "; ".join(faults))


OTHER_CACHE_DTYPE = "fp8"  # P's --kv-cache-dtype in drill 6 (D runs auto)


def _other_cache_dtype(srv: Servers, case: Case, rng: np.random.Generator, policy: str) -> Drill:
    """Drill 6: P restarted with another --kv-cache-dtype than D."""
    model = str(srv.model_dir)
    facts: dict[str, Any] = {"policy": policy, "p_kv_cache_dtype": OTHER_CACHE_DTYPE,
                             "restart_s": round(srv.restart_prefill(("--kv-cache-dtype", OTHER_CACHE_DTYPE)), 1)}
    prompt = random_prompt(rng, 3 * srv.recipe.block_size + 5)
    ref = complete(srv.d_url, model, prompt, case.max_tokens)
    params = prefill_on(srv.p_url, model, prompt)
    faults = []
    try:
        got = complete(srv.d_url, model, prompt, case.max_tokens, kv_transfer_params=params, timeout_s=120)
        verdict = judge(ref, got, "exact")  # recomputed on D: D alone's answer
        facts["verdict"] = verdict.to_dict()
        if policy == "fail":
            faults.append("answered under fail")
        elif not verdict.ok:
            faults.append(f"recomputed answer: {verdict.reason}")
    except CompletionError as exc:
        facts["status"] = exc.status
        if policy == "recompute":
            faults.append(f"failed under recompute: {exc}")
    if case.connector == "nixlkv":
        said = f"cache_dtype is '{OTHER_CACHE_DTYPE}' on the remote engine but 'auto' here"
        facts["setting_named"] = said in srv.d.log.read_text(errors="replace") if srv.d else False
        if not facts["setting_named"]:
            faults.append(f"D's log does not say {said!r}")
    if _still_held(srv, facts, p_timeout_s=LEASE_WAIT_S):  # P's blocks are freed by the lease
        faults.append("blocks still held after the request ended")
    try:
        complete(srv.d_url, model, prompt[:5], 2)
    except CompletionError as exc:
        faults.append(f"D serves no plain request after: {exc}")
    return Drill(f"P with another --kv-cache-dtype ({OTHER_CACHE_DTYPE})", not faults, facts, "; ".join(faults))


def run(case: Case, opts: Options, policies: tuple[str, ...] = ("recompute", "fail"),
        drills_of: Callable[[Case, Options, str], list[Drill]] = run_drills) -> dict[str, Any]:
    """``drills_of``: the group to run (these, or host_drills.run_host_drills across hosts)."""
    out: dict[str, Any] = {"case": case.label, "policies": {}}
    for policy in policies:
        try:
            drills = drills_of(case, opts, policy)
            out["policies"][policy] = [asdict(d) for d in drills]
        except (ServeError, CompletionError, OSError) as exc:
            out["policies"][policy] = [asdict(Drill("set-up", False, why=f"{type(exc).__name__}: {exc}"))]
    out["ok"] = all(d["ok"] for ds in out["policies"].values() for d in ds)
    return out


def format_drills(out: dict[str, Any]) -> str:
    lines = [f"== drills: {out['case']}  {'PASS' if out['ok'] else 'FAIL'}"]
    for policy, drills in out["policies"].items():
        for d in drills:
            lines.append(f"   [{policy}] {d['name']:<36} {'ok' if d['ok'] else 'FAIL'}  {d['why']}")
            keep = {k: v for k, v in d["facts"].items() if not isinstance(v, dict)}
            if keep:
                lines.append(f"       {keep}")
            if "bytes" in d["facts"]:
                lines.append(f"       {format_bytes(d['facts']['bytes'])}")
    return "\n".join(lines)
