"""The mamba strategy against the physics: byte tables of kv-layouts.md §5.5, every conv channel and
SSM unit of every decode rank traced back to the same global coordinate on the prefill rank it is
read from (with the oracle's independent sharding model), running-state pairing, refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nixlkv.core import IncompatibleGeometry, IncompatibleTopology, LayerCache, PageLayout, RequestError, Topology
from nixlkv.strategies.mamba import MAX_TRANSPOSED_ELEMENTS, ConvPage, MambaStrategy, running_state_block
from nixlkv.testing.kinds import KINDS, MAMBA_OPTIONAL
from nixlkv.testing.oracle import DTYPE_BYTES, mamba_state_coordinates

NEMOTRON = {"mamba_type": "mamba2", "num_heads": 128, "head_dim": 64, "d_state": 128, "n_groups": 8, "conv_kernel": 4}
BASE = 1 << 32


def params(**kw: Any) -> dict[str, Any]:
    return {**MAMBA_OPTIONAL, **kw}


def regions(p: dict[str, Any], tp: int, rank: int, name: str = "m0", layout: str | None = None):
    p = p if layout is None else {**p, "conv_layout": layout}
    spec = KINDS["mamba"].build(p, tp, 16)
    page = PageLayout((("head", 1), ("token", 1), ("byte", spec.state_content_size_bytes)))
    layer = LayerCache(name, 0, spec, BASE, 4, spec.page_size_bytes, page, KINDS["mamba"].hints(p))
    return {r.facts["part"]: r for r in MambaStrategy().local_regions(layer, Topology(tp, rank))}


def plan_segments(p: dict[str, Any], local_tp: int, local_rank: int, remote_tp: int,
                  local_layout: str | None = None, remote_layout: str | None = None):
    """Segments of every part of one local rank, as (part, local offset in page, remote rank,
    remote offset in page, nbytes); each side's conv layout its own where given."""
    mine = regions(p, local_tp, local_rank, layout=local_layout)
    theirs = {r: regions(p, remote_tp, r, layout=remote_layout) for r in range(remote_tp)}
    out = []
    for part, region in mine.items():
        segs = MambaStrategy().segments(region, {r: t[part] for r, t in theirs.items()}, Topology(local_tp, local_rank), remote_tp)
        for s in segs:
            out.append((part, region.base - BASE + s.local_offset, s.remote_rank,
                        theirs[s.remote_rank][part].base - BASE + s.remote_offset, s.nbytes))
    return out


