"""Circular buffers (compressor rings): one block per request, moved whole from one prefill rank,
by a strategy that is a plugin of its own (a module and an entry point; nothing in nixlkv.core,
the connector or nixlkv.vllm knows it).

What is checked here, beside the scenarios in tests/scenarios/ring-*.yaml:

* the plugin is installed and dispatches ``CircularBufferSpec``; no token is held back;
* the rehearsal's block lists are vLLM's: its real ``KVCacheManager`` (``CircularBufferManager``)
  gives a request exactly one ring block on both engines, whatever its length;
* the bytes moved are the ring pages and nothing else; a different ring is refused by name;
* without the plugin the full-attention strategy refuses the ring (its blocks are not token
  blocks) instead of pairing it by token range;
* the contract kit's suite passes, and its checks fail deliberately wrong strategies (the wrong
  block paired, half a page moved, the hold-back of a running state).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nixlkv.core import Dispatcher, IncompatibleGeometry, RequestError, hookimpl
from nixlkv.testing import contract
from nixlkv.testing.contract import ContractCase, ContractViolation, Point
from nixlkv.testing.rehearsal import build, rehearse, request_blocks
from nixlkv.testing.scenario import ScenarioError, load, parse
from nixlkv.testing.suite import StrategyContract

from plugin_helpers import check_installed_as_own_plugin, check_neither_builtin_nor_placeholder

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

SCENARIOS = Path(__file__).parent / "scenarios"
RING_PAGE = 8 * 1024 * 4  # the scenarios' DeepSeek-V4.1-like ring: 8 rows of 1024 fp32


# ---------------------------------------------------------------------------- the plugin


def test_the_plugin_is_installed_through_its_own_entry_point() -> None:
    check_installed_as_own_plugin("circular_buffer", "nixlkv.strategies.circular_buffer")


def test_it_is_neither_a_builtin_nor_a_placeholder() -> None:
    check_neither_builtin_nor_placeholder("circular_buffer")


def test_the_strategies_command_lists_it_served(capsys: pytest.CaptureFixture[str]) -> None:
    from nixlkv.cli import main

    assert main(["strategies"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("circular_buffer ")]
    assert "CircularBufferSpec" in line and "refused" not in line


def _spec(capacity: int = 8):
    import torch
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    return CircularBufferSpec(block_size=capacity, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32)


def test_dispatch_and_nothing_held_back() -> None:
    """Rows are keyed by position: D computing the last prompt token again rewrites its own row."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    disp = Dispatcher.from_plugins()
    assert disp.strategy_for(_spec(), "ring").name == "circular_buffer"
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert disp.decode_recomputes([(_spec(), "ring"), (full, "l1")]) == 0


def test_the_scenario_kind_comes_from_the_plugin() -> None:
    from nixlkv.strategies.circular_buffer import scenario_kind
    from nixlkv.testing.kinds import KINDS, known_kind

    assert known_kind("circular_buffer") and KINDS["circular_buffer"] is scenario_kind()
    base = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "request": {"num_tokens": 10}}
    with pytest.raises(ScenarioError, match=r"layers\[0\]\.capacity: must be a positive integer"):
        parse({**base, "model": {"layers": [{"kind": "circular_buffer", "capacity": 0}]}})
    with pytest.raises(ScenarioError, match=r"layers\[0\]\.dtype: must be one of 'float32', 'bfloat16', 'float16', got 'int8'"):
        parse({**base, "model": {"layers": [{"kind": "circular_buffer", "dtype": "int8"}]}})
    parse({**base, "model": {"layers": [{"kind": "circular_buffer"}]}})  # the control: defaults are valid


# ---------------------------------------------------------------------------- vLLM's block lists


