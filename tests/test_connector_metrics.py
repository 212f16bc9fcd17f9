"""Stats of real transfers go through vLLM's own KVConnectorLogging (the log line) and
KVConnectorProm (real prometheus_client metrics in a private registry) unchanged."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from nixlkv.vllm.metadata import NixlkvMetadata, NixlkvStats

from connector_helpers import filled_pair
from pd_harness import vllm_config
from test_connector_worker import drive, recv

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]


def _bound(cls, registry):
    class Bound(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    return Bound


def _transfer_stats() -> list[NixlkvStats]:
    """One request read P1 -> D2 over NIXL: each D worker's stats, as vLLM collects them."""
    p, d = filled_pair(1, 2, [1, 2, 3])
    try:
        p.workers[0].start_load_kv(NixlkvMetadata(reqs_to_send={"r": 30.0}))
        for w in d.workers:
            w.start_load_kv(NixlkvMetadata(reqs_to_recv={"r": recv(p, "r", [4, 5, 6], [1, 2, 3])}))
        done, failed, _ = drive(p, d, {"r"})
        assert all(v == {"r"} for v in done.values()) and not any(failed.values())
        return [w.take_stats() for w in d.workers] + [p.workers[0].take_stats() or NixlkvStats()]
    finally:
        p.close()
        d.close()


def test_stats_reach_the_log_line_and_prometheus() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    per_worker = _transfer_stats()
    per_worker[0].count("heartbeats_sent", 5)
    per_worker[1].count("failed_transfers")
    per_worker[2].count("expired_leases", 2)
    aggregated = NixlkvStats()
    for s in per_worker:  # what KVOutputAggregator does with the workers' stats
        aggregated.aggregate(s)
    reduced = aggregated.reduce()
    assert reduced["transfers"] == 2 and reduced["bytes"] > 0 and reduced["descriptors"] >= 2
    assert reduced["heartbeats_sent"] == 5 and reduced["failed_transfers"] == 1 and reduced["expired_leases"] == 2

    vc = vllm_config("kv_consumer", "D", 1, 16, {})
    logging_ = KVConnectorLogging(vc.kv_transfer_config)
    logging_.observe(per_worker[0].to_dict())
    logging_.observe(per_worker[1].to_dict())
    logging_.observe(per_worker[2].to_dict())
    lines: list[str] = []
    logging_.log(lambda fmt, arg: lines.append(fmt % arg))
    assert len(lines) == 1 and "transfers=2" in lines[0] and f"bytes={reduced['bytes']}" in lines[0]
    assert "failed_transfers=1" in lines[0] and "heartbeats_sent=5" in lines[0]

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = _bound(Gauge, registry)
        _counter_cls = _bound(Counter, registry)
        _histogram_cls = _bound(Histogram, registry)

    prom = Prom(vc, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(aggregated.to_dict(), engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}

    def value(name: str) -> float:
        got = registry.get_sample_value(name, labels)
        assert got is not None, name
        return got

    assert value("vllm:nixlkv_bytes_transferred_sum") == reduced["bytes"]
    assert value("vllm:nixlkv_bytes_transferred_count") == 2
    assert value("vllm:nixlkv_num_descriptors_sum") == reduced["descriptors"]
    assert value("vllm:nixlkv_xfer_time_seconds_count") == 2
    assert abs(value("vllm:nixlkv_xfer_time_seconds_sum") - sum(aggregated.data["transfer_s"])) < 1e-9
    assert value("vllm:nixlkv_post_time_seconds_count") == 2
    assert value("vllm:nixlkv_failed_transfers_total") == 1
    assert value("vllm:nixlkv_heartbeats_sent_total") == 5
    assert value("vllm:nixlkv_expired_leases_total") == 2
    assert value("vllm:nixlkv_failed_handshakes_total") == 0
    # each D worker handshook P once, planning anew
    assert reduced["handshakes_planned"] == 2 and value("vllm:nixlkv_handshakes_planned_total") == 2
    assert value("vllm:nixlkv_handshakes_rebased_total") == value("vllm:nixlkv_handshakes_recounted_total") == 0
    prom.observe(per_worker[1].to_dict(), engine_idx=0)  # counters accumulate across intervals
    assert value("vllm:nixlkv_failed_transfers_total") == 2
