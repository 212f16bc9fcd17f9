"""P acknowledges heartbeats, and D counts a hold extended only from an acknowledgement (issue #46).

A heartbeat that leaves D is not one that reached P: over a link that is down P's lease runs out
and P frees (and reuses) the blocks while a D that counted its heartbeats as sent believes them
held, reads them and calls the load good. Here heartbeats are dropped on their way to P (fault
injection on D's real NIXL agent) and P's lease is short: D fails the load (nothing read, or a READ
that ended after the hold D can prove not taken as loaded), and the controls, a D that counts
heartbeats as sent (what a P that does not acknowledge, an earlier nixlkv, still gets), read P's
reused blocks and report them loaded. Real NIXL and vLLM's real Scheduler; no mocks but the drop.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec
import pytest

from nixlkv.testing import oracle
from nixlkv.vllm import handshake
from nixlkv.vllm.liveness import (
    ACK_PREFIX, ACKED_HEARTBEAT_PREFIX, MAX_IDS_PER_HEARTBEAT, acked_heartbeat_messages, encode_ack, encode_acked_heartbeat, heartbeat_messages, is_ack, is_heartbeat,
    parse_ack, parse_acked_heartbeat, parse_heartbeat,
)
from nixlkv.vllm.metadata import LeaseView, NixlkvMetadata, NixlkvStats

from connector_helpers import blocks, filled_pair
from pd_harness import PDCase, PDEngine, prompt
from test_connector_lifecycle import SIDE, clean, prefill
from test_connector_liveness import lease_from_heartbeat_turns, lease_from_steps, step_both_for_leases
from test_connector_worker import drive, recv

pytestmark = pytest.mark.nixl


# ------------------------------------------------------------------ wire format
def test_ack_wire_format_round_trips_and_refuses_garbage() -> None:
    ids = [f"req-{i}" for i in range(MAX_IDS_PER_HEARTBEAT + 3)]
    beats = acked_heartbeat_messages(ids, 41, b"md")
    assert [b.seq for b in beats] == [41, 42]  # bounded size: chunked, one sequence number each
    msgs = [encode_acked_heartbeat(b) for b in beats]
    assert [parse_acked_heartbeat(m) for m in msgs] == beats
    assert sorted(r for b in beats for r in b.ids) == sorted(ids)
    ack = encode_ack(42, ["req-1"])
    assert parse_ack(ack).seq == 42 and parse_ack(ack).ids == ("req-1",)
    assert parse_ack(encode_ack(7, [])).ids == ()  # P held none of them: D learns the holds ended
    # the three kinds never pass for one another (a plain heartbeat is what an earlier P parses)
    plain = heartbeat_messages(["r"])[0]
    assert is_heartbeat(plain) and is_heartbeat(msgs[0]) and not is_heartbeat(ack)
    assert is_ack(ack) and not is_ack(plain) and not is_ack(msgs[0])
    for bad in (msgs[0], ack):
        with pytest.raises(ValueError):
            parse_heartbeat(bad)
    with pytest.raises(ValueError):
        parse_acked_heartbeat(plain)
    enc = msgspec.msgpack.encode
    for bad in (ACK_PREFIX + b"\xc1", ACK_PREFIX + enc([1]), ACK_PREFIX + enc([-1, []]), ACK_PREFIX + enc([1 << 63, []]),
                ACK_PREFIX + enc(["1", []]), ACK_PREFIX + enc([1, [""]]), ACK_PREFIX + enc([1, ids]),
                ACK_PREFIX + enc([1, [7]]), b"nixlkv:r:1", plain):
        with pytest.raises(ValueError):
            parse_ack(bad)
    for bad in (ACKED_HEARTBEAT_PREFIX + enc([1, ["r"], b""]), ACKED_HEARTBEAT_PREFIX + enc([1, [], b"md"]),
                ACKED_HEARTBEAT_PREFIX + enc([1, ["r"]]), ACKED_HEARTBEAT_PREFIX + enc([-3, ["r"], b"md"]),
                ACKED_HEARTBEAT_PREFIX + enc([1, ["r"], b"x" * (1 << 17)])):
        with pytest.raises(ValueError):
            parse_acked_heartbeat(bad)


# ------------------------------------------------------------------ fault injection
def drop_heartbeats(worker, to: str = "") -> list[str]:  # noqa: ANN001 - a NixlkvWorker
    """Heartbeats from ``worker`` to the P agents whose name holds ``to`` (every one by default)
    never reach P (a link that is down for them): D's real NIXL agent sends everything else.
    Returns the list each dropped heartbeat's agent is appended to."""
    dropped: list[str] = []
    real = worker.nixl.notify

    def notify(agent: str, msg: bytes) -> None:
        if is_heartbeat(msg) and to in agent:
            dropped.append(agent)
            return
        real(agent, msg)

    worker.nixl.notify = notify
    return dropped


