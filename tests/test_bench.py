"""The benchmark harness on tiny shapes: the figures it reports must be the right figures.

No timing is asserted here (the machines are shared); what is checked is what the numbers mean:
the descriptor count computed after NIXL's merge equals NIXL's own telemetry, the vLLM baseline
moves the same bytes as nixlkv through vLLM's own code, and the headline keys are complete.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from nixlkv import cli
from nixlkv.bench import run as bench_run
from nixlkv.bench.dram import run_transfer
from nixlkv.bench.measure import Untimed, interleaved, posted_after_merge
from nixlkv.bench.shapes import PATTERNS, Case, Shape, block_ids, fabricate_rank
from nixlkv.bench.vllm_planner import VllmPlanner
from nixlkv.core import Dispatcher
from nixlkv.core.descriptor_mode import TransferCosts

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

TINY = Shape("tiny-gqa", "full_attention", 3, {"num_kv_heads": 4, "head_size": 32, "dtype": "bfloat16", "head_size_v": None}, 16)
TINY_MLA = Shape("tiny-mla", "mla", 2, {"kv_lora_rank": 64, "qk_rope_head_dim": 32, "cache_dtype": "auto", "dtype": "bfloat16"}, 16)


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    return Dispatcher.from_plugins()


def test_merge_model_on_hand_made_rows() -> None:
    dense = np.array([[0, 64, 0, 64, 10], [10_000, 64, 0, 64, 10]], dtype=np.uint64)
    sliced = np.array([[0, 32, 0, 64, 20]], dtype=np.uint64)
    ids = np.arange(20)
    assert posted_after_merge(dense, ids, dense, ids) == 2  # one per row: never across rows
    assert posted_after_merge(dense, [0, 1, 2, 5, 6], dense, [0, 1, 2, 5, 6]) == 2
    assert posted_after_merge(dense, [0, 1, 2], dense, [0, 1, 3]) == 2  # remote side breaks the run
    assert posted_after_merge(sliced, ids, dense, ids) == 20  # a head slice never merges
    with pytest.raises(ValueError, match="outside"):
        posted_after_merge(dense, [20], dense, [0])


def test_fragmented_ids_are_distinct_mixed_runs() -> None:
    rng = np.random.default_rng(1)
    ids = block_ids("fragmented", 200, 500, rng)
    assert len(ids) == len(set(ids)) == 200 and 0 not in ids
    runs = 1 + int(np.sum(np.diff(ids) != 1))
    assert 20 < runs < 200  # neither one run nor all singletons
    assert block_ids("contiguous", 5, 10, rng) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="pool"):
        block_ids("contiguous", 10, 10, rng)


@pytest.mark.parametrize(
    ("shape", "p_tp", "d_tp", "reads"),
    [(TINY, 1, 1, 1), (TINY, 4, 2, 2), (TINY, 2, 4, 1), (TINY_MLA, 4, 2, 1)],
)
def test_vllm_baseline_moves_the_same_bytes_as_nixlkv(dispatcher, shape, p_tp, d_tp, reads) -> None:
    """Same geometry, same block ids: vLLM's own code and nixlkv's plan must address the same
    (local, remote) byte ranges, or the comparison compares different work."""
    case = Case(shape, p_tp, d_tp, 200, "fragmented")
    nb = case.num_blocks
    local = fabricate_rank(dispatcher, shape, "decode", d_tp, 0, nb)
    covered = range(p_tp // d_tp if p_tp > d_tp else 1)
    remote = {r: fabricate_rank(dispatcher, shape, "prefill", p_tp, r, nb) for r in covered}
    plan = dispatcher.plan(local, remote)
    vllm = VllmPlanner(shape, p_tp, d_tp, 0, nb, [r.base for r in local.regions],
                       {r: [x.base for x in g.regions] for r, g in remote.items()})
    vllm.handshake()
    rng = np.random.default_rng(3)
    p_ids = block_ids("fragmented", case.num_request_blocks, nb, rng)
    d_ids = block_ids("fragmented", case.num_request_blocks, nb, rng)
    ours = set(plan.byte_moves(plan.resolve([d_ids], [p_ids], case.num_tokens)))
    from nixlkv.core.request_ids import expand_ids

    theirs = set()
    for read in vllm.reads([d_ids], [p_ids]):
        la, ln = expand_ids(read.local_rows, read.local_ids)
        ra, _ = expand_ids(vllm.remote_rows[read.remote_rank], read.remote_ids)
        theirs |= set(zip(la.tolist(), [read.remote_rank] * la.size, ra.tolist(), ln.tolist()))
    assert len(vllm.source_ranks) == reads
    assert ours == theirs


@pytest.mark.nixl
@pytest.mark.parametrize(("p_tp", "d_tp", "pattern"), [
    (1, 1, "contiguous"), (1, 1, "fragmented"), (4, 2, "fragmented"), (4, 2, "contiguous"), (2, 4, "contiguous"),
])
def test_computed_merge_equals_nixl_telemetry(dispatcher, p_tp, d_tp, pattern) -> None:
    """The descriptor counts in the tables are computed; NIXL's own count must agree, in the
    descriptor mode auto picked (staged: summed over every round)."""
    # a free copy (no bandwidth or per-call cost): auto then stages wherever staging merges more
    cheap_copy = TransferCosts(copy_bytes_per_s=1e12, per_scatter_s=0.0, per_round_s=0.0)
    result = run_transfer(Case(TINY, p_tp, d_tp, 500, pattern), num_layers=2, reps=1, dispatcher=dispatcher, costs=cheap_copy)
    assert result.descs_posted_ours_nixl == result.descs_posted_ours_computed > 0
    assert result.descs_posted_staged_nixl == result.descs_posted_staged_computed > 0
    assert result.descs_posted_ours_computed <= result.descs_posted_direct
    if p_tp > d_tp:  # head slices on D: staging merges whole P pages
        assert result.modes == ["staged"]
        if pattern == "contiguous":  # one descriptor per (layer, P rank) run: 2 x 2 here
            assert result.descs_posted_ours_nixl == 4 and result.descs_posted_direct == 2 * 2 * 32
    else:
        assert result.modes == ["direct"]
    assert result.descs_posted_vllm_nixl == result.descs_posted_vllm_computed > 0
    assert result.spot_checked_bytes > 0
    if (p_tp, d_tp, pattern) == (1, 1, "contiguous"):
        assert result.descs_posted_ours_nixl == 2  # one per layer: whole pages, consecutive ids
    d = result.to_dict()
    assert d["ours_gbps"] > 0 and d["memcpy_gbps"] > 0 and "scaled down to 2 of 3 layers" in d["notes"][0]
    assert d["ceiling_gbps"] > 0 and d["ceiling_vs_memcpy"] > 0  # one descriptor per prefill rank, same bytes


@pytest.mark.nixl
def test_transfer_with_paused_progress_threads(dispatcher) -> None:
    """The bench's default: agents whose progress threads pause between polls still move every byte."""
    result = run_transfer(Case(TINY, 4, 2, 500, "contiguous"), num_layers=2, reps=1, dispatcher=dispatcher,
                          progress_delay_us=1000)
    assert result.spot_checked_bytes > 0
    assert result.descs_posted_ours_nixl == result.descs_posted_ours_computed > 0


