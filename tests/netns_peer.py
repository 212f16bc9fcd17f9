"""Fabricated engines on hosts of their own, each run inside a network namespace by
``ip netns exec`` (tests/test_connector_netns.py): real NIXL between them, over TCP only.

``prefill SPEC``: its workers hold requests on blocks filled with the oracle pattern and answer
handshakes on its address; prints ``port N``, serves until its stdin closes.
``decode SPEC``: reads one command a line from stdin (``release-as-nixl-offers``: the negative
control, READs released whatever NIXL's state; ``beat RID``: one heartbeat naming RID, and P's
acknowledgement across the link awaited; ``load RID LOCAL_IDS [HOST:PORT]``: load a
request of P's blocks into these blocks, from P's side channel or the one named, and print how it
ended as one JSON line: done, failed, seconds, the connector's warnings and errors, and whether
every block loaded so far is P's and nothing else was written); ends when stdin closes."""

from __future__ import annotations

import json
import logging
import select
import sys
import time

from nixlkv.testing import oracle
from nixlkv.vllm.config import ConnectorConfig
from nixlkv.vllm.handshake import SideChannelServer
from nixlkv.vllm.metadata import NixlkvMetadata, RecvRequest
from nixlkv.vllm.worker import serve_reply

from connector_helpers import COMPAT, Engine, blocks, fa_scenario
from pd_harness import keep_blocks


def prefill(spec: dict) -> None:
    p = Engine(fa_scenario(**spec["scenario"]), "prefill", "P")
    try:
        for r, w in zip(p.ranks, p.workers):
            oracle.fill_prefill(r, blocks(r, spec["p_ids"]), seed=spec["seed"])
            w.start_load_kv(NixlkvMetadata(reqs_to_send=dict.fromkeys(spec["holds"], 600.0)))
        infos = {w.topology.tp_rank: w.handshake_info() for w in p.workers}
        reply = serve_reply(p.engine_id, len(p.workers), infos, COMPAT)
        p.server = SideChannelServer(spec["address"], 0, lambda: reply)
        print(f"port {p.server.port}", flush=True)
        while not select.select([sys.stdin], [], [], 0.005)[0]:
            for w in p.workers:
                w.get_finished(set())
    finally:
        p.close()


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def release_as_nixl_offers(nixl):  # noqa: ANN001, ANN201 - a NixlRank
    """The release nixlkv made before it checked NIXL's state: whatever NIXL lets go of."""

    def release_handle(handle: object) -> bool:
        try:
            nixl.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001
            return False
        return True

    return release_handle


def beat_once(w, rid: str, wait_s: float = 5.0) -> dict:  # noqa: ANN001 - a NixlkvWorker
    """Name ``rid`` (lease 600 s) in one heartbeat to every handshaken remote and wait up to
    ``wait_s`` for P's acknowledgement: what D's acknowledged-hold count gained, and whether the
    remote said it acknowledges."""
    before = w.stats.data.get("hold_acks", 0)
    remotes = [r for r in w._remotes.values() if r.prepared is not None]
    for remote in remotes:
        w._beat(remote, {rid: (600.0, time.monotonic())})
    t0 = time.monotonic()
    while w.stats.data.get("hold_acks", 0) == before and time.monotonic() - t0 < wait_s:
        w.get_finished(set())
        time.sleep(0.01)
    return {"remotes": len(remotes), "acks": all(r.acks for r in remotes),
            "hold_acks": w.stats.data.get("hold_acks", 0) - before, "seconds": round(time.monotonic() - t0, 3)}


def decode(spec: dict) -> None:
    log = LogLines()
    logging.getLogger("nixlkv.connector").addHandler(log)
    config = ConnectorConfig(transfer_timeout_s=spec["transfer_timeout_s"], handshake_timeout_s=spec["handshake_timeout_s"],
                             heartbeat_interval_s=0, nixl_progress_delay_us=spec.get("nixl_progress_delay_us", 0))
    d = Engine(fa_scenario(**spec["scenario"]), "decode", "D", config=config)
    w, rank = d.workers[0], d.ranks[0]
    oracle.fill_decode(rank)
    expected = rank.buffer.clone()  # the sentinel: nothing loaded yet
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            if cmd[0] == "release-as-nixl-offers":  # the negative control: release READs NIXL still runs
                w.nixl.release_handle = release_as_nixl_offers(w.nixl)
                print("result {}", flush=True)
                continue
            if cmd[0] == "beat":  # one heartbeat naming RID to every handshaken P; P's acknowledgement awaited
                print("result " + json.dumps(beat_once(w, cmd[1])), flush=True)
                continue
            rid, local = cmd[1], [int(b) for b in cmd[2].split(",")]
            host, port = spec["remote_host"], spec["remote_port"]
            beat = "beat" in cmd[3:]  # heartbeats to P every second while the load waits, as D's scheduler asks
            where = [c for c in cmd[3:] if c != "beat"]
            if where:
                host, port = where[0].rsplit(":", 1)
            req = RecvRequest(local_block_ids=(local,), remote_block_ids=(spec["p_ids"][:len(local)],),
                              remote_engine_id="P", remote_request_id=rid, remote_host=host, remote_port=int(port))
            del log.lines[:]
            t0 = time.monotonic()
            w.start_load_kv(NixlkvMetadata(reqs_to_recv={rid: req}))
            out = {"rid": rid, "done": False}
            next_beat = t0 + 1.0
            while time.monotonic() - t0 < spec["give_up_s"]:
                w.start_load_kv(None)
                if beat and time.monotonic() > next_beat:
                    next_beat += 1.0
                    for remote in list(w._remotes.values()):
                        if remote.prepared is not None:
                            w._beat(remote, {rid: None})
                _, done = w.get_finished(set())
                failed = w.take_failed_recving()
                if rid in done:
                    out = {"rid": rid, "done": True, "failed": rid in failed}
                    break
                time.sleep(0.005)
            out["seconds"] = round(time.monotonic() - t0, 3)
            out["log"] = list(log.lines)
            out["busy"] = w.busy
            if out["done"] and not out["failed"]:
                oracle.write_pattern(rank, expected, blocks(rank, local), seed=spec["seed"])
            else:  # a failed (or unfinished) load's own blocks may hold anything
                keep_blocks(expected, rank, set(local))
            # every block loaded so far is P's, and nothing else was written
            wrong = oracle.compare(rank, expected)
            out["bytes_exact"] = wrong is None
            if wrong is not None:
                out["first_wrong"] = str(wrong)
            print("result " + json.dumps(out), flush=True)
    finally:
        d.close()


if __name__ == "__main__":
    {"prefill": prefill, "decode": decode}[sys.argv[1]](json.loads(sys.argv[2]))