def as_earlier_prefill(monkeypatch) -> None:
    """The controls' D: the prefill engine's handshake says it does not acknowledge heartbeats (an
    earlier nixlkv), so D counts each heartbeat as arrived when it leaves: nixlkv's D before this."""
    real = handshake.decode_reply
    monkeypatch.setattr(handshake, "decode_reply",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), heartbeat_acks=False))


def _stats(engine: PDEngine, *keys: str) -> dict[str, int]:
    return {k: sum(s.reduce()[k] for s in engine.stats) for k in keys}


# ------------------------------------------------------------------ worker level, real NIXL
def test_p_acknowledges_and_d_proves_the_hold_from_acknowledgements_only(caplog) -> None:
    """P answers each acknowledged heartbeat with the ids it extended (loading D's agent once); D's
    proven end of the hold moves only with acknowledgements, never past a lease from the send; an
    acknowledgement that is malformed, of an unknown heartbeat or naming ids it did not carry
    changes nothing and is counted."""
    p, d = filled_pair(1, 1, [1, 2, 3])
    try:
        pw, dw = p.workers[0], d.workers[0]
        key = ("P", "127.0.0.1", p.server.port)
        lease = lease_from_heartbeat_turns(pw, dw, key)
        remote = dw._remotes[key]
        assert remote.acks  # this nixlkv's handshake says so
        pw.start_load_kv(NixlkvMetadata(reqs_to_send={"kept": lease}))
        t_send = time.monotonic()
        dw.start_load_kv(NixlkvMetadata(heartbeats={key: {"kept": LeaseView(lease, 0.9 * lease), "ghost": None}}))
        deadline = time.monotonic() + 10
        while (key, "kept") not in dw._proven and time.monotonic() < deadline:
            pw.get_finished(set())
            dw.get_finished(set())
            time.sleep(0.01)
        ends = dw._proven[(key, "kept")]
        agent = remote.agents[0]
        assert set(ends) == {agent} and t_send <= ends[agent] <= t_send + 0.9 * lease + 0.5
        assert (key, "ghost") not in dw._proven  # P does not hold it: not acknowledged as extended
        assert dw.nixl.name in pw._ack_peers  # P loaded D's agent from reply_to to answer
        before = dict(ends)
        # garbage from P's agent to D: malformed, an unknown heartbeat, an id the heartbeat did not carry
        seq = max(dw._beats)
        garbage = [ACK_PREFIX + b"\xc1", ACK_PREFIX + msgspec.msgpack.encode([1, [""]]), encode_ack(seq + 1000, ["kept"]),
                   encode_ack(seq, ["never-named"])]
        with caplog.at_level(logging.WARNING, logger="nixlkv.connector"):
            for msg in garbage:
                pw.nixl.notify(dw.nixl.name, msg)
            stats = NixlkvStats()
            deadline = time.monotonic() + 5
            while stats.reduce()["ignored_acks"] < 3 and time.monotonic() < deadline:
                dw.get_finished(set())
                stats.aggregate(dw.take_stats() or NixlkvStats())
                time.sleep(0.01)
        assert stats.reduce()["ignored_acks"] == 3, stats.reduce()  # the stray id is skipped, not counted twice
        assert "malformed heartbeat acknowledgement" in caplog.text and "Traceback" not in caplog.text
        assert dw._proven[(key, "kept")] == before and (key, "never-named") not in dw._proven
        # P counts a malformed acknowledged heartbeat like any malformed one
        dw.nixl.notify(agent, ACKED_HEARTBEAT_PREFIX + msgspec.msgpack.encode([1, ["kept"], b""]))
        pstats = NixlkvStats()
        deadline = time.monotonic() + 5
        while pstats.reduce()["ignored_notifications"] < 1 and time.monotonic() < deadline:
            pw.get_finished(set())
            pstats.aggregate(pw.take_stats() or NixlkvStats())
        assert pstats.reduce()["ignored_notifications"] == 1
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"kept": recv(p, "kept", [4, 5, 6], [1, 2, 3])}))
        done, failed, sent = drive(p, d, {"kept"})
        assert done[0] == {"kept"} and not failed[0] and sent[0] == {"kept"}
        assert oracle.compare(d.ranks[0], oracle.expected_decode(d.ranks[0], blocks(d.ranks[0], [4, 5, 6]), seed=3)) is None
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("acked", [True, False], ids=["acknowledged", "control-counted-when-sent"])
def test_a_read_that_ends_after_the_proven_hold_is_not_taken_as_loaded(monkeypatch, acked: bool, caplog) -> None:
    """A READ posted while P's hold is proven, whose completion D sees only after that proof ran
    out (the link stalls it; heartbeats lost on the way meanwhile): D fails the request, naming
    lease_s and the fix. The control (heartbeats counted when sent) reports it loaded."""
    if not acked:
        as_earlier_prefill(monkeypatch)
    p, d = filled_pair(1, 1, [1, 2, 3])
    try:
        pw, dw = p.workers[0], d.workers[0]
        key = ("P", "127.0.0.1", p.server.port)
        lease = lease_from_heartbeat_turns(pw, dw, key)
        pw.start_load_kv(NixlkvMetadata(reqs_to_send={"r": lease}))
        req = dataclasses.replace(recv(p, "r", [4, 5, 6], [1, 2, 3]), held_for_s=0.9 * lease, lease_s=lease)
        dw.start_load_kv(NixlkvMetadata(reqs_to_recv={"r": req}))
        drop_heartbeats(dw)
        real_poll, stall_until = dw._poll, time.monotonic() + 2 * lease
        dw._poll = lambda flight: real_poll(flight) and time.monotonic() > stall_until  # the link stalls it
        t0 = time.monotonic()
        done: set[str] = set()
        with caplog.at_level(logging.ERROR, logger="nixlkv.connector"):
            while "r" not in done and time.monotonic() - t0 < 10 * lease + 10:
                dw.start_load_kv(NixlkvMetadata(heartbeats={key: {"r": LeaseView(lease, t0 + 0.9 * lease - time.monotonic())}}))
                done |= dw.get_finished(set())[1]
                pw.get_finished(set())
                time.sleep(lease / 20)
        failed = dw.take_failed_recving()
        assert done == {"r"}
        lapsed = dw.take_stats().reduce()["lapsed_reads"]
        if acked:
            assert failed == {"r"} and lapsed == 1
            assert any("READs ended after the last moment" in r.getMessage() and f"lease_s={lease:g} s" in r.getMessage()
                       and "raise lease_s" in r.getMessage() for r in caplog.records)
        else:
            assert not failed and lapsed == 0  # the heartbeats it sent "held" P's blocks
    finally:
        p.close()
        d.close()


