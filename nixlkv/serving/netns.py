"""Separate hosts on one machine: each engine and the proxy in a network namespace of its own.

The check makes the hosts itself (root, or ``CAP_NET_ADMIN``): one namespace per host, each joined
to a bridge in the machine's own namespace by a veth pair whose inner end is called ``nx0``, and
addresses of one /24 subnet it picks unused (the bridge ``.1``, the hosts ``.2`` on). A namespace
has no route but its subnet, so nothing it sends can leave the hosts the check made; the check's
client, in the machine's namespace, reaches every host over the bridge. Everything is removed on
exit, also after a failure.

Inside a host, vLLM serves on its own address; NIXL's UCX is held to TCP on ``nx0``
(:data:`UCX_ENV`), so every KV byte crosses a socket rather than process memory.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from types import TracebackType

from .launch import ServeError

DEVICE = "nx0"  # every host's interface on the check's network
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE}  # NIXL's bytes over TCP on that interface only
SUBNETS = [ipaddress.ip_network(f"10.231.{k}.0/24") for k in range(16, 240)]  # candidates
# Checks that make their networks at once (a matrix beside a drill) claim a subnet under this lock.
LOCK_PATH = os.path.join(tempfile.gettempdir(), "nixlkv-netns.lock")


@dataclass(frozen=True)
class Host:
    """One host of the check's network: a namespace and its address there."""

    namespace: str
    address: str

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the host (``ip netns exec`` enters the namespace and execs it)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise ServeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}; separate hosts "
                         f"are network namespaces, which need root (CAP_NET_ADMIN) and iproute2")


def _used_subnets() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True)
    nets = []
    for line in out.stdout.splitlines():
        dest = line.split()[0] if line.strip() else ""
        try:
            nets.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            continue  # "default" and the like
    return nets


def free_subnet(start: int = 0) -> ipaddress.IPv4Network:
    """The first candidate subnet, from candidate ``start`` on (cyclically), that no route of this
    machine overlaps. Each process starts at its own candidate, so checks run side by side pick
    different subnets; :meth:`Network.make` confirms the pick under a lock."""
    used = _used_subnets()
    for i in range(len(SUBNETS)):
        net = SUBNETS[(start + i) % len(SUBNETS)]
        if not any(net.overlaps(u) for u in used):
            return net
    raise ServeError("no free 10.231.x.0/24 subnet for the check's hosts: every candidate overlaps a route")


class Network:
    """Hosts named ``names``, addressed at construction (``hosts``), made on ``__enter__`` (or
    :meth:`make`) and removed on ``__exit__`` (or :meth:`close`)."""

    def __init__(self, names: list[str], tag: str | None = None,
                 subnet: ipaddress.IPv4Network | None = None) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"host names must differ: {names}")
        self.tag = tag or str(os.getpid())
        self.bridge = f"nxb{self.tag}"[:15]
        self.subnet = subnet or free_subnet(start=os.getpid())
        addresses = list(self.subnet.hosts())
        if len(names) + 1 > len(addresses):
            raise ValueError(f"{len(names)} hosts do not fit in {self.subnet}")
        self.gateway = str(addresses[0])  # the bridge: the check's client's address on the network
        self.hosts = {name: Host(f"nx{self.tag}-{name}", str(addresses[i + 1])) for i, name in enumerate(names)}
        self._made: list[str] = []  # namespaces made so far (removed on exit)
        self._bridge_made = False

    def __enter__(self) -> Network:
        self.make()
        return self

    def make(self) -> None:
        """Make every host; on any failure, remove what was made and raise."""
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _make(self) -> None:
        bits = self.subnet.prefixlen
        with open(LOCK_PATH, "a") as lock:  # the subnet is claimed (its route made) by one check at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = [u for u in _used_subnets() if self.subnet.overlaps(u)]
            if taken:
                raise ServeError(f"the check's subnet {self.subnet} overlaps route {taken[0]} (another network on this "
                                 f"machine took it since it was picked); start the check again to pick another")
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.gateway}/{bits}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts.values()):
            outer = f"nxv{self.tag}{i}"[:15]
            _ip("netns", "add", host.namespace)
            self._made.append(host.namespace)
            _ip("link", "add", outer, "type", "veth", "peer", "name", DEVICE, "netns", host.namespace)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{bits}", "dev", DEVICE)
            _ip("-n", host.namespace, "link", "set", DEVICE, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")  # vLLM's own processes talk over loopback

    def close(self) -> None:
        """Remove every namespace (their veth pairs go with them) and the bridge; never raises."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._bridge_made = False

    def received_bytes(self, name: str) -> int:
        """Bytes host ``name``'s interface has received since it was made (the kernel's counter)."""
        out = subprocess.run(["ip", "-n", self.hosts[name].namespace, "-s", "-j", "link", "show", DEVICE],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise ServeError(f"reading {name}'s {DEVICE} counters failed: {out.stderr.strip()}")
        return int(json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"])

    def set_link(self, name: str, up: bool) -> None:
        """Drop (or restore) one host's link to the others, as a cable pulled and put back."""
        _ip("-n", self.hosts[name].namespace, "link", "set", DEVICE, "up" if up else "down")