def test_nemotron_p2_to_d4_matches_the_byte_table() -> None:
    """kv-layouts.md §5.5: D rank r reads from P rank r // 2 with j = r % 2."""
    p = params(**NEMOTRON)
    for r in range(4):
        j = r % 2
        assert sorted(plan_segments(p, 4, r, 2)) == sorted([
            ("conv", 0, r // 2, 12288 * j, 12288),
            ("conv", 12288, r // 2, 24576 + 1536 * j, 1536),
            ("conv", 13824, r // 2, 27648 + 1536 * j, 1536),
            ("ssm", 15360, r // 2, 30720 + 1048576 * j, 1048576),
        ])


def test_nemotron_p4_to_d2_matches_the_byte_table() -> None:
    """kv-layouts.md §5.5: D rank r reads P ranks 2r + i; runs from two ranks stay separate."""
    p = params(**NEMOTRON)
    for r in range(2):
        want = []
        for i in range(2):
            want += [
                ("conv", 12288 * i, 2 * r + i, 0, 12288),
                ("conv", 24576 + 1536 * i, 2 * r + i, 12288, 1536),
                ("conv", 27648 + 1536 * i, 2 * r + i, 13824, 1536),
                ("ssm", 30720 + 1048576 * i, 2 * r + i, 15360, 1048576),
            ]
        assert sorted(plan_segments(p, 2, r, 4)) == sorted(want)


def test_single_group_is_read_whole_from_one_rank() -> None:
    """n_groups = 1: B / C are the whole group on every rank, so D reads all of it, once."""
    p = params(mamba_type="mamba2", num_heads=8, head_dim=16, d_state=32, n_groups=1, conv_kernel=4)
    row = 3 * 2
    for r in range(2):  # P1 -> D2: both decode ranks read the same B/C columns of P rank 0
        segs = [s for s in plan_segments(p, 2, r, 1) if s[0] == "conv"]
        assert ("conv", 64 * row, 0, 128 * row, 32 * row) in segs  # B: all 32 columns
        assert ("conv", 96 * row, 0, 160 * row, 32 * row) in segs  # C
    segs = plan_segments(p, 1, 0, 2)  # P2 -> D1: B/C from rank 0 only, x and heads from both
    assert {s[2] for s in segs if s[1] >= 128 * row and s[0] == "conv"} == {0}
    assert {s[2] for s in segs if s[0] == "ssm"} == {0, 1}


def shardable(units: int, tp: int, single: bool) -> bool:
    return units % tp == 0 or (single and units == 1)


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["mamba2", "gdn", "mamba1"]),
    heads=st.sampled_from([4, 8]),
    groups=st.sampled_from([1, 2, 4, 8]),
    local_tp=st.sampled_from([1, 2, 4]),
    remote_tp=st.sampled_from([1, 2, 4]),
    local_layout=st.sampled_from(["DS", "SD"]),
    remote_layout=st.sampled_from(["DS", "SD"]),
    data=st.data(),
)
def test_every_decode_byte_comes_from_the_same_global_coordinate(
    kind, heads, groups, local_tp, remote_tp, local_layout, remote_layout, data
) -> None:
    """Trace each byte a decode rank receives to (conv channel, row, byte | SSM unit, byte) on both
    sides, each in its own conv layout, with the oracle's own sharding model: equal everywhere,
    and every byte of the page written once."""
    groups = min(groups, heads)
    if kind == "mamba1":
        p = params(mamba_type="mamba1", intermediate_size=heads * 8, d_state=4, conv_kernel=3)
    else:
        p = params(mamba_type=kind, num_heads=heads, head_dim=4, d_state=8, n_groups=groups, conv_kernel=4)
    for tp in (local_tp, remote_tp):
        if kind != "mamba1" and not shardable(groups, tp, kind == "mamba2"):
            with pytest.raises(IncompatibleTopology, match=f"n_groups={groups} cannot be sharded over tp={tp}"):
                regions(p, tp, 0)
            return
    rank = data.draw(st.integers(0, local_tp - 1))
    element = DTYPE_BYTES[p["dtype"]]
    rows = p["conv_kernel"] - 1
    row = rows * element
    unit = (p["d_state"] if kind == "mamba1" else p["head_dim"] * p["d_state"]) * DTYPE_BYTES[p["ssm_dtype"]]
    local_ch, local_units = mamba_state_coordinates(p, local_tp, rank)
    conv_bytes = len(local_ch) * row
    written = np.zeros(conv_bytes + len(local_units) * unit, dtype=np.int64)

    def conv_coordinates(offset: np.ndarray, channels: list[int], layout: str) -> tuple[np.ndarray, ...]:
        """(global channel, row, byte of the element) of conv byte offsets, from vLLM's statement
        of the layouts: DS [channels, rows], SD [rows, channels]."""
        e, byte = offset // element, offset % element
        slot, r = (e // rows, e % rows) if layout == "DS" else (e % len(channels), e // len(channels))
        return np.asarray(channels)[slot], r, byte

    for part, loff, rrank, roff, n in plan_segments(p, local_tp, rank, remote_tp, local_layout, remote_layout):
        remote_ch, remote_units = mamba_state_coordinates(p, remote_tp, rrank)
        remote_conv = len(remote_ch) * row
        offs = np.arange(n)
        l, r = loff + offs, roff + offs
        if part == "conv":
            assert r.max() < remote_conv and l.max() < conv_bytes
            for a, b in zip(conv_coordinates(l, local_ch, local_layout), conv_coordinates(r, remote_ch, remote_layout)):
                assert np.array_equal(a, b)
        else:
            lu, ru = (l - conv_bytes), (r - remote_conv)
            assert lu.min() >= 0 and ru.min() >= 0
            assert np.array_equal(np.asarray(local_units)[lu // unit], np.asarray(remote_units)[ru // unit])
            assert np.array_equal(lu % unit, ru % unit)
        written[l] += 1
    assert (written == 1).all()


def test_groups_not_shardable_are_refused_naming_n_groups_and_tp() -> None:
    with pytest.raises(IncompatibleTopology, match=r"n_groups=2 cannot be sharded over tp=4"):
        regions(params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=2), 4, 0)


@pytest.mark.parametrize(("built", "claimed"), [("SD", "DS"), ("DS", "SD")])
def test_a_conv_shape_other_than_the_claimed_layout_is_refused(built: str, claimed: str) -> None:
    """The engine's VLLM_SSM_CONV_STATE_LAYOUT (the hint) must be what its shapes show."""
    p = params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1, conv_layout=built)
    spec = KINDS["mamba"].build(p, 2, 16)
    page = PageLayout((("head", 1), ("token", 1), ("byte", spec.state_content_size_bytes)))
    hints = {"mamba": {**KINDS["mamba"].hints(p)["mamba"], "conv_state_layout": claimed}}
    layer = LayerCache("m0", 0, spec, BASE, 4, spec.page_size_bytes, page, hints)
    with pytest.raises(IncompatibleGeometry, match=rf"is not {claimed} .*VLLM_SSM_CONV_STATE_LAYOUT={claimed}"):
        MambaStrategy().local_regions(layer, Topology(2, 0))


def test_conv_pages_name_their_layout_and_place_every_element() -> None:
    """DS is channel-major, SD row-major, over the same axes (a peer sees which); ConvPage.offsets
    is where each element lies, independently checked against numpy's own row-major strides."""
    p = params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1)
    ds, sd = (regions(p, 1, 0, layout=x)["conv"] for x in ("DS", "SD"))
    assert ds.page.axes == (("channel", 48), ("row", 3), ("byte", 2)) and ds.facts["conv_layout"] == "DS"
    assert sd.page.axes == (("row", 3), ("channel", 48), ("byte", 2)) and sd.facts["conv_layout"] == "SD"
    c, r = np.meshgrid(np.arange(48), np.arange(3), indexing="ij")
    for region, shape, index in ((ds, (48, 3), (c, r)), (sd, (3, 48), (r, c))):
        want = np.ravel_multi_index(index, shape) * 2
        assert np.array_equal(ConvPage.of(region).offsets(c, r), want)


def test_sd_on_both_sides_is_one_run_per_row_and_channel_run() -> None:
    """Nemotron-H P2 -> D4, both SD: each sub-projection's channel run moves as one byte run per
    conv row (3 rows), nothing per element."""
    p = params(**NEMOTRON)
    conv = [s for s in plan_segments(p, 4, 1, 2, "SD", "SD") if s[0] == "conv"]
    assert len(conv) == 3 * 3  # x, B, C: one run each per row
    channels, element = 2048 + 256 + 256, 2
    x = sorted(s for s in conv if s[4] == 2048 * element)
    assert x == [("conv", r * channels * element, 0, r * 2 * channels * element + 2048 * element, 2048 * element)
                 for r in range(3)]


def test_mixed_layouts_of_a_real_model_are_refused_naming_the_setting() -> None:
    """Between DS and SD every conv element is a descriptor: a Nemotron-H layer (30,720 elements
    at TP 1) is refused at planning with the setting that fixes it; a tiny one is planned."""
    big = params(**NEMOTRON)
    with pytest.raises(IncompatibleGeometry, match=r"SD here and DS on the remote.*30720 elements.*"
                                                   r"VLLM_SSM_CONV_STATE_LAYOUT to the same value"):
        plan_segments(big, 1, 0, 1, "SD", "DS")
    small = params(mamba_type="mamba2", num_heads=8, head_dim=16, d_state=16, n_groups=1)
    conv = [s for s in plan_segments(small, 1, 0, 1, "SD", "DS") if s[0] == "conv"]
    assert len(conv) == (128 + 32) * 3 <= MAX_TRANSPOSED_ELEMENTS and {s[4] for s in conv} == {2}


def test_missing_model_geometry_is_refused() -> None:
    p = params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1)
    spec = KINDS["mamba"].build(p, 1, 16)
    page = PageLayout((("head", 1), ("token", 1), ("byte", spec.state_content_size_bytes)))
    with pytest.raises(IncompatibleGeometry, match="hint 'mamba'"):
        MambaStrategy().local_regions(LayerCache("m0", 0, spec, BASE, 4, spec.page_size_bytes, page), Topology(1, 0))


def test_only_the_running_state_block_is_paired() -> None:
    """Earlier entries are superseded states or nulls, trailing ones speculative scratch; a prefix
    hit never trims the state list (pairing ignores num_tokens and list lengths)."""
    p = params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1)
    conv = regions(p, 1, 0)["conv"]
    lp, rp = MambaStrategy().pair_blocks(np.array([0, 0, 9]), np.array([0, 5, 7]), conv, conv, num_tokens=1000)
    assert lp.tolist() == [9] and rp.tolist() == [7]
    assert running_state_block(np.array([0, 4, 11, 12]), 2, "remote") == 4
    assert running_state_block(np.array([6]), 2, "remote") == 6  # before scratch is allocated
    with pytest.raises(RequestError, match="null block"):
        running_state_block(np.array([3, 0]), 0, "remote")
    with pytest.raises(RequestError, match="no block"):
        running_state_block(np.array([], dtype=np.int64), 0, "remote")


