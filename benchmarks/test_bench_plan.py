"""Per-request planning (block ids -> descriptor ids) and handshake-to-plan, nixlkv vs vLLM 0.33.

pytest-benchmark groups each case so its table puts nixlkv and vLLM side by side; compare them
within one run only (``--benchmark-group-by=group``, the default here). ``nixlkv bench`` is the
interleaved, ratio-reporting version of the same measurements.
"""

from __future__ import annotations

import numpy as np
import pytest

from nixlkv.bench.hybrid import NEMOTRON_H_8B, HybridShape, hybrid_request_ids, hybrid_setup
from nixlkv.bench.shapes import DEEPSEEK_MLA, LLAMA_8B, LLAMA_70B, Case, block_ids, fabricate_rank
from nixlkv.bench.vllm_planner import VllmPlanner
from nixlkv.core import Dispatcher, covered_remote_ranks

CASES = [
    Case(LLAMA_8B, 1, 1, 8192, "contiguous"),
    Case(LLAMA_8B, 4, 2, 8192, "contiguous"),
    Case(LLAMA_8B, 4, 2, 8192, "fragmented"),
    Case(LLAMA_8B, 8, 4, 131072, "contiguous"),
    Case(LLAMA_70B, 4, 8, 8192, "fragmented"),
    Case(DEEPSEEK_MLA, 8, 2, 8192, "contiguous"),
    Case(NEMOTRON_H_8B, 4, 2, 8192, "fragmented"),
]


@pytest.fixture(scope="module")
def dispatcher() -> Dispatcher:
    return Dispatcher.from_plugins()


def _setup(case: Case, dispatcher: Dispatcher):
    if isinstance(case.shape, HybridShape):
        local, remote, vllm = hybrid_setup(case, dispatcher)
        vllm.handshake()
        p_ids, d_ids = hybrid_request_ids(case, vllm.local_layout, np.random.default_rng(0))
        return local, remote, dispatcher.plan(local, remote), vllm, (p_ids, d_ids)
    nb = case.num_blocks
    local = fabricate_rank(dispatcher, case.shape, "decode", case.d_tp, 0, nb)
    remote = {
        r: fabricate_rank(dispatcher, case.shape, "prefill", case.p_tp, r, nb)
        for r in covered_remote_ranks(0, case.d_tp, case.p_tp)
    }
    plan = dispatcher.plan(local, remote)
    vllm = VllmPlanner(case.shape, case.p_tp, case.d_tp, 0, nb, [r.base for r in local.regions],
                       {r: [x.base for x in g.regions] for r, g in remote.items()})
    vllm.handshake()
    rng = np.random.default_rng(0)
    ids = ([block_ids(case.pattern, case.num_request_blocks, nb, rng)], [block_ids(case.pattern, case.num_request_blocks, nb, rng)])
    return local, remote, plan, vllm, ids  # block ids per KV group: (prefill, decode)


@pytest.mark.parametrize("side", ["nixlkv", "vllm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label.replace(" ", "_"))
def test_per_request_planning(benchmark, dispatcher, case: Case, side: str) -> None:
    _, _, plan, vllm, (p_ids, d_ids) = _setup(case, dispatcher)
    benchmark.group = f"request {case.label}"
    if side == "nixlkv":
        resolved = benchmark(plan.resolve, d_ids, p_ids, case.num_tokens)
        assert resolved.num_descriptors > 0
    else:
        reads = benchmark(vllm.desc_ids, d_ids, p_ids)
        assert sum(r[1].size for r in reads) > 0


@pytest.mark.parametrize("side", ["nixlkv", "vllm"])
@pytest.mark.parametrize("case", CASES[:3] + CASES[5:], ids=lambda c: c.label.replace(" ", "_"))
def test_handshake_to_plan(benchmark, dispatcher, case: Case, side: str) -> None:
    from nixlkv.core import RankGeometry

    local, remote, _, vllm, _ = _setup(case, dispatcher)
    wire = {r: g.to_dict() for r, g in remote.items()}
    benchmark.group = f"handshake {case.label}"
    if side == "nixlkv":
        plan = benchmark(lambda: dispatcher.plan(local, {r: RankGeometry.from_dict(d) for r, d in wire.items()}))
        assert plan.read_ranks
    else:
        benchmark(vllm.handshake)
        assert vllm.source_ranks
