"""Separate hosts for the serving check: network namespaces the check makes, joined by a bridge,
nothing reachable outside them, everything removed afterwards; and the engines placed on them."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time
import urllib.request

import pytest

from nixlkv.serving import check, netns
from nixlkv.serving.check import Case


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def test_hosts_reach_each_other_and_nothing_else_and_leave_nothing_behind() -> None:
    net = netns.Network(["a", "b"], tag="t9")
    with net:
        a, b = net.hosts["a"], net.hosts["b"]
        assert a.namespace in _namespaces() and b.namespace in _namespaces()
        server = subprocess.Popen(b.wrap([sys.executable, "-m", "http.server", "9931", "--bind", b.address]),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            fetch = ("import sys, urllib.request\n"
                     "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=3).status)\n"
                     "except OSError as e:\n    print(type(e).__name__)")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the server binds within a second or two
                try:
                    urllib.request.urlopen(f"http://{b.address}:9931/", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            assert urllib.request.urlopen(f"http://{b.address}:9931/", timeout=3).status == 200  # from this host
            across = subprocess.run(a.wrap([sys.executable, "-c", fetch, f"http://{b.address}:9931/"]),
                                    capture_output=True, text=True, timeout=30)
            assert across.stdout.strip() == "200"  # host a reaches host b over the bridge
            # the controls: b's own loopback is not a's, and no address outside the network is routed
            own = subprocess.run(a.wrap([sys.executable, "-c", fetch, "http://127.0.0.1:9931/"]),
                                 capture_output=True, text=True, timeout=30)
            assert own.stdout.strip() == "URLError"
            out = subprocess.run(a.wrap([sys.executable, "-c", "import socket; s = socket.socket(); "
                                         "s.settimeout(2); s.connect(('192.0.2.1', 80))"]),
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode != 0 and "Network is unreachable" in out.stderr
        finally:
            server.kill()
            server.wait()
    assert "nxt9-" not in _namespaces() and net.bridge not in _links()


def test_a_host_that_cannot_be_made_removes_what_was_made() -> None:
    net = netns.Network(["a", "a2"], tag="t8")
    net.hosts["a2"] = netns.Host(net.hosts["a"].namespace, net.hosts["a2"].address)  # the second clashes
    with pytest.raises(check.ServeError, match="ip netns add nxt8-a.* failed"):
        net.make()
    assert "nxt8-" not in _namespaces() and net.bridge not in _links()


def test_engines_and_the_proxy_are_placed_each_on_a_host_of_its_own(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    with pytest.raises(ValueError, match="hosts must be one of"):
        Case(hosts="cluster")
    case = Case(hosts="netns", prefills=2)
    assert case.label == "tiny-llama 2xP1->D1 b32 netns nixlkv"
    srv = check.Servers(case, check.Options(python="python"))
    assert srv.network is not None
    specs = [srv.p_spec, *srv.more_p_specs, srv.d_spec]
    addresses = {s.host for s in specs} | {srv.proxy_host}
    assert len(addresses) == 4 and all(ipaddress.ip_address(a) in srv.network.subnet for a in addresses)
    for spec in specs:
        argv, env = spec.argv("python"), spec.environ()
        assert argv[:4] == ["ip", "netns", "exec", srv.network.hosts[
            next(n for n, h in srv.network.hosts.items() if h.address == spec.host)].namespace]
        assert argv[argv.index("--host") + 1] == spec.host
        assert spec.kv_transfer_config()["kv_connector_extra_config"]["side_channel_host"] == spec.host
        assert env["VLLM_HOST_IP"] == spec.host and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == spec.host
        assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == netns.DEVICE
    assert srv.p_urls == [f"http://{s.host}:{s.port}" for s in specs[:2]]
    assert srv.proxy_url == f"http://{srv.proxy_host}:{srv.opts.port + 2}"
    plain = check.Servers(Case(), check.Options(python="python"))
    assert plain.network is None and plain.p_spec.host == "127.0.0.1" and "UCX_TLS" not in plain.p_spec.env
    assert plain.p_spec.argv("python")[0] == "python" and "VLLM_HOST_IP" not in plain.p_spec.environ()
    with pytest.raises(ValueError, match="--proxy-cmd.*netns is not supported"):
        check.Servers(case, check.Options(python="python", proxy_cmd="x {port}"))


def test_the_kv_must_reach_d_through_its_interface(monkeypatch) -> None:
    # D's connector says it read 1 MB: its interface must have received at least that much, or the
    # bytes came some other way than across the network (or nothing moved at all)
    class Net:
        hosts = {"decode0": netns.Host("ns", "10.231.16.3")}

        def __init__(self, received: int) -> None:
            self.received = received

        def received_bytes(self, name: str) -> int:
            assert name == "decode0"
            return self.received

    srv = type("S", (), {"case": Case(hosts="netns"), "decode_metrics": lambda self: {
        "vllm:nixlkv_xfer_time_seconds_count": 3.0, "vllm:nixlkv_bytes_transferred_sum": 1e6}})()
    assert check.crossed_the_network(srv, Net(1_200_000))["ok"]
    assert not check.crossed_the_network(srv, Net(999_999))["ok"]
    srv.decode_metrics = lambda: {}
    assert not check.crossed_the_network(srv, Net(1_200_000))["ok"]  # nothing loaded: nothing proven


def test_networks_made_side_by_side_get_subnets_of_their_own_and_a_taken_one_is_refused() -> None:
    """Checks run at once (a matrix beside a drill) each pick from their own candidate on, and a
    subnet another network took between a check's pick and its make is refused by name, never
    shared (two bridges on one subnet would cut both checks' clients off their hosts)."""
    used = netns._used_subnets()
    k = next(i for i, n in enumerate(netns.SUBNETS) if i > 0 and not any(n.overlaps(u) for u in used))
    assert netns.free_subnet(start=k) == netns.SUBNETS[k]  # from its own candidate on
    one = netns.Network(["a"], tag="t7")
    with one:
        assert netns.free_subnet(start=netns.SUBNETS.index(one.subnet)) != one.subnet  # its route is seen
        clash = netns.Network(["a"], tag="t6", subnet=one.subnet)
        with pytest.raises(check.ServeError, match=f"subnet {one.subnet} overlaps route .*start the check again"):
            clash.make()
        assert "nxt6-" not in _namespaces() and clash.bridge not in _links()  # nothing of it left
        other = netns.Network(["a"], tag="t5")
        with other:
            assert other.subnet != one.subnet
    assert "nxt7-" not in _namespaces() and "nxt5-" not in _namespaces()


def test_an_interrupt_while_stopping_still_stops_every_engine_and_removes_the_hosts(tmp_path, monkeypatch) -> None:
    """Ctrl-C twice: the second interrupt lands while the first engine winds down (its 20 s grace).
    Every other engine is still stopped and the hosts removed, then the interrupt is raised. Once,
    an engine outlived such a run (the stop loop ended at the second interrupt)."""
    monkeypatch.setattr(check, "build_model", lambda name, root, python: tmp_path)
    srv = check.Servers(Case(hosts="netns", prefills=2), check.Options(python="python"))
    stopped: list[tuple[str, float | None]] = []

    class Engine:
        def __init__(self, name: str, interrupts: bool = False) -> None:
            self.name, self.interrupts = name, interrupts

        def stop(self, grace_s: float | None = None) -> None:
            stopped.append((self.name, grace_s))
            if self.interrupts and grace_s is None:
                raise KeyboardInterrupt

    closed: list[bool] = []
    monkeypatch.setattr(srv.network, "close", lambda: closed.append(True))
    srv.proxy, srv.d, srv.p = Engine("proxy", interrupts=True), Engine("d"), Engine("p")
    srv.more_d, srv.more_p = [], [Engine("p1")]
    with pytest.raises(KeyboardInterrupt):
        srv.stop()
    assert [name for name, _ in stopped] == ["proxy", "proxy", "d", "p", "p1"]
    assert all(grace == 0.0 for _, grace in stopped[1:])  # after the interrupt: no more grace
    assert closed == [True]
