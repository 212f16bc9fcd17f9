"""Trailing prompt tokens the decode engine computes itself: declared per KV kind by the strategies,
made true on P by shortening the prefill (``stop_short``) and on D by claiming only what P holds
(``tokens_to_load``). Import-level: vLLM's real Request and specs, no engine, no NIXL."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from nixlkv.core import Dispatcher, PlanError, Strategy
from nixlkv.core.errors import RequestError
from nixlkv.core.registry import Registered, StrategyRegistry

pytestmark = pytest.mark.vllm


class ToySpec:
    pass


class ToyState(ToySpec):
    pass


class Tokens(Strategy):
    name = "tokens"
    spec_types = (ToySpec,)


class State(Strategy):
    name = "state"
    spec_types = (ToyState,)

    def decode_recomputes(self, spec: Any) -> int:
        return 1


class Negative(Strategy):
    name = "negative"
    spec_types = (ToyState,)

    def decode_recomputes(self, spec: Any) -> int:
        return -1


def _dispatcher(*strategies: Strategy) -> Dispatcher:
    return Dispatcher(StrategyRegistry([Registered(s, "test") for s in strategies]))


def test_the_model_holds_back_the_most_any_layer_declares() -> None:
    disp = _dispatcher(Tokens(), State())
    assert disp.decode_recomputes([(ToySpec(), "a0"), (ToySpec(), "a1")]) == 0
    assert disp.decode_recomputes([(ToySpec(), "a0"), (ToyState(), "m0")]) == 1
    assert disp.decode_recomputes([]) == 0


def test_a_declaration_that_is_not_a_count_is_refused_naming_the_strategy() -> None:
    with pytest.raises(PlanError, match=r"strategy 'negative' declared -1 .*layer 'm0'"):
        _dispatcher(Tokens(), Negative()).decode_recomputes([(ToyState(), "m0")])


def _kv_cache_config(model: str):
    from pd_harness import PDCase

    from nixlkv.testing.engines import build_rank

    return build_rank(PDCase(model).scenario(), "prefill", 0).kv_cache_config


@pytest.mark.parametrize("model,expected", [("llama", 0), ("llama-sw", 1), ("deepseek-mla", 0), ("nemotron-h", 1)])
def test_builtin_strategies_declare_one_token_for_a_running_state_or_a_window(model: str, expected: int) -> None:
    from nixlkv.vllm.config import ConnectorConfig
    from nixlkv.vllm.scheduler import decode_recomputes

    engine = SimpleNamespace(num_prefill_lookahead_tokens=0)
    assert decode_recomputes(engine, _kv_cache_config(model), ConnectorConfig().dispatcher()) == expected


def test_a_multi_module_mtp_lookahead_is_held_back_too() -> None:
    """vLLM's drafter reads ``num_prefill_lookahead_tokens`` ahead; all but one of them stay off P."""
    from nixlkv.vllm.config import ConnectorConfig
    from nixlkv.vllm.scheduler import decode_recomputes

    disp = ConnectorConfig().dispatcher()
    assert decode_recomputes(SimpleNamespace(num_prefill_lookahead_tokens=3), _kv_cache_config("llama"), disp) == 2
    assert decode_recomputes(SimpleNamespace(num_prefill_lookahead_tokens=1), _kv_cache_config("nemotron-h"), disp) == 1


def test_every_window_is_held_back_one_token() -> None:
    """The decode engine recomputes the last prompt token: it must hold that token's window, which
    vLLM's window manager frees when told all N tokens (N - W + 1 ending a block): served wrong."""
    from nixlkv.strategies.sliding_window import SlidingWindowStrategy
    from nixlkv.strategies.sliding_window_mla import SlidingWindowMLAStrategy

    assert SlidingWindowMLAStrategy().decode_recomputes(SimpleNamespace(prefix_replay_tokens=128)) == 1
    assert SlidingWindowMLAStrategy().decode_recomputes(SimpleNamespace(prefix_replay_tokens=0)) == 1
    assert SlidingWindowStrategy().decode_recomputes(SimpleNamespace(sliding_window=64)) == 1


@pytest.mark.parametrize("n,k,remote,expected", [
    (40, 0, 40, 40),  # attention only: the whole prompt, as before
    (40, 0, None, 40),
    (40, 1, 39, 39),  # P stopped one short: D loads what P holds
    (40, 1, 30, 30),  # P holds fewer: D computes more
    (40, 1, 40, None),  # P's state already took the last token: unusable
    (40, 1, None, None),  # P did not say: unusable
    (1, 1, 1, None),  # one token: D computes it
])
def test_decode_claims_only_what_leaves_it_its_tokens(n: int, k: int, remote: int | None, expected: int | None) -> None:
    from nixlkv.vllm.scheduler import tokens_to_load

    assert tokens_to_load(n, k, remote) == expected


HASH_BLOCK = 4


def _request(prompt: list[int], max_tokens: int = 5, **sampling: Any):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(request_id="r", prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(HASH_BLOCK, sha256))


