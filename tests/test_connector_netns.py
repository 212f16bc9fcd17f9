"""P and D on hosts of their own (network namespaces joined by a bridge, NIXL over TCP only):
real NIXL across a link that fails. A READ whose link dropped is given up only once NIXL says it
ended, so nothing lands in its blocks after D reported it (NIXL "releases" a READ in progress over
a stalled connection, and its data then arrives when the link comes back: the late write this
test caught); the next request is read byte-exact; a handshake to a loopback side channel, or to
a port nothing listens on, fails within handshake_timeout_s naming the setting. ~40 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nixlkv.serving import netns

pytestmark = pytest.mark.nixl

HERE = Path(__file__).resolve().parent
SCENARIO = {"p_tp": 1, "d_tp": 1, "num_tokens": 40}
TRANSFER_TIMEOUT_S = 1.0
HANDSHAKE_TIMEOUT_S = 2.0
LINK_DOWN_S = 3.0  # longer than the transfer timeout: D gives up on the READ while the link is down


class Peer:
    """A process of tests/netns_peer.py on one host."""

    def __init__(self, host: netns.Host, role: str, spec: dict) -> None:
        env = dict(os.environ, **netns.UCX_ENV, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
        self.proc = subprocess.Popen(host.wrap([sys.executable, str(HERE / "netns_peer.py"), role, json.dumps(spec)]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def line(self, prefix: str) -> str:
        for line in self.proc.stdout:  # NIXL writes its own lines there too
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise AssertionError(f"the peer ended (exit {self.proc.wait(10)}) before printing {prefix!r}")

    def load(self, rid: str, local: list[int], remote_port: int | None = None,
             remote_host: str | None = None) -> dict:
        where = f" {remote_host}:{remote_port}" if remote_port is not None else ""
        self.proc.stdin.write(f"load {rid} {','.join(map(str, local))}{where}\n")
        self.proc.stdin.flush()
        return json.loads(self.line("result "))

    def command(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.line("result "))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def pair():
    net = netns.Network(["p", "d"], tag=f"c{os.getpid() % 100000}")
    peers: list[Peer] = []
    with net:
        ph, dh = net.hosts["p"], net.hosts["d"]
        spec = {"scenario": SCENARIO, "p_ids": [1, 2, 3], "seed": 3}
        p = Peer(ph, "prefill", {**spec, "address": ph.address, "holds": [f"r{i}" for i in range(12)]})
        peers.append(p)
        port = int(p.line("port "))
        d = Peer(dh, "decode", {**spec, "remote_host": ph.address, "remote_port": port, "give_up_s": 60,
                                "transfer_timeout_s": TRANSFER_TIMEOUT_S, "handshake_timeout_s": HANDSHAKE_TIMEOUT_S})
        peers.append(d)
        d.line("ready")
        try:
            yield net, p, d, port
        finally:
            for peer in reversed(peers):
                peer.stop()


def cut_read(net: netns.Network, d: Peer, rid: str, local: list[int]) -> dict:
    """A load sent to D with P's link down, the link back LINK_DOWN_S later (or once D reported it)."""
    net.set_link("p", False)
    back = threading.Timer(LINK_DOWN_S, net.set_link, ("p", True))
    back.start()
    try:
        return d.load(rid, local)
    finally:
        back.cancel()
        net.set_link("p", True)


def test_a_handshake_to_loopback_or_a_closed_port_fails_in_time_naming_the_setting(pair) -> None:
    net, _, d, port = pair
    lo = d.load("r0", [4, 5, 6], port, "127.0.0.1")  # P advertised its side channel on loopback
    assert lo["done"] and lo["failed"] and lo["seconds"] < HANDSHAKE_TIMEOUT_S + 3, lo
    said = " ".join(lo["log"])
    assert "127.0.0.1" in said and "loopback address" in said and "side_channel_host" in said, said
    host = net.hosts["p"].address
    closed = d.load("r1", [7, 8, 9], port + 7, host)  # a port nothing listens on at P's address
    assert closed["done"] and closed["failed"] and closed["seconds"] < HANDSHAKE_TIMEOUT_S + 3, closed
    said = " ".join(closed["log"])
    assert f"connection refused: nothing listens on {host}:{port + 7}" in said and "side_channel_port" in said, said
    ok = d.load("r2", [10, 11, 12], port, host)  # the right address: served, byte-exact
    assert ok["done"] and not ok["failed"] and ok["bytes_exact"], ok


def test_a_read_cut_by_a_link_down_is_given_up_only_once_nothing_can_land(pair) -> None:
    net, _, d, port = pair
    warm = d.load("r3", [16, 17, 18])
    assert warm["done"] and not warm["failed"] and warm["bytes_exact"], warm
    cut = cut_read(net, d, "r4", [19, 20, 21])
    assert cut["done"] and cut["failed"], cut  # reported failed, never hung ...
    # ... but only once the READ ended: its blocks stayed held while the link was down
    assert cut["seconds"] >= LINK_DOWN_S, cut
    assert any(f"READs from {net.hosts['p'].address} not done after transfer_timeout_s=1 s" in line
               for line in cut["log"]), cut["log"]
    assert cut["bytes_exact"], cut  # nothing outside the failed request's blocks written
    nxt = d.load("r5", [22, 23, 24])
    assert nxt["done"] and not nxt["failed"] and nxt["bytes_exact"], nxt
    time.sleep(8)  # past TCP's next retransmissions: a READ still live would have landed by now
    last = d.load("r6", [25, 26, 27])
    # every block of every load is as it was when D reported it: no late write into the cut READ's blocks
    assert last["done"] and not last["failed"] and last["bytes_exact"], last


def test_p_acknowledges_heartbeats_across_the_link(pair) -> None:
    """P answers D's heartbeat over NIXL to D's own agent, on the other host: the path D's proof of
    P's hold rests on (docs/vllm.md, "Failure semantics")."""
    _, _, d, _ = pair
    ok = d.load("r9", [34, 35, 36])  # a handshake to P (again, after the cut) and a load
    assert ok["done"] and not ok["failed"] and ok["bytes_exact"], ok
    acked = d.command("beat r10")  # r10: held by P, not read yet
    assert acked["remotes"] == 1 and acked["acks"] and acked["hold_acks"] == 1, acked


def test_control_a_read_released_as_nixl_offers_lands_after_it_was_reported(pair) -> None:
    """The negative control (last: it leaves D's blocks written behind its back): READs released
    whatever NIXL's state, as nixlkv did before. The cut request is reported at the transfer
    timeout, while the link is down, and P's bytes land in its blocks once the link is back."""
    net, _, d, port = pair
    d.proc.stdin.write("release-as-nixl-offers\n")
    d.proc.stdin.flush()
    d.line("result ")
    cut = cut_read(net, d, "r7", [28, 29, 30])
    assert cut["done"] and cut["failed"] and cut["seconds"] < LINK_DOWN_S, cut  # reported with the link down
    assert cut["bytes_exact"], cut  # nothing had landed yet
    time.sleep(8)
    last = d.load("r8", [31, 32, 33])
    assert not last["bytes_exact"] and "block 28" in last.get("first_wrong", ""), last  # the late write