def test_mismatched_geometry_names_the_field() -> None:
    a = regions(params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1), 1, 0)["ssm"]
    b = regions(params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=16, n_groups=1), 1, 0)["ssm"]
    with pytest.raises(IncompatibleGeometry, match=r"\(d_state\) is 8 here but 16 on the remote engine"):
        MambaStrategy().segments(a, {0: b}, Topology(1, 0), 1)


@pytest.mark.nixl
def test_rehearsal_catches_b_columns_read_one_row_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle must see a B/C read that is off by one conv row (the kind of error vLLM's own
    connector makes with n_groups = 1): a mismatch naming a mamba layer, not byte-exact."""
    import dataclasses
    from pathlib import Path

    from nixlkv.testing.rehearsal import rehearse
    from nixlkv.testing.scenario import load

    original = MambaStrategy.segments

    def shifted(self, local, remote, topology, remote_tp):
        segs = original(self, local, remote, topology, remote_tp)
        if local.facts["part"] != "conv":
            return segs
        row = local.page.size("row") * local.page.size("byte")  # one channel's rows (DS)
        return [segs[0], dataclasses.replace(segs[1], remote_offset=segs[1].remote_offset + row), *segs[2:]]

    monkeypatch.setattr(MambaStrategy, "segments", shifted)
    result = rehearse(load(Path(__file__).parent / "scenarios" / "mamba2-g1-p1-d2.yaml"))
    assert result.outcome == "mismatch", result.message
    assert "model.layers.0.self_attn.attn" in result.message


@pytest.mark.nixl
@pytest.mark.parametrize("where", ["pair_blocks", "declared"])
def test_rehearsal_catches_a_scratch_block_taken_for_the_running_state(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """With speculative scratch blocks, moving the list's last entry instead of the running state
    must be a mismatch: in the strategy's own pairing, and in the RunningState it declares for
    the core to apply (one that ignores the scratch slots)."""
    from pathlib import Path

    import nixlkv.strategies.mamba as mamba
    from nixlkv.core import RunningState
    from nixlkv.testing.rehearsal import rehearse
    from nixlkv.testing.scenario import load

    if where == "pair_blocks":
        monkeypatch.setattr(MambaStrategy, "block_pairing", lambda self, local, remote: None)
        monkeypatch.setattr(mamba, "running_state_index", lambda ids, num_spec, side: ids.size - 1)
    else:
        monkeypatch.setattr(MambaStrategy, "block_pairing", lambda self, local, remote: RunningState(0, 0))
    result = rehearse(load(Path(__file__).parent / "scenarios" / "mamba2-spec2-p4-d2.yaml"))
    assert result.outcome == "mismatch", result.message


def test_speculative_conv_rows_are_part_of_the_page() -> None:
    p = params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1, num_spec=2)
    conv = regions(p, 2, 0)["conv"]
    assert conv.page.axes == (("channel", 16 + 16), ("row", 3 + 2), ("byte", 2))
    assert conv.facts["conv_rows"] == 5 and conv.facts["num_speculative_blocks"] == 2


SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.mark.nixl
@pytest.mark.parametrize("name", ["mamba-conv-sd-sd-p2-d1", "mamba-conv-sd-ds-p1-d2", "mamba-conv-ds-sd-p2-d1"])
def test_rehearsal_catches_an_sd_page_planned_as_ds(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Every conv element placed as if both pages were DS (the layout ignored, what dropping the
    refusal alone would do) must be a mismatch, whichever side is SD."""
    from nixlkv.testing.rehearsal import rehearse
    from nixlkv.testing.scenario import load

    monkeypatch.setattr(ConvPage, "offsets", lambda self, channel, row: (channel * self.rows + row) * self.itemsize)
    result = rehearse(load(SCENARIOS / f"{name}.yaml"), descriptor_mode="direct")
    assert result.outcome == "mismatch", result.message