def test_interleaved_times_every_function_alike() -> None:
    calls = {"a": 0, "b": 0}

    def bump(k):
        return lambda: calls.__setitem__(k, calls[k] + 1)

    ta, tb = interleaved([bump("a"), bump("b")], reps=7, warmup=1)
    assert calls == {"a": 8, "b": 8} and ta.reps == tb.reps == 7 and ta.p50 <= ta.p99


def test_an_untimed_setup_is_left_out_of_the_timing() -> None:
    got: list[int] = []
    counter = iter(range(100))
    slow_setup = Untimed(lambda: (time.sleep(0.02), next(counter))[1], got.append)
    timed_sleep = lambda: time.sleep(0.02)  # noqa: E731 - the control: the same sleep, timed
    untimed, control = interleaved([slow_setup, timed_sleep], reps=3, warmup=1)
    assert got == [0, 1, 2, 3]  # each call gets its own setup's result, warmup first
    assert untimed.p99 < 0.01 <= 0.02 <= control.p50


def test_interleaved_gives_every_function_every_predecessor() -> None:
    """Each function runs after each other one about as often (an alternating order would give
    ``c`` only ``b`` and itself before it)."""
    log: list[str] = []
    fns = [lambda k=k: log.append(k) for k in "abcd"]
    interleaved(fns, reps=400, warmup=0)
    after = {(x, y): 0 for x in "abcd" for y in "abcd" if x != y}
    for prev, cur in zip(log, log[1:]):
        if prev != cur:
            after[(prev, cur)] += 1
    assert len(log) == 1600 and min(after.values()) > 0.6 * max(after.values()), after


