"""Shared pieces of the connector tests: fabricated engines driven through NixlkvWorker."""

from __future__ import annotations

import numpy as np

from nixlkv.testing import oracle
from nixlkv.testing.engines import FabricatedRank, build_rank
from nixlkv.testing.scenario import parse
from nixlkv.vllm.config import ConnectorConfig
from nixlkv.vllm.handshake import SideChannelServer
from nixlkv.vllm.worker import NixlkvWorker, serve_reply

COMPAT = "test-compat"


def fa_scenario(p_tp: int, d_tp: int, num_tokens: int = 200, heads: int = 8, p_block: int = 16, d_block: int = 16,
                p_layout: str = "LBHNC", d_layout: str = "LBHNC"):
    return parse({
        "name": f"conn-p{p_tp}-d{d_tp}",
        "model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": heads, "head_size": 32}]},
        "prefill": {"tp": p_tp, "block_size": p_block, "layout": p_layout, "num_blocks": 64},
        "decode": {"tp": d_tp, "block_size": d_block, "layout": d_layout, "num_blocks": 64},
        "request": {"num_tokens": num_tokens, "seed": 3},
    })


def make_worker(rank: FabricatedRank, engine_id: str, config: ConnectorConfig | None = None,
                compat: str = COMPAT) -> NixlkvWorker:
    w = NixlkvWorker(
        engine_id, rank.tp_rank, rank.side.tp, rank.kv_cache_config, config or ConnectorConfig(),
        compat, lambda name: rank.total_heads[name],
    )
    w.register_kv_caches(rank.kv_caches)
    return w


class Engine:
    """All ranks of one fabricated engine, each with its own NixlkvWorker; P also serves handshakes."""

    def __init__(self, scenario, role: str, engine_id: str, serve: bool = False, config: ConnectorConfig | None = None,
                 compat: str = COMPAT):
        self.ranks = [build_rank(scenario, role, r) for r in range(getattr(scenario, role).tp)]
        self.engine_id = engine_id
        self.workers = [make_worker(r, engine_id, config, compat) for r in self.ranks]
        self.server = None
        if serve:
            infos = {w.topology.tp_rank: w.handshake_info() for w in self.workers}
            reply = serve_reply(engine_id, len(self.workers), infos, compat)
            self.server = SideChannelServer("127.0.0.1", 0, lambda: reply)

    def close(self):
        if self.server:
            self.server.close()
        for w in self.workers:
            w.shutdown()


def blocks(rank: FabricatedRank, ids: list[int], first_position: int = 0) -> list[oracle.GroupBlocks]:
    arr = np.asarray(ids, dtype=np.int64)
    return [oracle.GroupBlocks(ids=arr, first_position=first_position, holds=np.ones(arr.size, dtype=bool))]
