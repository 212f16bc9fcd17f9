"""``NixlkvConnector``: the vLLM KV connector (pull-mode P/D) running nixlkv's TransferPlan over NIXL.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "NixlkvConnector",
        "kv_connector_module_path": "nixlkv.connector", "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {...}}'

This module is the facade vLLM loads; the logic lives in ``nixlkv.vllm``: ``config`` (extra-config
keys), ``handshake`` (wire format, side channel), ``worker`` (one per TP rank), ``scheduler``;
``compat`` handles what differs between the vLLM versions it runs on (0.32 and 0.33).
See docs/vllm.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

# First: on a vLLM whose connector API lacks what nixlkv needs, this names what is missing.
from .vllm import compat  # isort: skip
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .core.geometry import RankGeometry
from .core.topology import Stage
from .vllm.config import ConfigError, ConnectorConfig
from .vllm.handshake import compat_hash, global_rank
from .vllm.liveness import engine_generation
from .vllm.metadata import NixlkvMetadata, NixlkvStats
from .vllm.model_heads import kv_heads_by_layer
from .vllm.capture import model_facts
from .vllm.model_backend import attention_layers, backend_hints, combine
from .vllm.model_mamba import mamba_hints_by_layer
from .vllm.scheduler import NixlkvScheduler
from .vllm.worker import HandshakeInfo, NixlkvWorker, serve_reply

logger = logging.getLogger("nixlkv.connector")


def _log_like_vllm() -> None:
    """nixlkv's log lines go where vLLM's go, in vLLM's format and at its level: an operator reads
    one log. (Without this, Python shows only nixlkv's warnings, bare, and none of its INFO lines.)"""
    ours, theirs = logging.getLogger("nixlkv"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


_log_like_vllm()

__all__ = ["ConfigError", "NixlkvConnector", "NixlkvHandshakeMetadata", "pp_rank_and_size", "tp_rank_and_size",
           "vllm_compat_hash"]


@dataclass
class NixlkvHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's advertisement, carried by vLLM from the worker to the scheduler process."""

    tp_rank: int
    agent_metadata: bytes
    geometry: dict[str, Any]  # RankGeometry.to_dict()
    pp_rank: int = 0  # the worker's pipeline stage


def vllm_compat_hash(vllm_config: Any, transfer_mode: str = "pull") -> str:
    """The hash of :func:`vllm_compat_inputs`."""
    return compat_hash(vllm_compat_inputs(vllm_config, transfer_mode))


def vllm_compat_inputs(vllm_config: Any, transfer_mode: str = "pull") -> dict[str, Any]:
    """What P and D must share exactly, the transfer mode included (a reader and a writer would
    each wait for the other). TP sizes, block sizes and layouts are not in it: the handshake
    advertises them and the plan checks them pairing by pairing."""
    import vllm

    model = vllm_config.model_config
    return {
        "vllm": vllm.__version__,
        "model": getattr(model, "model", None),
        "dtype": str(getattr(model, "dtype", None)),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "transfer": "push-write" if transfer_mode == "push" else "pull-read",
        **_speculative(getattr(vllm_config, "speculative_config", None)),
    }


# Speculative methods that propose from the token ids alone: no layer with KV, nothing of P's
# prefill or of D's trailing tokens changes, so either engine may run them without the other.
TOKEN_ONLY_SPECULATIVE = frozenset(("ngram", "ngram_gpu", "suffix"))


def _speculative(spec: Any) -> dict[str, Any]:
    """Speculative decoding with a drafter of its own (a draft model's layers, EAGLE's, MTP's)
    changes which layers hold KV and how many trailing tokens D computes: P and D must run the same
    method, draft model and token count. A proposer of :data:`TOKEN_ONLY_SPECULATIVE` (D alone
    running n-gram lookup, as deployments do) is not compared."""
    if spec is None or str(getattr(spec, "method", None)) in TOKEN_ONLY_SPECULATIVE:
        return {}
    return {"speculative": {
        "method": str(getattr(spec, "method", None)),
        "model": str(getattr(spec, "model", None)),
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None),
    }}


def tp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's TP rank and size (from vLLM's initialised parallel state)."""
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return 0, 1
    raise RuntimeError("nixlkv: TP size > 1 but vLLM's model-parallel state is not initialised")


def pp_rank_and_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's pipeline stage and the number of stages (from vLLM's initialised parallel state)."""
    size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if size == 1:
        return 0, 1
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_pp_group()
        return group.rank_in_group, group.world_size
    raise RuntimeError("nixlkv: pipeline_parallel_size > 1 but vLLM's model-parallel state is not initialised")


class NixlkvConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_engine_config(vllm_config)
        ktc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.parse(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        self.compat_inputs = vllm_compat_inputs(vllm_config, self.config.transfer_mode)
        self.compat = compat_hash(self.compat_inputs)
        self._scheduler: NixlkvScheduler | None = None
        self._worker: NixlkvWorker | None = None
        if kv_cache_config is None:  # vLLM 0.32 and 0.33 pass it to both roles
            raise ValueError(f"NixlkvConnector's {role.name.lower()} role needs the KVCacheConfig")
        compat.check_mamba_prefix_caching(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = NixlkvScheduler(vllm_config, self.engine_id, self.config, self.compat, kv_cache_config)
        else:
            tp_rank, tp_size = tp_rank_and_size(vllm_config)
            pp_rank, pp_size = pp_rank_and_size(vllm_config)
            heads = kv_heads_by_layer(vllm_config.model_config)
            self._worker = NixlkvWorker(
                self.engine_id, tp_rank, tp_size, kv_cache_config, self.config, self.compat, heads,
                model_hints=combine(mamba_hints_by_layer(vllm_config, kv_cache_config),
                                    backend_hints(attention_layers(vllm_config))),
                model_facts=model_facts(vllm_config) if self.config.capture_dir or self.config.dump_kv_dir else None,
                compat_inputs=self.compat_inputs,
                stage=Stage(pp_size, pp_rank),
            )

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> NixlkvHandshakeMetadata | None:
        if self._worker is None or self._worker.nixl is None:
            return None
        info = self._worker.handshake_info()
        return NixlkvHandshakeMetadata(info.tp_rank, info.agent_metadata, info.geometry.to_dict(), info.pp_rank)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self._worker.start_load_kv(meta if isinstance(meta, NixlkvMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # push mode writes a finished request's blocks when D orders them (nixlkv.vllm.push)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=self._worker.take_failed_recving()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_block_ids()

    def get_kv_connector_stats(self) -> NixlkvStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> NixlkvStats:
        return NixlkvStats(data=data) if data else NixlkvStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from .vllm.prom import NixlkvPromMetrics

        return NixlkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Asked by vLLM 0.33 before it enables sleep mode (see ``compat``): never."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Head-major pages let a rank read its head slice as one run per block under hetero TP.
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ================================================================ scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp_rank): meta for tp_rank, meta in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every worker's advertisement, keyed by (pipeline stage, TP rank): the side channel
        answers with all of them, so a decode rank handshakes every stage at once."""
        tp_size, pp_size = self._scheduler.tp_size, self._scheduler.pp_size
        infos = {}
        for (pp_rank, tp_rank), meta in metadata.items():
            if not isinstance(meta, NixlkvHandshakeMetadata):
                raise ValueError(f"NixlkvConnector expects NixlkvHandshakeMetadata, got {type(meta).__name__}")
            infos[global_rank(pp_rank, tp_rank, tp_size)] = HandshakeInfo(
                meta.tp_rank, meta.agent_metadata, RankGeometry.from_dict(meta.geometry), meta.pp_rank)
        reply = serve_reply(self.engine_id, tp_size, infos, self.compat, self.compat_inputs, pp_size)
        self._scheduler.serve_handshake(reply, engine_generation({r: i.agent_metadata for r, i in infos.items()}))

    def on_new_request(self, request: Any) -> None:
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output.finished_recving, connector_output.finished_sending)

    def has_pending_push_work(self) -> bool:
        """Asked by vLLM's scheduler whether to keep stepping with no request to run: in push mode a
        prefill engine writes when a decode engine's order arrives, so it steps while it holds blocks."""
        return self._scheduler is not None and self._scheduler.holds_for_push()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> NixlkvMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # The request's own blocks are read for every group the plan covers.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)