def test_headline_ok_names_bad_values() -> None:
    good = {"plan_time_ratio_vs_vllm": 0.9, "descs_ratio_vs_vllm_hetero": 1.0, "descs_ratio_vs_vllm_fragmented": 1.0}
    assert bench_run.headline_ok(good) == []
    assert bench_run.headline_ok({**good, "plan_time_ratio_vs_vllm": math.nan}) == ["plan_time_ratio_vs_vllm=nan"]
    assert bench_run.headline_ok({**good, "transfers": [{}]}) == ["nixl_vs_memcpy=None", "nixl_vs_memcpy_hetero=None"]


@pytest.mark.nixl
def test_cli_bench_quick_json_has_every_headline_key(monkeypatch, capsys, tmp_path) -> None:
    """``nixlkv bench --quick --json`` end to end, with the cases swapped for tiny ones so it runs
    in seconds: one JSON object, every key the issue names, finite positive ratios, a table, a PNG."""
    tiny = Shape("llama-8b-like", "full_attention", 2, TINY.params, 16)  # named like the headline shape
    monkeypatch.setattr(bench_run, "LLAMA_8B", tiny)
    monkeypatch.setattr(bench_run, "quick_cases", lambda: [
        Case(tiny, 4, 2, 8192, "contiguous"), Case(tiny, 4, 2, 1024, "contiguous"),
        Case(tiny, 4, 2, 8192, "fragmented"), Case(tiny, 1, 1, 8192, "contiguous"),
    ])
    monkeypatch.setattr(bench_run, "transfer_cases", lambda: [Case(tiny, 1, 1, 8192, "contiguous"), Case(tiny, 4, 2, 8192, "contiguous")])
    monkeypatch.setattr(bench_run, "TRANSFER_LAYERS", 2)
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    rc = cli.main(["bench", "--quick", "--json", "--transfer-reps", "1", "--markdown", str(md), "--plot", str(png)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("plan_time_ratio_vs_vllm", "descs_ratio_vs_vllm_hetero", "descs_ratio_vs_vllm_fragmented",
                "nixl_vs_memcpy", "nixl_vs_memcpy_hetero", "plan_us_ours_p50", "plan_us_vllm_p50",
                "nixl_gbps", "memcpy_gbps", "nixl_gbps_hetero", "memcpy_gbps_hetero", "handshake_ratio_vs_vllm_hetero",
                "handshake_first_ratio_vs_vllm_hetero", "handshake_first_ratio_vs_vllm_equal_tp",
                "handshake_other_blocks_ratio_vs_vllm_hetero", "handshake_other_blocks_ratio_vs_vllm_equal_tp"):
        assert isinstance(out[key], float) and math.isfinite(out[key]) and out[key] > 0, key
    assert out["merge_count_checked"] is True and out["merge_count_checked_hetero"] is True
    # P4->D2: head slices never merge, so the plan's own descriptors are vLLM's count; auto
    # stages whole pages instead, and NIXL's telemetry agrees with the staged count
    assert out["descs_posted_direct_hetero"] == out["descs_posted_vllm_hetero"]
    assert out["descs_ratio_vs_vllm_hetero_staged"] <= 1 / 8
    # auto reports what it picked, from the costs it measured on this machine now
    assert out["descriptor_mode_hetero"] in ("staged", "direct")
    expected = out["descs_ratio_vs_vllm_hetero_staged"] if out["descriptor_mode_hetero"] == "staged" else 1.0
    assert out["descs_ratio_vs_vllm_hetero"] == expected
    assert out["auto_costs"]["copy_gbps_measured"] > 0
    assert out["nixl_staged_vs_memcpy_hetero"] > 0 and out["nixl_direct_vs_memcpy_hetero"] > 0
    # every transfer figure also against the same run's one-descriptor-per-prefill-rank READ
    for key in ("nixl_vs_ceiling", "nixl_direct_vs_ceiling", "nixl_staged_vs_ceiling", "vllm_style_nixl_vs_ceiling",
                "nixl_ceiling_vs_memcpy", "two_pass_vs_ceiling", "direct_us_per_descriptor_for_90pct"):
        for suffix in ("", "_hetero"):
            assert isinstance(out[key + suffix], float) and math.isfinite(out[key + suffix]) and out[key + suffix] > 0, key
    # the same-run limits: two passes over the bytes take longer than one (the ceiling's)
    assert all(t["two_pass_ms_p50"] > 0 and math.isfinite(t["direct_extra_us_per_descriptor"]) for t in out["transfers"])
    assert out["nixl_num_threads"] == 4 and all(t["nixl_num_threads"] == 4 for t in out["transfers"])
    assert out["transfer_mode"] == "direct" and out["descs_ratio_vs_vllm_equal_tp"] == 1.0
    assert out["transfer_layers"] == "2 of 2"
    assert "llama-8b-like P4->D2 8k contiguous" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_planner_needs_its_handshake_first() -> None:
    vllm = VllmPlanner(TINY, 1, 1, 0, 20, [0, 1000, 2000], {0: [0, 1000, 2000]})
    with pytest.raises(RuntimeError, match="handshake"):
        vllm.desc_ids([[1, 2]], [[1, 2]])


def _tiny_vllm(p_tp: int, d_tp: int) -> VllmPlanner:
    remote = {r: [10_000 * (r + 1) + 1000 * i for i in range(3)] for r in range(max(p_tp // d_tp, 1))}
    return VllmPlanner(TINY, p_tp, d_tp, 0, 20, [0, 1000, 2000], remote)


def test_vllm_handshake_is_vllms_add_remote_agent_with_its_checks() -> None:
    """The timed baseline handshake runs vLLM's own add_remote_agent, checks included: a prefill
    rank advertising a block length that does not fit the TP ratio is refused by vLLM's code
    (negative control: the same handshake with the right length passes)."""
    import dataclasses

    vllm = _tiny_vllm(4, 2)
    vllm.handshake()
    assert vllm.worker.tp_mappings[vllm.engine_id] is vllm.mapping
    good = vllm._metadata
    vllm._metadata = lambda engine, rank: dataclasses.replace(good(engine, rank), block_lens=[1] * 3)
    with pytest.raises(AssertionError, match="SPLIT region"):
        vllm.handshake()
    vllm._metadata = good
    vllm.handshake()


@pytest.mark.parametrize(("p_tp", "d_tp", "splits", "remote"), [(4, 2, 2, 2), (1, 1, 0, 1), (2, 4, 0, 1)])
def test_vllm_handshake_prepares_what_vllm_does_per_engine(p_tp, d_tp, splits, remote) -> None:
    """Registration prepares the local rows once; each handshake prepares the remote rows of every
    rank it handshakes with; the split local handles (P_TP > D_TP) are built by the first
    handshake of the TP size only, as vLLM keeps them, and again by a first one."""
    vllm = _tiny_vllm(p_tp, d_tp)
    lists = vllm.worker.nixl_wrapper.lists
    assert len(lists) == 1 and lists[0] is vllm.local_rows  # the local handle, at registration
    vllm.handshake()
    assert len(lists) == 1 + splits + remote and len(vllm.split_rows) == splits
    vllm.handshake()  # another engine of the same TP size: its remote rows only
    assert len(lists) == 1 + splits + 2 * remote
    vllm.handshake_first()
    assert len(lists) == 1 + 2 * splits + 3 * remote
    assert sorted(vllm.remote_rows) == list(range(remote))


# ---------------------------------------------------------------- hybrid (Nemotron-H-like)
def _nemotron_like(pattern: str, n_groups: int = 8):
    import dataclasses

    from nixlkv.bench.hybrid import NEMOTRON_H_8B

    return dataclasses.replace(NEMOTRON_H_8B, name=f"hybrid-{pattern}-g{n_groups}", pattern=pattern,
                               mamba={**NEMOTRON_H_8B.mamba, "n_groups": n_groups})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_hybrid_layout_is_where_a_real_engine_puts_every_page(dispatcher, role) -> None:
    """The planning-only hybrid geometry equals the one read off a really allocated engine
    (vLLM's allocate_kv_cache, the scenario nemotronh-like P4->D2), byte offset for byte offset."""
    from nixlkv.bench.hybrid import fabricate_hybrid_rank, hybrid_layout
    from nixlkv.testing.engines import build_rank
    from nixlkv.testing.rehearsal import geometry
    from nixlkv.testing.scenario import load

    scenario = load("tests/scenarios/mamba-nemotronh-like-p4-d2.yaml")  # layers: mamba, attention, mamba
    side = scenario.prefill if role == "prefill" else scenario.decode
    real = build_rank(scenario, role, 0)
    real_geo = geometry(real, dispatcher)
    base = int(real.buffer.data_ptr())
    layout = hybrid_layout(_nemotron_like("M*M"), side.tp, side.num_blocks)
    ours = fabricate_hybrid_rank(dispatcher, layout, role, 0, base)
    assert layout.group_spec_types == tuple(type(g.kv_cache_spec) for g in real.kv_cache_config.kv_cache_groups)
    assert ours.regions == real_geo.regions and len(ours.regions) == 5  # 2 x (conv, ssm) + attention


@pytest.mark.parametrize(("p_tp", "d_tp", "reads"), [(4, 2, 2), (2, 4, 1), (1, 1, 1)])
def test_vllm_hybrid_baseline_moves_the_same_bytes_as_nixlkv(dispatcher, p_tp, d_tp, reads) -> None:
    """Nemotron-H-like (n_groups 8): vLLM's Mamba path (attention rows, then x / B / C / SSM rows
    per aliased region) and nixlkv's per-layer regions address the same (local, remote) bytes."""
    from nixlkv.bench.hybrid import NEMOTRON_H_8B, hybrid_request_ids, hybrid_setup

    case = Case(NEMOTRON_H_8B, p_tp, d_tp, 9000, "fragmented")
    local, remote, vllm = hybrid_setup(case, dispatcher)
    plan = dispatcher.plan(local, remote)
    vllm.handshake()
    p_ids, d_ids = hybrid_request_ids(case, vllm.local_layout, np.random.default_rng(5))
    assert [len(g) for g in d_ids] == [1] * 6 + [9]  # six Mamba groups, one state each; 9 attention blocks
    ours = set(plan.byte_moves(plan.resolve(d_ids, p_ids, case.num_tokens)))
    assert ours == _vllm_moves(vllm, d_ids, p_ids)
    assert len(vllm.source_ranks) == reads
    # 4 attention layers x 9 blocks + 24 Mamba layers x (x, B, C, SSM), per source rank
    assert len(ours) == reads * (4 * 9 + 24 * 4)


def _vllm_moves(vllm, d_ids, p_ids) -> set:
    from nixlkv.core.request_ids import expand_ids

    moves = set()
    for read in vllm.reads(d_ids, p_ids):
        la, ln = expand_ids(read.local_rows, read.local_ids)
        ra, _ = expand_ids(vllm.remote_rows[read.remote_rank], read.remote_ids)
        moves |= set(zip(la.tolist(), [read.remote_rank] * la.size, ra.tolist(), ln.tolist()))
    return moves


@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 2), (2, 4)])
def test_vllm_hybrid_baseline_reads_other_b_c_bytes_with_one_group(dispatcher, p_tp, d_tp) -> None:
    """With n_groups = 1 (B/C replicated on every rank) vLLM 0.33 offsets B and C as if they
    shrank with TP: the comparison sees exactly that, and only that, differ (x, SSM, attention agree)."""
    from nixlkv.bench.hybrid import hybrid_request_ids, hybrid_setup

    case = Case(_nemotron_like("M*M", n_groups=1), p_tp, d_tp, 2000, "contiguous")
    local, remote, vllm = hybrid_setup(case, dispatcher)
    plan = dispatcher.plan(local, remote)
    vllm.handshake()
    p_ids, d_ids = hybrid_request_ids(case, vllm.local_layout, np.random.default_rng(0))
    ours = set(plan.byte_moves(plan.resolve(d_ids, p_ids, case.num_tokens)))
    theirs = _vllm_moves(vllm, d_ids, p_ids)
    conv = vllm.worker._conv_decomp  # D's per-rank (x, B, C) byte runs
    (_, x_bytes), (b_start, _), (c_start, c_bytes) = conv.local_conv_offsets
    local_page = vllm.local_layout.unified_page
    differing = {(m[0] - vllm._local_bases[0]) % local_page for m in ours ^ theirs}
    assert ours != theirs
    assert differing and all(x_bytes <= off < c_start + c_bytes for off in differing)  # within B / C only
    assert sum(m[3] for m in ours) == sum(m[3] for m in theirs)  # same amount, other columns


def test_plan_case_runs_the_hybrid_shape_at_1k(dispatcher) -> None:
    """The bench's hybrid rows: same bytes (plan_case raises otherwise), same READs, ids and
    NIXL posts; registration counts come from both planners' own rows."""
    from nixlkv.bench.hybrid import NEMOTRON_H_8B

    for pattern in PATTERNS:
        row = bench_run.plan_case(Case(NEMOTRON_H_8B, 4, 2, 1024, pattern), dispatcher, budget=0.001)
        assert row["reads_ours"] == row["reads_vllm"] == 2
        # per READ: 4 attention layers x 1 block + 24 Mamba layers x 4 parts
        assert row["descs_ids_ours"] == row["descs_ids_vllm"] == 2 * (4 + 96)
        assert row["descs_posted_ours"] == row["descs_posted_vllm"] > 0
        assert row["registered_ours"] > 0 and row["registered_vllm"] > 0
        # several prefill engines of the layout: each brings its remote rows, the local list counts once
        assert row["registered_ours"] < row["registered_ours_engines"] < bench_run.ENGINES * row["registered_ours"]
        assert row["registered_vllm"] < row["registered_vllm_engines"]
        assert row["plan_us_ours_p50"] > 0 and row["plan_us_vllm_p50"] > 0


def test_full_bench_has_the_hybrid_and_quick_does_not() -> None:
    full = {(c.shape.name, c.p_tp, c.d_tp, c.num_tokens, c.pattern) for c in bench_run.full_cases()}
    assert {("nemotron-h-8b-like", 4, 2, t, p) for t in bench_run.TOKENS for p in PATTERNS} <= full
    assert {c.shape.name for c in bench_run.quick_cases()} == {"llama-8b-like"}
    assert not bench_run.NOT_MEASURED


def test_cli_bench_shape_filter_names_the_shapes(capsys) -> None:
    assert cli.main(["bench", "--no-transfer", "--shape", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "--shape 'no-such-model'" in err and "nemotron-h-8b-like" in err and "llama-8b-like" in err


def test_id_floor_writes_one_id_per_descriptor_and_declines_what_it_cannot_bound() -> None:
    """The floor the planning ratios are judged against does the work it claims: both lists
    converted, one distinct int32 ID per (row, block) on each side of every READ; it declines
    requests whose READs are not whole rows of the request's blocks (it would measure less)."""
    local, remote = [5, 6, 9], [1, 2, 3]
    floor = bench_run.id_floor(local, remote, [6, 3])
    assert floor is not None
    floor()
    (lo, ro), (lo2, ro2) = floor.out
    assert lo.dtype == ro.dtype == np.int32 and lo.size == ro.size == 6 and lo2.size == ro2.size == 3
    assert len(set(lo.tolist())) == 6 and lo[:3].tolist() == local and ro2.tolist() == remote
    assert bench_run.id_floor(local, remote, [4]) is None  # not whole rows
    assert bench_run.id_floor(local, remote[:2], [6]) is None  # lists of different lengths
    assert bench_run.id_floor([], [], [0]) is None
