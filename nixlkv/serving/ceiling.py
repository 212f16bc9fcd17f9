"""The transport's ceiling for a served transfer: a raw NIXL READ of the same byte count between
agents on this machine, with the agent settings the served engines ran with.

A served request's READs can go no faster than NIXL moving the same bytes as one contiguous
descriptor per prefill rank (what ``nixlkv bench`` calls its ceiling): no planner can post fewer
or larger descriptors. ``serve-bench`` measures it in the same run as the servers (after they
stopped, so they take no core from it) and states each connector's transfer against it.

Where the servers ran on separate hosts (``--hosts netns``), so does the ceiling: each prefill
agent and the decode agent in a host of its own (:mod:`nixlkv.serving.netns`), NIXL held to TCP
between them as the engines were. Run as ``python -m nixlkv.serving.ceiling prefill|decode ...``
inside those hosts, this module is both sides of that measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..transport.nixl_rank import NixlRank, TransferError
from . import agent_pause

WAIT_TIMEOUT_S = 120.0
HOSTS_TIMEOUT_S = 300.0  # a whole across-hosts measurement, agents' start included


@dataclass(frozen=True)
class AgentSettings:
    """What every NIXL agent of a measurement is built with: the served engines' and the ceiling's."""

    progress_delay_us: int  # 0: NIXL's busy-polling progress thread (vLLM's NixlConnector's own)
    num_threads: int  # the UCX backend's worker threads (vLLM's NixlConnector: its ``num_threads``, 4)
    telemetry: bool  # NIXL's per-transfer telemetry (vLLM's NixlConnector: always on)

    def nixlkv_config(self) -> dict[str, object]:
        """These settings as nixlkv's ``kv_connector_extra_config`` keys."""
        return {"nixl_progress_delay_us": self.progress_delay_us, "nixl_num_threads": self.num_threads,
                "nixl_telemetry": self.telemetry}

    def vllm_config(self) -> dict[str, object]:
        """These settings for vLLM's NixlConnector, which exposes only ``num_threads`` and builds its
        agents with telemetry on; its progress thread's pause comes from :meth:`engine_env`."""
        if not self.telemetry:
            raise ValueError("vLLM's NixlConnector always captures NIXL telemetry; got telemetry=False")
        return {"num_threads": self.num_threads}

    def engine_env(self) -> dict[str, str]:
        """What every engine's environment gets: a pause, through the plugin that gives it to every
        NIXL agent of the engine, vLLM's too (:mod:`nixlkv.serving.agent_pause`); none for 0."""
        return {agent_pause.ENV: str(self.progress_delay_us)} if self.progress_delay_us else {}

    def agent(self, name: str, buf: np.ndarray) -> NixlRank:
        """A NIXL agent with these settings and ``buf`` registered."""
        return NixlRank(name, [(buf.ctypes.data, buf.nbytes)], num_threads=self.num_threads,
                        capture_telemetry=self.telemetry, progress_delay_us=self.progress_delay_us)


# vLLM's NixlConnector's own agent (base_worker: nixl_agent_config(num_threads=4, capture_telemetry=True),
# NIXL's progress thread at its default pthrDelay 0), which nixlkv can be set to match.
VLLM_AGENT = AgentSettings(progress_delay_us=0, num_threads=4, telemetry=True)
# The same with nixlkv's CPU pause (1 ms between polls), for both connectors: on a machine with few
# cores each busy-polling agent takes a core from the engines.
PAUSED_AGENT = AgentSettings(progress_delay_us=1000, num_threads=4, telemetry=True)


def _touched(nbytes: int, fill: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)  # touch every page: untouched ones would fault inside the timed READ
    return buf


def _checked(nbytes: int, prefill_ranks: int, reps: int) -> int:
    """Each prefill rank's share of ``nbytes``, after the arguments are checked."""
    if nbytes <= 0 or prefill_ranks < 1 or reps < 1:
        raise ValueError(f"nbytes, prefill_ranks and reps must be positive, got {nbytes}, {prefill_ranks}, {reps}")
    return nbytes // prefill_ranks


@dataclass(frozen=True)
class PrefillAddress:
    """What the decode side needs of one prefill agent: its NIXL metadata and where its bytes are."""

    metadata: bytes
    base: int  # address of the prefill agent's registered buffer

    def to_json(self) -> str:
        return json.dumps({"metadata": self.metadata.hex(), "base": self.base})

    @classmethod
    def from_json(cls, text: str) -> PrefillAddress:
        d = json.loads(text)
        return cls(bytes.fromhex(d["metadata"]), int(d["base"]))


