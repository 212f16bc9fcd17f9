"""Chunked local attention (Llama 4): only the current chunk moves, null blocks never do, and the
strategy is a plugin of its own (a module and an entry point; nothing in nixlkv.core, the
connector or nixlkv.vllm knows it).

What is checked here, beside the scenarios in tests/scenarios/chunked-*.yaml:

* the plugin is installed and dispatches ``ChunkedLocalAttentionSpec``; the model holds back one
  token (P publishes N - 1, D computes the last one);
* the rehearsal's block lists are vLLM's: its real ``KVCacheManager`` (chunked-local manager)
  nulls and lists exactly what the scenario kind's ``skipped_tokens`` says;
* the bytes moved are the chunk's blocks only, and nothing at all when ``M % C == 0``;
* the contract kit's suite passes, and its byte oracle fails deliberately wrong strategies
  (a block below the chunk start moved, a chunk block missed, null pairs kept).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nixlkv.core import Dispatcher, IncompatibleGeometry, RequestError, hookimpl
from nixlkv.testing import contract
from nixlkv.testing.cases import BLOCK_SIZE_POINTS
from nixlkv.testing.contract import ContractCase, ContractViolation, Point, attention_refusals
from nixlkv.testing.rehearsal import build, rehearse, request_blocks
from nixlkv.testing.scenario import ScenarioError, load, parse
from nixlkv.testing.suite import StrategyContract

from plugin_helpers import check_installed_as_own_plugin, check_neither_builtin_nor_placeholder

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

SCENARIOS = Path(__file__).parent / "scenarios"
C = 64  # the scenarios' chunk


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------- the plugin


def test_the_plugin_is_installed_through_its_own_entry_point() -> None:
    check_installed_as_own_plugin("chunked_local", "nixlkv.strategies.chunked_local")


def test_it_is_not_a_builtin_nor_a_placeholder_any_more() -> None:
    check_neither_builtin_nor_placeholder("chunked_local")


def _spec(chunk: int = C, block_size: int = 16):
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                     attention_chunk_size=chunk)


def test_dispatch_and_one_token_held_back() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    disp = Dispatcher.from_plugins()
    assert disp.strategy_for(_spec(), "l0").name == "chunked_local"
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert disp.decode_recomputes([(full, "l3")]) == 0
    assert disp.decode_recomputes([(_spec(), "l0"), (full, "l3")]) == 1


def test_the_connector_holds_back_one_token_for_a_llama4_like_model() -> None:
    """What the scheduler computes from the engine's real KV groups (3 chunked + 1 full)."""
    from types import SimpleNamespace

    from nixlkv.testing.engines import build_rank
    from nixlkv.vllm.config import ConnectorConfig
    from nixlkv.vllm.scheduler import decode_recomputes

    kcc = build_rank(load(SCENARIOS / "chunked-llama4-like-p1-d1-t65.yaml"), "prefill", 0).kv_cache_config
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in kcc.kv_cache_groups)
    assert kinds == ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"]  # vLLM's hybrid manager: not promoted
    engine = SimpleNamespace(num_prefill_lookahead_tokens=0)
    assert decode_recomputes(engine, kcc, ConnectorConfig().dispatcher()) == 1


def test_without_the_plugin_full_attention_refuses_the_null_blocks_never_moves_them() -> None:
    """Disabled (or not installed), the spec reaches full attention through the MRO, which
    refuses a request holding null blocks: a loud error, never wrong bytes."""
    scenario = load(SCENARIOS / "chunked-llama4-like-p1-d1-t65.yaml")
    result = rehearse(scenario, Dispatcher.from_plugins(disabled=["chunked_local"]))
    assert result.outcome == "failed" and "null block" in result.message, result.message


def test_the_scenario_kind_comes_from_the_plugin() -> None:
    from nixlkv.strategies.chunked_local import scenario_kind
    from nixlkv.testing.kinds import KINDS, known_kind, load_plugin_kinds

    assert known_kind("chunked_local")
    assert KINDS["chunked_local"] is scenario_kind()
    load_plugin_kinds()  # asking again registers the same definition: a no-op
    base = {"model": {"layers": [{"kind": "chunked_local", "num_kv_heads": 2, "head_size": 64, "chunk": 0}]},
            "prefill": {"tp": 1}, "decode": {"tp": 1}, "request": {"num_tokens": 10}}
    with pytest.raises(ScenarioError, match=r"layers\[0\]\.chunk: must be a positive integer"):
        parse(base)
    with pytest.raises(ScenarioError, match=r"missing required field 'chunk'"):
        parse({**base, "model": {"layers": [{"kind": "chunked_local", "num_kv_heads": 2, "head_size": 64}]}})


