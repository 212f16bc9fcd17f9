"""The per-request fast path (:mod:`nixlkv.core.fast_path`) against the general path.

The general path resolves a request pairing by pairing, each group's block pairs from its
strategy's own ``pair_blocks`` (``TransferPlan.undeclared``). The fast path resolves the plans
most requests meet (one declared tail pairing in one phase; every pairing declared) from one
conversion of the request's lists. Both must give the same READs, byte for byte, and where the
fast path declines a request, the general path's refusal.

Geometry is fabricated from integers (the bench's shapes); no memory is allocated.
"""

from __future__ import annotations

import numpy as np
import pytest

from nixlkv.bench.hybrid import NEMOTRON_H_8B, hybrid_request_ids, hybrid_setup
from nixlkv.bench.shapes import DEEPSEEK_MLA, LLAMA_8B, Case, block_ids, fabricate_rank
from nixlkv.core import Dispatcher, IdScratch, RequestError, ResolvedRequest, covered_remote_ranks
from nixlkv.core import fast_path

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _reads(resolved: ResolvedRequest) -> list[tuple[int, list[int], list[int], int | None]]:
    return [(r.remote_rank, r.local_ids.tolist(), r.remote_ids.tolist(), r.nbytes) for r in resolved.reads]


def _same(fast: ResolvedRequest, general: ResolvedRequest) -> None:
    assert _reads(fast) == _reads(general)
    assert fast.notify_only == general.notify_only and fast.consumers == general.consumers


def _dense_plan(shape, p_tp: int, d_tp: int, nb: int = 64):
    d = Dispatcher.from_plugins()
    local = fabricate_rank(d, shape, "decode", d_tp, 0, nb)
    remote = {r: fabricate_rank(d, shape, "prefill", p_tp, r, nb) for r in covered_remote_ranks(0, d_tp, p_tp)}
    return d.plan(local, remote)


@pytest.mark.parametrize(("shape", "p_tp", "d_tp"), [(LLAMA_8B, 4, 2), (LLAMA_8B, 1, 1), (LLAMA_8B, 2, 4),
                                                      (LLAMA_8B, 4, 1), (DEEPSEEK_MLA, 2, 1)])
def test_one_tail_fast_path_matches_the_general_path(shape, p_tp: int, d_tp: int) -> None:
    plan = _dense_plan(shape, p_tp, d_tp)
    general = plan.undeclared()
    assert plan._one_tail_reads is not None and general._one_tail_reads is None  # each path is the one taken
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    scratch = IdScratch()
    for n, extra in ((1, 0), (5, 3), (20, 0), (33, 7), (0, 4)):
        local = block_ids("fragmented", n, 64, rng)
        remote = block_ids("fragmented", n + extra, 64, rng)  # P holds more blocks: D reads the tail
        _same(plan.resolve([local], [remote]), general.resolve([local], [remote]))
        _same(plan.resolve([local], [remote], scratch=scratch), general.resolve([local], [remote]))
        assert plan.byte_moves(plan.resolve([local], [remote])) == general.byte_moves(general.resolve([local], [remote]))


def test_declared_pairs_fast_path_matches_the_general_path_on_a_hybrid() -> None:
    """Nemotron-H-like: attention (a declared tail) and Mamba (a declared running state) groups."""
    d = Dispatcher.from_plugins()
    case = Case(NEMOTRON_H_8B, 2, 1, 8192, "fragmented")
    local, remote, vllm = hybrid_setup(case, d)
    plan = d.plan(local, remote)
    general = plan.undeclared()
    assert plan._declared is not None and general._declared is None
    rng = np.random.default_rng(3)
    for _ in range(4):
        p_ids, d_ids = hybrid_request_ids(case, vllm.local_layout, rng)
        assert fast_path.declared_pairs(plan._declared, d_ids, p_ids) is not None  # the fast path takes it
        _same(plan.resolve(d_ids, p_ids, case.num_tokens), general.resolve(d_ids, p_ids, case.num_tokens))


def test_where_the_fast_path_declines_the_general_path_refuses_as_the_strategy_does() -> None:
    """A null block, an id out of bounds, too few remote blocks, an id that is no integer: the
    request is refused with the message the strategy's own pair_blocks gives."""
    plan = _dense_plan(LLAMA_8B, 4, 2)
    general = plan.undeclared()
    for local, remote in (([1, 0, 3], [4, 5, 6]), ([1, 2, 3], [4, 5, 10_000]), ([1, 2, 3], [4, 5]), ([1, 2.5], [4, 5])):
        messages = []
        for p in (plan, general):
            with pytest.raises(RequestError) as refused:
                p.resolve([local], [remote])
            messages.append(str(refused.value))
        assert messages[0] == messages[1]
