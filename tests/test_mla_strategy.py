"""The mla strategy's geometry and the scenario kinds that build MLA caches (no NIXL transfer)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixlkv.core import (
    Dispatcher,
    IncompatibleGeometry,
    LayerCache,
    PageLayout,
    Region,
    RequestError,
    Topology,
    consumers_per_remote_rank,
    covered_remote_ranks,
)
from nixlkv.strategies.mla import MLAStrategy
from nixlkv.testing.engines import layer_spec
from nixlkv.testing.rehearsal import build, geometry
from nixlkv.testing.scenario import ScenarioError, Side, parse


def scenario(layers: list, p_tp: int = 4, d_tp: int = 2, **extra):
    return parse({
        "name": "mla-unit",
        "model": {"layers": layers},
        "prefill": {"tp": p_tp, "block_size": 64, "layout": "LBHNC"},
        "decode": {"tp": d_tp, "block_size": 64, "layout": "LBHNC"},
        "request": {"num_tokens": 200, "seed": 1},
        **extra,
    })


@pytest.mark.parametrize(
    ("layer", "page_bytes"),
    [
        ({"kind": "mla", "cache_dtype": "auto"}, 1152 * 64),  # kv-layouts.md §3 table, block 64
        ({"kind": "mla", "cache_dtype": "fp8_ds_mla"}, 656 * 64),
        ({"kind": "mla", "cache_dtype": "nvfp4_ds_mla"}, 352 * 64),
        ({"kind": "mla_indexer"}, 132 * 64),
        # DeepSeek V4 compressed latents: 64 / 4 = 16 states, padded to the alignment (19 x 576)
        ({"kind": "mla", "cache_dtype": "fp8_ds_mla", "compress_ratio": 4, "alignment": 576}, 19 * 576),
        ({"kind": "mla", "compress_ratio": 4, "alignment": 512, "kv_lora_rank": 448}, 16 * 1024),
    ],
)
def test_specs_have_vllms_page_sizes_on_every_tp(layer: dict, page_bytes: int) -> None:
    kind = scenario([layer]).layers[0]
    for tp in (1, 2, 8):
        spec = layer_spec(kind, Side(tp=tp, block_size=64, layout="LBHNC"))
        assert (spec.num_kv_heads, spec.max_tp_shards, spec.head_size_v) == (1, 1, 0)
        assert spec.page_size_bytes == page_bytes


def test_dispatch_by_spec_type() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    reg = Dispatcher.from_plugins().registry
    assert reg.for_type(MLAAttentionSpec).name == "mla"
    # HiddenStateCacheSpec subclasses MLAAttentionSpec but is no decode KV: refused by name, not MLA (docs/spec-types.md).
    assert reg.for_type(HiddenStateCacheSpec).name == "hidden_state_cache"
    assert reg.for_type(FullAttentionSpec).name == "full_attention"
    # SlidingWindowMLASpec inherits from SlidingWindowSpec, not MLAAttentionSpec: it has its own
    # placeholder, so neither the window nor the MLA logic takes it half-way.
    assert reg.for_type(SlidingWindowMLASpec).name == "sliding_window_mla"
    assert reg.for_type(SlidingWindowSpec).name == "sliding_window"


def test_sliding_window_mla_is_a_windowed_whole_page_read() -> None:
    """Served by sliding_window_mla: the MLA geometry plus the window, which both sides must share."""
    dispatcher = Dispatcher.from_plugins()
    engines = build(
        scenario([{"kind": "sliding_window_mla", "count": 1, "window": 128}], p_tp=2, d_tp=1), dispatcher
    )
    plan = engines.plans[0]
    assert [(s.remote_rank, s.local_offset, s.nbytes) for s in plan.segments] == [(0, 0, 1152 * 64)]
    assert plan.to_dict()["groups"][0]["strategy"] == "sliding_window_mla"
    # 10 block positions, window 128 at block 64: only the last cdiv(128, 64) + 1 = 3 move, never 0.
    ids = np.arange(1, 11)
    remote = np.arange(3, 13)
    remote[:5] = 0  # prefill has already freed the blocks below the window
    resolved = plan.resolve([ids], [remote])  # one segment at row 0: descriptor id == block id
    assert [(r.local_ids.tolist(), r.remote_ids.tolist()) for r in resolved.reads] == [([8, 9, 10], [10, 11, 12])]
    assert resolved.notify_only == (1,)

    local = geometry(engines.decode[0], dispatcher).regions[0]
    peer = geometry(engines.prefill[0], dispatcher).regions[0]
    assert local.facts["sliding_window"] == 128 and local.facts["cache_role"] == "sparse"
    other_window = dataclasses.replace(peer, facts={**peer.facts, "sliding_window": 256})
    with pytest.raises(IncompatibleGeometry, match="sliding window"):
        MLAStrategy.segments(dispatcher.registry.by_name("sliding_window_mla"), local, {0: other_window}, Topology(1, 0), 2)


def test_mixed_group_gets_head_split_and_whole_page_segments() -> None:
    """One UniformTypeKVCacheSpecs group, P4 -> D2: GQA regions read half a page from each of two
    prefill ranks; the MLA region reads its whole page once, from the first covered rank."""
    engines = build(
        scenario([{"kind": "uniform", "members": [
            {"kind": "full_attention", "count": 2, "num_kv_heads": 8, "head_size": 64},
            {"kind": "mla", "count": 1},
        ]}]),
        Dispatcher.from_plugins(),
    )
    assert all(r.num_groups == 1 for r in (*engines.prefill, *engines.decode))
    for rank, plan in enumerate(engines.plans):
        d = plan.to_dict()
        assert [(g["local_group"], g["strategy"]) for g in d["groups"]] == [(0, "full_attention"), (0, "mla")]
        by_layer: dict[str, list[tuple]] = {}
        for s in d["segments"]:
            by_layer.setdefault(s["local_region"], []).append((s["strategy"], s["remote_rank"], s["local_offset"], s["nbytes"]))
        gqa_page = 4 * 64 * 256  # 4 heads x 64 tokens x (64 + 64) bf16
        for layer in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
            assert by_layer[layer] == [
                ("full_attention", 2 * rank, 0, gqa_page // 2),
                ("full_attention", 2 * rank + 1, gqa_page // 2, gqa_page // 2),
            ]
        assert by_layer["model.layers.2.self_attn.attn"] == [("mla", 2 * rank, 0, 1152 * 64)]


def test_latent_and_indexer_of_different_page_sizes_in_one_group() -> None:
    engines = build(
        scenario([{"kind": "uniform", "members": [
            {"kind": "mla", "cache_dtype": "fp8_ds_mla"}, {"kind": "mla_indexer"},
        ]}], p_tp=2, d_tp=4),
        Dispatcher.from_plugins(),
    )
    for rank, plan in enumerate(engines.plans):
        segs = [(s.local_region, s.remote_rank, s.nbytes) for s in plan.segments]
        assert segs == [
            ("model.layers.0.self_attn.attn", rank // 2, 656 * 64),
            ("model.layers.1.self_attn.attn", rank // 2, 132 * 64),
        ]
        assert plan.consumers == 2


def test_mla_group_refuses_the_null_block() -> None:
    engines = build(scenario([{"kind": "mla", "count": 1}], p_tp=1, d_tp=1), Dispatcher.from_plugins())
    with pytest.raises(RequestError, match="null block.*MLA group"):
        engines.plans[0].resolve([np.array([0, 3])], [np.array([5, 6])])


def test_facts_must_match_on_both_sides() -> None:
    """A latent read into an indexer region (same page size by accident) must be refused."""
    dispatcher = Dispatcher.from_plugins()
    engines = build(scenario([{"kind": "mla", "count": 1}], p_tp=1, d_tp=1), dispatcher)
    local = geometry(engines.decode[0], dispatcher).regions[0]
    peer = geometry(engines.prefill[0], dispatcher).regions[0]
    indexer_peer = dataclasses.replace(peer, facts={**peer.facts, "cache_role": "indexer"})
    with pytest.raises(IncompatibleGeometry, match="cache role"):
        MLAStrategy().segments(local, {0: indexer_peer}, Topology(1, 0), 1)


def test_a_head_sharded_page_is_not_mla() -> None:
    layer = LayerCache(
        "L0", 0, layer_spec(scenario([{"kind": "mla"}]).layers[0], Side(tp=1, block_size=64, layout="LBHNC")),
        0x1000, 4, 2 * 73728, PageLayout((("head", 2), ("token", 64), ("byte", 1152))),
    )
    with pytest.raises(IncompatibleGeometry, match="not one head of 1152-byte states"):
        MLAStrategy().local_region(layer, Topology(1, 0))


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([{"kind": "mla", "cache_dtype": "fp8_ds_mla", "kv_lora_rank": 256}], "set kv_lora_rank: 512"),
        ([{"kind": "mla", "cache_dtype": "fp8"}], "cache_dtype: must be one of 'auto', 'fp8_ds_mla', 'nvfp4_ds_mla'"),
        ([{"kind": "mla_indexer", "index_head_dim": 100}], "index_head_dim: must be a positive multiple of 128"),
        ([{"kind": "mla", "compress_ratio": 0}], "compress_ratio"),
        ([{"kind": "mla", "alignment": True}], "alignment"),
        ([{"kind": "uniform", "members": []}], "model.layers[0].members must be a non-empty list"),
        ([{"kind": "uniform", "count": 2, "members": [{"kind": "mla"}]}], "unknown field(s) ['count']"),
        (
            [{"kind": "uniform", "members": [{"kind": "uniform", "members": [{"kind": "mla"}]}]}],
            "model.layers[0].members[0]: a uniform group cannot contain another uniform group",
        ),
    ],
)
def test_malformed_kinds_name_the_field(layers: list, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        scenario(layers)
    assert message in str(info.value)


def test_decode_model_only_in_rejection_tests() -> None:
    with pytest.raises(ScenarioError, match="decode_model .* only for rejection tests"):
        scenario([{"kind": "mla"}], decode_model={"layers": [{"kind": "mla"}]})


def test_uniform_members_vllm_does_not_group_as_uniform_are_an_error() -> None:
    """Identical MLA layers make a plain MLAAttentionSpec group, not a uniform one."""
    with pytest.raises(ScenarioError, match=r"model.layers\[0\] \(uniform\).*not in one UniformTypeKVCacheSpecs"):
        build(scenario([{"kind": "uniform", "members": [{"kind": "mla", "count": 2}]}]), Dispatcher.from_plugins())


def _mla_region(rank_page: int = 64 * 656) -> Region:
    return Region(
        "L0", 0, "mla", 0x10000, 8, rank_page, PageLayout((("head", 1), ("token", 64), ("byte", 656))),
        facts={"cache_role": "sparse", "head_size": 576, "dtype": "uint8", "cache_dtype": "fp8_ds_mla",
               "kv_quant_mode": 1, "content_bytes": 656, "tokens_per_state": "1", "tokens_per_block": 64,
               "page_bytes": rank_page},
    )


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]))
@settings(max_examples=40, deadline=None)
def test_every_prefill_rank_is_read_or_told_exactly_consumers_times(p_tp: int, d_tp: int) -> None:
    """Over all decode ranks: one whole-page read each, reads spread over distinct prefill ranks
    when P > D, and every prefill rank covered by exactly ``consumers`` decode ranks."""
    region = _mla_region()
    reads: list[int] = []
    heard = {p: 0 for p in range(p_tp)}
    for r in range(d_tp):
        covered = covered_remote_ranks(r, d_tp, p_tp)
        (seg,) = MLAStrategy().segments(region, {p: region for p in covered}, Topology(d_tp, r), p_tp)
        assert (seg.local_offset, seg.remote_offset, seg.nbytes) == (0, 0, region.page.nbytes)
        assert seg.remote_rank == (r * p_tp // d_tp if p_tp >= d_tp else r // (d_tp // p_tp))
        reads.append(seg.remote_rank)
        for p in covered:
            heard[p] += 1
    assert set(heard.values()) == {consumers_per_remote_rank(d_tp, p_tp)}
    if p_tp >= d_tp:
        assert len(set(reads)) == d_tp


def test_a_compressed_latent_moves_its_states_never_the_page_padding() -> None:
    """300 tokens in blocks of 64 at ratio 4: 5 blocks of 16 fp8_ds_mla states (10,496 B) in a
    10,944 B block stride. Each decode rank reads 2 layers x 5 unpadded pages; the padding stays
    the decode engine's (the byte oracle checks every byte of the buffer, padding included)."""
    from pathlib import Path

    from nixlkv.testing.rehearsal import rehearse
    from nixlkv.testing.scenario import load

    path = Path(__file__).parent / "scenarios" / "mla-dsv4-compressed-fp8-r4-p4-d2.yaml"
    result = rehearse(load(path))
    assert result.outcome == "byte-exact", result.message
    assert result.bytes_moved == 2 * (2 * 5 * 16 * 656)
    spec = layer_spec(load(path).layers[0], Side(tp=2, block_size=64, layout="LBHNC"))
    assert (spec.num_states, spec.page_size_bytes) == (16, 10944)


def test_the_oracle_holds_a_compressed_state_where_it_holds_any_of_its_tokens() -> None:
    from nixlkv.testing.oracle import slot_holds

    holds = np.array([[True] * 8, [True] * 5 + [False] * 3])
    assert slot_holds(holds, 2).tolist() == [[True, True], [True, True]]  # state 1 of block 1: tokens 4..7
    assert slot_holds(holds[:, :4] & [True, False, False, False], 2).tolist() == [[True, False], [True, False]]
    assert slot_holds(holds[:, :2], 4).tolist() == [[True] * 4, [True] * 4]  # two states per token
    assert slot_holds(holds, 8) is holds
    with pytest.raises(ValueError, match="neither divides"):
        slot_holds(holds, 3)
