"""PageLayout, box_copy_runs, Region and RankGeometry (de)serialisation."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixlkv.core.errors import HandshakeError, IncompatibleGeometry
from nixlkv.core.byte_runs import box_copy_runs
from nixlkv.core.geometry import PageLayout, PagePart, RankGeometry, Region, Segment

HEAD_OUTER = PageLayout((("head", 4), ("token", 16), ("byte", 64)))
TOKEN_OUTER = PageLayout((("token", 16), ("head", 4), ("byte", 64)))


# ----------------------------------------------------------------------------- PageLayout


def test_page_layout_strides_and_sizes() -> None:
    assert HEAD_OUTER.names == ("head", "token", "byte")
    assert HEAD_OUTER.nbytes == 4 * 16 * 64
    assert HEAD_OUTER.strides() == {"byte": 1, "token": 64, "head": 16 * 64}
    assert TOKEN_OUTER.strides() == {"byte": 1, "head": 64, "token": 4 * 64}
    assert HEAD_OUTER.size("token") == 16
    assert HEAD_OUTER.describe() == "head4xtoken16xbyte64"


@pytest.mark.parametrize(
    "axes",
    [(), (("head", 2), ("head", 2)), (("head", 0), ("byte", 4)), (("byte", -3),)],
)
def test_page_layout_rejects_bad_axes(axes: tuple) -> None:
    with pytest.raises(IncompatibleGeometry):
        PageLayout(axes)


# ----------------------------------------------------------------------------- box_copy_runs


def test_whole_page_is_one_run() -> None:
    for page in (HEAD_OUTER, TOKEN_OUTER):
        assert box_copy_runs(page, {}, page, {}, {}) == [(0, 0, page.nbytes)]


def test_head_slice_on_head_outer_page_is_one_run_at_head_stride() -> None:
    dst = PageLayout((("head", 2), ("token", 16), ("byte", 64)))
    head_bytes = 16 * 64
    runs = box_copy_runs(dst, {"head": 0}, HEAD_OUTER, {"head": 2}, {"head": 2})
    assert runs == [(0, 2 * head_bytes, 2 * head_bytes)]
    # same-size pages, slice in the middle on both sides
    runs = box_copy_runs(HEAD_OUTER, {"head": 1}, HEAD_OUTER, {"head": 3}, {"head": 1})
    assert runs == [(1 * head_bytes, 3 * head_bytes, head_bytes)]


def test_head_slice_on_token_outer_page_is_one_run_per_token() -> None:
    dst = PageLayout((("token", 16), ("head", 2), ("byte", 64)))
    runs = box_copy_runs(dst, {"head": 0}, TOKEN_OUTER, {"head": 2}, {"head": 2})
    expected = [(t * 2 * 64, t * 4 * 64 + 2 * 64, 2 * 64) for t in range(16)]
    assert runs == expected


def test_token_sub_range_on_head_outer_page_is_one_run_per_head() -> None:
    runs = box_copy_runs(HEAD_OUTER, {"token": 0}, HEAD_OUTER, {"token": 8}, {"token": 8})
    expected = [(h * 16 * 64, h * 16 * 64 + 8 * 64, 8 * 64) for h in range(4)]
    assert runs == expected


def test_different_axis_orders_raise() -> None:
    with pytest.raises(IncompatibleGeometry, match="permute"):
        box_copy_runs(HEAD_OUTER, {}, TOKEN_OUTER, {}, {})


@pytest.mark.parametrize(
    "dst_start,src_start,extent",
    [
        ({"head": 3}, {"head": 0}, {"head": 2}),  # past the end of dst
        ({"head": 0}, {"head": 3}, {"head": 2}),  # past the end of src
        ({"head": -1}, {"head": 0}, {"head": 1}),  # negative start
        ({}, {}, {"head": 0}),  # empty box
        ({}, {}, {"token": 17}),  # longer than the axis
    ],
)
def test_out_of_range_boxes_raise(dst_start: dict, src_start: dict, extent: dict) -> None:
    with pytest.raises(IncompatibleGeometry):
        box_copy_runs(HEAD_OUTER, dst_start, HEAD_OUTER, src_start, extent)


def test_unequal_axis_without_extent_raises() -> None:
    dst = PageLayout((("head", 2), ("token", 16), ("byte", 64)))
    with pytest.raises(IncompatibleGeometry):
        box_copy_runs(dst, {}, HEAD_OUTER, {}, {})


@st.composite
def _box_case(draw: st.DrawFn) -> tuple:
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    dst_axes, src_axes, dst_start, src_start, extent = [], [], {}, {}, {}
    for name in names:
        dsize = draw(st.integers(1, 4))
        ssize = draw(st.integers(1, 4))
        if draw(st.booleans()):
            ssize = dsize
        n = draw(st.integers(1, min(dsize, ssize)))
        d0 = draw(st.integers(0, dsize - n))
        s0 = draw(st.integers(0, ssize - n))
        dst_axes.append((name, dsize))
        src_axes.append((name, ssize))
        if n == dsize == ssize and d0 == s0 == 0 and draw(st.booleans()):
            continue  # whole axis, left implicit
        extent[name] = n
        dst_start[name] = d0
        src_start[name] = s0
    return PageLayout(tuple(dst_axes)), dst_start, PageLayout(tuple(src_axes)), src_start, extent


@settings(max_examples=150, deadline=None)
@given(case=_box_case())
def test_box_copy_runs_match_numpy_slice_copy(case: tuple) -> None:
    dst, dst_start, src, src_start, extent = case
    runs = box_copy_runs(dst, dst_start, src, src_start, extent)

    src_buf = np.arange(src.nbytes, dtype=np.int64)
    dst_buf = np.full(dst.nbytes, -1, dtype=np.int64)
    written = np.zeros(dst.nbytes, dtype=np.int64)
    for d, s, n in runs:
        assert n > 0 and 0 <= d and d + n <= dst.nbytes and 0 <= s and s + n <= src.nbytes
        dst_buf[d : d + n] = src_buf[s : s + n]
        written[d : d + n] += 1
    assert written.max() <= 1  # no byte written twice

    expected = np.full(dst.nbytes, -1, dtype=np.int64).reshape([s for _, s in dst.axes])
    src_arr = src_buf.reshape([s for _, s in src.axes])
    dsl, ssl = [], []
    for (name, dsize), (_, ssize) in zip(dst.axes, src.axes):
        n = extent.get(name, dsize)
        dsl.append(slice(dst_start.get(name, 0), dst_start.get(name, 0) + n))
        ssl.append(slice(src_start.get(name, 0), src_start.get(name, 0) + n))
    expected[tuple(dsl)] = src_arr[tuple(ssl)]
    assert np.array_equal(dst_buf, expected.ravel())
    # runs are as long as possible: no two adjacent runs could be merged
    for (d1, s1, n1), (d2, s2, _) in zip(runs, runs[1:]):
        assert not (d1 + n1 == d2 and s1 + n1 == s2)


@st.composite
def _any_box(draw: st.DrawFn) -> tuple:
    """A box over two pages, valid or not: the starts and extents may leave the pages, name no
    axis of them, or cover axes the pages size differently."""
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    dst_axes = [(n, draw(st.integers(1, 4))) for n in names]
    src_axes = [(n, draw(st.sampled_from([size, size, draw(st.integers(1, 4))]))) for n, size in dst_axes]
    if draw(st.booleans()) and len(names) > 1:  # another axis order on one side
        src_axes = src_axes[::-1]
    boxes = []
    for _ in range(3):
        keys = draw(st.lists(st.sampled_from([*names, "z"]), max_size=3, unique=True))
        boxes.append({k: draw(st.integers(-1, 4)) for k in keys})
    return PageLayout(tuple(dst_axes)), boxes[0], PageLayout(tuple(src_axes)), boxes[1], boxes[2]


@settings(max_examples=400, deadline=None)
@given(case=_any_box())
def test_the_one_run_shortcut_answers_only_as_the_general_path_does(case: tuple) -> None:
    """box_copy_runs answers a whole page or a head slice (a range of the outermost axis, every
    other whole) without its general path: where it does, the general path gives that one run;
    where the general path refuses a box, so does box_copy_runs."""
    from nixlkv.core.byte_runs import _box_copy_runs, _slab_run

    dst, dst_start, src, src_start, extent = case
    try:
        general = _box_copy_runs(dst, dst_start, src, src_start, extent)
    except IncompatibleGeometry:
        general = None
    slab = _slab_run(dst, dst_start, src, src_start, extent)
    if slab is not None:
        assert general == [slab]
    if general is None:
        with pytest.raises(IncompatibleGeometry):
            box_copy_runs(dst, dst_start, src, src_start, extent)
    else:
        assert box_copy_runs(dst, dst_start, src, src_start, extent) == general


def test_the_one_run_shortcut_takes_whole_pages_and_head_slices_only() -> None:
    from nixlkv.core.byte_runs import _slab_run

    dst = PageLayout((("head", 2), ("token", 16), ("byte", 64)))
    assert _slab_run(HEAD_OUTER, {}, HEAD_OUTER, {}, {}) == (0, 0, HEAD_OUTER.nbytes)
    assert _slab_run(dst, {"head": 0}, HEAD_OUTER, {"head": 2}, {"head": 2}) == (0, 2 * 16 * 64, 2 * 16 * 64)
    assert _slab_run(HEAD_OUTER, {"token": 0}, HEAD_OUTER, {"token": 8}, {"token": 8}) is None  # runs per head
    assert _slab_run(TOKEN_OUTER, {"head": 0}, TOKEN_OUTER, {"head": 2}, {"head": 2}) is None  # runs per token
    parted = PageLayout(HEAD_OUTER.axes, (PagePart(0, (("head", 4, 1024), ("token", 16, 64), ("byte", 64, 1))),))
    assert _slab_run(parted, {}, parted, {}, {}) is None  # pages with parts: the general path


# ----------------------------------------------------------------------------- Region


def _page(heads: int = 2, tokens: int = 4, nbytes: int = 16) -> PageLayout:
    return PageLayout((("head", heads), ("token", tokens), ("byte", nbytes)))


def test_region_end() -> None:
    r = Region("L0", 0, "s", base=1000, num_blocks=5, block_stride=256, page=_page())
    assert r.page.nbytes == 128
    assert r.end == 1000 + 4 * 256 + 128


def test_region_page_larger_than_stride_raises() -> None:
    with pytest.raises(IncompatibleGeometry, match="stride"):
        Region("L0", 0, "s", base=0, num_blocks=2, block_stride=64, page=_page())
    # a single block has no neighbour to overlap
    single = Region("L0", 0, "s", base=0, num_blocks=1, block_stride=0, page=_page())
    assert single.end == 128


@pytest.mark.parametrize(
    "field,value",
    [("base", -1), ("num_blocks", 0), ("num_blocks", -2), ("block_stride", -128), ("base", True), ("base", 1.5)],
)
def test_region_rejects_bad_ints(field: str, value: Any) -> None:
    kwargs = dict(name="L0", group=0, strategy="s", base=0, num_blocks=2, block_stride=128, page=_page())
    kwargs[field] = value
    with pytest.raises(IncompatibleGeometry):
        Region(**kwargs)


def test_region_fact_missing_names_key() -> None:
    r = Region("L0", 0, "s", 0, 1, 128, _page(), facts={"x": 1})
    assert r.fact("x") == 1
    with pytest.raises(IncompatibleGeometry, match="'y'"):
        r.fact("y")


# ----------------------------------------------------------------------------- RankGeometry


def _geometry() -> RankGeometry:
    regions = (
        Region("L0", 0, "toy", 4096, 8, 256, _page(), facts={"heads": 2, "dtype": "bfloat16"}),
        Region("L1", 0, "toy", 4096 + 128, 8, 256, _page(), facts={"heads": 2}),
        Region("M0", 1, "toy_mla", 1 << 20, 3, 64, PageLayout((("token", 4), ("byte", 16))), facts={}),
    )
    return RankGeometry(
        engine_id="prefill-0",
        tp_size=4,
        tp_rank=2,
        regions=regions,
        memory=((4096, 8 * 256), (1 << 20, 3 * 64)),
        device_id=3,
        mem_type="VRAM",
    )


def test_rank_geometry_round_trip_through_json() -> None:
    g = _geometry()
    d = g.to_dict()
    wire = json.loads(json.dumps(d))
    back = RankGeometry.from_dict(wire)
    assert back == g
    assert back.to_dict() == d
    assert back.region("M0") == g.regions[2]
    assert back.region("nope") is None
    assert [r.name for r in back.iter_regions()] == ["L0", "L1", "M0"]


def test_rank_geometry_defaults_for_optional_keys() -> None:
    d = _geometry().to_dict()
    del d["device_id"], d["mem_type"]
    for r in d["regions"]:
        del r["facts"]
    back = RankGeometry.from_dict(d)
    assert back.device_id == 0 and back.mem_type == "DRAM"
    assert all(dict(r.facts) == {} for r in back.regions)


def test_rank_geometry_duplicate_region_names_raise() -> None:
    r = Region("L0", 0, "s", 0, 1, 128, _page())
    with pytest.raises(IncompatibleGeometry, match="L0"):
        RankGeometry("e", 1, 0, (r, r), ((0, 128),))


def test_segment_to_dict() -> None:
    s = Segment("L0", 16, 1, "L0", 32, 8)
    assert s.to_dict() == {
        "local_region": "L0", "local_offset": 16, "remote_rank": 1,
        "remote_region": "L0", "remote_offset": 32, "nbytes": 8, "phase": 0,
    }
    assert Segment("L0", 0, 0, "L0", 0, 8, phase=3).to_dict()["phase"] == 3


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _delete(path: tuple) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


MALFORMED: dict[str, Callable[[dict], None]] = {
    "missing engine_id": _delete(("engine_id",)),
    "missing tp_size": _delete(("tp_size",)),
    "missing regions": _delete(("regions",)),
    "missing memory": _delete(("memory",)),
    "missing region name": _delete(("regions", 0, "name")),
    "missing region page": _delete(("regions", 1, "page")),
    "missing region block_stride": _delete(("regions", 0, "block_stride")),
    "negative tp_rank": _set(("tp_rank",), -1),
    "negative region base": _set(("regions", 0, "base"), -4096),
    "negative memory size": _set(("memory", 0, 1), -1),
    "negative page axis": _set(("regions", 0, "page", 0, 1), -2),
    "negative device_id": _set(("device_id",), -1),
    "bool tp_size": _set(("tp_size",), True),
    "bool num_blocks": _set(("regions", 2, "num_blocks"), True),
    "bool memory address": _set(("memory", 1, 0), False),
    "str tp_size": _set(("tp_size",), "4"),
    "float block_stride": _set(("regions", 0, "block_stride"), 256.0),
    "int engine_id": _set(("engine_id",), 7),
    "empty engine_id": _set(("engine_id",), ""),
    "None strategy": _set(("regions", 0, "strategy"), None),
    "int mem_type": _set(("mem_type",), 1),
    "regions is None": _set(("regions",), None),
    "region is a string": _set(("regions", 0), "L0"),
    "memory is an int": _set(("memory",), 5),
    "memory entry too short": _set(("memory", 0), [4096]),
    "memory entry too long": _set(("memory", 0), [4096, 1, 2]),
    "page axis not a pair": _set(("regions", 0, "page", 0), ["head"]),
    "page is an int": _set(("regions", 0, "page"), 3),
    "facts is an int": _set(("regions", 0, "facts"), 3),
    "str group": _set(("regions", 0, "group"), "0"),
}


@pytest.mark.parametrize("mutation", sorted(MALFORMED))
def test_malformed_rank_geometry_raises_handshake_error(mutation: str) -> None:
    d = copy.deepcopy(_geometry().to_dict())
    MALFORMED[mutation](d)
    with pytest.raises(HandshakeError):
        RankGeometry.from_dict(d)


@pytest.mark.parametrize("payload", [None, [], "geometry", 42, {}])
def test_non_mapping_or_empty_payload_raises_handshake_error(payload: Any) -> None:
    with pytest.raises(HandshakeError):
        RankGeometry.from_dict(payload)


@pytest.mark.parametrize("mutation", ["missing page", "negative base", "bool group", "str num_blocks"])
def test_malformed_region_dict_raises_handshake_error(mutation: str) -> None:
    d = _geometry().regions[0].to_dict()
    if mutation == "missing page":
        del d["page"]
    elif mutation == "negative base":
        d["base"] = -1
    elif mutation == "bool group":
        d["group"] = False
    else:
        d["num_blocks"] = "8"
    with pytest.raises(HandshakeError):
        Region.from_dict(d)


# Well-typed but impossible values in a peer's handshake must also be HandshakeErrors (they used to
# escape as IncompatibleGeometry from the dataclass checks).
SEMANTICALLY_INVALID: dict[str, Callable[[dict], None]] = {
    "zero page axis": _set(("regions", 0, "page", 0, 1), 0),
    "empty page": _set(("regions", 0, "page"), []),
    "zero num_blocks": _set(("regions", 0, "num_blocks"), 0),
    "page larger than stride": _set(("regions", 0, "block_stride"), 8),
    "duplicate region names": _set(("regions", 1, "name"), "L0"),
    "zero tp_size": _set(("tp_size",), 0),
    # found by fuzzing the wire: a TP size sizes what planning allocates (the covered ranks), so
    # 2**40 ranks ran the dispatcher out of memory instead of being refused here
    "tp_size beyond any engine": _set(("tp_size",), 2**40),
    "tp_rank beyond tp_size": _set(("tp_rank",), 7),
    # found by the handshake campaign: a region reaching past any address (2**63 - 1 blocks) was
    # refused only when the columns were first read, after parsing, as an IncompatibleGeometry
    "region spanning past any address": _set(("regions", 0, "num_blocks"), 2**63 - 1),
    "region based past any address": _set(("regions", 0, "base"), 2**62),
}


@pytest.mark.parametrize("mutation", sorted(SEMANTICALLY_INVALID))
def test_invalid_values_in_handshake_raise_handshake_error(mutation: str) -> None:
    d = copy.deepcopy(_geometry().to_dict())
    SEMANTICALLY_INVALID[mutation](d)
    with pytest.raises(HandshakeError):
        RankGeometry.from_dict(d)
    RankGeometry.from_dict(_geometry().to_dict())  # control: the geometry unchanged parses


# ----------------------------------------------------------------------------- the columnar wire


def _layers(n: int = 6) -> RankGeometry:
    """``n`` layers of one geometry (different names, bases, groups), one MLA-like layer, and a
    layer with page parts: three geometry classes."""
    page = PageLayout((("head", 2), ("token", 16), ("byte", 64)))
    parted = PageLayout((("token", 4), ("byte", 16)), parts=(PagePart(0, (("token", 4, 8), ("byte", 8, 1))),
                                                            PagePart(32, (("token", 4, 8), ("byte", 8, 1)))))
    regions = [Region(f"L{i}", i % 2, "toy", 4096 + i * 0x10000, 8, 2048, page, facts={"heads": [0, 1], "dtype": "bf16"})
               for i in range(n)]
    regions.append(Region("M0", 2, "toy_mla", 1 << 20, 3, 64, PageLayout((("token", 4), ("byte", 16))), facts={}))
    regions.append(Region("P0", 3, "toy", 1 << 21, 2, 64, parted, facts={"heads": [0]}))
    return RankGeometry("prefill-0", 4, 2, tuple(regions), ((4096, 1 << 22),), device_id=1, mem_type="VRAM")


@pytest.mark.parametrize("make", [_geometry, _layers])
def test_columnar_wire_round_trips_to_the_geometry_the_per_region_form_gives(make: Callable[[], RankGeometry]) -> None:
    g = make()
    wire = json.loads(json.dumps(g.to_wire()))
    assert "regions" not in wire
    back = RankGeometry.from_dict(wire)
    old = RankGeometry.from_dict(json.loads(json.dumps(g.to_dict())))
    assert back == g == old
    assert [r.__dict__ for r in back.regions] == [r.__dict__ for r in g.regions]  # facts, pages, types and all
    assert np.array_equal(back.columns, g.columns) and np.array_equal(back.columns, old.columns)
    assert back.to_wire() == wire and back.to_dict() == g.to_dict()
    # one description per distinct geometry: the classes the geometry itself finds
    assert len(wire["region_classes"]) == len(set(g.geometry_classes))
    assert back.geometry_classes == tuple(wire["region_columns"]["class"])


def test_columnar_wire_of_identical_layers_holds_one_description() -> None:
    wire = _layers(40).to_wire()
    assert len(wire["region_classes"]) == 3
    assert wire["region_columns"]["class"] == [0] * 40 + [1, 2]
    assert wire["region_columns"]["group"][:4] == [0, 1, 0, 1]
    assert RankGeometry.from_dict(wire).regions[39].base == 4096 + 39 * 0x10000


def test_columnar_wire_with_no_regions() -> None:
    g = RankGeometry("e", 1, 0, (), ((0, 64),))
    assert RankGeometry.from_dict(g.to_wire()) == g


def _cols(key: str, fn: Callable[[list], None]) -> Callable[[dict], None]:
    return lambda d: fn(d["region_columns"][key])


# mutation of the columnar wire of _layers() -> what the refusal must say (the field it names)
COLUMNAR_MALFORMED: dict[str, tuple[Callable[[dict], None], str]] = {
    "length mismatch": (_cols("base", list.pop), r"region_columns must be lists of one length, got name 8, base 7, group 8, class 8"),
    "class index out of range": (_cols("class", lambda c: c.__setitem__(7, 3)), r"region_columns\['class'\]\[7\] = 3 is out of range: .* 3 region_classes"),
    "negative class index": (_cols("class", lambda c: c.__setitem__(2, -1)), r"region_columns\['class'\]\[2\] must be a non-negative integer, got -1"),
    "bool class index": (_cols("class", lambda c: c.__setitem__(1, True)), r"region_columns\['class'\]\[1\] must be a non-negative integer, got True"),
    "bool base": (_cols("base", lambda c: c.__setitem__(3, True)), r"region_columns\['base'\]\[3\] must be a non-negative integer, got True"),
    "bool group": (_cols("group", lambda c: c.__setitem__(0, False)), r"region_columns\['group'\]\[0\] must be a non-negative integer, got False"),
    "float base": (_cols("base", lambda c: c.__setitem__(0, 4096.0)), r"region_columns\['base'\]\[0\] must be a non-negative integer, got 4096.0"),
    "str group": (_cols("group", lambda c: c.__setitem__(5, "1")), r"region_columns\['group'\]\[5\] must be a non-negative integer, got '1'"),
    "negative base": (_cols("base", lambda c: c.__setitem__(4, -4096)), r"region_columns\['base'\]\[4\] must be a non-negative integer, got -4096"),
    "negative group": (_cols("group", lambda c: c.__setitem__(4, -1)), r"region_columns\['group'\]\[4\] must be a non-negative integer, got -1"),
    "base beyond 2**62": (_cols("base", lambda c: c.__setitem__(6, 1 << 62)), r"region_columns\['base'\]\[6\] = \d+ lies beyond 2\*\*62"),
    "duplicate names": (_cols("name", lambda c: c.__setitem__(5, "L1")), r"region_columns\['name'\] repeats region names \['L1'\]"),
    "empty name": (_cols("name", lambda c: c.__setitem__(0, "")), r"region_columns\['name'\]\[0\] must be a non-empty string, got ''"),
    "int name": (_cols("name", lambda c: c.__setitem__(2, 7)), r"region_columns\['name'\]\[2\] must be a non-empty string, got 7"),
    "missing base column": (lambda d: d["region_columns"].pop("base"), r"region_columns lacks the columns \['base'\]"),
    "missing class column": (lambda d: d["region_columns"].pop("class"), r"region_columns lacks the columns \['class'\]"),
    "missing region_columns": (lambda d: d.pop("region_columns"), r"malformed rank geometry: 'region_columns'"),
    "missing region_classes": (lambda d: d.pop("region_classes"), r"malformed rank geometry: 'region_classes'"),
    "column not a list": (lambda d: d["region_columns"].__setitem__("group", 3), r"region_columns\['group'\] must be a list, got int"),
    "columns not a map": (lambda d: d.__setitem__("region_columns", [[], [], [], []]), r"region_columns must be a map"),
    "classes not a list": (lambda d: d.__setitem__("region_classes", {}), r"region_classes must be a list"),
    "class not a map": (lambda d: d["region_classes"].__setitem__(1, "M0"), r"region_classes\[1\] must be a map, got str"),
    "class missing page": (lambda d: d["region_classes"][1].pop("page"), r"region_classes\[1\]: malformed region description: 'page'"),
    "class bool num_blocks": (lambda d: d["region_classes"][0].__setitem__("num_blocks", True), r"region_classes\[0\]: .*num_blocks must be a non-negative integer, got True"),
    "class page over stride": (lambda d: d["region_classes"][0].__setitem__("block_stride", 8), r"region_classes\[0\]: .*exceeds the block stride"),
    "class parts not covering": (lambda d: d["region_classes"][2]["page_parts"].pop(), r"region_classes\[2\]: .*do not cover the page"),
    "class holds a name": (lambda d: d["region_classes"][0].__setitem__("name", "L0"), r"region_classes\[0\] holds \['name'\]: a region's own fields belong in region_columns"),
    "both forms": (lambda d: d.__setitem__("regions", []), r"both 'regions' and 'region_classes'"),
}


@pytest.mark.parametrize("mutation", sorted(COLUMNAR_MALFORMED))
def test_malformed_columnar_wire_is_refused_naming_the_field(mutation: str) -> None:
    wire = json.loads(json.dumps(_layers().to_wire()))
    assert RankGeometry.from_dict(copy.deepcopy(wire)) == _layers()  # control: the message as sent is accepted
    mutate, message = COLUMNAR_MALFORMED[mutation]
    mutate(wire)
    with pytest.raises(HandshakeError, match=message):
        RankGeometry.from_dict(wire)