# ------------------------------------------------------------------ vLLM's real schedulers
@pytest.mark.vllm
@pytest.mark.parametrize("case", ["acknowledged", "dropped", "control-dropped-counted-when-sent",
                                  "pp2-acknowledged", "pp2-stage1-dropped"])
def test_heartbeats_that_never_reach_p_fail_the_load(monkeypatch, case: str) -> None:
    """vLLM's real Schedulers: D has no free blocks for the request for 2.5 of P's leases (a local
    request occupies them; the lease is 1 s or six of this machine's steps now) and names it in a
    heartbeat every step. Acknowledged: P keeps the blocks, D loads them byte-exact (the path as
    before). Dropped on the way: P's lease expires and P gives the blocks to its next prefill; D,
    which has no acknowledgement, fails the load and reads nothing. Control, the same with
    heartbeats counted when sent: D reads the reused blocks and reports the load good, and its
    bytes are the other prefill's. With P in two pipeline stages: both acknowledge and D loads
    byte-exact; heartbeats to stage 1 alone dropped, stage 1's hold is unproven and D fails the
    load (stage 0's acknowledgements do not vouch for stage 1's layers)."""
    from vllm.v1.request import RequestStatus

    if case.startswith("control"):
        as_earlier_prefill(monkeypatch)
    pp = 2 if case.startswith("pp2") else 1
    d = PDEngine(PDCase(num_blocks=8), "decode", "D", {**SIDE, "heartbeat_interval_s": 0.05})
    p = None
    try:
        oracle.fill_decode(d.ranks[0])
        to = "-pp1-" if case == "pp2-stage1-dropped" else ""  # P's agents are named <engine>-tp<r>-pp<stage>-...
        dropped = drop_heartbeats(d.workers[0]._worker, to) if "dropped" in case else []
        d.add("hog", prompt(9, 70), 200, None)  # local prefill: 5 blocks, growing
        lease_s = lease_from_steps(d)
        p = PDEngine(PDCase(num_blocks=8, p_pp=pp), "prefill", "P", {**SIDE, "lease_s": lease_s})
        params = prefill(p, "r", 40)  # 3 of P's 7 usable blocks
        d.add("r", prompt(1, 40), 2, params)
        step_both_for_leases(d, p, lease_s)
        assert "r" not in d.recv_blocks, "the request was not queued behind the local one"
        if case in ("dropped", "control-dropped-counted-when-sent"):
            assert p.finished_sending == {"r"} and dropped  # freed by its lease: no heartbeat reached P
            prefill(p, "x", 100)  # 7 blocks: P's next prefill takes r's freed blocks
        d.scheduler.finish_requests("hog", RequestStatus.FINISHED_ABORTED)
        deadline = time.monotonic() + 30 * lease_s
        while ("r" not in d.outputs or "r" not in p.finished_sending) and time.monotonic() < deadline:
            d.step()
            p.step()
            time.sleep(0.005)
        p_stats = _stats(p, "expired_leases", "lease_extensions")
        d_stats = _stats(d, "hold_acks", "lapsed_holds", "lapsed_reads")
        loaded = d.finished_recving == {"r"} and not d.failed_recving
        exact = loaded and oracle.compare(d.ranks[0], d.expected(0, {"r": d.recv_blocks["r"]})) is None
        if case.endswith("acknowledged"):
            assert loaded and exact, (p_stats, d_stats, lease_s)
            assert p_stats["expired_leases"] == 0 and p_stats["lease_extensions"] > 0, p_stats
            assert d_stats["hold_acks"] > 0 and d_stats["lapsed_holds"] == d_stats["lapsed_reads"] == 0, d_stats
            if pp == 2:  # D's worker heard from both stages' agents
                remote = next(iter(d.workers[0]._worker._remotes.values()))
                assert len(remote.agents) == 2 and {a.split("-")[2] for a in remote.agents.values()} == {"pp0", "pp1"}
        elif case == "pp2-stage1-dropped":
            assert dropped and all("-pp1-" in a for a in dropped), set(dropped)
            assert d.failed_recving == {"r"} and d.invalid_blocks == set(d.recv_blocks["r"][0]), (d_stats, lease_s)
            assert (d.ranks[0].buffer.numpy().view("uint8") == oracle.SENTINEL).all()  # nothing read
            assert d_stats["hold_acks"] > 0 and d_stats["lapsed_holds"] == 1, d_stats  # stage 0 did answer
            assert p_stats["expired_leases"] >= 1, p_stats  # stage 1's
        elif case == "dropped":
            assert d.failed_recving == {"r"} and d.invalid_blocks == set(d.recv_blocks["r"][0]), (d_stats, lease_s)
            assert (d.ranks[0].buffer.numpy().view("uint8") == oracle.SENTINEL).all()  # nothing read
            assert d_stats == {"hold_acks": 0, "lapsed_holds": 1, "lapsed_reads": 0}, d_stats
            assert p_stats == {"expired_leases": 1, "lease_extensions": 0}, p_stats
        else:  # the gap: reported loaded, from blocks holding P's next prefill
            assert loaded and not exact, (d_stats, lease_s)
            assert p_stats == {"expired_leases": 1, "lease_extensions": 0}, p_stats
        if case != "control-dropped-counted-when-sent":
            clean(d)
    finally:
        if p is not None:
            p.close()
        d.close()
