"""Heterogeneous geometry: per-group heads and tokens per block, block-size mismatch, minimal peers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from nixlkv.core import Dispatcher, IncompatibleGeometry, RequestError
from nixlkv.core.token_blocks import pair_by_tokens, token_phases
from nixlkv.testing.rehearsal import build, request_blocks
from nixlkv.testing.scenario import load

SCENARIOS = Path(__file__).parent / "scenarios"


def test_token_phases_both_directions() -> None:
    assert token_phases(16, 16) == [(0, 0, 16)]
    assert token_phases(32, 16) == [(0, 0, 16), (16, 0, 16)]  # a local block takes two remote ones
    assert token_phases(16, 64) == [(0, 0, 16), (0, 16, 16), (0, 32, 16), (0, 48, 16)]
    with pytest.raises(IncompatibleGeometry, match="24 here and 16 on the remote"):
        token_phases(24, 16)


def test_pair_larger_local_blocks() -> None:
    # 100 tokens: 7 remote blocks of 16, 4 local blocks of 32; the last local block gets one.
    local, remote = np.array([40, 41, 42, 43]), np.arange(10, 17)
    l, r, ph = pair_by_tokens(local, remote, 32, 16, 100)
    assert l.tolist() == [40, 40, 41, 41, 42, 42, 43]
    assert r.tolist() == remote.tolist()
    assert ph.tolist() == [0, 1, 0, 1, 0, 1, 0]


def test_pair_smaller_local_blocks_with_a_prefix_hit() -> None:
    # 100 tokens: 2 remote blocks of 64; local blocks of 16 at positions 3..6 (3 already held).
    local, remote = np.array([50, 51, 52, 53]), np.array([7, 8])
    l, r, ph = pair_by_tokens(local, remote, 16, 64, 100)
    assert l.tolist() == [50, 51, 52, 53]
    assert r.tolist() == [7, 8, 8, 8]
    assert ph.tolist() == [3, 0, 1, 2]


def test_pairing_needs_the_request_length_and_a_sufficient_remote_list() -> None:
    with pytest.raises(RequestError, match="num_tokens"):
        pair_by_tokens(np.array([1]), np.array([2, 3]), 32, 16, None)
    with pytest.raises(RequestError, match="remote list starts at token 32"):
        pair_by_tokens(np.array([1, 2, 3]), np.array([10]), 16, 32, 48)  # local needs tokens 0..47
    with pytest.raises(RequestError, match="fill only"):
        pair_by_tokens(np.array([1, 2, 3]), np.array([9]), 16, 32, 20)


def test_nothing_to_fill_pairs_nothing_whatever_the_block_sizes() -> None:
    """A decode engine computing the whole prompt itself (a one-token prompt held back) still
    resolves its request, to notify P: no local blocks, no pairs, no error (served: it failed the
    request with 'can only be paired knowing num_tokens' where block sizes differed)."""
    for num_tokens in (None, 0, 1):
        lp, rp, phase = pair_by_tokens(np.array([], dtype=np.int64), np.array([7]), 32, 64, num_tokens)
        assert lp.size == rp.size == phase.size == 0


def _plan(name: str, decode_rank: int = 0):
    return build(load(SCENARIOS / f"{name}.yaml"), Dispatcher.from_plugins()).plans[decode_rank]


def test_gemma4_groups_keep_their_own_heads_and_block_sizes() -> None:
    plan = _plan("hetero-gemma4-like-p4-d8", decode_rank=3)
    segs = plan.to_dict()["segments"]
    sliding = [s for s in segs if s["local_region"] == "model.layers.0.self_attn.attn"]
    full = [s for s in segs if s["local_region"] == "model.layers.5.self_attn.attn"]
    # Sliding: 16 heads, D8 rank 3 holds heads 6-7, which P4 rank 1 holds at slots 2-3 (4 per rank).
    assert {s["remote_rank"] for s in sliding} == {1}
    assert {s["phase"] for s in sliding} == {0}
    # Full: 4 heads; D8 rank 3 holds head 1 (replicated), which P4 rank 1 holds alone. Blocks are 16
    # tokens on D (TP8) and 32 on P (TP4): two phases, each the half of a P page's tokens.
    assert {s["remote_rank"] for s in full} == {1}
    assert sorted((s["phase"], s["remote_offset"]) for s in full) == [(0, 0), (1, 16 * 2048)]


def test_minimal_remote_geometry_is_derived_from_its_pages() -> None:
    """A homogeneous peer that advertises no per-region facts plans exactly like a full one."""
    plan = _plan("hetero-gemma4-like-p2-d4")
    bare = {
        rank: dataclasses.replace(g, regions=tuple(dataclasses.replace(r, facts={}) for r in g.regions))
        for rank, g in plan.remote.items()
    }
    again = Dispatcher.from_plugins().plan(plan.local, bare)
    assert again.to_dict()["segments"] == plan.to_dict()["segments"]
    ids = [np.arange(1, 40), np.arange(40, 79), np.arange(79, 118), np.arange(118, 157), np.arange(157, 196), np.arange(196, 215)]
    assert [r.local_ids.tolist() for r in again.resolve(ids, ids, 600).reads] == [
        r.local_ids.tolist() for r in plan.resolve(ids, ids, 600).reads
    ]


def test_minimal_remote_with_wrong_page_geometry_is_still_rejected() -> None:
    plan = _plan("fa-p2-d4-h8")
    bare = {}
    for rank, g in plan.remote.items():
        regions = []
        for r in g.regions:
            axes = tuple((n, s * 2 if n == "byte" else s) for n, s in r.page.axes)  # claims 2x head size
            regions.append(dataclasses.replace(r, facts={}, page=dataclasses.replace(r.page, axes=axes), block_stride=r.block_stride * 2))
        bare[rank] = dataclasses.replace(g, regions=tuple(regions), memory=((0, 1 << 62),))
    with pytest.raises(IncompatibleGeometry, match="content_bytes"):
        Dispatcher.from_plugins().plan(plan.local, bare)


@pytest.mark.parametrize("name", ["fa-p4-d2-h8", "hetero-gemma4-like-p4-d8", "mamba-nemotronh-like-p4-d2", "fa-p2-d8-h4-replicated"])
def test_every_rank_of_an_engine_describes_its_layers_alike(name: str) -> None:
    """Which heads a rank holds follows from its rank (heads_held): no rank advertises it, so the
    ranks of one engine send the same class descriptions and a peer parses them once."""
    engines = build(load(SCENARIOS / f"{name}.yaml"), Dispatcher.from_plugins())
    sent: dict = {}
    for plan in engines.plans:
        sent.update(plan.remote)
    described = [g.to_wire()["region_classes"] for _, g in sorted(sent.items())]
    assert len(described) > 1
    assert all(d == described[0] for d in described[1:])


def _with_head_start(plan, shift: int = 0) -> dict:
    """The plan's remote ranks as an older nixlkv describes them: each full-attention region
    advertising its first head (``shift`` heads off where its rank puts it)."""
    from nixlkv.core.topology import heads_held

    out = {}
    for rank, g in plan.remote.items():
        regions = []
        for r in g.regions:
            if r.strategy in ("full_attention", "sliding_window"):
                start = heads_held(rank, g.tp_size, r.facts["total_kv_heads"]).start + shift
                r = dataclasses.replace(r, facts={**r.facts, "head_start": start})
            regions.append(r)
        out[rank] = dataclasses.replace(g, regions=tuple(regions))
    return out


def test_a_peer_that_advertises_its_first_head_plans_alike_and_is_checked() -> None:
    plan = _plan("hetero-gemma4-like-p4-d8", decode_rank=3)
    older = Dispatcher.from_plugins().plan(plan.local, _with_head_start(plan))
    assert older.to_dict()["segments"] == plan.to_dict()["segments"]
    # negative control: a first head where the rank does not put it is refused, naming the fact
    with pytest.raises(IncompatibleGeometry, match=r"advertises head_start=\d+, but \d+ heads over tp=4 put it at"):
        Dispatcher.from_plugins().plan(plan.local, _with_head_start(plan, shift=1))


def _hetero_with_opaque_prefill(name: str):
    """A scenario's ranks with every prefill layer marked as vLLM's CPU backend marks its pages."""
    from nixlkv.core.geometry import RankGeometry
    from nixlkv.testing.engines import build_rank
    from nixlkv.testing.rehearsal import geometry

    scenario = load(SCENARIOS / f"{name}.yaml")
    dispatcher = Dispatcher.from_plugins()
    prefill = [build_rank(scenario, "prefill", r) for r in range(scenario.prefill.tp)]
    for rank in prefill:
        for layer in rank.kv_caches:
            rank.hints[layer] = {**rank.hints.get(layer, {}), "token_major_interior": False, "interior": "K channel-major"}
    # through the handshake's wire form, as D sees P
    p_geo = {r.tp_rank: RankGeometry.from_dict(geometry(r, dispatcher).to_dict()) for r in prefill}
    return dispatcher, geometry(build_rank(scenario, "decode", 0), dispatcher), p_geo


def test_a_block_size_mismatch_is_refused_where_a_page_is_not_token_major() -> None:
    # vLLM's CPU attention backend: keys channel-major inside a block (nixlkv.vllm.model_backend);
    # a P b32 -> D b16 copy of half a block's tokens would scramble them
    dispatcher, local, p_geo = _hetero_with_opaque_prefill("hetero-llama-like-p2b32-d2b16")
    with pytest.raises(IncompatibleGeometry, match=r"not token-major inside \(K channel-major\).*same --block-size"):
        dispatcher.plan(local, p_geo)


def test_equal_block_sizes_still_plan_with_pages_that_are_not_token_major() -> None:
    dispatcher, local, p_geo = _hetero_with_opaque_prefill("fa-p2-d4-h8")  # whole per-head runs only
    assert dispatcher.plan(local, p_geo).to_dict()["segments"]


# The handshake's columnar geometry (one description per distinct region geometry, the regions as
# columns) against an earlier peer's per-region form: the same geometry, the same plan, the same bytes.
WIRE_SCENARIOS = ["fa-p4-d2-h8", "fa-p2-d8-h4-replicated", "hetero-gemma4-like-p4-d8", "hetero-gemma4-like-p2-d4-kernel16",
                  "mamba-nemotronh-like-p4-d2", "cpu-gemma4-tiny-p2-d1"]


@pytest.mark.parametrize("name", WIRE_SCENARIOS)
def test_columnar_and_per_region_handshakes_plan_the_same_bytes(name: str) -> None:
    import json

    from nixlkv.core.geometry import RankGeometry

    dispatcher = Dispatcher.from_plugins()
    scenario = load(SCENARIOS / f"{name}.yaml")
    engines = build(scenario, dispatcher)
    sent = next(iter(engines.plans)).remote  # what P advertises, as built (never through a wire)
    for plan in engines.plans:
        sent = {**sent, **plan.remote}
    columnar = {r: RankGeometry.from_dict(json.loads(json.dumps(g.to_wire()))) for r, g in sent.items()}
    per_region = {r: RankGeometry.from_dict(json.loads(json.dumps(g.to_dict()))) for r, g in sent.items()}
    assert columnar == per_region == sent
    assert sum(len(g.to_wire()["region_classes"]) for g in sent.values()) < sum(len(g.regions) for g in sent.values())
    for plan in engines.plans:
        a, b = dispatcher.plan(plan.local, columnar), dispatcher.plan(plan.local, per_region)
        assert a.to_dict() == b.to_dict() == plan.to_dict()
        assert np.array_equal(a.local_descs, b.local_descs) and np.array_equal(a.local_descs, plan.local_descs)
        assert all(np.array_equal(a.remote_descs[p], b.remote_descs[p]) for p in plan.remote_descs)
        p_blocks, d_blocks = request_blocks(scenario, engines)  # the scenario's own request
        args = ([g.ids for g in d_blocks], [g.ids for g in p_blocks], scenario.request.num_tokens)
        moves = a.byte_moves(a.resolve(*args))
        assert moves and moves == b.byte_moves(b.resolve(*args))