# ---------------------------------------------------------------------------- vLLM's block lists


def _vllm_lists(tokens: int, block_size: int, chunk: int = C) -> tuple[list[int], list[int]]:
    """(P's block ids after computing ``tokens``, D's unhashed ids after loading ``tokens``) from
    vLLM's own KVCacheManager with one chunked-local group: what its scheduler hands a connector."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    def manager() -> KVCacheManager:
        config = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], _spec(chunk, block_size))])
        return KVCacheManager(config, max_model_len=4096, scheduler_block_size=block_size, hash_block_size=block_size,
                              max_in_flight_tokens=2048, enable_caching=False)

    p, req = manager(), Request("p", list(range(1, tokens + 1)), SamplingParams(max_tokens=1), None)
    assert p.allocate_slots(req, tokens) is not None
    req.num_computed_tokens = tokens
    p.remove_skipped_blocks(req.request_id, tokens, num_prompt_tokens=tokens)  # at request_finished
    prefill = list(p.get_block_ids_for_computed_tokens(req.request_id, tokens)[0])
    d, req = manager(), Request("d", list(range(1, tokens + 2)), SamplingParams(max_tokens=1), None)
    blocks, _, _ = d.get_computed_blocks(req)
    assert d.allocate_slots(req, 0, num_new_computed_tokens=0, new_computed_blocks=blocks,
                            num_external_computed_tokens=tokens, delay_cache_blocks=True) is not None
    decode = list(d.get_blocks(req.request_id).get_unhashed_block_ids_all_groups()[0])
    return prefill, decode


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tokens", [1, 50, 63, 64, 65, 100, 127, 128, 129, 200])
def test_the_rehearsal_nulls_and_lists_what_vllm_does(tokens: int, block_size: int) -> None:
    """The oracle's physics against vLLM's: P's null positions and D's list length, per request."""
    prefill, decode = _vllm_lists(tokens, block_size)
    scenario = parse({
        "model": {"layers": [{"kind": "chunked_local", "count": 2, "num_kv_heads": 2, "head_size": 64, "chunk": C}]},
        "prefill": {"tp": 1, "block_size": block_size}, "decode": {"tp": 1, "block_size": block_size},
        "request": {"num_tokens": tokens},
    })
    p_blocks, d_blocks = request_blocks(scenario, build(scenario, Dispatcher.from_plugins()))
    assert (p_blocks[0].ids == 0).tolist() == [b == 0 for b in prefill]
    assert len(d_blocks[0].ids) == len(decode) and 0 not in decode
    assert d_blocks[0].first_position == cdiv(tokens, block_size) - len(decode)


# ---------------------------------------------------------------------------- what moves


def page_bytes(block_size: int, tp: int) -> int:
    return max(1, 2 // tp) * block_size * 2 * 64 * 2  # heads held x tokens x (K + V) x bf16


@pytest.mark.parametrize(
    "name, chunked_blocks, full_blocks",
    [
        # 62 tokens = 4 blocks of 16, all in the first chunk: everything moves.
        ("chunked-llama4-like-p1-d1-t62", 4, 4),
        # 64 tokens: the next token starts a chunk; the chunked groups move nothing.
        ("chunked-llama4-like-p1-d1-t64", 0, 4),
        # 65 tokens: the chunk [64, 65) is block 4.
        ("chunked-llama4-like-p1-d1-t65", 1, 5),
        # 127 tokens: chunk [64, 127) = blocks 4..7.
        ("chunked-llama4-like-p1-d1-t127", 4, 8),
        ("chunked-llama4-like-p1-d1-t128", 0, 8),
        # 999 tokens = 63 blocks; chunk [960, 999) = blocks 60..62.
        ("chunked-llama4-like-p1-d1-t999", 3, 63),
        # Blocks of 32: 32 blocks; chunk [960, 999) = blocks 30 and 31.
        ("chunked-llama4-like-p2-d4-bs32-t999", 2, 32),
        # D holds 30 blocks (below the chunk): the full group moves 33, the chunk still 3.
        ("chunked-llama4-like-p2-d4-t999-prefix-hit-below-chunk", 3, 33),
        # D holds 61 blocks (into the chunk): 2 blocks per group.
        ("chunked-llama4-like-p2-d4-t999-prefix-hit-in-chunk", 2, 2),
    ],
)
def test_bytes_moved_are_the_chunk_blocks_only(name: str, chunked_blocks: int, full_blocks: int) -> None:
    scenario = load(SCENARIOS / f"{name}.yaml")
    result = rehearse(scenario)
    assert result.outcome == "byte-exact", result.message
    d = scenario.decode
    assert result.bytes_moved == (3 * chunked_blocks + full_blocks) * page_bytes(d.block_size, d.tp) * d.tp


def test_nothing_moves_when_the_chunk_is_complete_but_every_prefill_rank_is_freed() -> None:
    """All layers chunked and 128 tokens: P's list is all null, D's empty. No READ at all, and
    each prefill rank still hears that its blocks may go."""
    scenario = parse({
        "model": {"layers": [{"kind": "chunked_local", "count": 4, "num_kv_heads": 2, "head_size": 64, "chunk": C}]},
        "prefill": {"tp": 2, "block_size": 16}, "decode": {"tp": 1, "block_size": 16}, "request": {"num_tokens": 128},
    })
    result = rehearse(scenario)
    assert result.outcome == "byte-exact", result.message
    assert result.bytes_moved == 0 and result.descriptors == 0
    assert result.notifications == {"P0": 1, "P1": 1}


def _plan(chunk: int = C, prefill_block: int = 16, decode_block: int = 16, tokens: int = 100):
    scenario = parse({
        "model": {"layers": [{"kind": "chunked_local", "count": 1, "num_kv_heads": 2, "head_size": 64, "chunk": chunk}]},
        "prefill": {"tp": 1, "block_size": prefill_block}, "decode": {"tp": 1, "block_size": decode_block},
        "request": {"num_tokens": tokens},
    })
    return build(scenario, Dispatcher.from_plugins()).plans[0]


def moved_block_pairs(plan, resolved) -> set[tuple[int, int]]:
    """(local block, remote block) of every byte move, recovered from addresses alone."""
    local = list(plan.local.regions)
    remote = [r for g in plan.remote.values() for r in g.regions]

    def block(addr: int, regions) -> int:
        (region,) = [r for r in regions if r.base <= addr < r.end]
        return (addr - region.base) // region.block_stride

    return {(block(la, local), block(ra, remote)) for la, _, ra, _ in plan.byte_moves(resolved)}


def test_pairs_by_tail_without_null_blocks() -> None:
    plan = _plan()
    # 100 tokens, chunk [64, 100): P nulled positions 0..3; D lists positions 4..6 only.
    remote = np.array([0, 0, 0, 0, 15, 16, 17])
    assert moved_block_pairs(plan, plan.resolve([np.array([7, 8, 9])], [remote], 100)) == {(7, 15), (8, 16), (9, 17)}
    # A prefix hit inside the chunk: D lists only position 6.
    assert moved_block_pairs(plan, plan.resolve([np.array([9])], [remote], 100)) == {(9, 17)}
    # Without the token count (equal block sizes) the same pairs.
    assert moved_block_pairs(plan, plan.resolve([np.array([7, 8, 9])], [remote])) == {(7, 15), (8, 16), (9, 17)}


def test_a_complete_chunk_pairs_nothing_and_is_no_error() -> None:
    plan = _plan(tokens=128)
    resolved = plan.resolve([np.array([], dtype=np.int64)], [np.zeros(8, dtype=np.int64)], 128)
    assert resolved.reads == () and resolved.notify_only == (0,)


def test_a_null_prefill_block_inside_the_chunk_is_a_request_error() -> None:
    plan = _plan()
    with pytest.raises(RequestError, match="current chunk .* starts at token 64"):
        plan.resolve([np.array([7, 8, 9])], [np.array([0, 0, 0, 0, 0, 16, 17])], 100)
    with pytest.raises(RequestError, match="null prefill block"):
        plan.resolve([np.array([7, 8, 9])], [np.array([0, 0, 0, 0, 0, 16, 17])])


def test_a_decode_block_straddling_the_chunk_start_takes_the_chunk_tokens_only() -> None:
    """Chunk 48, P blocks of 16, D blocks of 32, 60 tokens: the chunk [48, 60) is P block 3 and
    half of D block 1 (tokens 32..63). P block 2 (tokens 32..47) is null: that pair is dropped,
    and D block 1's first half is left alone (never read by the chunk)."""
    plan = _plan(chunk=48, prefill_block=16, decode_block=32, tokens=60)
    resolved = plan.resolve([np.array([5])], [np.array([0, 0, 0, 13])], 60)
    assert moved_block_pairs(plan, resolved) == {(5, 13)}
    assert sum(n for *_, n in plan.byte_moves(resolved)) == page_bytes(16, 1)  # one P block's worth: half of D's page
    scenario = parse({
        "model": {"layers": [{"kind": "chunked_local", "count": 2, "num_kv_heads": 2, "head_size": 64, "chunk": 48}]},
        "prefill": {"tp": 2, "block_size": 16}, "decode": {"tp": 1, "block_size": 32}, "request": {"num_tokens": 60},
    })
    result = rehearse(scenario)
    assert result.outcome == "byte-exact", result.message


