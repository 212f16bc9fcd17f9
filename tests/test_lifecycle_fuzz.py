"""Seeded interleavings of the request lifecycle through the workers of a P/D pair, with real NIXL.

Each seed draws a TP pair, a descriptor mode and a handful of requests, each of one kind:

- ``normal``: P is handed the request, then D reads it;
- ``early``: D reads before P's worker is handed the request (its notifications arrive first);
- ``notify``: D reads nothing (its prefix was cached): P's blocks are freed by notification alone;
- ``bad``: D names a remote block outside P's pool: that request fails, alone, nothing written;
- ``unread``: D never asks: P frees the blocks when the short lease expires.

P's hand-overs and D's requests arrive at random steps, the workers stepped as the model runner
steps them. What must hold whatever the order: every request D was given is reported once, as
loaded or failed exactly as its kind says; every request P held is freed once, by its readers'
notifications unless it was never (or badly) read; every byte D holds is the pattern of the
requests it loaded and the sentinel elsewhere; no worker keeps anything afterwards.

Three controls show the checks can fail: a request reported twice, a hand-over nobody reads (a
hold kept or freed by its lease), and a request read with its prefill blocks out of order (every
byte lands, in the wrong blocks).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

from nixlkv.testing import oracle
from nixlkv.vllm.config import ConnectorConfig
from nixlkv.vllm.metadata import NixlkvMetadata, RecvRequest

from connector_helpers import Engine, blocks, fa_scenario

pytestmark = pytest.mark.nixl

KINDS = ("normal", "early", "notify", "bad", "unread")
NUM_BLOCKS = 64
SHORT_LEASE = 0.4  # what P holds a request D never (or badly) reads for
TP_PAIRS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4))
MODES = (("direct", None), ("staged", 64 << 10), ("auto", None))  # 64 KiB: a few pages per round


@dataclass
class Req:
    rid: str
    kind: str
    seed: int
    p_ids: list[int]
    d_ids: list[int]
    p_step: int  # when P's worker is handed it
    d_step: int | None  # when D's workers are given it (None: never)

    @property
    def lease(self) -> float:
        return SHORT_LEASE if self.kind in ("bad", "unread") else 30.0

    def recv(self, p: Engine) -> RecvRequest:
        remote = list(self.p_ids)
        if self.kind == "bad":
            remote[-1] = NUM_BLOCKS  # one past P's pool
        local = [] if self.kind == "notify" else list(self.d_ids)
        return RecvRequest(local_block_ids=(local,), remote_block_ids=(remote,), remote_engine_id=p.engine_id,
                           remote_request_id=self.rid, remote_host="127.0.0.1", remote_port=p.server.port)


def draw(seed: int) -> tuple[tuple[int, int], tuple[str, int | None], list[Req]]:
    rng = random.Random(seed)
    tp = rng.choice(TP_PAIRS)
    mode = rng.choice(MODES)
    n = rng.randint(2, 5)
    p_free, d_free = list(range(1, NUM_BLOCKS)), list(range(1, NUM_BLOCKS))
    rng.shuffle(p_free)
    rng.shuffle(d_free)
    reqs = []
    for i in range(n):
        kind = rng.choice(KINDS)
        k = rng.randint(1, 5)  # blocks of 16 tokens
        p_ids, d_ids = [p_free.pop() for _ in range(k)], [d_free.pop() for _ in range(k)]
        d_step = None if kind == "unread" else rng.randint(0, 4)
        p_step = rng.randint(d_step + 1, d_step + 4) if kind == "early" else rng.randint(0, 4) if d_step is None \
            else rng.randint(0, d_step)
        reqs.append(Req(f"req-{seed}-{i}", kind, 100 + i, p_ids, d_ids, p_step, d_step))
    return tp, mode, reqs


def run(seed: int, hand_over=None) -> dict:
    """Drive one seed's requests; ``hand_over(p_worker, step, due)`` replaces how P's workers are
    handed requests (the controls)."""
    (p_tp, d_tp), (mode, staging), reqs = draw(seed)
    sc = fa_scenario(p_tp, d_tp, num_tokens=80, num_blocks=NUM_BLOCKS)
    cfg = ConnectorConfig(descriptor_mode=mode, **({"staging_bytes": staging} if staging else {}))
    p = Engine(sc, "prefill", "P", serve=True)
    try:
        d = Engine(sc, "decode", "D", config=cfg)
    except BaseException:
        p.close()
        raise
    try:
        for r in p.ranks:
            oracle.fill_prefill(r, blocks(r, reqs[0].p_ids), seed=reqs[0].seed)
            for q in reqs[1:]:
                oracle.write_pattern(r, r.buffer, blocks(r, q.p_ids), q.seed)
        for r in d.ranks:
            oracle.fill_decode(r)
        reported = [[] for _ in d.workers]
        failed = [set() for _ in d.workers]
        freed = [[] for _ in p.workers]
        expired = [0] * len(p.workers)
        asked = [q for q in reqs if q.d_step is not None]
        deadline = time.monotonic() + 30
        step = 0
        while time.monotonic() < deadline:
            for w in p.workers:
                due = {q.rid: q.lease for q in reqs if q.p_step == step}
                if hand_over is not None:
                    hand_over(w, step, due)
                else:
                    w.start_load_kv(NixlkvMetadata(reqs_to_send=due) if due else None)
            for w in d.workers:
                due = {q.rid: q.recv(p) for q in asked if q.d_step == step}
                w.start_load_kv(NixlkvMetadata(reqs_to_recv=due) if due else None)
            for i, w in enumerate(d.workers):
                reported[i] += sorted(w.get_finished(set())[1])
                failed[i] |= w.take_failed_recving()
            for i, w in enumerate(p.workers):
                freed[i] += sorted(w.get_finished(set())[0])
                stats = w.take_stats()
                expired[i] += stats.reduce().get("expired_leases", 0) if stats is not None else 0
            step += 1
            if step > 5 and all(len(x) >= len(asked) for x in reported) and all(len(x) >= len(reqs) for x in freed):
                break
            time.sleep(0.002)
        for r in d.ranks:
            expected = oracle.expected_decode(r, blocks(r, []), seed=0)
            for q in reqs:
                if q.kind in ("normal", "early"):
                    oracle.write_pattern(r, expected, blocks(r, q.d_ids), q.seed)
            mismatch = oracle.compare(r, expected)
            assert mismatch is None, f"seed {seed}: D rank {r.tp_rank}: {mismatch}"
        leftovers = [(w._flights, w._waiting, w._draining) for w in d.workers] + [(w._holds, w._early) for w in p.workers]
        return {"reqs": reqs, "asked": asked, "reported": reported, "failed": failed, "freed": freed,
                "expired": expired, "leftovers": leftovers}
    finally:
        p.close()
        d.close()


def check(seed: int, out: dict) -> None:
    reqs, asked = out["reqs"], out["asked"]
    for i, got in enumerate(out["reported"]):
        assert sorted(got) == sorted(q.rid for q in asked), f"seed {seed}: D rank {i} reported {got}"
    for i, got in enumerate(out["failed"]):
        assert got == {q.rid for q in reqs if q.kind == "bad"}, f"seed {seed}: D rank {i} failed {got}"
    for i, got in enumerate(out["freed"]):
        assert sorted(got) == sorted(q.rid for q in reqs), f"seed {seed}: P rank {i} freed {got}"
    lapsed = sum(q.kind in ("bad", "unread") for q in reqs)
    assert out["expired"] == [lapsed] * len(out["freed"]), f"seed {seed}: P's leases expired {out['expired']}"
    assert not any(any(x) for x in out["leftovers"]), f"seed {seed}: kept {out['leftovers']}"


SEEDS = range(12)


def test_the_seeds_draw_every_kind_pair_and_mode() -> None:
    drawn = [draw(s) for s in SEEDS]
    assert {q.kind for _, _, reqs in drawn for q in reqs} == set(KINDS)
    assert len({tp for tp, _, _ in drawn}) >= 5 and {m for _, (m, _), _ in drawn} == {m for m, _ in MODES}


@pytest.mark.parametrize("seed", SEEDS)
def test_any_order_of_hand_overs_and_reads_reports_and_frees_each_request_once(seed: int) -> None:
    check(seed, run(seed))


def test_control_a_request_reported_twice_is_seen() -> None:
    out = run(0)
    first = out["asked"][0].rid
    out["reported"][0].append(first)
    with pytest.raises(AssertionError, match="reported"):
        check(0, out)


def test_control_a_hold_nobody_reads_is_seen() -> None:
    """P handed a request D never names (a stale hand-over): it is held until its lease, or kept
    past the end of the run: the checks see it."""
    def hand_over(w, step, due):
        due = {**due, "ghost": SHORT_LEASE} if step == 0 else due
        w.start_load_kv(NixlkvMetadata(reqs_to_send=due) if due else None)

    out = run(1, hand_over)
    with pytest.raises(AssertionError, match="freed|kept|expired"):
        check(1, out)


def test_control_blocks_read_out_of_order_are_seen(monkeypatch) -> None:
    """D names its request's prefill blocks in another order: every byte lands, in the wrong
    blocks, and the byte check sees it."""
    seed = next(s for s in SEEDS if any(q.kind == "normal" and len(q.p_ids) > 1 for q in draw(s)[2]))
    recv = Req.recv

    def swapped(self, p):
        req = recv(self, p)
        if self.kind == "normal":
            req = RecvRequest(req.local_block_ids, (req.remote_block_ids[0][::-1],), req.remote_engine_id,
                              req.remote_request_id, req.remote_host, req.remote_port)
        return req

    monkeypatch.setattr(Req, "recv", swapped)
    with pytest.raises(AssertionError, match="D rank"):
        run(seed)