def _vllm_lists(tokens: int, capacity: int = 8) -> tuple[list[int], list[int]]:
    """(P's ring block ids after computing ``tokens``, D's after loading ``tokens``) from vLLM's
    own KVCacheManager with one ring group: what its scheduler hands a connector."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    def manager() -> KVCacheManager:
        config = KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["ring"], _spec(capacity))])
        return KVCacheManager(config, max_model_len=4096, scheduler_block_size=capacity, hash_block_size=capacity,
                              max_in_flight_tokens=2048, enable_caching=False)

    p, req = manager(), Request("p", list(range(1, tokens + 1)), SamplingParams(max_tokens=1), None)
    assert p.allocate_slots(req, tokens) is not None
    req.num_computed_tokens = tokens
    p.remove_skipped_blocks(req.request_id, tokens, num_prompt_tokens=tokens)
    prefill = list(p.get_block_ids_for_computed_tokens(req.request_id, tokens)[0])
    d, req = manager(), Request("d", list(range(1, tokens + 2)), SamplingParams(max_tokens=1), None)
    blocks, _, _ = d.get_computed_blocks(req)
    assert d.allocate_slots(req, 0, num_new_computed_tokens=0, new_computed_blocks=blocks,
                            num_external_computed_tokens=tokens, delay_cache_blocks=True) is not None
    decode = list(d.get_blocks(req.request_id).get_unhashed_block_ids_all_groups()[0])
    return prefill, decode


@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 100, 1000])
def test_the_rehearsal_lists_one_ring_block_as_vllm_does(tokens: int) -> None:
    prefill, decode = _vllm_lists(tokens)
    assert len(prefill) == len(decode) == 1 and 0 not in prefill + decode
    scenario = parse({
        "model": {"layers": [{"kind": "circular_buffer", "count": 2}]},
        "prefill": {"tp": 1, "block_size": 16}, "decode": {"tp": 1, "block_size": 16},
        "request": {"num_tokens": tokens, "cached_blocks": 1},  # a prefix hit never trims a ring
    })
    p_blocks, d_blocks = request_blocks(scenario, build(scenario, Dispatcher.from_plugins()))
    assert len(p_blocks[0].ids) == len(d_blocks[0].ids) == 1 and d_blocks[0].holds.all()


# ---------------------------------------------------------------------------- what moves


# vLLM's planner gives every group one page size: the attention block grows to 64 tokens (2 heads x
# 64 x K|V x bf16 = 512 B a token, 32 KiB a block), the ring's page. Whole attention blocks move.
ATTENTION_BLOCK = 64 * 2 * 2 * 64 * 2


@pytest.mark.parametrize(
    "name, attention_bytes_per_rank",
    [
        # 100 tokens: 2 blocks of 64 tokens in each of the 2 GQA layers, all on the one decode rank.
        ("ring-gqa-p2-d1-t100", 2 * 2 * ATTENTION_BLOCK),
        # 1 token: the first block of each layer, half of it (one of the 2 heads) on each decode rank.
        ("ring-gqa-p1-d2-t1", 2 * ATTENTION_BLOCK // 2),
        ("ring-only-p1-d2-t37", 0),
    ],
)
def test_bytes_moved_are_the_ring_pages_and_the_attention_blocks(name: str, attention_bytes_per_rank: int) -> None:
    scenario = load(SCENARIOS / f"{name}.yaml")
    result = rehearse(scenario)
    assert result.outcome == "byte-exact", result.message
    d = scenario.decode
    assert result.bytes_moved == (2 * RING_PAGE + attention_bytes_per_rank) * d.tp


def _plan(prefill_tp: int = 4, decode_tp: int = 2):
    scenario = parse({
        "model": {"layers": [{"kind": "circular_buffer", "count": 1}]},
        "prefill": {"tp": prefill_tp, "block_size": 16}, "decode": {"tp": decode_tp, "block_size": 16},
        "request": {"num_tokens": 100},
    })
    return build(scenario, Dispatcher.from_plugins()).plans


def test_each_decode_rank_reads_one_prefill_rank_and_the_others_are_told_to_free() -> None:
    plans = _plan(4, 2)
    for rank, plan in enumerate(plans):
        resolved = plan.resolve([np.array([5])], [np.array([9])], 100)
        moves = list(plan.byte_moves(resolved))
        assert sum(n for *_, n in moves) == RING_PAGE
        assert [r.remote_rank for r in resolved.reads] == [2 * rank]
        assert set(resolved.notify_only) == {2 * rank + 1}


def test_pairing_is_one_block_each_and_refuses_anything_else() -> None:
    from nixlkv.strategies.circular_buffer import CircularBufferStrategy

    s = CircularBufferStrategy()
    plan = _plan(1, 1)[0]
    region = plan.local.regions[0]
    lp, rp = s.pair_blocks(np.array([5]), np.array([9]), region, region, 1000)
    assert lp.tolist() == [5] and rp.tolist() == [9]
    lp, rp = s.pair_blocks(np.array([], dtype=np.int64), np.array([9]), region, region)
    assert lp.size == rp.size == 0
    with pytest.raises(RequestError, match="one block per request.*2 local and 1 remote"):
        s.pair_blocks(np.array([5, 6]), np.array([9]), region, region)
    with pytest.raises(RequestError, match="remote ring block is vLLM's null block"):
        s.pair_blocks(np.array([5]), np.array([0]), region, region)


def test_a_peer_with_another_ring_is_refused_naming_the_fact() -> None:
    plan = _plan(1, 1)[0]
    local, peer = plan.local.regions[0], plan.remote[0].regions[0]
    from nixlkv.core import Topology
    from nixlkv.strategies.circular_buffer import CircularBufferStrategy

    s = CircularBufferStrategy()
    assert len(s.segments(local, {0: peer}, Topology(1, 0), 1)) == 1  # the control
    for key, value in (("capacity", 16), ("head_size", 512), ("dtype", "bfloat16"), ("num_kv_heads", 2)):
        tampered = dataclasses.replace(peer, facts={**peer.facts, key: value})
        with pytest.raises(IncompatibleGeometry, match=rf"\({key}\) is .* here but {value!r} on the remote"):
            s.segments(local, {0: tampered}, Topology(1, 0), 1)
    from nixlkv.core import PageLayout

    smaller = dataclasses.replace(peer, page=PageLayout((("token", 4), ("byte", 4096))), facts={
        k: v for k, v in peer.facts.items() if k not in ("page_bytes", "page_shape")})
    with pytest.raises(IncompatibleGeometry, match="remote ring page holds 16384 B, this one 32768 B"):
        s.segments(local, {0: smaller}, Topology(1, 0), 1)


def test_without_the_plugin_full_attention_refuses_the_ring() -> None:
    """Disabled (or not installed), the spec reaches full attention through the MRO, which must not
    pair a ring's one block by token range (with another capacity on D that would move wrong rows)."""
    for name in ("ring-gqa-p2-d1-t100", "ring-reject-capacity-mismatch"):
        result = rehearse(load(SCENARIOS / f"{name}.yaml"), Dispatcher.from_plugins(disabled=["circular_buffer"]))
        assert result.outcome == "failed" and "CircularBufferSpec's blocks are not token blocks" in result.message, result.message
    assert rehearse(load(SCENARIOS / "ring-gqa-p2-d1-t100.yaml")).outcome == "byte-exact"  # the control


