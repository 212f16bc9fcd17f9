"""Prometheus metrics of NixlkvConnector, registered through vLLM's ``build_prom_metrics`` hook.

vLLM's logger process builds these once per engine with its own metric classes and label names,
then hands ``observe`` each interval's aggregated ``NixlkvStats`` payload (``to_dict()``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from .metadata import NixlkvStats

PREFIX = "vllm:nixlkv_"

# (stats key, metric suffix, buckets, documentation)
HISTOGRAMS = (
    ("transfer_s", "xfer_time_seconds",
     (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
     "Seconds from posting a request's READs to all of them done, per request and rank."),
    ("post_s", "post_time_seconds",
     (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
     "Seconds spent posting a request's READs (descriptor setup and submission)."),
    ("bytes", "bytes_transferred",
     tuple(float(2 ** e) for e in range(12, 36, 2)),
     "Bytes read per request and rank."),
    ("descriptors", "num_descriptors",
     (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
     "Descriptors posted per request and rank (before NIXL's merge of adjacent ones)."),
)
COUNTERS = {
    "failed_transfers": "Requests whose KV load failed (READ error or timeout, lapsed lease, stale remote).",
    "failed_handshakes": "Handshakes with a remote engine that failed.",
    "expired_leases": "Held requests freed at lease expiry instead of by their consumers (prefill side).",
    "ignored_notifications": "Notifications ignored: not nixlkv's, malformed heartbeats, unknown requests.",
    "heartbeats_sent": "Request ids named in heartbeats sent to prefill engines (decode side).",
    "lease_extensions": "Holds extended by a heartbeat (prefill side).",
    "stale_heartbeats": "Heartbeat entries for requests the prefill worker no longer held.",
    "remotes_released": "Dropped handshakes (restarted or failed prefill engines) whose NIXL state was freed.",
    "unreleased_transfers": "Failed or timed-out loads whose READs NIXL would not release at once (blocks kept held).",
    "release_retries": "Release retries of such READs before their request was reported failed.",
    "staged_loads": "Loads read through the staging buffer (descriptor_mode staged, or auto choosing it) (decode side).",
    "handshakes_planned": "Handshakes whose plan the strategies made (the first of a layout and shape) (decode side).",
    "handshakes_rebased": "Handshakes given another engine's plan at their addresses (the same layout) (decode side).",
    "handshakes_recounted": "Handshakes given another engine's segments with their own block counts (decode side).",
    "lapsed_holds": "Loads not read because the prefill engine's hold may have ended: queued past its lease, or "
                    "arrived after the end it published (a late decode leg, or the hosts' clocks apart) (decode side).",
    "push_writes": "WRITEs that ended done in push mode (prefill side).",
    "push_abandoned": "Push-mode loads not written within transfer_timeout_s: abandoned, blocks held until answered (decode side).",
    "stale_push_answers": "Push-mode answers for no order out (decode side).",
    "lapsed_reads": "Loads whose READs ended after the prefill engine's hold this engine could prove (its "
                    "heartbeats unacknowledged, e.g. the link down): not taken as loaded (decode side).",
    "hold_acks": "Holds the prefill engine acknowledged extending, per request id and rank (decode side).",
    "ignored_acks": "Heartbeat acknowledgements ignored: malformed, unknown or from another agent (decode side).",
    "failed_acks": "Heartbeat acknowledgements that could not be sent to the decode engine (prefill side).",
}


class NixlkvPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.histograms = {
            key: self._per_engine(self._histogram_cls(
                name=PREFIX + suffix, documentation=doc, buckets=list(buckets), labelnames=labelnames))
            for key, suffix, buckets, doc in HISTOGRAMS
        }
        self.counters = {
            key: self._per_engine(self._counter_cls(name=f"{PREFIX}{key}", documentation=doc, labelnames=labelnames))
            for key, doc in COUNTERS.items()
        }

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = NixlkvStats(data=transfer_stats_data)
        for key, by_engine in self.histograms.items():
            for value in stats.data.get(key, ()):
                by_engine[engine_idx].observe(value)
        for key, by_engine in self.counters.items():
            if stats.data.get(key):
                by_engine[engine_idx].inc(stats.data[key])