@dataclass(frozen=True)
class PrefillAgent:
    """One prefill agent of the ceiling: a share of bytes, every one ``rank + 1``, registered."""

    nixl: NixlRank
    buf: np.ndarray

    @classmethod
    def make(cls, settings: AgentSettings, rank: int, share: int) -> PrefillAgent:
        buf = _touched(share, rank + 1)
        return cls(settings.agent(f"ceiling-P{rank}", buf), buf)

    @property
    def address(self) -> PrefillAddress:
        return PrefillAddress(bytes(self.nixl.metadata()), self.buf.ctypes.data)


def timed_reads(d: NixlRank, d_buf: np.ndarray, share: int, prefills: list[PrefillAddress], reps: int) -> list[float]:
    """The decode side: READ ``share`` bytes from each prefill agent (in rank order; rank r's bytes
    are all ``r + 1``) into its slice of ``d_buf``, posted together; one warm-up READ, checked,
    then ``reps`` timed (their seconds)."""
    agent = d.agent
    lists = [(agent.get_xfer_descs(np.array([[d_buf.ctypes.data + r * share, share, 0]], dtype=np.uint64), "DRAM"),
              agent.get_xfer_descs(np.array([[p.base, share, 0]], dtype=np.uint64), "DRAM"), d.add_remote(p.metadata))
             for r, p in enumerate(prefills)]

    def once() -> float:
        t0 = time.perf_counter()
        handles = [agent.initialize_xfer("READ", loc, rem, name) for loc, rem, name in lists]
        for h in handles:
            if agent.transfer(h) == "ERR":
                raise TransferError("NIXL refused the ceiling's READ")
        deadline = t0 + WAIT_TIMEOUT_S
        while any(agent.check_xfer_state(h) == "PROC" for h in handles):
            if time.perf_counter() > deadline:
                raise TransferError(f"the ceiling's READ of {share * len(lists)} bytes was not done in "
                                    f"{WAIT_TIMEOUT_S:.0f} s")
        elapsed = time.perf_counter() - t0
        if any(agent.check_xfer_state(h) == "ERR" for h in handles):
            raise TransferError("the ceiling's READ ended in error")
        for h in handles:
            agent.release_xfer_handle(h)
        return elapsed

    d_buf.fill(0)
    once()
    for r in range(len(lists)):
        got = d_buf[r * share:(r + 1) * share]
        if not (got[:4096] == r + 1).all() or not (got[-4096:] == r + 1).all():
            raise TransferError(f"the ceiling's READ did not bring prefill agent {r}'s bytes")
    return [once() for _ in range(reps)]


def read_ceiling(nbytes: int, prefill_ranks: int, reps: int, settings: AgentSettings) -> list[float]:
    """Seconds for one decode agent to READ ``nbytes`` as one contiguous descriptor from each of
    ``prefill_ranks`` prefill agents (an equal share each), posted together, every agent in this
    process; one warm-up READ, then ``reps`` timed (their seconds). Every agent is built with
    ``settings``."""
    share = _checked(nbytes, prefill_ranks, reps)
    d_buf = _touched(share * prefill_ranks, 0)
    d = settings.agent("ceiling-D", d_buf)
    made: list[PrefillAgent] = []
    try:
        made = [PrefillAgent.make(settings, r, share) for r in range(prefill_ranks)]
        return timed_reads(d, d_buf, share, [p.address for p in made], reps)
    finally:
        d.close()
        for p in made:
            p.nixl.close()