def test_different_chunk_sizes_are_refused_naming_the_fact() -> None:
    scenario = load(SCENARIOS / "chunked-reject-chunk-size-mismatch.yaml")
    result = rehearse(scenario)
    assert result.outcome == "rejected" and "attention_chunk_size" in result.message
    engines = build(load(SCENARIOS / "chunked-llama4-like-p1-d1-t65.yaml"), Dispatcher.from_plugins())
    local = engines.plans[0].local
    tampered = dataclasses.replace(local, regions=tuple(
        dataclasses.replace(r, facts={**r.facts, "attention_chunk_size": 8192}) if r.strategy == "chunked_local" else r
        for r in local.regions))
    with pytest.raises(IncompatibleGeometry, match=r"attention chunk size \(tokens\) \(attention_chunk_size\) is 8192"):
        Dispatcher.from_plugins().plan(tampered, engines.plans[0].remote)


# ---------------------------------------------------------------------------- the contract kit


def chunked_refusals(point: Point, params) -> str | None:
    """Full attention's refusals, plus one of vLLM's hybrid manager: with a companion layer of
    another page size, a block-outermost engine wraps each group in UniformTypeKVCacheSpecs and
    a layer-outermost one does not, so P and D group layers differently (the dispatcher refuses)."""
    if point.wrapped and point.prefill_layout != point.decode_layout:
        return "IncompatibleGeometry"
    return attention_refusals(point, params)


