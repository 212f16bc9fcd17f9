"""The push-mode wire (nixlkv.vllm.push) and its checks, without engines: what D sends parses back
to the same ids and rows; anything malformed is a PushWireError naming the field; rows outside a
prefill rank's registered memory are found; push and staged READs are refused together."""

from __future__ import annotations

import numpy as np
import pytest

from nixlkv.vllm import push
from nixlkv.vllm.config import ConfigError, ConnectorConfig


def test_ids_round_trip_and_runs_compress() -> None:
    ids = (np.arange(64)[:, None] * 1000 + np.arange(512)[None, :]).ravel()  # 64 regions x 512 blocks
    blob = push.encode_ids(ids)
    assert np.array_equal(push.decode_ids(blob, "ids"), ids)
    assert len(blob) < ids.size  # under a byte per id (runs of equal differences)
    assert push.decode_ids(push.encode_ids(np.zeros(0, np.int64)), "ids").size == 0


def test_orders_and_hellos_round_trip() -> None:
    order = push.Order(3, "p-req", "d-req", 2, np.array([5, 6, 7]), np.array([10, 11, 40]))
    back = push.Order.decode(order.encode())
    assert (back.plan, back.prefill_request_id, back.decode_request_id, back.consumers) == (3, "p-req", "d-req", 2)
    assert back.decode_ids.tolist() == [5, 6, 7] and back.prefill_ids.tolist() == [10, 11, 40]
    rows = np.array([[4096, 256, 0, 512, 8], [65536, 128, 0, 128, 1]], dtype=np.uint64)
    hello = push.Hello.decode(push.Hello(3, b"meta", "DRAM", rows, rows[:1]).encode())
    assert hello.agent_metadata == b"meta" and np.array_equal(hello.decode_rows, rows)
    assert np.array_equal(hello.prefill_rows, rows[:1])
    assert push.parse_failed(push.failed("d-req", "why")) == ("d-req", "why")
    assert push.parse_pushed(push.pushed("d-req")) == "d-req"
    assert push.parse_abandon(push.abandon("d-req")) == "d-req"
    for msg, prefix in ((order.encode(), push.ORDER), (push.pushed("x"), push.PUSHED), (push.failed("x", ""), push.FAILED),
                        (push.abandon("x"), push.ABANDON), (hello.encode(), push.HELLO)):
        assert push.kind(msg) == prefix
    assert push.kind(b"nixlkv:req:1") is None and push.kind(b"nixlkv-hb:\x90") is None


@pytest.mark.parametrize("mutate,match", [
    (lambda o: push.Order(o.plan, o.prefill_request_id, o.decode_request_id, 0, o.decode_ids, o.prefill_ids), "consumers"),
    (lambda o: push.Order(o.plan, "", o.decode_request_id, 1, o.decode_ids, o.prefill_ids), "prefill_request_id"),
    (lambda o: push.Order(o.plan, o.prefill_request_id, o.decode_request_id, 1, o.decode_ids[:1], o.prefill_ids),
     "equal"),
    (lambda o: push.Order(o.plan, o.prefill_request_id, o.decode_request_id, 1, np.array([-1, 2]), o.prefill_ids),
     "negative"),
])
def test_malformed_orders_are_named(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    order = push.Order(1, "p", "d", 1, np.array([1, 2]), np.array([3, 4]))
    with pytest.raises(push.PushWireError, match=match):
        push.Order.decode(mutate(order).encode())


@pytest.mark.parametrize("msg,match", [
    (push.ORDER + b"\xc1", "unreadable"),
    (push.ORDER + b"\x96\x01\xa1p\xa1d\x01\xc4\x03abc\xc4\x00", "not compressed"),
    (push.HELLO + b"\x95\x01\xc4\x00\xa4DISK\xc4\x00\xc4\x00", "DRAM or VRAM"),
    (push.HELLO + b"\x95\x01\xc4\x00\xa4DRAM\xc4\x03abc\xc4\x00", "whole rows"),
    (push.FAILED + b"\x92\xa0\xa0", "empty"),
])
def test_malformed_messages_are_named(msg: bytes, match: str) -> None:
    decode = {push.ORDER: push.Order.decode, push.HELLO: push.Hello.decode, push.FAILED: push.parse_failed}[push.kind(msg)]
    with pytest.raises(push.PushWireError, match=match):
        decode(msg)


def test_rows_outside_registered_memory_are_found() -> None:
    memory = [(1 << 20, 4096), (1 << 24, 8192)]
    rows = np.array([
        [1 << 20, 256, 0, 512, 8],          # 0: [1M, 1M + 7*512 + 256) inside the first range
        [1 << 20, 256, 0, 512, 9],          # 1: its last descriptor ends past the first range
        [(1 << 24) + 8000, 192, 0, 0, 1],   # 2: ends exactly at the second range's end
        [(1 << 24) + 8000, 193, 0, 0, 1],   # 3: one byte past it
        [(1 << 22), 16, 0, 0, 1],           # 4: between the ranges
        [1 << 20, 16, 0, 16, 0],            # 5: no descriptors at all
    ], dtype=np.uint64)
    assert push.rows_outside(rows, memory).tolist() == [1, 3, 4, 5]


def test_transfer_mode_is_checked_and_push_refuses_staged_reads() -> None:
    assert ConnectorConfig.parse({"transfer_mode": "push"}, env={}).transfer_mode == "push"
    assert ConnectorConfig.parse({}, env={}).transfer_mode == "pull"
    with pytest.raises(ConfigError, match="transfer_mode must be one of"):
        ConnectorConfig.parse({"transfer_mode": "write"}, env={})
    for mode in ("staged", "auto"):
        with pytest.raises(ConfigError, match="descriptor_mode 'direct'"):
            ConnectorConfig.parse({"transfer_mode": "push", "descriptor_mode": mode}, env={})


def test_the_side_channel_answers_which_requests_are_still_held() -> None:
    """A prefill engine's side channel answers a held query from its own thread (an idle engine
    too); a server that answers no held query refuses it (D then keeps its orders waiting), and an
    answer that is not a HeldReply for every id asked is named."""
    import msgspec

    from nixlkv.vllm import handshake as hs

    held = {"p-1", "p-3"}
    answers = {"good": lambda ids: msgspec.msgpack.encode(hs.HeldReply("P", [i in held for i in ids])),
               "short": lambda ids: msgspec.msgpack.encode(hs.HeldReply("P", [True])),
               "other": lambda ids: b"handshake"}
    servers = {k: hs.SideChannelServer("127.0.0.1", 0, lambda: b"handshake", f) for k, f in answers.items()}
    servers["old"] = hs.SideChannelServer("127.0.0.1", 0, lambda: b"handshake")
    try:
        reply = hs.fetch_held("127.0.0.1", servers["good"].port, 5.0, ["p-1", "p-2", "p-3"], 1 << 16)
        assert reply.engine_id == "P" and reply.held == [True, False, True]
        assert hs.fetch("127.0.0.1", servers["good"].port, 5.0, 1 << 16) == b"handshake"  # plain: the handshake
        for name, match in (("old", "refused"), ("short", "answered 1 of 3"), ("other", "something else")):
            with pytest.raises(hs.HandshakeError, match=match):
                hs.fetch_held("127.0.0.1", servers[name].port, 5.0, ["p-1", "p-2", "p-3"], 1 << 16)
    finally:
        for server in servers.values():
            server.close()
