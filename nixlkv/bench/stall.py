"""``nixlkv bench-handshake``: how long a decode engine's steps get while it handshakes a new
prefill engine (#19: no engine-thread stall on a new remote).

Fabricated engines (``nixlkv.testing``), real NIXL on this machine's memory: P and D workers in
one process, D stepped the way its model runner steps the connector (``start_load_kv`` then
``get_finished`` per step) from the step that names the new remote until the request is loaded.
Reported in one run: the steps while the handshake runs, the step that takes it and posts the
READs, and the NIXL work of the handshake (adding the remote agents, preparing the descriptor
lists) that this step also paid before it moved to the handshake thread; and the NIXL work of a
second prefill engine of the same layout that the same decode engine meets next (its own remote
lists only: the local list is prepared once and shared).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ..testing.engines import build_rank
from ..testing.scenario import parse
from ..vllm.config import ConnectorConfig
from ..vllm.handshake import SideChannelServer
from ..vllm.metadata import NixlkvMetadata, RecvRequest
from ..vllm.worker import NixlkvWorker, serve_reply


HEADS, HEAD_SIZE, BLOCK = 8, 64, 16  # bf16 full attention: a block of one layer is BLOCK x HEADS x HEAD_SIZE x 2 (K, V) x 2 B


def scenario(layers: int, p_tp: int, d_tp: int, num_blocks: int, block: int = BLOCK, name: str = "stall") -> Any:
    """Full-attention layers of HEADS x HEAD_SIZE, P and D at ``block`` tokens a block, a request of 8 blocks."""
    return parse({
        "name": f"{name}-{layers}l-p{p_tp}-d{d_tp}",
        "model": {"layers": [{"kind": "full_attention", "count": layers, "num_kv_heads": HEADS, "head_size": HEAD_SIZE}]},
        "prefill": {"tp": p_tp, "block_size": block, "layout": "LBHNC", "num_blocks": num_blocks},
        "decode": {"tp": d_tp, "block_size": block, "layout": "LBHNC", "num_blocks": num_blocks},
        "request": {"num_tokens": block * 8, "seed": 0},
    })


def serve(p: list[NixlkvWorker], engine_id: str) -> SideChannelServer:
    """The side channel answering for the prefill workers ``p``."""
    reply = serve_reply(engine_id, len(p), {w.topology.tp_rank: w.handshake_info() for w in p}, "bench")
    return SideChannelServer("127.0.0.1", 0, lambda: reply)


def hand_over(p: list[NixlkvWorker], engine_id: str, port: int, rid: str, blocks: int) -> NixlkvMetadata:
    """P holds request ``rid`` (blocks 1..``blocks``); the metadata that makes D read it."""
    ids = list(range(1, blocks + 1))
    for w in p:
        w.start_load_kv(NixlkvMetadata(reqs_to_send={rid: 30.0}))
    req = RecvRequest(local_block_ids=(ids,), remote_block_ids=(ids,), remote_engine_id=engine_id,
                      remote_request_id=rid, remote_host="127.0.0.1", remote_port=port)
    return NixlkvMetadata(reqs_to_recv={rid: req})


def fabricated_workers(sc: Any, role: str, engine_id: str, config: ConnectorConfig) -> list[NixlkvWorker]:
    out = []
    for r in range(getattr(sc, role).tp):
        rank = build_rank(sc, role, r)
        w = NixlkvWorker(engine_id, rank.tp_rank, rank.side.tp, rank.kv_cache_config, config, "bench",
                         lambda name, rank=rank: rank.total_heads[name])
        w.register_kv_caches(rank.kv_caches)
        w._bench_rank = rank  # keeps the fabricated memory alive with its worker
        out.append(w)
    return out


def run(layers: int = 48, p_tp: int = 2, d_tp: int = 1, num_blocks: int = 64, reps: int = 3) -> dict[str, Any]:
    sc = scenario(layers, p_tp, d_tp, num_blocks)
    config = ConnectorConfig(nixl_progress_delay_us=1000)
    p = fabricated_workers(sc, "prefill", "P", config)
    q = fabricated_workers(sc, "prefill", "Q", config)  # another prefill engine of the same layout
    server, other = serve(p, "P"), serve(q, "Q")
    runs = []
    try:
        for i in range(reps):
            d = fabricated_workers(sc, "decode", f"D{i}", config)  # a fresh D each time: every first handshake is new
            try:
                first = _one(p, d, "P", server.port, f"req-{i}")
                second = _one(q, d, "Q", other.port, f"req-q-{i}")  # the same D meets Q next
                first["second_engine_nixl_ms"] = second["handshake_nixl_ms"]
                first["second_engine_lists_ms"] = second["handshake_lists_ms"]
                first["second_engine_lists"] = second["lists_prepared"]
                first["local_lists"] = max(w.nixl.local_lists for w in d)
                runs.append(first)
            finally:
                for w in d:
                    w.shutdown()
    finally:
        server.close()
        other.close()
        for w in (*p, *q):
            w.shutdown()
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "shape": f"{layers} full-attention layers, P TP{p_tp} -> D TP{d_tp}, {num_blocks} blocks",
        "runs": runs,
        "max_step_during_handshake_ms": max(r["max_step_during_handshake_ms"] for r in runs),
        "median_step_during_handshake_ms": med("median_step_during_handshake_ms"),
        "post_step_ms": med("post_step_ms"),
        "handshake_nixl_ms": med("handshake_nixl_ms"),
        "handshake_lists_ms": med("handshake_lists_ms"),
        # Before, the step that took the handshake also added the agents and prepared the lists.
        "post_step_before_ms": med("post_step_ms") + med("handshake_nixl_ms"),
        # A second prefill engine of the layout: its remote lists only (the local list is shared).
        "second_engine_nixl_ms": med("second_engine_nixl_ms"),
        "second_engine_lists_ms": med("second_engine_lists_ms"),
        "second_vs_first_nixl": med("second_engine_nixl_ms") / med("handshake_nixl_ms"),
        "lists_first_engine": runs[0]["lists_prepared"],
        "lists_second_engine": runs[0]["second_engine_lists"],
        "local_lists": max(r["local_lists"] for r in runs),
    }


def _one(p: list[NixlkvWorker], d: list[NixlkvWorker], engine_id: str, port: int, rid: str) -> dict[str, Any]:
    during: list[float] = []  # steps that ended with the handshake still in progress
    post_ms = 0.0  # the step that took the finished handshake and posted the READs
    done: set[int] = set()
    lists_before = sum(len(w.nixl._prepped) for w in d)
    meta: NixlkvMetadata | None = hand_over(p, engine_id, port, rid, blocks=8)
    deadline = time.monotonic() + 120
    while len(done) < len(d) and time.monotonic() < deadline:
        waiting_before = any(rid in w._waiting for w in d)
        t0 = time.perf_counter()
        for i, w in enumerate(d):
            w.start_load_kv(meta)
            _, recv = w.get_finished(set())
            if recv:
                done.add(i)
        took = time.perf_counter() - t0
        waiting_after = any(rid in w._waiting for w in d)
        if waiting_after:
            during.append(took)
        elif waiting_before or meta is not None:
            post_ms = max(post_ms, 1e3 * took)
        meta = None
        for w in p:
            w.get_finished(set())
        time.sleep(0.001)  # the model's forward pass, elsewhere
    if len(done) < len(d):
        raise RuntimeError("the bench request was not loaded in 120 s")
    mine = [remote for w in d for key, remote in w._remotes.items() if key[0] == engine_id]
    nixl = max(remote.nixl_seconds for remote in mine)
    lists = max(remote.prepare_seconds for remote in mine)
    return {
        "steps_during_handshake": len(during),
        "max_step_during_handshake_ms": 1e3 * max(during, default=0.0),
        "median_step_during_handshake_ms": 1e3 * float(np.median(during)) if during else 0.0,
        "post_step_ms": post_ms,
        "handshake_nixl_ms": 1e3 * nixl,
        "handshake_lists_ms": 1e3 * lists,  # of which preparing the descriptor lists (the rest: adding agents)
        "lists_prepared": sum(len(w.nixl._prepped) for w in d) - lists_before,  # NIXL descriptor lists it added
    }


def markdown(out: dict[str, Any]) -> str:
    return "\n".join([
        f"Handshake stall, {out['shape']} (fabricated engines, real NIXL, median of {len(out['runs'])} handshakes):",
        "",
        "| decode engine step | ms |",
        "|---|---|",
        f"| longest while the handshake runs (on its thread) | {out['max_step_during_handshake_ms']:.2f} |",
        f"| median while the handshake runs | {out['median_step_during_handshake_ms']:.3f} |",
        f"| the step that takes the finished handshake and posts the READs | {out['post_step_ms']:.2f} |",
        f"| that step before (plus adding the agents and preparing the lists there) | {out['post_step_before_ms']:.2f} |",
        f"| of which the NIXL work now on the handshake thread | {out['handshake_nixl_ms']:.2f} |",
        f"| ... of which preparing the descriptor lists (the rest: adding the remote agents) "
        f"| {out['handshake_lists_ms']:.2f} |",
        "",
        f"A second prefill engine of the same layout, handshaken by the same decode engine: NIXL work "
        f"{out['second_engine_nixl_ms']:.2f} ms ({out['second_vs_first_nixl']:.2f} of the first's; "
        f"lists {out['second_engine_lists_ms']:.2f} ms), "
        f"{out['lists_second_engine']} descriptor lists prepared where the first prepared {out['lists_first_engine']} "
        f"(the local list is shared: {out['local_lists']} per decode rank).",
    ])
