"""``kv_connector_extra_config`` for NixlkvConnector: every key typed and checked, unknown keys refused.

See docs/configuration.md for the user-facing description of each key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..core.errors import NixlkvError
from ..core.staging import DEFAULT_STAGING_BYTES, DESCRIPTOR_MODES
from .params import MAX_LEASE_S

MIN_STAGING_BYTES = 1 << 20  # two halves of at least one typical page each
# More than the largest request's KV (Llama-70B-like, 128k tokens, one rank: ~40 GiB): a request
# is staged in rounds of half the buffer, so a larger one is never used, only allocated.
MAX_STAGING_BYTES = 1 << 36
# A rank's geometry is kilobytes: the bound keeps a peer from making a decode worker read (and
# decode) gigabytes; beyond a GiB the guard would guard nothing.
MAX_HANDSHAKE_BYTES = 1 << 30


class ConfigError(NixlkvError):
    """kv_connector_extra_config is malformed: the message names the key and what is accepted."""


DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_LEASE_S = 480.0  # see ConnectorConfig.lease_s
# Every time setting is at most a day, as a lease is on the wire (a decode engine refuses a longer
# one and computes each such prompt itself, no transfer): beyond, a timeout is a typo, and an
# endless one overflows the socket's and the clock's timeouts.
MAX_SECONDS = MAX_LEASE_S
# Upper bounds of the NIXL integer settings (each passed to C): a thread count and a pause beyond
# them are typos, and a value beyond 64 bits fails inside NIXL with no name for the setting.
MAX_NIXL_THREADS = 1024
MAX_PROGRESS_DELAY_US = 1_000_000  # a second between polls of each agent's progress thread
# pull: the decode engine READs from the prefill engine; push: the prefill engine WRITEs into the
# decode engine's blocks (nixlkv.vllm.push). Both engines must name the same one.
TRANSFER_MODES = ("pull", "push")

# vLLM NixlConnector's kv_connector_extra_config keys a user may carry over: the same setting under
# nixlkv's name (``backends`` is spelled alike) ...
VLLM_ALIASES: Mapping[str, str] = {
    "kv_lease_duration": "lease_s",
    "num_threads": "nixl_num_threads",
    "enforce_handshake_compat": "enforce_compat_hash",
}
# ... and the ones nixlkv has no such setting for, with what to do instead.
VLLM_UNSUPPORTED: Mapping[str, str] = {
    "engine_ttl": "nixlkv forgets a remote engine's NIXL state when it restarts or fails, not after a TTL; remove it",
    "kv_recompute_threshold": "nixlkv loads every remote prefill it is given (the proxy decides what is "
                              "disaggregated); remove it",
    "bidirectional_kv_xfer": "nixlkv only pulls P's KV into D; remove it",
    "decoder_kv_blocks_ttl": "nixlkv only pulls P's KV into D (no D blocks are held for P); remove it",
    "push_registration_timeout": "nixlkv's push mode (transfer_mode 'push') waits transfer_timeout_s for a write; "
                                 "remove it",
}


@dataclass(frozen=True)
class ConnectorConfig:
    """Parsed ``kv_connector_extra_config``."""

    # strategies
    pin_strategies: Mapping[str, str] = field(default_factory=dict)  # spec class name -> strategy name
    disable_strategies: tuple[str, ...] = ()
    allowed_plugins: tuple[str, ...] | None = None  # None: every installed plugin; builtin always allowed
    # NIXL
    backends: tuple[str, ...] = ("UCX",)
    nixl_num_threads: int = 0
    # NIXL's per-transfer telemetry (vLLM's NixlConnector turns it on); nixlkv times transfers
    # itself, so it is off unless asked (docs/configuration.md, measured there)
    nixl_telemetry: bool = False
    # pause of each NIXL agent's progress thread between polls; 0: NIXL's busy poll (a core per
    # agent). On CPU-only P/D with few cores a pause doubles transfer speed (docs/performance.md)
    nixl_progress_delay_us: int = 0
    # descriptor mode of the decode side's READs (see nixlkv/transport/reader.py and docs/performance.md)
    descriptor_mode: str = "direct"  # measured best here (docs/performance.md, "Descriptor modes")
    staging_bytes: int = DEFAULT_STAGING_BYTES
    # side channel
    side_channel_host: str = "localhost"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # timeouts and lease
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    # How long P holds a finished request's blocks for a decode leg that has not reached D yet (D's
    # heartbeats then keep it). 480 s: the longest any vLLM connector waits for a decode leg
    # (VLLM_NIXL_ABORT_REQUEST_TIMEOUT of earlier NixlConnectors; VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
    # in 0.33). vLLM 0.33's NixlConnector frees at 30 s (kv_lease_duration) but D reads a later leg
    # anyway, from freed blocks; nixlkv refuses such a leg, so it holds as long as a router may
    # queue one. Trade-off and how to lower it: docs/configuration.md, "The lease".
    lease_s: float = DEFAULT_LEASE_S
    heartbeat_interval_s: float = 5.0  # 0: no heartbeats
    max_handshake_bytes: int = 64 << 20
    enforce_compat_hash: bool = True
    # where each worker writes what its engine built for the KV cache (nixlkv capture); None: nothing
    capture_dir: str | None = None
    # where each worker writes the bytes of every request's blocks it hands over or loads, and its
    # capture record (nixlkv.vllm.kvdump; serve-check --verify-bytes judges them); None: nothing
    dump_kv_dir: str | None = None
    transfer_mode: str = "pull"  # see TRANSFER_MODES

    @classmethod
    def known_keys(cls) -> list[str]:
        return sorted(f.name for f in fields(cls))

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Parse and validate; defaults for the side channel come from vLLM's own env variables
        (``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``) so existing deployments keep their ports."""
        env = os.environ if env is None else env
        extra = _translate_vllm_keys(dict(extra or {}))
        unknown = sorted(k for k in extra if k not in cls.known_keys())
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; known keys: {cls.known_keys()}"
            )
        out: dict[str, Any] = {}
        if "pin_strategies" in extra:
            pins = extra["pin_strategies"]
            if not isinstance(pins, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in pins.items()
            ):
                raise ConfigError(
                    f"pin_strategies must map spec class names to strategy names, e.g. "
                    f'{{"FullAttentionSpec": "full_attention"}}; got {pins!r}'
                )
            out["pin_strategies"] = dict(pins)
        for key in ("disable_strategies", "backends"):
            if key in extra:
                out[key] = _str_list(key, extra[key], allow_empty=key != "backends")
        if "allowed_plugins" in extra:
            value = extra["allowed_plugins"]
            out["allowed_plugins"] = None if value is None else _str_list("allowed_plugins", value, allow_empty=True)
        host = extra.get("side_channel_host", env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"))
        if not isinstance(host, str) or not host:
            raise ConfigError(f"side_channel_host must be a non-empty string, got {host!r}")
        out["side_channel_host"] = host
        port = extra.get("side_channel_port", env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_SIDE_CHANNEL_PORT))
        if isinstance(port, str) and port.isdigit():
            port = int(port)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(f"side_channel_port must be an integer in [0, 65535] (0: any free port), got {port!r}")
        out["side_channel_port"] = port
        for key in ("handshake_timeout_s", "transfer_timeout_s", "lease_s"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
                    raise ConfigError(f"{key} must be a positive number of seconds, at most {MAX_SECONDS:g} (a day), got {value!r}")
                out[key] = float(value)
        if "heartbeat_interval_s" in extra:
            value = extra["heartbeat_interval_s"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECONDS:
                raise ConfigError(
                    f"heartbeat_interval_s must be a number of seconds in [0, {MAX_SECONDS:g}] (0: no heartbeats), got {value!r}"
                )
            out["heartbeat_interval_s"] = float(value)
        if "descriptor_mode" in extra:
            value = extra["descriptor_mode"]
            if value not in DESCRIPTOR_MODES:
                raise ConfigError(
                    f"descriptor_mode must be one of {list(DESCRIPTOR_MODES)} (auto: chosen per request from "
                    f"measured costs), got {value!r}"
                )
            out["descriptor_mode"] = value
        if "transfer_mode" in extra:
            value = extra["transfer_mode"]
            if value not in TRANSFER_MODES:
                raise ConfigError(f"transfer_mode must be one of {list(TRANSFER_MODES)} (pull: the decode engine reads; "
                                  f"push: the prefill engine writes), got {value!r}")
            out["transfer_mode"] = value
        if out.get("transfer_mode") == "push" and out.get("descriptor_mode", "direct") != "direct":
            raise ConfigError(f"descriptor_mode {out['descriptor_mode']!r} stages READs on the decode engine; with "
                              "transfer_mode 'push' the prefill engine writes each descriptor directly: use "
                              "descriptor_mode 'direct'")
        for key, lo, hi in (("nixl_num_threads", 0, MAX_NIXL_THREADS), ("nixl_progress_delay_us", 0, MAX_PROGRESS_DELAY_US),
                            ("max_handshake_bytes", 1024, MAX_HANDSHAKE_BYTES),
                            ("staging_bytes", MIN_STAGING_BYTES, MAX_STAGING_BYTES)):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                    raise ConfigError(f"{key} must be an integer >= {lo} and <= {hi}, got {value!r}")
                out[key] = value
        for key in ("capture_dir", "dump_kv_dir"):
            if extra.get(key) is not None:
                value = extra[key]
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{key} must be a directory path (a non-empty string), got {value!r}")
                out[key] = value
        for key in ("enforce_compat_hash", "nixl_telemetry"):
            if key in extra:
                value = extra[key]
                if not isinstance(value, bool):
                    raise ConfigError(f"{key} must be true or false, got {value!r}")
                out[key] = value
        return cls(**out)

    def dispatcher(self):  # noqa: ANN201 - avoids importing core at module load for config-only users
        from ..core import Dispatcher

        return Dispatcher.from_plugins(
            pins=dict(self.pin_strategies), disabled=self.disable_strategies, allow=self.allowed_plugins
        )


def _str_list(key: str, value: Any, allow_empty: bool) -> tuple[str, ...]:
    if (
        not isinstance(value, (list, tuple))
        or not all(isinstance(v, str) and v for v in value)
        or (not value and not allow_empty)
    ):
        need = "a list of names" if allow_empty else "a non-empty list of names"
        raise ConfigError(f"{key} must be {need}, got {value!r}")
    return tuple(value)


def _translate_vllm_keys(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM NixlConnector's keys under nixlkv's names; the ones without a nixlkv meaning refused."""
    refused = sorted(k for k in extra if k in VLLM_UNSUPPORTED)
    if refused:
        raise ConfigError("; ".join(f"{k} is a vLLM NixlConnector key: {VLLM_UNSUPPORTED[k]}" for k in refused))
    for theirs, ours in VLLM_ALIASES.items():
        if theirs not in extra:
            continue
        value = extra.pop(theirs)
        if ours in extra and extra[ours] != value:
            raise ConfigError(
                f"{theirs}={value!r} (vLLM NixlConnector's name for {ours}) and {ours}={extra[ours]!r} disagree; "
                f"give only {ours}"
            )
        extra[ours] = value
    return extra
