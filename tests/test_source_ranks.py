"""A plan holds the geometry of the remote ranks its strategies read from
(``Strategy.source_ranks``): an MLA decode rank reads one of the prefill ranks it covers, so it
plans with that rank's geometry alone and only tells the others."""

from __future__ import annotations

import numpy as np
import pytest

from nixlkv.bench.shapes import DEEPSEEK_MLA, fabricate_rank
from nixlkv.core import Dispatcher, PlanError, PlanValidationError, Segment
from nixlkv.strategies.mla import MLAStrategy

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

NB = 64


def mla_ranks(d: Dispatcher, p_tp: int = 8, d_tp: int = 2, d_rank: int = 1):
    local = fabricate_rank(d, DEEPSEEK_MLA, "decode", d_tp, d_rank, NB)
    return local, {r: fabricate_rank(d, DEEPSEEK_MLA, "prefill", p_tp, r, NB) for r in range(p_tp)}


def test_an_mla_plan_holds_only_the_rank_it_reads() -> None:
    d = Dispatcher.from_plugins()
    local, remote = mla_ranks(d)
    plan = d.plan(local, {4: remote[4]})  # D1 of 2 covers P4..P7 and reads P4: its geometry is enough
    assert plan.covered == (4, 5, 6, 7) and plan.sources == (4,) and list(plan.remote) == [4]
    assert plan.read_ranks == (4,)
    given_all = Dispatcher.from_plugins().plan(local, remote)  # every rank given: the same plan
    assert given_all.sources == (4,) and list(given_all.remote) == [4]
    assert np.array_equal(plan.local_descs, given_all.local_descs)
    assert np.array_equal(plan.remote_descs[4], given_all.remote_descs[4])
    ids = [list(range(1, 9))]
    resolved = plan.resolve(ids, ids, 8 * 64)
    assert [r.remote_rank for r in resolved.reads] == [4] and resolved.notify_only == (5, 6, 7)
    with pytest.raises(PlanError, match=r"remote ranks \[4\] is needed"):  # negative control: not the one it reads
        Dispatcher.from_plugins().plan(local, {5: remote[5]})


def test_a_strategy_naming_ranks_it_does_not_cover_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Dispatcher.from_plugins()
    local, remote = mla_ranks(d)
    monkeypatch.setattr(MLAStrategy, "source_ranks", lambda self, region, topology, remote_tp: [3])
    with pytest.raises(PlanError, match=r"names remote ranks \[3\].*covers \[4, 5, 6, 7\]"):
        d.plan(local, remote)
    monkeypatch.setattr(MLAStrategy, "source_ranks", lambda self, region, topology, remote_tp: [])
    with pytest.raises(PlanError, match="names remote ranks"):
        d.plan(local, remote)


def test_segments_reading_a_rank_source_ranks_left_out_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strategy that says it reads P5 but whose segments read P4: P4's geometry is not planned with."""
    d = Dispatcher.from_plugins()
    local, remote = mla_ranks(d)
    monkeypatch.setattr(MLAStrategy, "source_ranks", lambda self, region, topology, remote_tp: [5])
    with pytest.raises(PlanError, match=r"remote rank 4 .* not among the given remote regions \[5\]"):  # MLA checks its peers
        d.plan(local, remote)

    def reads_p4(self, region, peers, topology, remote_tp):
        return [Segment(region.name, 0, 4, region.name, 0, region.page.nbytes)]

    monkeypatch.setattr(MLAStrategy, "segments", reads_p4)
    with pytest.raises(PlanValidationError, match=r"reads remote rank 4, outside the ranks this local rank reads \[5\]"):
        Dispatcher.from_plugins().plan(local, remote)
    monkeypatch.setattr(MLAStrategy, "source_ranks", lambda self, region, topology, remote_tp: [4])
    assert Dispatcher.from_plugins().plan(local, remote).read_ranks == (4,)  # negative control: named, it plans
