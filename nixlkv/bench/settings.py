"""``nixlkv bench-settings``: NIXL agent settings measured on the connector's own READ path.

Fabricated P and D engines (``nixlkv.testing``) with real NIXL, one pair per setting, every
setting's requests interleaved round by round (each round starting at another setting) so that
a machine getting busier, or going first, affects them alike. Per setting: D's transfer time
per request (post to done, the worker's own stat) over the same request sizes. The settings compared are NIXL's progress threads (``nixl_num_threads``:
nixlkv's 0 against vLLM's NixlConnector's 4) and NIXL's per-transfer telemetry (nixlkv off,
vLLM on).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..vllm.config import ConnectorConfig
from ..vllm.metadata import NixlkvMetadata
from .stall import BLOCK, HEAD_SIZE, HEADS, fabricated_workers, hand_over, scenario, serve

SETTINGS: dict[str, dict[str, Any]] = {
    "nixlkv default (threads 0, telemetry off)": {},
    "nixlkv default again (control: the spread between identical pairs)": {},
    "threads 4 (vLLM's)": {"nixl_num_threads": 4},
    "telemetry on (vLLM's)": {"nixl_telemetry": True},
    "threads 4 + telemetry on (vLLM's defaults)": {"nixl_num_threads": 4, "nixl_telemetry": True},
}


class _Pair:
    def __init__(self, sc: Any, config: ConnectorConfig, tag: str) -> None:
        self.p = fabricated_workers(sc, "prefill", f"P-{tag}", config)
        self.d = fabricated_workers(sc, "decode", f"D-{tag}", config)
        self.engine = f"P-{tag}"
        self.server = serve(self.p, self.engine)
        self.n = 0

    def request(self, blocks: int) -> float:
        """One request of ``blocks`` blocks, P to D; D's transfer seconds (post to done)."""
        self.n += 1
        meta: NixlkvMetadata | None = hand_over(self.p, self.engine, self.server.port, f"r{self.n}", blocks)
        done: set[int] = set()
        deadline = time.monotonic() + 60
        while len(done) < len(self.d) and time.monotonic() < deadline:
            for i, w in enumerate(self.d):
                w.start_load_kv(meta)
                if w.get_finished(set())[1]:
                    done.add(i)
            meta = None
            for w in self.p:
                w.get_finished(set())
        if len(done) < len(self.d):
            raise RuntimeError("a bench request was not loaded in 60 s")
        stats = [w.take_stats() for w in self.d]
        return max(s.data["transfer_s"][-1] for s in stats if s is not None)

    def close(self) -> None:
        self.server.close()
        for w in self.p + self.d:
            w.shutdown()


def run(layers: int = 32, p_tp: int = 1, d_tp: int = 1, blocks: int = 48, rounds: int = 15,
        progress_delay_us: int = 1000) -> dict[str, Any]:
    sc = scenario(layers, p_tp, d_tp, num_blocks=blocks + 1)
    pairs: dict[str, _Pair] = {}
    try:
        for i, (name, extra) in enumerate(SETTINGS.items()):
            pairs[name] = _Pair(sc, ConnectorConfig(nixl_progress_delay_us=progress_delay_us, **extra), str(i))
        for pair in pairs.values():  # handshakes and first touches out of the timing
            pair.request(blocks)
        times: dict[str, list[float]] = {name: [] for name in pairs}
        names = list(pairs)
        for r in range(rounds):  # each round starts at another setting: no setting always goes first
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(pairs[name].request(blocks))
    finally:
        for pair in pairs.values():
            pair.close()
    base = statistics.median(times[next(iter(SETTINGS))])
    nbytes = layers * blocks * BLOCK * HEADS * HEAD_SIZE * 2 * 2 // d_tp  # K and V, bf16
    rows = {name: {"median_ms": 1e3 * statistics.median(t), "ratio_vs_default": statistics.median(t) / base}
            for name, t in times.items()}
    return {"shape": f"{layers} layers, P TP{p_tp} -> D TP{d_tp}, {blocks} blocks per request "
                     f"({nbytes / 2**20:.1f} MiB per D rank), progress_delay_us {progress_delay_us}, {rounds} rounds",
            "settings": rows}


def markdown(out: dict[str, Any]) -> str:
    lines = [f"NIXL settings on the connector's READ path, {out['shape']}:", "",
             "| setting | median transfer ms | vs nixlkv default |", "|---|---|---|"]
    for name, row in out["settings"].items():
        lines.append(f"| {name} | {row['median_ms']:.2f} | {row['ratio_vs_default']:.2f} |")
    return "\n".join(lines)