@pytest.mark.parametrize("n", [2, 9, 12, 13])
def test_prefill_stops_short_as_if_sent_the_shorter_prompt(n: int) -> None:
    from nixlkv.vllm.scheduler import stop_short

    prompt = list(range(100, 100 + n))
    req = _request(prompt)
    assert stop_short(req, 1)
    short = _request(prompt[:-1], max_tokens=1)
    assert req.prompt_token_ids == short.prompt_token_ids and list(req.all_token_ids) == prompt[:-1]
    assert req.num_prompt_tokens == req.num_tokens == n - 1 and req.max_tokens == 1
    assert req.block_hashes == short.block_hashes  # no hash left over for the block with the cut token
    assert prompt == list(range(100, 100 + n))  # the caller's list is untouched


def test_what_cannot_or_need_not_be_cut_is_left_whole() -> None:
    from nixlkv.vllm.scheduler import stop_short

    for req, k in ((_request([5]), 1), (_request([5, 6, 7]), 0), (_request([5, 6, 7]), 3),
                   (_request([5, 6, 7], prompt_logprobs=1), 1)):
        before = (list(req.all_token_ids), req.num_prompt_tokens, req.max_tokens, list(req.block_hashes))
        assert not stop_short(req, k)
        assert (list(req.all_token_ids), req.num_prompt_tokens, req.max_tokens, list(req.block_hashes)) == before


def _scheduler(model: str, prefix_caching: bool | None = None):
    """``prefix_caching``: the engine's own prefix cache on or off (None: the harness model's)."""
    from pd_harness import vllm_config

    from nixlkv.vllm.config import ConnectorConfig
    from nixlkv.vllm.scheduler import NixlkvScheduler

    vc = vllm_config("kv_producer", "P", 1, 16, {}, model)
    if prefix_caching is not None:
        vc.cache_config.enable_prefix_caching = prefix_caching
    return NixlkvScheduler(vc, "P", ConnectorConfig(), "c", _kv_cache_config(model))


def test_prefill_scheduler_cuts_a_state_model_once_and_attention_never() -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    mamba = _scheduler("nemotron-h")
    req = _request(list(range(10, 30)))
    req.kv_transfer_params = dict(params)
    mamba.on_new_request(req)
    mamba.on_new_request(req)  # seen again (never by vLLM today): the cut is not repeated
    assert req.num_prompt_tokens == 19 and req.max_tokens == 1
    attention = _scheduler("llama")
    req = _request(list(range(10, 30)))
    req.kv_transfer_params = dict(params)
    attention.on_new_request(req)
    assert req.num_prompt_tokens == 20 and req.max_tokens == 5


def test_decode_scheduler_claims_what_the_prefill_holds() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "h",
              "remote_port": 1, "remote_block_ids": [[1, 2]]}
    mamba, attention = _scheduler("nemotron-h"), _scheduler("llama")
    for sched, remote, expected in ((mamba, 19, 19), (mamba, 20, 0), (attention, 20, 20)):
        req = _request(list(range(10, 30)))
        req.kv_transfer_params = {**params, "remote_num_tokens": remote}
        assert sched.get_num_new_matched_tokens(req, 0) == (expected, expected > 0)
    req = _request(list(range(10, 30)))
    req.kv_transfer_params = {**params, "remote_num_tokens": 19}
    assert mamba.get_num_new_matched_tokens(req, 16) == (3, True)  # a local prefix hit of one block


class _NewBlocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc sees them: the ids its prefix cache did not hold."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = [list(g) for g in groups]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return self.groups


@pytest.mark.parametrize("model,remote,hit", [("llama", 40, 16), ("llama", 40, 32), ("nemotron-h", 39, 16)])
@pytest.mark.parametrize("deferred", [False, True])
def test_decode_lists_describe_its_prefix_hit_plus_what_it_claims(model: str, remote: int, hit: int,
                                                                  deferred: bool) -> None:
    """D's prefix cache holds the first ``hit`` tokens (whole blocks of 16): D claims the rest
    from P, and the lists handed to the workers describe ``hit`` + claimed tokens, P's count,
    whether vLLM calls update_state_after_alloc before setting ``num_computed_tokens`` (the
    usual path) or after (a deferred load). Served before the fix, every such request failed:
    'remote_num_tokens=97 but the decode engine holds 1 tokens'."""
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "h",
              "remote_port": 1, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": remote}
    sched = _scheduler(model)
    req = _request(list(range(10, 50)))
    req.kv_transfer_params = dict(params)
    claimed, asynchronous = sched.get_num_new_matched_tokens(req, hit)
    assert (claimed, asynchronous) == (remote - hit, True)
    if deferred:  # vLLM sets the request's count (hit + claimed) before a deferred load's call
        req.num_computed_tokens = hit + claimed
    sched.update_state_after_alloc(req, _NewBlocks([5, 6]), claimed)
    recv = sched.build_connector_meta(None).reqs_to_recv[req.request_id]
    assert recv.num_tokens == remote and recv.tokens_to_pair() == remote
    assert recv.local_block_ids == ([5, 6],)
    # the control: lists that describe other than P's count are refused, naming both counts
    with pytest.raises(RequestError, match=f"remote_num_tokens={remote} but the decode engine holds {claimed} tokens"):
        dataclasses.replace(recv, num_tokens=claimed).tokens_to_pair()
    sched.request_finished(req, [[5, 6]])
    assert not sched._local_hit  # nothing kept per request once it finished


