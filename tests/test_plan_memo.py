"""The dispatcher's per-class template memo: a later handshake with peers of a geometry already
planned skips the strategy call, and gives the same plan and the same refusals as a cold one."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from nixlkv.bench.shapes import block_ids
from nixlkv.core import Dispatcher, IncompatibleGeometry, MalformedRemoteFact, RankGeometry
from test_faults import dispatcher_with
from test_plan_by_geometry import SMALL, Counting, parsed, ranks

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def columnar(remote: dict[int, RankGeometry]) -> dict[int, dict]:
    return {r: copy.deepcopy(g.to_wire()) for r, g in remote.items()}


def same_plan(a, b, nb: int = 40) -> None:
    assert np.array_equal(a.local_descs, b.local_descs) and a.local_descs.dtype == b.local_descs.dtype
    assert list(a.remote_descs) == list(b.remote_descs)
    assert all(np.array_equal(a.remote_descs[p], b.remote_descs[p]) for p in a.remote_descs)
    assert a.to_dict() == b.to_dict()
    assert a.segments == b.segments and a.layer_segments == b.layer_segments
    assert [(g.local_group, g.remote_group, g.local_num_blocks, g.remote_num_blocks, g.local_region, g.remote_region)
            for g in a.pairings] == [(g.local_group, g.remote_group, g.local_num_blocks, g.remote_num_blocks,
                                      g.local_region, g.remote_region) for g in b.pairings]
    ids = block_ids("fragmented", 20, nb, np.random.default_rng(5))
    assert a.byte_moves(a.resolve([ids], [ids])) == b.byte_moves(b.resolve([ids], [ids]))


@pytest.mark.parametrize("p_tp,d_tp", [(4, 2), (2, 4), (1, 1)])
def test_a_memo_hit_plans_the_same_as_a_cold_dispatcher(p_tp: int, d_tp: int) -> None:
    Counting.calls = 0
    d = dispatcher_with(Counting())
    local, remote = ranks(d, SMALL, p_tp, d_tp)
    wire = columnar(remote)
    first = d.plan(local, parsed(wire))
    again = d.plan(local, parsed(wire))  # fresh geometries of the same classes: a memo hit
    assert Counting.calls == 1
    same_plan(first, again)
    cold = dispatcher_with(Counting())
    same_plan(cold.plan(local, parsed(wire)), again)


def test_a_memo_hit_does_not_hide_a_bad_peer() -> None:
    d = Dispatcher.from_plugins()
    local, remote = ranks(d, SMALL, 4, 2)
    wire = columnar(remote)
    d.plan(local, parsed(wire))
    bad = copy.deepcopy(wire)
    bad[1]["region_classes"][0]["facts"]["head_size"] = 128
    with pytest.raises(IncompatibleGeometry):
        d.plan(local, parsed(bad))
    bad = copy.deepcopy(wire)
    bad[0]["region_classes"][0]["facts"]["num_heads"] = "2"
    with pytest.raises(MalformedRemoteFact, match="num_heads"):
        d.plan(local, parsed(bad))
    # the same faults refused with the same messages by a dispatcher that planned nothing before
    for key, value in (("head_size", 128), ("num_heads", "2")):
        bad = copy.deepcopy(wire)
        bad[0]["region_classes"][0]["facts"][key] = value
        with pytest.raises(IncompatibleGeometry) as warm:
            d.plan(local, parsed(bad))
        with pytest.raises(IncompatibleGeometry) as cold:
            Dispatcher.from_plugins().plan(local, parsed(bad))
        assert str(warm.value) == str(cold.value)
