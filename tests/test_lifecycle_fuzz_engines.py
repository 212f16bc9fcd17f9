"""Seeded request lifecycles through vLLM's real Scheduler on both sides (P and D in this process,
real NIXL): prompts of any length arrive at random steps, and each request takes one path:

- ``normal``: P prefills it, D loads it and decodes up to 40 tokens;
- ``p_abort``: aborted on P while it may still be prefilling;
- ``d_abort_now``: D aborts it before its blocks are allocated;
- ``d_abort_later``: D aborts it some steps after it arrived (while it loads, or decodes);
- ``unread``: P's params never reach D;
- ``late``: P's params reach D after P's lease ended (a router that held the decode leg): D must
  not read P's freed blocks; the load fails and D answers it alone.

Whatever the order, afterwards: no request is left on either engine and every block is back in
its pool (vLLM's own leak check); every request P handed over is freed once, by D's notification
unless D never heard of it in time (then by the lease); every ``normal`` request decodes on D
from a successful load; the loads that fail are exactly the ``late`` ones.

Controls show the checks can fail: a P whose lease frees a request D did read (the notifications
ignored), a D that keeps one request's blocks, and a D that reads the late legs (judging P's hold
by its own arrival alone).
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass

import pytest

from pd_harness import PDCase, PDEngine, prompt
from test_connector_lifecycle import SIDE
from test_connector_liveness import judge_by_arrival_alone, lease_from_a_leg

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

KINDS = ("normal", "normal", "p_abort", "d_abort_now", "d_abort_later", "unread", "late")


@functools.cache
def lease_s() -> float:
    """P's lease here: 2 s, or more where a decode leg measured on this machine now is slow (a
    ``normal`` leg reaches D up to four steps after P's answer and must be read in the hold)."""
    return lease_from_a_leg(factor=8.0, floor_s=2.0)


def late_s() -> float:
    """How long after P's answer a late decode leg reaches D: past P's hold, whatever the lease."""
    return 1.25 * lease_s() + 0.25
CASES = (PDCase(), PDCase(model="llama-sw"), PDCase(p_tp=2, d_tp=1), PDCase(p_tp=1, d_tp=2),
         PDCase(model="nemotron-h"), PDCase(model="llama", d_block=32),
         PDCase(num_blocks=20))  # a pool of 19 blocks: P queues prompts, D waits for room


@dataclass
class Req:
    rid: str
    kind: str
    tokens: int
    max_tokens: int
    p_step: int  # when P gets it
    delay: int  # steps between P's output and D getting it
    abort_after: int  # steps after arrival the abort comes (p_abort, d_abort_later)

    def prompt(self) -> list[int]:
        """Its prompt, the same on P and D (seeded by its id)."""
        return prompt(int(self.rid[1:].replace("-", "")) % 97, self.tokens)


def draw(seed: int) -> tuple[PDCase, list[Req]]:
    rng = random.Random(seed)
    case = CASES[seed % len(CASES)]
    reqs = [Req(f"r{seed}-{i}", rng.choice(KINDS), rng.randint(5, 150), rng.randint(1, 40), rng.randint(0, 3),
                rng.randint(0, 3), rng.randint(0, 3)) for i in range(rng.randint(2, 5))]
    return case, reqs