def test_a_prefill_request_is_read_by_one_decode_request_only(caplog: pytest.LogCaptureFixture) -> None:
    """P frees a request's blocks on its reader's notification. A second decode request naming the
    same prefill request (vLLM's n > 1 children each carry the params; a client sending them twice)
    computes its prompt here: it claims nothing, reads nothing and tells P nothing, before or after
    the reader finished, and an abort of it does not free the reader's blocks early. The reader
    itself may be asked again (vLLM asks each step a request waits)."""
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p-7", "remote_host": "h",
              "remote_port": 1, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40}
    sched = _scheduler("llama", prefix_caching=False)  # nothing to wait for: see the test below
    reqs = {}
    for rid in ("child-0", "child-1", "again", "aborted"):
        reqs[rid] = req = _request(list(range(10, 50)))
        req.request_id, req.kv_transfer_params = rid, dict(params)
        sched.on_new_request(req)
    reader = reqs["child-0"]
    assert sched.get_num_new_matched_tokens(reader, 0) == (40, True)
    assert sched.get_num_new_matched_tokens(reader, 0) == (40, True)  # the same request, a step later
    caplog.set_level(logging.WARNING, logger="nixlkv.connector")
    assert sched.get_num_new_matched_tokens(reqs["child-1"], 0) == (0, False)
    assert "prefill request p-7 of engine P, which request child-0 reads" in caplog.text
    sched.update_state_after_alloc(reader, _NewBlocks([5, 6, 7]), 40)
    sched.update_state_after_alloc(reqs["child-1"], _NewBlocks([8, 9, 10]), 0)
    sched.request_finished(reqs["aborted"], [])  # aborted while waiting: its blocks are the reader's
    meta = sched.build_connector_meta(None)
    assert list(meta.reqs_to_recv) == ["child-0"]  # one read, one notification to P
    assert "child-1" not in sched._awaiting and "aborted" not in sched._awaiting  # no heartbeats for them
    sched.request_finished(reader, [[5, 6, 7]])
    assert sched.get_num_new_matched_tokens(reqs["again"], 0) == (0, False)  # after the reader, too
    sched.update_state_after_alloc(reqs["again"], _NewBlocks([11]), 0)
    assert not sched.build_connector_meta(None).reqs_to_recv
    # the control: another prefill request is read as usual
    other = _request(list(range(10, 50)))
    other.request_id, other.kv_transfer_params = "fresh", {**params, "remote_request_id": "p-8"}
    assert sched.get_num_new_matched_tokens(other, 0) == (40, True)


@pytest.mark.parametrize("outcome", ["loaded", "failed", "reader aborted", "reader claimed nothing"])
def test_with_a_prefix_cache_the_others_wait_for_the_reader_then_claim_nothing(outcome: str) -> None:
    """D caching prefixes: a second request naming a prefill request that its reader is still
    loading waits (vLLM asks again each step) and, once the reader's load ended however it ended,
    claims nothing: its prompt's full blocks are then in D's prefix cache (vLLM hands it the hit),
    not computed again. It never reads, never tells P, and another prefill request is not held up."""
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p-7", "remote_host": "h",
              "remote_port": 1, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40}
    sched = _scheduler("llama", prefix_caching=True)
    reqs = {}
    for rid in ("child-0", "child-1", "other"):
        reqs[rid] = req = _request(list(range(10, 50)))
        req.request_id, req.kv_transfer_params = rid, dict(params)
        sched.on_new_request(req)
    reqs["other"].kv_transfer_params["remote_request_id"] = "p-8"
    reader, child = reqs["child-0"], reqs["child-1"]
    if outcome == "reader claimed nothing":  # D's own cache held the whole prompt: nothing to load
        assert sched.get_num_new_matched_tokens(reader, 40) == (0, False)
        sched.update_state_after_alloc(reader, _NewBlocks([]), 0)
    else:
        assert sched.get_num_new_matched_tokens(reader, 0) == (40, True)
        assert sched.get_num_new_matched_tokens(child, 0) == (None, False)  # waits
        sched.update_state_after_alloc(reader, _NewBlocks([5, 6, 7]), 40)
        assert sched.get_num_new_matched_tokens(child, 0) == (None, False)  # still loading
        assert sched.get_num_new_matched_tokens(reqs["other"], 0) == (40, True)  # another prefill request: read
        if outcome == "reader aborted":
            sched.request_finished(reader, [[5, 6, 7]])
        else:  # vLLM reports a failed load among the finished ones too
            sched.update_connector_output({"child-0"})
    assert sched.get_num_new_matched_tokens(child, 32) == (0, False)  # D's cache hit is its; nothing claimed
    sched.update_state_after_alloc(child, _NewBlocks([9]), 0)
    recv = sched.build_connector_meta(None).reqs_to_recv
    assert "child-1" not in recv and "child-1" not in sched._awaiting
