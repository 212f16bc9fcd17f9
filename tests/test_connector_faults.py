"""Failure semantics of the connector workers: incompatible or malformed remotes fail only their
requests with a log line naming the problem, write nothing, and leave the worker serving."""

from __future__ import annotations

import logging

import pytest

from nixlkv.testing import oracle
from nixlkv.vllm.handshake import SideChannelServer, compat_hash
from nixlkv.vllm.metadata import NixlkvMetadata

from connector_helpers import COMPAT, Engine, blocks, fa_scenario
from test_connector_handshake import HASH, MUTATIONS
from test_connector_worker import drive, recv

pytestmark = pytest.mark.nixl


def _sentinel_only(rank) -> bool:
    return bool((rank.buffer.numpy().view("uint8") == oracle.SENTINEL).all())


def test_incompatible_geometry_fails_only_that_remote(caplog) -> None:
    """P pages are token-major (LBNHC), D head-major (LBHNC), with hetero TP: no byte copy exists."""
    bad_sc = fa_scenario(2, 4, num_tokens=40, p_layout="LBNHC")
    good_sc = fa_scenario(2, 4, num_tokens=40)
    bad = Engine(bad_sc, "prefill", "P-bad", serve=True)
    good = Engine(good_sc, "prefill", "P-good", serve=True)
    d = Engine(good_sc, "decode", "D")
    try:
        for r in good.ranks:
            oracle.fill_prefill(r, blocks(r, [1, 2, 3]), seed=3)
        for r in d.ranks:
            oracle.fill_decode(r)
        for w in good.workers:
            w.start_load_kv(NixlkvMetadata(reqs_to_send={"ok": 30.0}))
        with caplog.at_level(logging.ERROR, logger="nixlkv.connector"):
            for w in d.workers:
                w.start_load_kv(NixlkvMetadata(reqs_to_recv={
                    "x": recv(bad, "x", [4, 5, 6], [1, 2, 3]), "ok": recv(good, "ok", [7, 8, 9], [1, 2, 3]),
                }))
            done_recv, failed, done_send = drive(good, d, {"x", "ok"}, sent={"ok"})
        assert all(v == {"x"} for v in failed.values()), failed
        assert all(v == {"x", "ok"} for v in done_recv.values())
        assert "handshake failed engine=P-bad" in caplog.text and "IncompatibleGeometry" in caplog.text
        assert "order their axes differently" in caplog.text  # the mismatch is named
        for r in d.ranks:
            assert oracle.compare(r, oracle.expected_decode(r, blocks(r, [7, 8, 9]), seed=3)) is None
    finally:
        for e in (bad, good, d):
            e.close()


_OURS = {"vllm": "0.33.0", "model": "/models/m", "dtype": "torch.bfloat16", "cache_dtype": "auto", "transfer": "pull-read"}
_THEIRS = {**_OURS, "cache_dtype": "fp8"}


@pytest.mark.parametrize("p_inputs,d_inputs,said", [
    # an earlier peer (no inputs sent): the refusal lists what may differ
    (None, None, "model, dtype, kv-cache dtype, speculative decoding, vLLM or nixlkv version differ"),
    # P started with another --kv-cache-dtype: the setting, both values and the flag, and nothing else
    (_THEIRS, _OURS, "cache_dtype is 'fp8' on the remote engine but 'auto' here (start both with the same --kv-cache-dtype)"),
])
def test_a_compat_hash_mismatch_fails_only_the_request_and_says_why(caplog, p_inputs, d_inputs, said) -> None:
    sc = fa_scenario(1, 1, num_tokens=40)
    p = Engine(sc, "prefill", "P", serve=True, compat=compat_hash(p_inputs) if p_inputs else "other-model",
               compat_inputs=p_inputs)
    d = Engine(sc, "decode", "D", compat=compat_hash(d_inputs) if d_inputs else COMPAT, compat_inputs=d_inputs)
    try:
        oracle.fill_decode(d.ranks[0])
        with caplog.at_level(logging.ERROR, logger="nixlkv.connector"):
            d.workers[0].start_load_kv(NixlkvMetadata(reqs_to_recv={"r": recv(p, "r", [1, 2], [1, 2])}))
            _, failed, _ = drive(p, d, {"r"}, timeout=5, sent=set())
        assert failed[0] == {"r"}
        assert "compatibility hash mismatch" in caplog.text and said in caplog.text
        if p_inputs:
            assert "model is" not in caplog.text and "dtype is" not in caplog.text.replace("cache_dtype is", "")
        assert _sentinel_only(d.ranks[0])
    finally:
        p.close()
        d.close()


MALFORMED = sorted(MUTATIONS)


def test_malformed_handshakes_through_the_worker(caplog) -> None:
    """Every mutated reply, served in turn by one side channel: each request fails, nothing is
    written, the worker neither crashes nor stops serving (a good remote afterwards transfers)."""
    sc = fa_scenario(1, 1, num_tokens=40)
    good = Engine(sc, "prefill", "P", serve=True, compat=HASH)  # the mutations are built with HASH
    d = Engine(sc, "decode", "D", compat=HASH)
    replies = iter([MUTATIONS[name]() for name in MALFORMED])
    server = SideChannelServer("127.0.0.1", 0, lambda: next(replies))
    try:
        oracle.fill_decode(d.ranks[0])
        for r in good.ranks:
            oracle.fill_prefill(r, blocks(r, [1, 2, 3]), seed=3)
        failed_all = set()
        with caplog.at_level(logging.ERROR, logger="nixlkv.connector"):
            for name in MALFORMED:  # one at a time: a failed handshake is retried by the next request
                req = recv(good, name, [4, 5, 6], [1, 2, 3], port=server.port)
                d.workers[0].start_load_kv(NixlkvMetadata(reqs_to_recv={name: req}))
                _, failed, _ = drive(good, d, {name}, timeout=10, sent=set())
                failed_all |= failed[0]
        assert failed_all == set(MALFORMED), set(MALFORMED) - failed_all
        assert server.served == len(MALFORMED)
        assert caplog.text.count("nixlkv handshake failed engine=P") == len(MALFORMED)
        assert "HandshakeError" in caplog.text and "Traceback" not in caplog.text
        assert _sentinel_only(d.ranks[0])
        good.workers[0].start_load_kv(NixlkvMetadata(reqs_to_send={"after": 30.0}))
        d.workers[0].start_load_kv(NixlkvMetadata(reqs_to_recv={"after": recv(good, "after", [7, 8, 9], [1, 2, 3])}))
        done, failed, sent = drive(good, d, {"after"})
        assert done[0] == {"after"} and not failed[0] and sent[0] == {"after"}
        assert oracle.compare(d.ranks[0], oracle.expected_decode(d.ranks[0], blocks(d.ranks[0], [7, 8, 9]), seed=3)) is None
    finally:
        server.close()
        good.close()
        d.close()