def run(seed: int, p_extra: dict | None = None, d_hook=None) -> dict:
    from vllm.v1.request import RequestStatus

    case, reqs = draw(seed)
    p = PDEngine(case, "prefill", "P", {**SIDE, "lease_s": lease_s(), **(p_extra or {})})
    try:
        d = PDEngine(case, "decode", "D", SIDE)
    except BaseException:
        p.close()
        raise
    try:
        handed: set[str] = set()  # P's outputs with params (P holds their blocks)
        to_d: dict[int, list[tuple[Req, dict]]] = {}
        late: list[tuple[float, Req, dict]] = []  # (when, request, params): legs held past P's lease
        d_aborts: dict[int, list[str]] = {}
        p_aborts: dict[int, list[str]] = {}
        step = 0
        deadline = time.monotonic() + 90 + 4 * lease_s()
        while time.monotonic() < deadline:
            for q in reqs:
                if q.p_step == step:
                    p.add(q.rid, q.prompt(), 1,
                          {"do_remote_decode": True, "do_remote_prefill": False})
                    if q.kind == "p_abort":
                        p_aborts.setdefault(step + q.abort_after, []).append(q.rid)
            for rid in p_aborts.pop(step, []):
                p.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            now = time.monotonic()
            due = [(q, params) for when, q, params in late if when <= now]
            late = [x for x in late if x[0] > now]
            for q, params in to_d.pop(step, []) + due:
                d.add(q.rid, q.prompt(), q.max_tokens, params)
                if q.kind == "d_abort_now":
                    d.scheduler.finish_requests(q.rid, RequestStatus.FINISHED_ABORTED)
                elif q.kind == "d_abort_later":
                    d_aborts.setdefault(step + 1 + q.abort_after, []).append(q.rid)
            for rid in d_aborts.pop(step, []):
                d.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            p.step()
            for q in reqs:
                out = p.outputs.get(q.rid)
                if out is not None and q.rid not in handed and out.kv_transfer_params:
                    handed.add(q.rid)
                    if q.kind == "late":
                        late.append((time.monotonic() + late_s(), q, dict(out.kv_transfer_params)))
                    elif q.kind not in ("unread", "p_abort"):
                        to_d.setdefault(step + 1 + q.delay, []).append((q, dict(out.kv_transfer_params)))
            d.step()
            if d_hook is not None:
                d_hook(d, step)
            step += 1
            idle = not (p.scheduler.requests or d.scheduler.requests or to_d or late or d_aborts or p_aborts)
            if idle and step > 4 and all(q.p_step < step for q in reqs):
                break
            time.sleep(0.001)
        return {"case": case, "reqs": reqs, "handed": handed, "p": p.leaks(), "d": d.leaks(),
                "freed": set(p.finished_sending), "expired": sum(s.reduce()["expired_leases"] for s in p.stats),
                "decoded": {r for r, o in d.outputs.items() if o.finished}, "loaded": set(d.finished_recving),
                "failed": set(d.failed_recving), "steps": step}
    finally:
        p.close()
        d.close()


def check(seed: int, out: dict) -> None:
    reqs, handed = out["reqs"], out["handed"]
    for side in ("p", "d"):
        leaks = out[side]
        assert leaks["requests"] == leaks["waiting"] == leaks["running"] == leaks["nonzero_refs"] == 0, (seed, side, leaks)
        assert leaks["free_blocks"] == leaks["expected_free"], (seed, side, leaks)
    assert out["freed"] == handed, (seed, "freed", out["freed"], handed)
    unread = {q.rid for q in reqs if q.kind in ("unread", "p_abort", "late")} & handed
    # every prefill rank holds the request and counts its own lease
    assert out["expired"] == len(unread) * out["case"].p_tp, (seed, "expired leases", out["expired"], unread)
    normal = {q.rid for q in reqs if q.kind == "normal"}
    assert normal <= handed and normal <= out["decoded"] and normal <= out["loaded"], (seed, "normal", out)
    assert out["failed"] == {q.rid for q in reqs if q.kind == "late"}, (seed, "failed loads", out["failed"])
    assert {q.rid for q in reqs if q.kind == "late"} <= out["decoded"], (seed, "late ones answered", out)


SEEDS = range(12)


def test_the_seeds_draw_every_path_and_case() -> None:
    drawn = [draw(s) for s in SEEDS]
    assert {q.kind for _, reqs in drawn for q in reqs} == set(KINDS)
    assert {c for c, _ in drawn} == set(CASES)


@pytest.mark.parametrize("seed", SEEDS)
def test_any_lifecycle_leaks_nothing_and_frees_each_hand_over_once(seed: int) -> None:
    check(seed, run(seed))


def test_control_notifications_ignored_are_seen(monkeypatch) -> None:
    """P ignoring its readers' notifications frees every request by its lease instead."""
    import nixlkv.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "parse_notification", lambda msg: None)
    seed = next(s for s in SEEDS if any(q.kind == "normal" for q in draw(s)[1]))
    with pytest.raises(AssertionError, match="expired leases"):
        check(seed, run(seed))


def test_control_blocks_kept_are_seen() -> None:
    """A D that takes a block from its pool and keeps it: the leak check sees it."""
    taken = []

    def keep_one(d: PDEngine, step: int) -> None:
        if step == 0:
            taken.extend(d.scheduler.kv_cache_manager.block_pool.get_new_blocks(1))

    with pytest.raises(AssertionError, match="'d'"):
        check(0, run(0, d_hook=keep_one))


def test_control_late_legs_read_from_freed_blocks_are_seen(monkeypatch) -> None:
    """A D that judges P's hold by its own arrival alone reads the late legs from blocks P freed."""
    judge_by_arrival_alone(monkeypatch)
    seed = next(s for s in SEEDS if any(q.kind == "late" for q in draw(s)[1]))
    with pytest.raises(AssertionError, match="failed loads"):
        check(seed, run(seed))