# Chunk 64 over blocks of 16 and 32: requests of 1 and 37 tokens sit in the first chunk, 64
# completes it (nothing moves), 100 keeps [64, 100) after P nulled the first chunk's blocks.
CHUNKED_CASE = ContractCase(
    strategy="chunked_local",
    kind="chunked_local",
    params={"num_kv_heads": 2, "head_size": 32, "chunk": 64},
    token_counts=(1, 37, 64, 100),
    prefix_hits=(0, 5),
    refuses=chunked_refusals,
    extra_points=(
        *BLOCK_SIZE_POINTS,
        Point(2, 2, "BLHNC", "BLHNC", 16, 16, 100, wrapped=True),
        Point(1, 2, prefill_block_size=16, decode_block_size=32, num_tokens=127),
        Point(2, 1, prefill_block_size=32, decode_block_size=16, num_tokens=129, cached_blocks=7),
    ),
)


class TestChunkedLocalContract(StrategyContract):
    case = CHUNKED_CASE


class ReadsBelowChunkStart:
    """Believes the chunk starts one block earlier: each decode block reads the prefill block one
    position before its own, the first one a block below the chunk start."""

    name = "reads_below_chunk_start"

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        shifted = np.concatenate([remote_ids[:1], remote_ids[:-1]])  # position i holds P's block i - 1
        return local_ids, shifted[len(shifted) - len(local_ids) :], np.zeros(len(local_ids), dtype=np.int64)


class MissesChunkBlock:
    """Believes the chunk starts one block later: the chunk's first block never arrives."""

    name = "misses_chunk_block"

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        lp, rp, phase = super().pair_blocks(local_ids, remote_ids, local, remote, num_tokens)
        return lp[1:], rp[1:], phase[1:]


