"""kv_connector_extra_config parsing: every key typed, unknown keys listed."""

from __future__ import annotations

import pytest

from nixlkv.vllm.config import ConfigError, ConnectorConfig


def test_defaults_and_env_side_channel() -> None:
    c = ConnectorConfig.parse({}, env={})
    assert c.backends == ("UCX",) and c.side_channel_port == 5600 and c.side_channel_host == "localhost"
    assert c.descriptor_mode == "direct" and c.staging_bytes == 16 << 20
    # P holds a decode leg's blocks as long as any vLLM connector waits for one (docs/configuration.md, "The lease")
    assert c.lease_s == 480.0 and c.heartbeat_interval_s == 5.0
    c = ConnectorConfig.parse(None, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "7000", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2"})
    assert c.side_channel_port == 7000 and c.side_channel_host == "10.0.0.2"


def test_all_keys_parse() -> None:
    c = ConnectorConfig.parse({
        "pin_strategies": {"FullAttentionSpec": "full_attention"},
        "disable_strategies": ["sliding_window"],
        "allowed_plugins": ["nixlkv_example_plugin"],
        "backends": ["UCX"],
        "nixl_num_threads": 4,
        "nixl_progress_delay_us": 1000,
        "side_channel_host": "0.0.0.0",
        "side_channel_port": 6000,
        "handshake_timeout_s": 2,
        "transfer_timeout_s": 10.5,
        "lease_s": 60,
        "heartbeat_interval_s": 0,
        "max_handshake_bytes": 1 << 20,
        "enforce_compat_hash": False,
        "descriptor_mode": "staged",
        "staging_bytes": 8 << 20,
    }, env={})
    assert c.descriptor_mode == "staged" and c.staging_bytes == 8 << 20
    assert c.nixl_progress_delay_us == 1000 and ConnectorConfig.parse({}, env={}).nixl_progress_delay_us == 0
    assert c.pin_strategies == {"FullAttentionSpec": "full_attention"}
    assert c.disable_strategies == ("sliding_window",) and c.allowed_plugins == ("nixlkv_example_plugin",)
    assert c.handshake_timeout_s == 2.0 and c.lease_s == 60.0 and not c.enforce_compat_hash
    assert c.heartbeat_interval_s == 0.0 and ConnectorConfig.parse({}, env={}).heartbeat_interval_s == 5.0


def test_time_settings_reach_a_day_and_nixl_counts_their_bounds() -> None:
    """Controls for the upper bounds: each bound itself is accepted."""
    c = ConnectorConfig.parse({"handshake_timeout_s": 86400, "transfer_timeout_s": 86400.0, "lease_s": 86400,
                               "heartbeat_interval_s": 86400, "nixl_num_threads": 1024, "nixl_progress_delay_us": 10**6}, env={})
    assert c.lease_s == c.handshake_timeout_s == c.transfer_timeout_s == c.heartbeat_interval_s == 86400.0
    assert (c.nixl_num_threads, c.nixl_progress_delay_us) == (1024, 10**6)


def test_unknown_key_lists_known_keys() -> None:
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.parse({"lease": 3, "backend": ["UCX"]}, env={})
    msg = str(e.value)
    assert "['backend', 'lease']" in msg and "lease_s" in msg and "backends" in msg


@pytest.mark.parametrize("key,value", [
    ("pin_strategies", ["full_attention"]),
    ("pin_strategies", {"FullAttentionSpec": 3}),
    ("disable_strategies", "sliding_window"),
    ("backends", []),
    ("allowed_plugins", [1]),
    ("side_channel_port", -1),
    ("side_channel_port", 70000),
    ("side_channel_port", "abc"),
    ("side_channel_port", True),
    ("handshake_timeout_s", 0),
    ("lease_s", -1),
    ("heartbeat_interval_s", -0.5),
    ("heartbeat_interval_s", None),
    ("transfer_timeout_s", "5"),
    ("nixl_num_threads", -1),
    ("nixl_progress_delay_us", -5),
    ("nixl_progress_delay_us", 0.5),
    ("max_handshake_bytes", 10),
    ("enforce_compat_hash", "yes"),
    ("side_channel_host", ""),
    ("descriptor_mode", "fast"),
    ("descriptor_mode", None),
    ("staging_bytes", 4096),
    ("staging_bytes", "64MiB"),
    # found by fuzzing the config: accepted, then an OverflowError at the first handshake (the
    # socket's timeout), or a lease every decode engine refuses on the wire (it then computed every
    # prompt itself: no transfer at all)
    ("handshake_timeout_s", float("inf")),
    ("transfer_timeout_s", 1e300),
    ("lease_s", 86400.5),
    ("heartbeat_interval_s", float("inf")),
    ("nixl_num_threads", 2**70),
    ("nixl_progress_delay_us", 10**7),
    # no upper bound before: a handshake guard that guards nothing, a buffer allocated (or refused
    # by the allocator) at the first handshake that stages instead of at start-up
    ("max_handshake_bytes", (1 << 30) + 1),
    ("staging_bytes", 1 << 50),
])
def test_bad_values_name_the_key(key, value) -> None:
    with pytest.raises(ConfigError, match=key):
        ConnectorConfig.parse({key: value}, env={})


def test_dispatcher_honours_disable_and_unknown_names() -> None:
    from nixlkv.core import RegistryError

    d = ConnectorConfig.parse({"disable_strategies": ["sliding_window"]}, env={}).dispatcher()
    assert "sliding_window" not in {r.strategy.name for r in d.registry.registered()}
    with pytest.raises(RegistryError, match="unknown strategies"):
        ConnectorConfig.parse({"disable_strategies": ["nope"]}, env={}).dispatcher()
    with pytest.raises(RegistryError, match="no strategy named"):
        ConnectorConfig.parse({"pin_strategies": {"FullAttentionSpec": "nope"}}, env={}).dispatcher()


def test_stats_aggregate_reduce_and_rebuild() -> None:
    from nixlkv.connector import NixlkvConnector
    from nixlkv.vllm.metadata import NixlkvStats

    a, b = NixlkvStats(), NixlkvStats()
    assert a.is_empty()
    a.record(1000, 10, 0.002, 0.001)
    b.record(3000, 30, 0.004, 0.001)
    b.count("failed_transfers")
    a.aggregate(b)
    r = a.reduce()
    assert r["transfers"] == 2 and r["bytes"] == 4000 and r["descriptors"] == 40 and r["failed_transfers"] == 1
    assert abs(r["avg_transfer_ms"] - 3.0) < 1e-9
    rebuilt = NixlkvConnector.build_kv_connector_stats(a.to_dict())
    assert rebuilt.reduce() == r
    assert NixlkvConnector.build_kv_connector_stats().is_empty()


@pytest.mark.parametrize(("theirs", "ours", "value"), [
    ("kv_lease_duration", "lease_s", 45),
    ("num_threads", "nixl_num_threads", 4),
    ("enforce_handshake_compat", "enforce_compat_hash", False),
])
def test_vllm_connector_keys_are_aliases(theirs, ours, value):
    c = ConnectorConfig.parse({theirs: value})
    assert getattr(c, ours) == value
    assert ConnectorConfig.parse({theirs: value, ours: value}) == c  # both, agreeing
    with pytest.raises(ConfigError, match=f"{theirs}=.*disagree; give only {ours}"):
        ConnectorConfig.parse({theirs: value, ours: 7 if value != 7 else 8})


@pytest.mark.parametrize("key", ["engine_ttl", "kv_recompute_threshold", "bidirectional_kv_xfer",
                                 "decoder_kv_blocks_ttl", "push_registration_timeout"])
def test_vllm_connector_keys_without_a_meaning_here_are_refused_naming_them(key):
    with pytest.raises(ConfigError, match=f"{key} is a vLLM NixlConnector key: .*remove it"):
        ConnectorConfig.parse({key: 1})


def test_nixl_telemetry_is_a_checked_bool_off_by_default():
    assert ConnectorConfig.parse({}).nixl_telemetry is False
    assert ConnectorConfig.parse({"nixl_telemetry": True}).nixl_telemetry is True
    with pytest.raises(ConfigError, match="nixl_telemetry must be true or false"):
        ConnectorConfig.parse({"nixl_telemetry": "on"})