@pytest.mark.nixl
@pytest.mark.parametrize(("name", "layout"), [("mamba-conv-sd-sd-p2-d1", "SD"), ("mamba-conv-sd-ds-p2-d1", "SD"),
                                              ("mamba-conv-ds-sd-p2-d1", "DS")])
def test_rehearsal_catches_one_conv_element_of_prefill_corrupted(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                   layout: str) -> None:
    """One element (row 1 of channel 5) of P rank 0's running conv state flipped after it is
    written: decode rank 0 must differ in exactly those bytes, in either layout pairing."""
    from nixlkv.testing import oracle
    from nixlkv.testing.rehearsal import rehearse
    from nixlkv.testing.scenario import load

    original = oracle.fill_prefill

    def corrupted(rank, blocks, seed):
        original(rank, blocks, seed)
        if rank.tp_rank != 0:
            return
        layer = "model.layers.0.self_attn.attn"
        group = next(g for g in range(rank.num_groups) if layer in rank.group_layers(g))
        block = oracle.running_state(blocks[group].ids, rank.params[layer]["num_spec"] or 0)
        view = rank.kv_caches[layer]
        channels = len(oracle.mamba_state_coordinates(rank.params[layer], rank.side.tp, 0)[0])
        conv = ConvPage(layout, channels, 3, 2)
        at = int(conv.offsets(np.int64(5), np.int64(1)))
        page = view.view(torch.uint8).numpy().reshape(view.shape[0], -1)
        page[block, at : at + 2] ^= 0xFF

    monkeypatch.setattr(oracle, "fill_prefill", corrupted)
    result = rehearse(load(SCENARIOS / f"{name}.yaml"), descriptor_mode="direct")
    assert result.outcome == "mismatch", result.message
    assert result.message.startswith("decode rank 0: 2 wrong bytes"), result.message


def test_a_replicated_state_in_two_layouts_is_refused_naming_the_setting() -> None:
    """A tp_replicated conv state moves as one whole page: in two layouts it would be a transpose."""
    p = params(mamba_type="mamba2", num_heads=8, head_dim=4, d_state=8, n_groups=1, tp_replicated=True)
    sd, ds = regions(p, 1, 0, layout="SD")["state"], regions(p, 1, 0, layout="DS")["state"]
    assert len(MambaStrategy().segments(sd, {0: regions(p, 1, 0, layout="SD")["state"]}, Topology(1, 0), 1)) == 1
    with pytest.raises(IncompatibleGeometry, match=r"replicated conv state laid out SD here and DS remotely.*"
                                                   r"VLLM_SSM_CONV_STATE_LAYOUT to the same value"):
        MambaStrategy().segments(sd, {0: ds}, Topology(1, 0), 1)
