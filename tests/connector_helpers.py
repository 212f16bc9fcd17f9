"""Shared pieces of the connector tests: fabricated engines driven through NixlkvWorker."""

from __future__ import annotations

import numpy as np

from nixlkv.testing import oracle
from nixlkv.testing.engines import FabricatedRank, build_rank
from nixlkv.testing.scenario import parse
from nixlkv.vllm.config import ConnectorConfig
from nixlkv.vllm.handshake import SideChannelServer
from nixlkv.vllm.metadata import NixlkvMetadata
from nixlkv.vllm.worker import NixlkvWorker, serve_reply

COMPAT = "test-compat"


def fa_scenario(p_tp: int, d_tp: int, num_tokens: int = 200, heads: int = 8, p_block: int = 16, d_block: int = 16,
                p_layout: str = "LBHNC", d_layout: str = "LBHNC", layers: int = 2, head_size: int = 32,
                num_blocks: int = 64):
    return parse({
        "name": f"conn-p{p_tp}-d{d_tp}",
        "model": {"layers": [{"kind": "full_attention", "count": layers, "num_kv_heads": heads, "head_size": head_size}]},
        "prefill": {"tp": p_tp, "block_size": p_block, "layout": p_layout, "num_blocks": num_blocks},
        "decode": {"tp": d_tp, "block_size": d_block, "layout": d_layout, "num_blocks": num_blocks},
        "request": {"num_tokens": num_tokens, "seed": 3},
    })


def make_worker(rank: FabricatedRank, engine_id: str, config: ConnectorConfig | None = None,
                compat: str = COMPAT, compat_inputs: dict | None = None) -> NixlkvWorker:
    w = NixlkvWorker(
        engine_id, rank.tp_rank, rank.side.tp, rank.kv_cache_config, config or ConnectorConfig(),
        compat, lambda name: rank.total_heads[name], compat_inputs=compat_inputs,
    )
    w.register_kv_caches(rank.kv_caches)
    return w


class Engine:
    """All ranks of one fabricated engine, each with its own NixlkvWorker; P also serves handshakes."""

    def __init__(self, scenario, role: str, engine_id: str, serve: bool = False, config: ConnectorConfig | None = None,
                 compat: str = COMPAT, compat_inputs: dict | None = None):
        """``compat_inputs``: what ``compat`` hashes (sent in the reply, compared on a refusal)."""
        self.ranks = [build_rank(scenario, role, r) for r in range(getattr(scenario, role).tp)]
        self.engine_id = engine_id
        self.workers = [make_worker(r, engine_id, config, compat, compat_inputs) for r in self.ranks]
        self.server = None
        if serve:
            infos = {w.topology.tp_rank: w.handshake_info() for w in self.workers}
            reply = serve_reply(engine_id, len(self.workers), infos, compat, compat_inputs)
            self.server = SideChannelServer("127.0.0.1", 0, lambda: reply)

    def close(self):
        if self.server:
            self.server.close()
        for w in self.workers:
            w.shutdown()


def blocks(rank: FabricatedRank, ids: list[int], first_position: int = 0) -> list[oracle.GroupBlocks]:
    arr = np.asarray(ids, dtype=np.int64)
    return [oracle.GroupBlocks(ids=arr, first_position=first_position, holds=np.ones(arr.size, dtype=bool))]


def filled_pair(p_tp: int, d_tp: int, p_ids: list[int], seed: int = 3) -> tuple[Engine, Engine]:
    """A serving P whose blocks ``p_ids`` hold the oracle pattern, and a D holding the sentinel."""
    sc = fa_scenario(p_tp, d_tp, num_tokens=40)
    p = Engine(sc, "prefill", "P", serve=True)
    try:
        d = Engine(sc, "decode", "D")
    except BaseException:
        p.close()
        raise
    for r in p.ranks:
        oracle.fill_prefill(r, blocks(r, p_ids), seed=seed)
    for r in d.ranks:
        oracle.fill_decode(r)
    return p, d


def serve_prefill(conn, scenario_kw: dict, p_ids: list[int], holds: list[str], seed: int) -> None:
    """A prefill engine process: its workers hold ``holds`` (all on blocks ``p_ids``, oracle
    pattern ``seed``) and serve handshakes; sends its side-channel port, runs until told to stop."""
    p = Engine(fa_scenario(**scenario_kw), "prefill", "P", serve=True)
    try:
        for r, w in zip(p.ranks, p.workers):
            oracle.fill_prefill(r, blocks(r, p_ids), seed=seed)
            w.start_load_kv(NixlkvMetadata(reqs_to_send=dict.fromkeys(holds, 600.0)))
        conn.send(p.server.port)
        while not conn.poll(0.005):
            for w in p.workers:
                w.get_finished(set())
    finally:
        p.close()
