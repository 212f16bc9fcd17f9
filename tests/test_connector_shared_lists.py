"""A decode rank that reads several prefill engines of one layout prepares its local descriptor
list once and shares it (vLLM keeps its local handles too): each engine's plan holds it, giving
one engine up keeps it for the others, and the last gives it back. Real NIXL, bytes checked."""

from __future__ import annotations

import time

import pytest

from nixlkv.testing import oracle

from pd_harness import PDCase, PDEngine, assert_no_leaks, prompt

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

SIDE = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}


def _prefill(case: PDCase, engine_id: str, prompts: dict[str, int]) -> tuple[PDEngine, dict[str, dict]]:
    p = PDEngine(case, "prefill", engine_id, dict(SIDE))
    for rid, i in prompts.items():
        p.add(rid, prompt(i, 40), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    while len(p.outputs) < len(prompts):
        p.step()
    return p, {rid: dict(p.outputs[rid].kv_transfer_params) for rid in prompts}


def _load(d: PDEngine, engines: list[PDEngine], wanted: set[str]) -> None:
    deadline = time.monotonic() + 60
    while not wanted <= set(d.outputs) and time.monotonic() < deadline:
        d.step()
        for p in engines:
            p.step()
        time.sleep(0.001)
    assert wanted <= d.finished_recving and not d.failed_recving, (d.finished_recving, d.failed_recving)


def _release(d: PDEngine, key: tuple) -> None:
    """D gives up one remote (as after a transfer error) and steps until its lists are given back."""
    worker = d.workers[0]._worker
    worker._invalidate(key)
    deadline = time.monotonic() + 30
    while worker._retiring and time.monotonic() < deadline:
        d.step()
    assert not worker._retiring


# direct: P1 -> D1, one local list; staged: P2 -> D1 read as whole prefill pages into D's staging
# buffer, whose two halves' lists are local lists too (three per decode rank), shared alike.
@pytest.mark.parametrize("mode, case, lists", [("direct", PDCase(), 1), ("staged", PDCase(p_tp=2), 3)])
def test_prefill_engines_of_one_layout_share_the_local_list(mode: str, case: PDCase, lists: int) -> None:
    p1, params1 = _prefill(case, "P1", {"a": 0})
    p2, params2 = _prefill(case, "P2", {"b": 1, "c": 2})
    d = PDEngine(case, "decode", "D", {**SIDE, "transfer_timeout_s": 5.0, "handshake_timeout_s": 5.0,
                                       "descriptor_mode": mode})
    try:
        oracle.fill_decode(d.ranks[0])
        d.add("a", prompt(0, 40), 2, params1["a"])
        d.add("b", prompt(1, 40), 2, params2["b"])
        _load(d, [p1, p2], {"a", "b"})
        worker = d.workers[0]._worker
        remotes = {key[0]: r for key, r in worker._remotes.items()}
        assert set(remotes) == {params1["a"]["remote_engine_id"], params2["b"]["remote_engine_id"]}
        one, two = (remotes[params["a" if params is params1 else "b"]["remote_engine_id"]].prepared
                    for params in (params1, params2))
        first, second = one.prepared, two.prepared
        assert first.local is second.local and worker.nixl.local_lists == lists  # prepared once
        assert len(one.staging_lists) == len(two.staging_lists) == lists - 1
        assert all(a is b for a, b in zip(one.staging_lists, two.staging_lists))
        assert first.remote[0] is not second.remote[0]  # each engine's own rows
        remote_lists = {id(h) for rp in (one, two) for h in (*rp.prepared.remote.values(), *rp.remote_lists.values())}
        assert len(worker.nixl._prepped) == lists + len(remote_lists)
        if mode == "staged":
            assert worker.reader.staged_requests == 2  # both loads went through the staging buffer

        # P1 given up: the list stays for P2, whose next request still loads through it.
        (key1,) = [key for key in worker._remotes if key[0] == params1["a"]["remote_engine_id"]]
        _release(d, key1)
        d.add("c", prompt(2, 40), 2, params2["c"])
        _load(d, [p1, p2], {"a", "b", "c"})  # fails where P1's release freed the shared list
        assert worker.nixl.local_lists == lists
        assert len(worker.nixl._prepped) == lists + len(second.remote) + len(two.remote_lists)
        staged = sum(s.data["staged_loads"] for s in d.stats)
        assert staged == (3 if mode == "staged" else 0)  # the operator's counter: every load of the run
        expected = d.expected(0, {rid: d.recv_blocks[rid] for rid in ("a", "b", "c")})
        assert oracle.compare(d.ranks[0], expected) is None

        # The last engine given up gives the list back.
        (key2,) = list(worker._remotes)
        _release(d, key2)
        assert worker.nixl.local_lists == 0 and not worker.nixl._prepped
        deadline = time.monotonic() + 30
        while (p1.finished_sending != {"a"} or p2.finished_sending != {"b", "c"}) and time.monotonic() < deadline:
            p1.step()
            p2.step()
        for engine in (d, p1, p2):
            assert_no_leaks(engine.leaks(), engine.role)
    finally:
        for engine in (d, p1, p2):
            engine.close()