# ---------------------------------------------------------------------------- the contract kit


def ring_refusals(point: Point, params) -> str | None:
    """A ring of several head slots keeps its slots and rows in the layout's order; where one side
    puts rows outside slots and the other inside, the pages are a permute apart and are refused."""
    def slots_first(layout: str) -> bool:
        return layout.index("H") < layout.index("N")

    if params.get("num_kv_heads", 1) > 1 and slots_first(point.prefill_layout) != slots_first(point.decode_layout):
        return "IncompatibleGeometry"
    return None


# Two head slots of 128 fp32 (GLM-5-Next-like [K | gate]), 8 rows: replicated on every rank, so
# every TP pair and block size is served; only a layout pair that reorders slots and rows is not.
RING_CASE = ContractCase(
    strategy="circular_buffer",
    kind="circular_buffer",
    params={"capacity": 8, "head_size": 128, "num_kv_heads": 2},
    tp_pairs=((2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (1, 1)),
    token_counts=(1, 8, 37),
    refuses=ring_refusals,
    extra_points=(Point(1, 2, "LBNHC", "BLHNC", 16, 32, 100), Point(2, 1, "BLNHC", "LBNHC", 32, 16, 9)),
)


class TestCircularBufferContract(StrategyContract):
    case = RING_CASE


class PairsTheNextBlock:
    """Reads the prefill block after the request's ring: a block of another request."""

    name = "pairs_the_next_block"

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        return local_ids, remote_ids + 1


class MovesHalfThePage:
    """Copies only the first half of each ring page (the rows of positions below capacity / 2)."""

    name = "moves_half_the_page"

    def segments(self, local, remote, local_topology, remote_tp):
        (seg,) = super().segments(local, remote, local_topology, remote_tp)
        return [dataclasses.replace(seg, nbytes=seg.nbytes // 2)]


class HoldsBackAToken:
    """Treats the ring as a running state and holds back the last prompt token: harmless to bytes
    (the rows are keyed by position), so the byte checks must still pass; it only costs D a token."""

    name = "holds_back_a_token"

    def decode_recomputes(self, spec):
        return 1


def faulty(mixin: type):
    from nixlkv.strategies.circular_buffer import CircularBufferStrategy

    klass = type(mixin.__name__, (mixin, CircularBufferStrategy), {"overrides": ("circular_buffer",)})
    return klass()


def case_for(strategy) -> ContractCase:
    class Plugin:
        @hookimpl
        def nixlkv_strategies(self):
            return [strategy]

    return dataclasses.replace(RING_CASE, strategy=strategy.name, plugins=(Plugin(),))


POINT = Point(2, 1, num_tokens=37)


def test_the_reference_strategy_passes_where_the_faulty_ones_fail() -> None:
    contract.check_point(RING_CASE, POINT)
    contract.check_point(case_for(faulty(HoldsBackAToken)), POINT)


def test_the_wrong_block_fails_the_byte_oracle_and_the_read_check() -> None:
    case = case_for(faulty(PairsTheNextBlock))
    run = contract.build_point(case, POINT)
    with pytest.raises(ContractViolation) as info:
        contract.check_byte_oracle(run)
    assert info.value.invariant == contract.BYTE_ORACLE
    with pytest.raises(ContractViolation, match="reads-inside-request violated: .*holds no KV of this request"):
        contract.check_reads_inside_request(run)


def test_half_a_page_fails_the_byte_oracle_and_completeness() -> None:
    case = case_for(faulty(MovesHalfThePage))
    run = contract.build_point(case, POINT)
    with pytest.raises(ContractViolation) as info:
        contract.check_byte_oracle(run)
    assert info.value.invariant == contract.BYTE_ORACLE and "expected" in str(info.value)
    with pytest.raises(ContractViolation, match="every-byte-once violated: .*never written"):
        contract.check_every_byte_once(run)