def read_ceiling_across_hosts(nbytes: int, prefill_ranks: int, reps: int, settings: AgentSettings,
                              python: str = sys.executable) -> list[float]:
    """:func:`read_ceiling` with each prefill agent and the decode agent on a host of its own (a
    network namespace made here and removed on return; root), NIXL held to TCP between them
    (``netns.UCX_ENV``), as the engines of ``serve-bench --hosts netns`` were; the decode host's
    interface must have received every byte read. ``python``: one that imports nixlkv and NIXL."""
    from . import netns

    share = _checked(nbytes, prefill_ranks, reps)
    names = [f"prefill{r}" for r in range(prefill_ranks)] + ["decode0"]
    env = {**os.environ, **netns.UCX_ENV}
    cfg = json.dumps(asdict(settings))
    with netns.Network(names, tag=f"c{os.getpid() % 100000}") as network, tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp)
        done = files / "done"
        procs: dict[str, subprocess.Popen] = {}

        def start(name: str, argv: list[str]) -> None:
            with open(files / f"{name}.out", "w") as out, open(files / f"{name}.err", "w") as err:
                procs[name] = subprocess.Popen(network.hosts[name].wrap([python, "-m", __name__, *argv]), env=env,
                                               stdout=out, stderr=err)

        def said(name: str) -> str:
            return (files / f"{name}.err").read_text().strip()[-400:]

        try:
            for r in range(prefill_ranks):
                start(f"prefill{r}", ["prefill", "--rank", str(r), "--share", str(share), "--settings", cfg,
                                      "--out", str(files / f"prefill{r}.json"), "--until", str(done)])
            start("decode0", ["decode", "--share", str(share), "--reps", str(reps), "--settings", cfg,
                              *[str(files / f"prefill{r}.json") for r in range(prefill_ranks)]])
            deadline = time.monotonic() + HOSTS_TIMEOUT_S
            while procs["decode0"].poll() is None:  # bounded: a prefill agent gone, or the deadline, ends it
                gone = [n for n, p in procs.items() if n != "decode0" and p.poll() is not None]
                if gone or time.monotonic() > deadline:
                    why = f"{gone[0]} exited ({said(gone[0])})" if gone else f"not done in {HOSTS_TIMEOUT_S:.0f} s"
                    raise TransferError(f"the ceiling across hosts failed: {why}")
                time.sleep(0.05)
            if procs["decode0"].returncode != 0:
                raise TransferError(f"the ceiling across hosts failed: its decode agent exited "
                                    f"{procs['decode0'].returncode} ({said('decode0')})")
            crossed = network.received_bytes("decode0")
            if crossed < nbytes * (reps + 1):  # the warm-up READ and the timed ones
                raise TransferError(f"the ceiling across hosts read {nbytes * (reps + 1)} bytes but decode0's interface "
                                    f"received {crossed}: NIXL did not go over the network")
            return [float(x) for x in json.loads((files / "decode0.out").read_text().strip().splitlines()[-1])]
        finally:
            done.touch()  # the prefill agents leave within one of their 50 ms naps
            if "decode0" in procs and procs["decode0"].poll() is None:
                procs["decode0"].kill()  # only after a failure: it may be waiting for an agent that died
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _wait_for(paths: list[Path], deadline: float) -> None:
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise TransferError(f"no prefill agent wrote {missing} in time")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    """One side of :func:`read_ceiling_across_hosts`, run inside its host."""
    ap = argparse.ArgumentParser(prog="python -m nixlkv.serving.ceiling")
    sub = ap.add_subparsers(dest="side", required=True)
    p = sub.add_parser("prefill", help="register a share of bytes all rank + 1, write the agent's JSON, serve "
                       "READs until --until exists")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--until", required=True)
    d = sub.add_parser("decode", help="READ each prefill agent's share and print the timed READs' seconds as JSON")
    d.add_argument("--reps", type=int, required=True)
    d.add_argument("prefills", nargs="+", help="the prefill agents' JSON files, in rank order")
    for q in (p, d):
        q.add_argument("--share", type=int, required=True)
        q.add_argument("--settings", required=True, help="AgentSettings as JSON")
    args = ap.parse_args(argv)
    settings = AgentSettings(**json.loads(args.settings))
    deadline = time.monotonic() + HOSTS_TIMEOUT_S
    if args.side == "prefill":
        prefill = PrefillAgent.make(settings, args.rank, args.share)
        try:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(prefill.address.to_json())
            tmp.rename(args.out)  # whole, or not there
            while not Path(args.until).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # NIXL's progress thread answers the READs
        finally:
            prefill.nixl.close()
        return 0
    files = [Path(f) for f in args.prefills]
    _wait_for(files, deadline)
    d_buf = _touched(args.share * len(files), 0)
    agent = settings.agent("ceiling-D", d_buf)
    try:
        secs = timed_reads(agent, d_buf, args.share, [PrefillAddress.from_json(f.read_text()) for f in files], args.reps)
    finally:
        agent.close()
    print(json.dumps(secs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
