"""Handshake wire format: a valid reply round-trips; every malformed or hostile mutation is a
clean HandshakeError (no crash, no other exception type); the side channel times out cleanly."""

from __future__ import annotations

import copy
import time
import types
from pathlib import Path

import msgspec
import pytest

from nixlkv.core import HandshakeError, PageLayout, RankGeometry, Region
from nixlkv.vllm import handshake as hs

HASH = "abc123"


def geometry(rank: int = 0, tp: int = 2, engine: str = "P") -> RankGeometry:
    base = 0x10000 + rank * 0x100000
    page = PageLayout((("head", 4), ("token", 16), ("byte", 128)))
    regions = tuple(
        Region(f"layer.{i}", 0, "full_attention", base + i * 0x40000, 16, page.nbytes, page,
               {"heads": [rank * 4 + h for h in range(4)], "tokens_per_block": 16})
        for i in range(2)
    )
    return RankGeometry(engine, tp, rank, regions, ((base, 0x80000),))


def ranks(tp: int = 2) -> dict:
    return {r: (b"agent-%d" % r, geometry(r, tp)) for r in range(tp)}


def valid() -> bytes:
    return hs.encode_reply("P", 2, ranks(), HASH)


def payload_dict(columnar: bool = True) -> list:
    """The payload as plain msgpack data, to mutate field by field: as this nixlkv sends it
    (columnar geometry), or as an earlier nixlkv did (``columnar=False``: a description per region)."""
    if not columnar:
        return ["P", 2, [[r, meta, geo.to_dict()] for r, (meta, geo) in sorted(ranks().items())]]
    reply = msgspec.msgpack.decode(valid())
    return msgspec.msgpack.decode(reply[2])


def rewrap(payload, version=hs.SCHEMA_VERSION, hash_=HASH) -> bytes:
    return msgspec.msgpack.encode([version, hash_, msgspec.msgpack.encode(payload)])


def test_heartbeat_acks_are_offered_and_an_earlier_reader_ignores_the_field() -> None:
    """This nixlkv says it acknowledges heartbeats; an earlier peer's payload (no such field) reads
    as one that does not (D then sends it plain heartbeats); an earlier reader's payload struct
    (no such field) decodes this nixlkv's payload, the field ignored."""
    assert hs.decode_reply(valid(), HASH).heartbeat_acks
    earlier = payload_dict()
    assert earlier[-1] is True and len(earlier) == 5
    assert not hs.decode_reply(rewrap(earlier[:4]), HASH).heartbeat_acks

    class EarlierPayload(msgspec.Struct, array_like=True):  # EnginePayload before heartbeat_acks
        engine_id: str
        tp_size: int
        ranks: list
        pp_size: int = 1

    got = msgspec.msgpack.decode(msgspec.msgpack.decode(valid())[2], type=EarlierPayload)
    assert got.engine_id == "P" and got.tp_size == 2 and len(got.ranks) == 2 and got.pp_size == 1


def test_round_trip() -> None:
    engine = hs.decode_reply(valid(), HASH, expected_engine_id="P")
    assert engine.tp_size == 2 and engine.geometry[1] == geometry(1) and engine.agent_metadata[0] == b"agent-0"


def test_the_reply_is_columnar_and_an_earlier_peers_per_region_reply_is_still_accepted() -> None:
    sent = payload_dict()[2][0][2]
    assert "regions" not in sent and len(sent["region_classes"]) == 1  # two layers, one geometry
    assert sent["region_columns"] == {"name": ["layer.0", "layer.1"], "base": [0x10000, 0x50000], "group": [0, 0], "class": [0, 0]}
    new = hs.decode_reply(valid(), HASH, expected_engine_id="P")
    old = hs.decode_reply(rewrap(payload_dict(columnar=False)), HASH, expected_engine_id="P")
    assert old.geometry == new.geometry == {r: geometry(r) for r in range(2)}


def _mut(fn, columnar: bool = True):
    def build():
        p = payload_dict(columnar)
        fn(p)
        return rewrap(p)
    return build


