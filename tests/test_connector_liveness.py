"""Heartbeats keep P's hold alive while D queues a request; without them D refuses to read blocks
P may have freed. Heartbeats are checked on P's clock only, and garbage is ignored and counted."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest

from nixlkv.testing import oracle
from nixlkv.vllm.liveness import HEARTBEAT_PREFIX, MAX_IDS_PER_HEARTBEAT, heartbeat_messages, parse_heartbeat
from nixlkv.vllm.metadata import LeaseView, NixlkvMetadata, NixlkvStats

from connector_helpers import blocks, filled_pair
from pd_harness import PDCase, PDEngine, prompt
from test_connector_lifecycle import SIDE, clean, prefill
from test_connector_worker import drive, recv

pytestmark = pytest.mark.nixl


def test_heartbeat_wire_format_round_trips_and_refuses_garbage() -> None:
    ids = [f"req-{i}" for i in range(MAX_IDS_PER_HEARTBEAT + 3)]
    msgs = heartbeat_messages(ids)
    assert len(msgs) == 2  # bounded size: chunked
    assert sorted(r for m in msgs for r in parse_heartbeat(m)) == sorted(ids)
    for bad in (b"nixlkv:r:1", HEARTBEAT_PREFIX + b"\xc1", HEARTBEAT_PREFIX + msgspec.msgpack.encode([1, 2]),
                HEARTBEAT_PREFIX + msgspec.msgpack.encode([]), HEARTBEAT_PREFIX + msgspec.msgpack.encode([""]),
                HEARTBEAT_PREFIX + msgspec.msgpack.encode(ids)):
        with pytest.raises(ValueError):
            parse_heartbeat(bad)


def _heartbeat_turn(pw, dw, key) -> float:
    """One turn of the loop below without a hold (D names only "ghost"); its seconds."""
    t0 = time.monotonic()
    dw.start_load_kv(NixlkvMetadata(heartbeats={key: {"ghost": None}}))
    dw.get_finished(set())
    pw.get_finished(set())
    time.sleep(0.05)
    return time.monotonic() - t0


def lease_from_heartbeat_turns(pw, dw, key, turns: int = 5, factor: float = 6.0, floor_s: float = 0.4) -> float:
    """A lease for the heartbeat test on this machine now: D handshakes P first (its first
    heartbeat starts the handshake; at most 60 s), then ``factor`` times the slowest of ``turns``
    heartbeat turns, at least ``floor_s``: a turn slower than the lease would let P expire a hold
    D did name, whatever the code does."""
    deadline = time.monotonic() + 60
    while (key not in dw._remotes or dw._remotes[key].prepared is None) and time.monotonic() < deadline:
        _heartbeat_turn(pw, dw, key)
    return max(floor_s, factor * max(_heartbeat_turn(pw, dw, key) for _ in range(turns)))


def test_heartbeats_extend_the_hold_and_garbage_is_ignored(caplog) -> None:
    """Two holds with a short lease (0.4 s, or six heartbeat turns as measured on this machine
    now): the one D names in its heartbeats outlives it several times and is then read
    byte-exact; the other expires. Malformed heartbeats and heartbeats for requests P does not
    hold change nothing and are counted."""
    p, d = filled_pair(1, 1, [1, 2, 3])
    try:
        pw, dw = p.workers[0], d.workers[0]
        key = ("P", "127.0.0.1", p.server.port)
        lease = lease_from_heartbeat_turns(pw, dw, key)
        pw.start_load_kv(NixlkvMetadata(reqs_to_send={"kept": lease, "unnamed": lease}))
        freed: set[str] = set()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="nixlkv.connector"):
            while time.monotonic() - t0 < 3.75 * lease:
                beat = {key: {"kept": LeaseView(lease, t0 + 0.9 * lease - time.monotonic()), "ghost": None}}
                dw.start_load_kv(NixlkvMetadata(heartbeats=beat))
                freed |= pw.get_finished(set())[0]
                time.sleep(0.05)
            name = dw._remotes[key].agents[0]
            for garbage in (HEARTBEAT_PREFIX + b"\xc1", HEARTBEAT_PREFIX + msgspec.msgpack.encode([7]),
                            HEARTBEAT_PREFIX + msgspec.msgpack.encode([])):
                dw.nixl.notify(name, garbage)
            collected = NixlkvStats()
            deadline = time.monotonic() + 5
            while collected.reduce()["ignored_notifications"] < 3 and time.monotonic() < deadline:
                freed |= pw.get_finished(set())[0]
                collected.aggregate(pw.take_stats() or NixlkvStats())
        stats = collected.reduce()
        assert freed == {"unnamed"}  # expired; "kept" outlived its lease 3x thanks to heartbeats
        assert stats["ignored_notifications"] == 3 and "malformed heartbeat" in caplog.text
        assert stats["lease_extensions"] > 0 and stats["stale_heartbeats"] > 0  # "ghost" is not held
        assert stats["expired_leases"] == 1
        assert "Traceback" not in caplog.text
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"kept": recv(p, "kept", [4, 5, 6], [1, 2, 3])}))
        done, failed, sent = drive(p, d, {"kept"})
        assert done[0] == {"kept"} and not failed[0] and sent[0] == {"kept"}
        assert oracle.compare(d.ranks[0], oracle.expected_decode(d.ranks[0], blocks(d.ranks[0], [4, 5, 6]), seed=3)) is None
        assert dw.take_stats().reduce()["heartbeats_sent"] > 0
    finally:
        p.close()
        d.close()


@pytest.mark.vllm
@pytest.mark.parametrize("heartbeat_interval_s", [0.2, 5.0, 0.0], ids=["heartbeats", "interval-over-lease", "no-heartbeats"])
def test_decode_queueing_longer_than_the_lease(heartbeat_interval_s: float) -> None:
    _queue_longer_than_the_lease(heartbeat_interval_s)


@pytest.mark.vllm
@pytest.mark.parametrize("heartbeat_interval_s", [0.2, 0.0], ids=["heartbeats", "no-heartbeats"])
@pytest.mark.parametrize("skew_s", [1e5, -1e5], ids=["scheduler-clock-ahead", "scheduler-clock-behind"])
def test_lease_is_judged_on_one_clock(monkeypatch, heartbeat_interval_s: float, skew_s: float) -> None:
    """D's scheduler and its workers may be processes on different hosts, whose monotonic clocks
    share no origin: the same queueing as above with the scheduler's clock a day off the workers'.
    A time of one clock read on the other would read blocks P freed (ahead) or fail every load
    (behind)."""
    import types

    from nixlkv.vllm import scheduler

    skewed = types.SimpleNamespace(monotonic=lambda: time.monotonic() + skew_s, time=time.time)  # one host: one wall clock
    monkeypatch.setattr(scheduler, "time", skewed)
    _queue_longer_than_the_lease(heartbeat_interval_s)


def lease_from_steps(engine: PDEngine, steps: int = 5, factor: float = 6.0, floor_s: float = 1.0) -> float:
    """A prefill lease for these engines on this machine now: ``factor`` times the slowest of
    ``steps`` steps of ``engine`` (a decode loop steps D and P once per turn, and D names a request
    in a heartbeat at most once per step), at least ``floor_s``. On a quiet machine a step takes
    milliseconds and the lease is ``floor_s``; on a loaded one it grows with the steps, so what
    the test proves (heartbeats keep a hold the queueing outlasts) does not hang on the load."""
    slowest = 0.0
    for _ in range(steps):
        t0 = time.monotonic()
        engine.step()
        slowest = max(slowest, time.monotonic() - t0)
    return max(floor_s, factor * 2 * slowest)  # one turn steps two engines


def step_both_for_leases(d: PDEngine, p: PDEngine, lease_s: float, leases: float = 2.5) -> None:
    """Step D and P in turn for ``leases`` leases, ten turns a lease (~25 turns whatever the lease: a
    local request D decodes meanwhile grows a token a turn and must not outgrow D's blocks)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < leases * lease_s:
        d.step()
        p.step()
        time.sleep(lease_s / 10)


def _queue_longer_than_the_lease(heartbeat_interval_s: float) -> None:
    """vLLM's real Schedulers: P holds for lease_s (1 s, or more where this machine's steps are
    slow: :func:`lease_from_steps`); D has no free blocks for the request for 2.5 leases (a local
    request occupies them). With heartbeats P keeps the blocks and D loads them byte-exact, also
    when D's configured interval (5 s, the default) is longer than P's lease: D then beats three
    times per the lease P published; without, P frees them at lease expiry and D fails the
    request cleanly (invalid blocks, nothing written) instead of reading blocks P may have reused."""
    from vllm.v1.request import RequestStatus

    d = PDEngine(PDCase(num_blocks=8), "decode", "D", {**SIDE, "heartbeat_interval_s": heartbeat_interval_s})
    p = None
    try:
        oracle.fill_decode(d.ranks[0])
        d.add("hog", prompt(9, 70), 200, None)  # local prefill: 5 blocks, growing
        lease_s = lease_from_steps(d)  # the hog's steps, on this machine now
        p = PDEngine(PDCase(), "prefill", "P", {**SIDE, "lease_s": lease_s})
        params = prefill(p, "r", 40)  # 3 blocks; D has 7 usable
        d.add("r", prompt(1, 40), 2, params)
        step_both_for_leases(d, p, lease_s)
        assert "r" not in d.recv_blocks, "the request was not queued behind the local one"
        d.scheduler.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
        deadline = time.monotonic() + 30 * lease_s
        while ("r" not in d.outputs or not p.finished_sending) and time.monotonic() < deadline:
            d.step()
            p.step()
            time.sleep(0.005)
        p_stats = {k: sum(s.reduce()[k] for s in p.stats) for k in ("expired_leases", "lease_extensions")}
        assert p.finished_sending == {"r"}, lease_s
        if heartbeat_interval_s:
            assert d.finished_recving == {"r"} and not d.failed_recving and not d.invalid_blocks, lease_s
            assert p_stats["expired_leases"] == 0 and p_stats["lease_extensions"] > 0, (p_stats, lease_s)
            assert oracle.compare(d.ranks[0], d.expected(0, {"r": d.recv_blocks["r"]})) is None
        else:
            assert d.failed_recving == {"r"} and d.invalid_blocks == set(d.recv_blocks["r"][0])
            assert str(d.outputs["r"].finish_reason).lower().endswith("error")
            assert p_stats == {"expired_leases": 1, "lease_extensions": 0}, p_stats
            assert sum(s.reduce()["lapsed_holds"] for s in d.stats) == 1
            assert (d.ranks[0].buffer.numpy().view("uint8") == oracle.SENTINEL).all()  # nothing read
        clean(p)
        clean(d)
    finally:
        if p is not None:
            p.close()
        d.close()


def _leg_on_its_way(p: PDEngine, delay_s: float) -> None:
    """``delay_s`` of a decode leg on its way to D (a router queueing it): P's workers keep stepping."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < delay_s:
        p.step()
        time.sleep(0.02)


def _decode_leg(p: PDEngine, d: PDEngine, params: dict, rid: str = "r") -> None:
    """Request ``rid`` reaches D with P's ``params``; both step until D answered and P let it go."""
    d.add(rid, prompt(1, 40), 2, params)
    deadline = time.monotonic() + 60
    while (rid not in d.outputs or not p.finished_sending) and time.monotonic() < deadline:
        d.step()
        p.step()
        time.sleep(0.005)


def lease_from_a_leg(factor: float = 5.0, floor_s: float = 1.0) -> float:
    """A prefill lease for these engines on this machine now: ``factor`` times one measured decode
    leg (fresh P and D; from P's answer to D's finished read, D's first handshake with P included),
    at least ``floor_s``. A quiet machine gets ``floor_s``; a loaded one a lease that grows with what
    a leg takes there, so "in time" and "late" below are fractions of what the machine does, not
    wall-clock guesses."""
    p = PDEngine(PDCase(), "prefill", "Pw", {**SIDE, "lease_s": 600.0})
    d = PDEngine(PDCase(), "decode", "Dw", SIDE)
    try:
        params = prefill(p, "w", 40)
        t0 = time.monotonic()
        _decode_leg(p, d, params, "w")
        took = time.monotonic() - t0
        assert d.finished_recving == {"w"} and not d.failed_recving, "the measuring leg did not load"
    finally:
        p.close()
        d.close()
    return max(floor_s, factor * took)


@pytest.mark.parametrize("fraction", [0.3, 1.6])
def test_a_decode_leg_delayed_past_the_lease_is_not_read(fraction: float, caplog) -> None:
    """vLLM's real Schedulers: P holds for ``lease_s`` (1 s, or five decode legs as measured on this
    machine now: :func:`lease_from_a_leg`); the decode leg reaches D ``fraction`` of the lease after P
    answered (a router queueing it). D's count from its own arrival would still give the lease
    0.9 of it; P published when its hold ends (``remote_held_until``), so D reads a leg that came in
    time and refuses one that came after P freed the blocks (they may hold another request's KV
    by then): the request fails cleanly, nothing written."""
    caplog.set_level(logging.ERROR, logger="nixlkv.connector")
    lease_s = lease_from_a_leg()
    p = PDEngine(PDCase(), "prefill", "P", {**SIDE, "lease_s": lease_s})
    d = PDEngine(PDCase(), "decode", "D", SIDE)
    try:
        oracle.fill_decode(d.ranks[0])
        params = prefill(p, "r", 40)
        assert params["remote_held_until"] > time.time()
        _leg_on_its_way(p, fraction * lease_s)
        _decode_leg(p, d, params)
        assert p.finished_sending == {"r"}
        if fraction < 0.9:
            assert d.finished_recving == {"r"} and not d.failed_recving, lease_s
            assert oracle.compare(d.ranks[0], d.expected(0, {"r": d.recv_blocks["r"]})) is None
        else:
            assert d.failed_recving == {"r"} and d.invalid_blocks == set(d.recv_blocks["r"][0])
            assert (d.ranks[0].buffer.numpy().view("uint8") == oracle.SENTINEL).all()  # nothing read
            assert sum(s.reduce()["expired_leases"] for s in p.stats) == 1
            assert any("after the end of the hold the remote published" in r.getMessage() for r in caplog.records)
            # D's log names P's lease and the fix (the client only sees vLLM's "internal error")
            assert any(f"lease_s={lease_s:g} s" in r.getMessage() and "raise lease_s in the prefill engine's "
                       "kv_connector_extra_config" in r.getMessage() for r in caplog.records)
            assert sum(s.reduce()["lapsed_holds"] for s in d.stats) == 1
        clean(p)
        clean(d)
    finally:
        p.close()
        d.close()


def judge_by_arrival_alone(monkeypatch) -> None:
    """The controls' D: it ignores the end of the hold P published, and counts P's lease from its
    own arrival only (as before remote_held_until)."""
    from nixlkv.vllm import metadata

    by_arrival = metadata.lease_view
    monkeypatch.setattr(metadata, "lease_view",
                        lambda lease_s, arrived, now=None, held_until=None, wall_now=None: by_arrival(lease_s, arrived, now))


def test_control_without_the_published_end_d_reads_blocks_p_freed(monkeypatch) -> None:
    """The control of the test above: a D that counts the lease from its own arrival only reads
    the late leg from blocks P had already freed (expired before D's READ), and calls it loaded."""
    judge_by_arrival_alone(monkeypatch)
    lease_s = lease_from_a_leg()
    p = PDEngine(PDCase(), "prefill", "P", {**SIDE, "lease_s": lease_s})
    d = PDEngine(PDCase(), "decode", "D", SIDE)
    try:
        params = prefill(p, "r", 40)
        _leg_on_its_way(p, 1.6 * lease_s)
        assert p.finished_sending == {"r"}  # freed by its lease before D heard of it
        _decode_leg(p, d, params)
        assert d.finished_recving == {"r"} and not d.failed_recving  # read from freed blocks
    finally:
        p.close()
        d.close()


def test_the_lease_view_takes_the_earlier_end() -> None:
    from nixlkv.vllm.metadata import lease_view

    # arrived 10 s ago on D's clock, lease 30 s: 17 s left by D's count
    assert lease_view(30.0, 100.0, 110.0).held_for_s == pytest.approx(17.0)
    # P's hold ends in 5 s on the wall clock: 5 s less the 3 s margin
    assert lease_view(30.0, 100.0, 110.0, held_until=1005.0, wall_now=1000.0).held_for_s == pytest.approx(2.0)
    # P's hold ended before D heard of the request: nothing left, whatever D's count says
    assert lease_view(30.0, 100.0, 100.0, held_until=990.0, wall_now=1000.0).held_for_s < 0
    # the wall clock alone (no arrival known), and nothing at all
    assert lease_view(30.0, None, None, held_until=1040.0, wall_now=1000.0).held_for_s == pytest.approx(37.0)
    assert lease_view(30.0, None) is None and lease_view(None, 100.0, held_until=1e9) is None
