"""The vLLM versions the connector runs on, and the one place that handles how they differ.

nixlkv's connector runs on vLLM 0.32 (the CPU build that serves on CPU-only machines) and on
vLLM 0.33 (GPU). For every hook the connector uses, their contracts are identical: the worker
reports through ``get_transfer_results`` (``failed_recving`` included) and
``get_block_ids_with_load_errors`` on both, and the scheduler calls the same hooks with the same
arguments. See docs/vllm.md, "vLLM versions", for the comparison and where each piece lives in
vLLM's source. The difference the connector has to handle is sleep mode:

- **0.33** asks ``KVConnectorBase_V1.supports_sleep_mode`` before it enables sleep mode. It then
  calls ``unregister_kv_caches`` / ``restore_kv_caches`` around a sleep, after which the KV cache
  may be at other addresses. nixlkv's NIXL registrations, and the plans peers built from its
  handshake, cannot follow that, so the connector answers False and vLLM refuses the
  configuration.
- **0.32** neither asks nor tells the connector. Its CPU platform refuses sleep mode anyway, but
  a GPU build would not, so the connector refuses it itself when it starts (:func:`check_engine_config`).

Returned routed experts (``--enable-return-routed-experts``) are refused on both. vLLM refuses them
with its own NIXL connectors ("PD auxiliary output is not supported") but does not know nixlkv's.
0.33's scheduler also caps a connector's hit to what its routed-experts store covers
(``cap_external_hit``), which turns a P/D load into a local prefill without a word.

Features are detected from vLLM's classes (attributes and dataclass fields), not from its
version string. The version appears in messages only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar


class VllmCompatError(ImportError):
    """The installed vLLM lacks a connector feature nixlkv relies on (names what is missing)."""


@dataclass(frozen=True)
class VllmFeatures:
    """What the installed vLLM's connector API offers, as seen by nixlkv."""

    version: str
    # The worker calls get_transfer_results and the scheduler reads failed_recving: the only way
    # a failed load reaches the scheduler with several KV groups. Required.
    transfer_results: bool
    # get_block_ids_with_load_errors -> KVConnectorOutput.invalid_block_ids (one KV group). Required.
    load_error_blocks: bool
    # SupportsHMA.request_finished_all_groups: P's per-group block ids. Required.
    hma_all_groups: bool
    # KVConnectorBase_V1.supports_sleep_mode: vLLM asks before enabling sleep mode (0.33).
    sleep_mode_hook: bool
    # unregister_kv_caches / restore_kv_caches around a sleep (0.33).
    kv_cache_reregistration: bool

    REQUIRED: ClassVar[tuple[str, ...]] = ("transfer_results", "load_error_blocks", "hma_all_groups")

    def missing(self) -> list[str]:
        """The required features this vLLM lacks."""
        return [name for name in self.REQUIRED if not getattr(self, name)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def detect(base: ModuleType | None = None, outputs: ModuleType | None = None, version: str | None = None) -> VllmFeatures:
    """The features of vLLM's ``kv_connector.v1.base`` and ``v1.outputs`` modules (the installed
    ones by default; tests pass stand-ins)."""
    if base is None:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    if outputs is None:
        from vllm.v1 import outputs
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    connector = getattr(base, "KVConnectorBase_V1", None)
    hma = getattr(base, "SupportsHMA", None)
    output_fields = _field_names(getattr(outputs, "KVConnectorOutput", None))
    results_fields = _field_names(getattr(base, "KVConnectorTransferResults", None))

    def has(cls: Any, *names: str) -> bool:
        return cls is not None and all(callable(getattr(cls, n, None)) for n in names)

    return VllmFeatures(
        version=version,
        transfer_results=has(connector, "get_transfer_results")
        and "failed_recving" in results_fields and "failed_recving" in output_fields,
        load_error_blocks=has(connector, "get_block_ids_with_load_errors") and "invalid_block_ids" in output_fields,
        hma_all_groups=has(hma, "request_finished_all_groups"),
        sleep_mode_hook=has(connector, "supports_sleep_mode"),
        kv_cache_reregistration=has(connector, "unregister_kv_caches", "restore_kv_caches"),
    )


def require(features: VllmFeatures) -> VllmFeatures:
    """``features``, or VllmCompatError naming what this vLLM lacks."""
    missing = features.missing()
    if missing:
        raise VllmCompatError(
            f"nixlkv's NixlkvConnector cannot run on vLLM {features.version}: its KV connector API lacks "
            f"{missing} (nixlkv supports vLLM 0.32 and 0.33; see docs/vllm.md, 'vLLM versions')"
        )
    return features


FEATURES: VllmFeatures = require(detect())


def check_engine_config(vllm_config: Any) -> None:
    """Refuse engine settings the connector cannot serve (ValueError naming the setting)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "enable_sleep_mode", False):
        # 0.33 refuses it before this (supports_sleep_mode); 0.32 never asks the connector.
        hook = "" if FEATURES.sleep_mode_hook else f" (vLLM {FEATURES.version} does not ask connectors before enabling it)"
        raise ValueError(
            "NixlkvConnector does not support sleep mode (--enable-sleep-mode): its NIXL registrations and the "
            f"plans peers built from its handshake cannot follow the KV cache to new addresses{hook}"
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    for attr, flag, why in (
        ("decode_context_parallel_size", "--decode-context-parallel-size",
         "tokens interleaved across ranks within a block are not planned"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size",
         "a prompt's KV spread across prefill context ranks is not planned"),
    ):
        size = getattr(parallel, attr, 1) if parallel is not None else 1
        if isinstance(size, int) and size > 1:
            raise ValueError(f"NixlkvConnector does not support {flag} {size} ({attr}): {why}; run with {attr}=1")
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    buffer = getattr(transfer, "kv_buffer_device", None) if transfer is not None else None
    kv_device = _kv_device(vllm_config)
    if isinstance(buffer, str) and buffer and kv_device and buffer != kv_device:
        raise ValueError(
            f"NixlkvConnector reads and writes the KV cache where it lives ({kv_device}); kv_buffer_device="
            f"{buffer!r} (a host staging buffer) is not implemented: remove kv_buffer_device from "
            f"--kv-transfer-config or set it to {kv_device!r}"
        )
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enable_return_routed_experts", False):
        raise ValueError(
            "NixlkvConnector does not support --enable-return-routed-experts (PD auxiliary output, refused for "
            "vLLM's NIXL connectors too): D cannot return routed experts for prompt tokens P computed, and vLLM "
            "0.33 would turn every remote load into a local prefill"
        )


def check_mamba_prefix_caching(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse Mamba prefix caching with hits finer than a state entry (ValueError naming the setting).

    In ``mamba_cache_mode`` "align" a request's state list holds one entry per Mamba block, and
    nixlkv moves the running state into the entry vLLM allocated for it (docs/vllm.md, "Mamba
    prefix caching"). Where prefix-cache keys are finer than that block (``prefix_match_unit``, or
    groups whose block sizes have a smaller common divisor), vLLM 0.33 hits prefixes that end
    inside a state entry and copies the hit entry into the request's own (copy-on-write) on the
    worker, around the step that starts the load: the order of that copy and nixlkv's READ into
    the same entry is not proven, so the configuration is refused rather than served unproven."""
    cache = getattr(vllm_config, "cache_config", None)
    if cache is None or getattr(cache, "mamba_cache_mode", "none") != "align" or kv_cache_config is None:
        return
    try:
        from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled, resolve_kv_cache_block_sizes
    except ImportError:  # a vLLM without fine-grained hits: every hit ends on an entry
        return
    _, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if not partial_hash_hits_enabled(kv_cache_config.kv_cache_groups, hash_block):
        return
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba_block = max(
        (g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)),
        default=hash_block,
    )
    raise ValueError(
        f"NixlkvConnector does not support Mamba prefix caching (mamba_cache_mode 'align') with prefix-cache "
        f"keys every {hash_block} tokens, finer than the Mamba state entry of {mamba_block} tokens "
        f"(prefix_match_unit={getattr(cache, 'prefix_match_unit', None)}): a hit ending inside a state entry is "
        f"copied into the entry the load writes, in an order not proven; unset --prefix-match-unit or set it to "
        f"{mamba_block}, or switch prefix caching off (--no-enable-prefix-caching)"
    )


def _kv_device(vllm_config: Any) -> str | None:
    """The device type the engine keeps its KV cache on (``cuda``, ``cpu``, ...), if known."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if isinstance(device, str) and device:
        return device
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    device = getattr(current_platform, "device_type", None)
    return device if isinstance(device, str) and device else None