def _old(fn):
    """A mutation of an earlier nixlkv's per-region reply (still accepted when well formed)."""
    return _mut(fn, columnar=False)


def _region(fn):
    def f(p):
        fn(p[2][0][2]["regions"][0])
    return f


def _columns(fn):
    def f(p):
        fn(p[2][0][2]["region_columns"])
    return f


def _class(fn):
    def f(p):
        fn(p[2][0][2]["region_classes"][0])
    return f


MUTATIONS = {
    "empty": lambda: b"",
    "truncated-1": lambda: valid()[:1],
    "truncated-half": lambda: valid()[: len(valid()) // 2],
    "truncated-last-byte": lambda: valid()[:-1],
    "garbage": lambda: bytes(range(256)) * 4,
    "map-not-array": lambda: msgspec.msgpack.encode({"schema_version": 1}),
    "wrong-version": lambda: rewrap(payload_dict(), version=99),
    "wrong-hash": lambda: rewrap(payload_dict(), hash_="other"),
    "hash-not-str": lambda: msgspec.msgpack.encode([hs.SCHEMA_VERSION, 7, b""]),
    "payload-not-bytes": lambda: msgspec.msgpack.encode([hs.SCHEMA_VERSION, HASH, "text"]),
    "payload-garbage": lambda: msgspec.msgpack.encode([hs.SCHEMA_VERSION, HASH, b"\xc1\xc1"]),
    "payload-truncated": lambda: msgspec.msgpack.encode([hs.SCHEMA_VERSION, HASH, msgspec.msgpack.encode(payload_dict())[:-3]]),
    "engine-id-empty": _mut(lambda p: p.__setitem__(0, "")),
    "engine-id-other": _mut(lambda p: p.__setitem__(0, "Q")),
    "tp-size-zero": _mut(lambda p: p.__setitem__(1, 0)),
    "tp-size-huge": _mut(lambda p: p.__setitem__(1, 10**9)),
    "tp-size-negative": _mut(lambda p: p.__setitem__(1, -2)),
    "tp-size-bool": _mut(lambda p: p.__setitem__(1, True)),
    "ranks-missing": _mut(lambda p: p[2].pop()),
    "rank-duplicate": _mut(lambda p: p[2].__setitem__(1, copy.deepcopy(p[2][0]))),
    "rank-out-of-range": _mut(lambda p: p[2][1].__setitem__(0, 5)),
    "rank-negative": _mut(lambda p: p[2][1].__setitem__(0, -1)),
    "agent-metadata-empty": _mut(lambda p: p[2][0].__setitem__(1, b"")),
    "agent-metadata-str": _mut(lambda p: p[2][0].__setitem__(1, "x")),
    "geometry-not-map": _mut(lambda p: p[2][0].__setitem__(2, [1, 2])),
    "geometry-no-regions": _old(lambda p: p[2][0][2].pop("regions")),
    "geometry-no-memory": _mut(lambda p: p[2][0][2].__setitem__("memory", [])),
    "geometry-engine-differs": _mut(lambda p: p[2][0][2].__setitem__("engine_id", "Q")),
    "geometry-rank-differs": _mut(lambda p: p[2][0][2].__setitem__("tp_rank", 1)),
    "geometry-tp-differs": _mut(lambda p: p[2][0][2].__setitem__("tp_size", 4)),
    "regions-huge-count": _old(lambda p: p[2][0][2].__setitem__("regions", [{}] * (hs.MAX_REGIONS + 1))),
    "memory-entry-shape": _mut(lambda p: p[2][0][2].__setitem__("memory", [[1, 2, 3]])),
    "memory-past-2^64": _mut(lambda p: p[2][0][2].__setitem__("memory", [[2**64 - 16, 4096]])),
    "memory-negative": _mut(lambda p: p[2][0][2].__setitem__("memory", [[-5, 4096]])),
    # an earlier nixlkv's per-region geometry
    "region-not-map": _old(lambda p: p[2][0][2]["regions"].__setitem__(0, "layer")),
    "region-base-negative": _old(_region(lambda r: r.__setitem__("base", -1))),
    "region-base-str": _old(_region(lambda r: r.__setitem__("base", "0x10"))),
    "region-num-blocks-zero": _old(_region(lambda r: r.__setitem__("num_blocks", 0))),
    "region-outside-memory": _old(_region(lambda r: r.__setitem__("base", 0x7000000))),
    "region-too-many-blocks": _old(_region(lambda r: r.__setitem__("num_blocks", 10**6))),
    "region-page-over-stride": _old(_region(lambda r: r.__setitem__("block_stride", 16))),
    "region-page-axis-negative": _old(_region(lambda r: r["page"][0].__setitem__(1, -4))),
    "region-page-axis-shape": _old(_region(lambda r: r["page"].__setitem__(0, ["head"]))),
    "region-page-too-many-axes": _old(_region(lambda r: r.__setitem__("page", [[f"a{i}", 1] for i in range(40)]))),
    "region-page-empty": _old(_region(lambda r: r.__setitem__("page", []))),
    "region-name-empty": _old(_region(lambda r: r.__setitem__("name", ""))),
    "region-name-duplicate": _old(lambda p: p[2][0][2]["regions"][1].__setitem__("name", "layer.0")),
    "region-facts-deep": _old(_region(lambda r: r.__setitem__("facts", {"x": [[[[[[1]]]]]]}))),
    "region-facts-int-key": _old(_region(lambda r: r.__setitem__("facts", {1: 2}))),
    "region-missing-stride": _old(_region(lambda r: r.pop("block_stride"))),
    # the columnar geometry this nixlkv sends: the same refusals, per class and per column
    "geometry-no-region-classes": _mut(lambda p: p[2][0][2].pop("region_classes")),
    "geometry-no-region-columns": _mut(lambda p: p[2][0][2].pop("region_columns")),
    "geometry-both-forms": _mut(lambda p: p[2][0][2].__setitem__("regions", [])),
    "classes-huge-count": _mut(lambda p: p[2][0][2].__setitem__("region_classes", [{}] * (hs.MAX_REGIONS + 1))),
    "columns-huge-count": _mut(_columns(lambda c: c.__setitem__("name", ["x"] * (hs.MAX_REGIONS + 1)))),
    "columns-not-map": _mut(lambda p: p[2][0][2].__setitem__("region_columns", [])),
    "column-not-list": _mut(_columns(lambda c: c.__setitem__("base", 7))),
    "column-missing": _mut(_columns(lambda c: c.pop("group"))),
    "columns-length-mismatch": _mut(_columns(lambda c: c["name"].pop())),
    "column-base-negative": _mut(_columns(lambda c: c["base"].__setitem__(0, -1))),
    "column-base-str": _mut(_columns(lambda c: c["base"].__setitem__(0, "0x10"))),
    "column-base-bool": _mut(_columns(lambda c: c["base"].__setitem__(1, True))),
    "column-base-float": _mut(_columns(lambda c: c["base"].__setitem__(1, 65536.0))),
    "column-base-outside-memory": _mut(_columns(lambda c: c["base"].__setitem__(0, 0x7000000))),
    "column-group-bool": _mut(_columns(lambda c: c["group"].__setitem__(0, False))),
    "column-class-out-of-range": _mut(_columns(lambda c: c["class"].__setitem__(1, 1))),
    "column-class-negative": _mut(_columns(lambda c: c["class"].__setitem__(1, -1))),
    "column-name-empty": _mut(_columns(lambda c: c["name"].__setitem__(0, ""))),
    "column-name-duplicate": _mut(_columns(lambda c: c["name"].__setitem__(1, "layer.0"))),
    "column-name-int": _mut(_columns(lambda c: c["name"].__setitem__(1, 1))),
    "class-not-map": _mut(lambda p: p[2][0][2]["region_classes"].__setitem__(0, "layer")),
    "class-holds-a-base": _mut(_class(lambda r: r.__setitem__("base", 0x10000))),
    "class-num-blocks-zero": _mut(_class(lambda r: r.__setitem__("num_blocks", 0))),
    "class-too-many-blocks": _mut(_class(lambda r: r.__setitem__("num_blocks", 10**6))),
    "class-page-over-stride": _mut(_class(lambda r: r.__setitem__("block_stride", 16))),
    "class-page-axis-negative": _mut(_class(lambda r: r["page"][0].__setitem__(1, -4))),
    "class-page-axis-shape": _mut(_class(lambda r: r["page"].__setitem__(0, ["head"]))),
    "class-page-too-many-axes": _mut(_class(lambda r: r.__setitem__("page", [[f"a{i}", 1] for i in range(40)]))),
    "class-page-empty": _mut(_class(lambda r: r.__setitem__("page", []))),
    "class-facts-deep": _mut(_class(lambda r: r.__setitem__("facts", {"x": [[[[[[1]]]]]]}))),
    "class-facts-int-key": _mut(_class(lambda r: r.__setitem__("facts", {1: 2}))),
    "class-missing-stride": _mut(_class(lambda r: r.pop("block_stride"))),
    "class-strategy-none": _mut(_class(lambda r: r.__setitem__("strategy", None))),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_is_rejected_cleanly(name: str) -> None:
    raw = MUTATIONS[name]()
    with pytest.raises(HandshakeError) as e:
        hs.decode_reply(raw, HASH, expected_engine_id="P")
    assert str(e.value)


# Columnar mutations whose refusal must name the field (the wire's own words).
NAMED = {
    "columns-length-mismatch": r"region_columns must be lists of one length, got name 1, base 2",
    "column-class-out-of-range": r"region_columns\['class'\]\[1\] = 1 is out of range",
    "column-base-bool": r"region_columns\['base'\]\[1\] must be a non-negative integer, got True",
    "column-group-bool": r"region_columns\['group'\]\[0\] must be a non-negative integer, got False",
    "column-name-duplicate": r"region_columns\['name'\] repeats region names \['layer.0'\]",
    "column-base-negative": r"region_columns\['base'\]\[0\] must be a non-negative integer, got -1",
    "column-missing": r"region_columns lacks the columns \['group'\]",
    "column-base-outside-memory": r"region 'layer.0' .* lies outside every memory range",
    "classes-huge-count": r"65537 region classes",
    "class-page-axis-shape": r"region_classes\[0\]: page axes must be \[name, size\]",
    "class-num-blocks-zero": r"region_classes\[0\]: .*num_blocks must be >= 1",
    "geometry-no-region-columns": r"'region_columns'",
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_columnar_mutation_refusal_names_the_field(name: str) -> None:
    assert hs.decode_reply(rewrap(payload_dict()), HASH, expected_engine_id="P").tp_size == 2  # control
    with pytest.raises(HandshakeError, match=NAMED[name]):
        hs.decode_reply(MUTATIONS[name](), HASH, expected_engine_id="P")


def test_at_least_twenty_mutations() -> None:
    assert len(MUTATIONS) >= 20


def test_every_truncation_is_rejected() -> None:
    raw = valid()
    for n in range(0, len(raw), max(1, len(raw) // 97)):
        with pytest.raises(HandshakeError):
            hs.decode_reply(raw[:n], HASH)


def test_oversized_reply_is_refused_before_decoding() -> None:
    with pytest.raises(HandshakeError, match="max_handshake_bytes"):
        hs.decode_reply(valid(), HASH, max_bytes=100)


def test_hash_mismatch_names_both_and_can_be_overridden() -> None:
    with pytest.raises(HandshakeError, match="'other'.*'abc123'"):
        hs.decode_reply(rewrap(payload_dict(), hash_="other"), HASH)
    assert hs.decode_reply(rewrap(payload_dict(), hash_="other"), HASH, enforce_hash=False).tp_size == 2


INPUTS = {"vllm": "0.33.0", "model": "/models/m", "dtype": "torch.bfloat16", "cache_dtype": "auto",
          "transfer": "pull-read", "speculative": {"method": "mtp", "num_speculative_tokens": 1}}


@pytest.mark.parametrize("key,value,setting", [
    ("cache_dtype", "fp8", "--kv-cache-dtype"),
    ("model", "/other/model", "--model"),
    ("dtype", "torch.float16", "--dtype"),
    ("speculative", {"method": "mtp", "num_speculative_tokens": 2}, "--speculative-config"),
    ("vllm", "0.32.0", "the vLLM version"),
])
def test_a_refused_hash_names_the_setting_the_engines_differ_in(key: str, value: object, setting: str) -> None:
    theirs = {**INPUTS, key: value}
    raw = hs.encode_reply("P", 2, ranks(), hs.compat_hash(theirs), theirs)
    with pytest.raises(HandshakeError) as info:
        hs.decode_reply(raw, hs.compat_hash(INPUTS), expected_inputs=INPUTS)
    msg = str(info.value)
    assert f"{key} is {value!r} on the remote engine but {INPUTS[key]!r} here (start both with the same {setting})" in msg
    others = [k for k in INPUTS if k != key and f"{k} is " in msg.replace(f"{key} is ", "")]
    assert not others, msg  # only what differs is named
    # the same inputs pass the hash; a setting only one side has is named with None on the other
    assert hs.decode_reply(hs.encode_reply("P", 2, ranks(), hs.compat_hash(INPUTS), INPUTS),
                           hs.compat_hash(INPUTS), expected_inputs=INPUTS).tp_size == 2
    extra = {**INPUTS, "new_setting": 1}
    with pytest.raises(HandshakeError, match="new_setting is 1 on the remote engine but None here"):
        hs.decode_reply(hs.encode_reply("P", 2, ranks(), hs.compat_hash(extra), extra),
                        hs.compat_hash(INPUTS), expected_inputs=INPUTS)


def test_a_refused_hash_without_inputs_to_compare_says_what_may_differ() -> None:
    """An earlier peer sends no inputs, and a reader may have none: the refusal lists the candidates."""
    theirs = {**INPUTS, "cache_dtype": "fp8"}
    for raw, mine in ((rewrap(payload_dict(), hash_=hs.compat_hash(theirs)), INPUTS),
                      (hs.encode_reply("P", 2, ranks(), hs.compat_hash(theirs), theirs), None)):
        with pytest.raises(HandshakeError, match="model, dtype, kv-cache dtype, speculative decoding, vLLM or nixlkv"):
            hs.decode_reply(raw, hs.compat_hash(INPUTS), expected_inputs=mine)


def test_the_compat_inputs_keep_the_wire_and_the_hash_of_earlier_peers() -> None:
    """A reader of the three-field reply still decodes one with inputs, and the hash of given inputs
    is the one earlier nixlkv computed (engines of both versions still pair)."""
    import hashlib
    import json

    class EarlierReply(msgspec.Struct, array_like=True):
        schema_version: int
        compat_hash: str
        payload: bytes

    raw = hs.encode_reply("P", 2, ranks(), HASH, INPUTS)
    assert msgspec.msgpack.decode(raw, type=EarlierReply).compat_hash == HASH
    earlier = hashlib.sha256(json.dumps({"schema_version": hs.SCHEMA_VERSION, **INPUTS}, sort_keys=True,
                                        default=str).encode()).hexdigest()[:32]
    assert hs.compat_hash(INPUTS) == earlier
    assert hs.compat_hash({**INPUTS, "cache_dtype": "fp8"}) != earlier  # negative control


def test_side_channel_round_trip_and_timeout() -> None:
    server = hs.SideChannelServer("127.0.0.1", 0, valid)
    try:
        raw = hs.fetch("127.0.0.1", server.port, 2.0, 1 << 20)
        assert hs.decode_reply(raw, HASH).engine_id == "P"
        # a malformed request gets an empty answer, the server keeps serving
        import zmq

        s = zmq.Context.instance().socket(zmq.REQ)
        s.setsockopt(zmq.RCVTIMEO, 2000)
        s.connect(f"tcp://127.0.0.1:{server.port}")
        s.send(b"\xc1garbage")
        assert s.recv() == b""
        s.close(0)
        assert hs.decode_reply(hs.fetch("127.0.0.1", server.port, 2.0, 1 << 20), HASH).tp_size == 2
    finally:
        server.close()
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="no handshake answer"):
        hs.fetch("127.0.0.1", server.port, 0.3, 1 << 20)
    assert time.monotonic() - t0 < 2


def test_an_unanswered_handshake_names_the_prefill_engines_settings() -> None:
    # A wrong side_channel_host or a closed port reaches D only as silence: the error must say which
    # of P's settings to fix, and single out a loopback address (P reachable from its own host only)
    from nixlkv.vllm import handshake as hs

    loop = hs.unanswered("127.0.0.1", 5600, 2.0)
    assert "127.0.0.1:5600 within 2.0 s" in loop and "loopback" in loop and "side_channel_host" in loop
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in loop and "localhost" in hs.unanswered("localhost", 1, 1.0).split(":", 1)[1]
    far = hs.unanswered("10.0.0.7", 5600, 2.0)
    assert "loopback" not in far and "side_channel_host (10.0.0.7)" in far and "side_channel_port (5600) is open" in far


def test_an_unanswered_handshake_says_what_a_tcp_connection_met(monkeypatch) -> None:
    # ZMQ retries a refused connection in silence: the probe after the timeout tells a closed port
    # (nothing listens) from one that accepts but never answers, and from a host that does not answer
    import socket

    from nixlkv.core.errors import HandshakeError
    from nixlkv.vllm import handshake as hs

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]  # nothing listens once the socket closes
    t0 = time.monotonic()
    with pytest.raises(HandshakeError) as err:
        hs.fetch("127.0.0.1", closed, 0.3, 1 << 20)
    assert time.monotonic() - t0 < 2
    assert f"(connection refused: nothing listens on 127.0.0.1:{closed})" in str(err.value)
    assert "loopback" in str(err.value)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert hs.probe("127.0.0.1", port) == (f"127.0.0.1:{port} accepts TCP connections but sent no handshake answer "
                                               "(another service on that port, or the prefill engine stuck)")

    def silent(address, timeout):  # fault injection: a host that never answers the SYN
        raise TimeoutError

    monkeypatch.setattr(socket, "create_connection", silent)
    assert hs.probe("10.0.0.7", 5600, 0.5) == ("10.0.0.7:5600 did not accept a TCP connection within 0.5 s (host down "
                                               "or unreachable, or a firewall drops it)")


def test_invalid_utf8_in_any_string_is_a_handshake_error() -> None:
    """A msgpack str holding invalid UTF-8 (was UnicodeDecodeError out of decode_reply)."""
    from nixlkv.core.errors import HandshakeError
    from nixlkv.vllm.handshake import SCHEMA_VERSION, decode_reply

    bad_str = b"\xa2\xff\xfe"  # fixstr of 2 bytes, not UTF-8
    header_hash = bytes([0x93, SCHEMA_VERSION]) + bad_str + b"\xc4\x00"  # [1, <bad>, b""]
    with pytest.raises(HandshakeError, match="header unreadable"):
        decode_reply(header_hash, "h")
    # the hash fine, the payload's engine id not UTF-8
    payload = bytes([0x93]) + bad_str + bytes([0x01, 0x90])  # [<bad>, 1, []]
    raw = bytes([0x93, SCHEMA_VERSION, 0xa1]) + b"h" + bytes([0xc4, len(payload)]) + payload
    with pytest.raises(HandshakeError, match="payload malformed"):
        decode_reply(raw, "h")


def test_region_in_memory_check_matches_brute_force() -> None:
    """The O(n log n) containment check (many regions x many memory ranges no longer costs their
    product) accepts and refuses exactly what checking every range would, overlaps included."""
    import random

    from nixlkv.core.errors import HandshakeError
    from nixlkv.vllm.handshake import _check_regions_in_memory

    import numpy as np

    from nixlkv.core.geometry import COL_BASE, COL_END

    def geometry(memory, spans):
        columns = np.zeros((len(spans), 7), dtype=np.int64)
        columns[:, COL_BASE] = [b for b, _ in spans]
        columns[:, COL_END] = [b + n for b, n in spans]
        regions = [types.SimpleNamespace(name=f"r{i}", base=b, end=b + n) for i, (b, n) in enumerate(spans)]
        return types.SimpleNamespace(memory=memory, columns=columns, regions=regions)

    rng = random.Random(7)
    for scale in (1, 1 << 53):  # small addresses, and ranges reaching past 2**63 (clipped, same answers)
        for _ in range(300):
            memory = [(rng.randrange(0, 1000) * scale, rng.randrange(1, 200) * scale) for _ in range(rng.randrange(1, 6))]
            spans = [(rng.randrange(0, 1100) * min(scale, 1 << 51), rng.randrange(1, 150)) for _ in range(rng.randrange(1, 4))]
            geo = geometry(memory, spans)
            outside = [i for i, (b, n) in enumerate(spans) if not any(a <= b and b + n <= a + m for a, m in memory)]
            if not outside:
                _check_regions_in_memory(geo, 0)
            else:
                with pytest.raises(HandshakeError, match=f"region 'r{outside[0]}' .* outside every memory range"):
                    _check_regions_in_memory(geo, 0)


def test_a_renamed_page_axis_is_refused_naming_the_axis() -> None:
    """A remote page whose 'head' axis is renamed (was KeyError: 'head' out of the planner): a
    malformed reply (HandshakeError) naming the axes, before any strategy reads the page."""
    import dataclasses

    from nixlkv.core import Dispatcher
    from nixlkv.core.errors import IncompatibleGeometry, MalformedRemoteFact
    from nixlkv.testing.rehearsal import build, geometry
    from nixlkv.testing.scenario import load

    page = PageLayout((("hd", 4), ("token", 16), ("byte", 128)))
    with pytest.raises(IncompatibleGeometry, match="no axis 'head'"):
        page.size("head")
    sc = load(Path(__file__).parent / "scenarios" / "fa-p1-d1-h8.yaml")
    dispatcher = Dispatcher.from_plugins()
    engines = build(sc, dispatcher)
    local, remote = geometry(engines.decode[0], dispatcher), geometry(engines.prefill[0], dispatcher)
    region = remote.regions[0]
    renamed = tuple(("hd" if n == "head" else n, z) for n, z in region.page.axes)
    bad = dataclasses.replace(region, page=PageLayout(renamed))
    with pytest.raises(MalformedRemoteFact, match="axes") as info:
        dispatcher.plan(local, {0: dataclasses.replace(remote, regions=(bad, *remote.regions[1:]))})
    assert isinstance(info.value, HandshakeError) and "'hd'" in str(info.value)


@pytest.mark.parametrize(("fact", "value", "kind"), [
    ("tokens_per_block", 1.5, "number"),  # was accepted until resolve
    ("tokens_per_block", "16", "string"),
    ("total_kv_heads", True, "bool"),
])
def test_a_remote_fact_of_another_kind_is_refused_naming_it(fact: str, value: object, kind: str) -> None:
    """A remote region whose fact has another type than the one this strategy writes (a string
    where a number belongs, 1.5 tokens per block) is refused at planning, naming the layer and the
    fact, instead of a ValueError/TypeError from inside a strategy."""
    import dataclasses

    from nixlkv.core import Dispatcher
    from nixlkv.core.errors import IncompatibleGeometry
    from nixlkv.testing.rehearsal import build, geometry
    from nixlkv.testing.scenario import load

    sc = load(Path(__file__).parent / "scenarios" / "fa-p1-d1-h8.yaml")
    dispatcher = Dispatcher.from_plugins()
    engines = build(sc, dispatcher)
    local, remote = geometry(engines.decode[0], dispatcher), geometry(engines.prefill[0], dispatcher)
    assert fact in remote.regions[0].facts
    dispatcher.plan(local, {0: remote})  # as advertised: plans
    bad = dataclasses.replace(remote.regions[0], facts={**remote.regions[0].facts, fact: value})
    broken = dataclasses.replace(remote, regions=(bad, *remote.regions[1:]))
    with pytest.raises(IncompatibleGeometry, match=f"advertises {fact}=.*\\({kind}\\)") as info:
        dispatcher.plan(local, {0: broken})
    assert isinstance(info.value, HandshakeError)  # a malformed reply, as the worker reports it


@pytest.mark.parametrize(("fact", "value"), [
    ("tokens_per_block", 0),  # was ZeroDivisionError in token_phases
    ("tokens_per_block", None),  # was TypeError (None skipped the kind check)
    ("total_kv_heads", None),  # was TypeError in heads_held
    ("tokens_per_block", 2**40),  # was an OOM (2**36 phases)
    ("tokens_per_block", -16),  # was planned: a head slice silently never read
    ("tokens_per_block", 32),  # a count its page does not hold
    ("num_heads", 8),
])
def test_hostile_remote_facts_are_malformed_replies_naming_the_fact(fact: str, value: object) -> None:
    """Found by the campaign (tests/test_campaign.py): one advertised fact of an otherwise true
    reply, P TP 2 -> D TP 1. Each is refused as a HandshakeError naming the fact, never another
    exception, never a plan."""
    import dataclasses

    from nixlkv.core import Dispatcher
    from nixlkv.core.errors import MalformedRemoteFact
    from nixlkv.testing.engines import build_rank
    from nixlkv.testing.rehearsal import geometry
    from nixlkv.testing.scenario import parse

    sc = parse({"model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 4, "head_size": 32}]},
                "prefill": {"tp": 2}, "decode": {"tp": 1}, "request": {"num_tokens": 64}})
    dispatcher = Dispatcher.from_plugins()
    prefill = {r: geometry(build_rank(sc, "prefill", r), dispatcher) for r in range(2)}
    local = geometry(build_rank(sc, "decode", 0), dispatcher)
    assert len(dispatcher.plan(local, prefill).segments) == 4  # the true reply plans
    region = prefill[0].regions[0]
    bad = dataclasses.replace(region, facts={**region.facts, fact: value})
    prefill[0] = dataclasses.replace(prefill[0], regions=(bad, *prefill[0].regions[1:]))
    with pytest.raises(MalformedRemoteFact, match=fact) as info:
        dispatcher.plan(local, prefill)
    assert isinstance(info.value, HandshakeError)


def test_a_reader_parses_only_the_ranks_it_plans_with() -> None:
    """A decode rank reads some of the prefill ranks (Dispatcher.read_ranks): only their geometry
    is parsed and checked; every rank's envelope and agent metadata is, for the ranks only told."""
    asked = []

    def rank_one(tp: int) -> list[int]:
        asked.append(tp)
        return [1]

    engine = hs.decode_reply(valid(), HASH, expected_engine_id="P", ranks=rank_one)
    assert asked == [2] and list(engine.geometry) == [1] and engine.geometry[1] == geometry(1)
    assert engine.agent_metadata == {0: b"agent-0", 1: b"agent-1"}
    broken = payload_dict()
    broken[2][0][2]["region_columns"]["base"] = "junk"  # rank 0's geometry: never read by this reader
    assert list(hs.decode_reply(rewrap(broken), HASH, ranks=rank_one).geometry) == [1]
    with pytest.raises(HandshakeError, match="region_columns"):  # negative control: read, it is refused
        hs.decode_reply(rewrap(broken), HASH, ranks=lambda tp: [0, 1])
    with pytest.raises(HandshakeError, match="region_columns"):  # and by default every rank is read
        hs.decode_reply(rewrap(broken), HASH)
    twice = payload_dict()
    twice[2][0][0] = 1
    with pytest.raises(HandshakeError, match="rank 1 twice"):
        hs.decode_reply(rewrap(twice), HASH, ranks=lambda tp: [])
    no_agent = payload_dict()
    no_agent[2][0][1] = b""
    with pytest.raises(HandshakeError, match="rank 0: empty NIXL agent metadata"):
        hs.decode_reply(rewrap(no_agent), HASH, ranks=rank_one)