class KeepsNullPairs:
    """Pairs by token range but keeps pairs with a null prefill block: the bytes of P's block 0
    land below the chunk start in a decode block that straddles it."""

    name = "keeps_null_pairs"

    def pair_blocks(self, local_ids, remote_ids, local, remote, num_tokens=None):
        from nixlkv.core.token_blocks import pair_by_tokens
        from nixlkv.strategies.full_attention import tokens_per_block

        return pair_by_tokens(local_ids, remote_ids, tokens_per_block(local), tokens_per_block(remote), num_tokens)


def faulty(mixin: type):
    from nixlkv.strategies.chunked_local import ChunkedLocalStrategy

    klass = type(mixin.__name__, (mixin, ChunkedLocalStrategy), {"overrides": ("chunked_local",)})
    return klass()


def case_for(strategy, **params) -> ContractCase:
    class Plugin:
        @hookimpl
        def nixlkv_strategies(self):
            return [strategy]

    return dataclasses.replace(CHUNKED_CASE, strategy=strategy.name, plugins=(Plugin(),),
                               params={**CHUNKED_CASE.params, **params})


CHUNK_100 = Point(2, 1, num_tokens=100)  # chunk [64, 100): D lists positions 4..6
STRADDLE = Point(2, 1, prefill_block_size=16, decode_block_size=32, num_tokens=60)  # with chunk 48


def byte_oracle_violation(case: ContractCase, point: Point) -> ContractViolation:
    run = contract.build_point(case, point)
    with pytest.raises(ContractViolation) as info:
        contract.check_byte_oracle(run)
    return info.value


def test_the_reference_strategy_passes_where_the_faulty_ones_fail() -> None:
    contract.check_point(CHUNKED_CASE, CHUNK_100)
    contract.check_point(dataclasses.replace(CHUNKED_CASE, params={**CHUNKED_CASE.params, "chunk": 48}), STRADDLE)


def test_a_block_below_the_chunk_start_fails_the_byte_oracle() -> None:
    case = case_for(faulty(ReadsBelowChunkStart))
    v = byte_oracle_violation(case, CHUNK_100)
    assert v.invariant == contract.BYTE_ORACLE and "mismatch" in str(v)
    with pytest.raises(ContractViolation, match="reads-inside-request violated: .*holds no KV of this request"):
        contract.check_reads_inside_request(contract.build_point(case, CHUNK_100))


def test_a_missed_chunk_block_fails_the_byte_oracle() -> None:
    case = case_for(faulty(MissesChunkBlock))
    v = byte_oracle_violation(case, CHUNK_100)
    assert v.invariant == contract.BYTE_ORACLE and "expected" in str(v)
    with pytest.raises(ContractViolation, match="request block position 4"):  # the chunk's first block
        contract.check_every_byte_once(contract.build_point(case, CHUNK_100))


def test_null_pairs_kept_put_foreign_bytes_below_the_chunk_start() -> None:
    case = case_for(faulty(KeepsNullPairs), chunk=48)
    v = byte_oracle_violation(case, STRADDLE)
    assert v.invariant == contract.BYTE_ORACLE
    assert "token slot" in str(v) and "expected 0x5a" in str(v)  # the sentinel: nothing may land there


def test_a_captured_chunked_layer_becomes_the_plugins_kind() -> None:
    """``nixlkv capture`` records the spec's fields; the plugin's kind turns them into a scenario
    layer (KindDef.captured_spec / from_capture), and vLLM's CPU page interior applies to it."""
    from nixlkv.testing.captured import layer_kind
    from nixlkv.testing.kinds import takes_interior

    rec = {"spec": "ChunkedLocalAttentionSpec", "hints": {"total_kv_heads": 2},
           "facts": {"head_size": 64, "head_size_v": 64, "attention_chunk_size": 64, "dtype": "bfloat16"}}
    assert layer_kind("l0", rec, {}) == {"kind": "chunked_local", "num_kv_heads": 2, "head_size": 64, "chunk": 64,
                                         "dtype": "bfloat16"}
    assert takes_interior("chunked_local") and takes_interior("full_attention") and not takes_interior("mla")
    with pytest.raises(ScenarioError, match="no scenario layer kind for captured spec SinkFullAttentionSpec"):
        layer_kind("l0", {**rec, "spec": "SinkFullAttentionSpec"}, {})
