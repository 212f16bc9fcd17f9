"""The columnar wire form of a rank's geometry, parsed: one description per distinct region
geometry and the regions as columns (:meth:`RankGeometry.to_wire
<nixlkv.core.geometry.RankGeometry.to_wire>`), and the per-region form earlier peers send.

A model's layers are a handful of distinct geometries, and every engine of one model sends the
same ones: a class description is parsed and checked once (remembered by its exact bytes), a
column layout (everything but the bases) likewise, and an engine whose memory holds other block
counts has its layout recounted from one parsed before. The memos are bounded
(:func:`~nixlkv.core.memo.remember`) and emptied by :func:`forget_parsed`.
"""

from __future__ import annotations

import copy
import marshal
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

import numpy as np

from .errors import HandshakeError
from .memo import remember
from .regions import ADDRESS_LIMIT, COL_BLOCKS, COL_END, SCALAR_TYPES, Region, counted_in, counted_out, geometry_key


class ColumnRegions(Sequence[Region]):
    """The regions of a geometry parsed from the columnar wire: one validated description per
    class plus each region's name, base and group, each :class:`Region` made on first access.

    Planning reads the columns (:attr:`RankGeometry.columns`) and one region per class, so a
    handshake does not build an object per layer it never looks at.
    """

    __slots__ = ("layout", "_protos", "_names", "_bases", "_groups", "_classes", "_made")

    def __init__(self, layout: ColumnLayout, bases: list[int]) -> None:
        self.layout = layout  # all but the bases, checked: what the regions' classes and columns derive from
        self._protos, self._names, self._groups, self._classes = layout.protos, layout.names, layout.groups, layout.classes
        self._bases = bases
        self._made: list[Region | None] | None = None

    def class_key(self, c: int) -> tuple[Any, ...]:
        """:func:`geometry_key` of class ``c``'s regions, known from parsing."""
        return self.layout.keys[c]

    @property
    def class_ids(self) -> tuple[int, ...]:
        """Per region, its geometry class (:attr:`RankGeometry.geometry_classes`), as the columns carried it."""
        return self.layout.class_ids

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> list[str]:
        """The regions' names in order, as the columns carried them (checked: unique, non-empty)."""
        return self._names

    @property
    def bases(self) -> list[int]:
        """The regions' bases in order, as the columns carried them (checked). Read-only."""
        return self._bases

    def _make(self, i: int) -> Region:
        """Region ``i``: its class's validated region with its own name, base and group."""
        return replace(self._protos[self._classes[i]], name=self._names[i], base=self._bases[i], group=self._groups[i])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        made = self._made
        if made is None:
            made = self._made = [None] * len(self._names)
        region = made[i]
        if region is None:
            region = made[i] = self._make(range(len(made))[i])
        return region

    def __iter__(self) -> Iterator[Region]:
        made = self._made
        if made is None or None in made:
            made = self._made = [r if r is not None else self._make(i) for i, r in enumerate(made or [None] * len(self))]
        return iter(made)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (tuple, ColumnRegions)) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # like the regions' facts: not hashable

    def __repr__(self) -> str:
        return repr(tuple(self))


class ParsedRegions(tuple):  # type: ignore[type-arg]
    """The regions of a per-region handshake (a tuple of :class:`Region`), with the geometry class
    of each that parsing found (:attr:`RankGeometry.geometry_classes`)."""

    def __new__(cls, regions: Sequence[Region] = (), class_ids: tuple[int, ...] = ()) -> ParsedRegions:
        out = super().__new__(cls, regions)
        out.class_ids = class_ids
        return out

    def __getnewargs__(self) -> tuple[Any, ...]:  # copies and pickles keep the classes
        return tuple(self), self.class_ids


def parse_regions(items: Any, share: bool = True) -> tuple[Region, ...]:
    """Regions of a handshake, each region that repeats an earlier one's description (all but its
    name, base and KV group, values and their types alike) made as a copy of it: a model's
    layers are a handful of distinct geometries, so the wire is parsed (and later planned) once
    per distinct one.

    Equality is found with C-level passes over all descriptions per distinct geometry; that
    equal values also have equal types (``True == 1`` and ``16.0 == 16`` in Python, not on the
    wire) is checked for all copies at once; where anything is not plain, every region is parsed
    on its own, with every check and its own message.
    """
    if share:
        try:
            return _parse_shared(list(items))
        except _NotPlain:
            pass
    # classes left to RankGeometry.geometry_classes (by value and type), so that such a peer is
    # planned per geometry class like any other (and aliasing groups share registered rows)
    return tuple(Region.from_dict(rd) for rd in items)


REGION_COLUMNS = ("name", "base", "group", "class")  # the columnar wire's per-region fields
_REGION_OWN = frozenset(("name", "base", "group"))


def parse_columnar(d: Mapping[str, Any]) -> ColumnRegions | tuple[Region, ...]:
    """Regions of a columnar handshake (:meth:`RankGeometry.to_wire`): each class description
    parsed and checked once as a region, the columns checked in bulk (lengths, exact types, ranges,
    unique names); a region is a copy of its class with its own name, base and group, made when
    first read (:class:`ColumnRegions`). A layout parsed before (everything but the bases, the
    same bytes) is taken as it was: only the bases are checked."""
    described, columns = d["region_classes"], d["region_columns"]
    key = _layout_key(described, columns)
    layout = _LAYOUTS.get(key) if key is not None else None
    if layout is None and key is not None:  # an engine of a layout met before, with other block counts?
        shaped = _SHAPED.get(key[0])
        layout = shaped.recounted(key[1]) if shaped is not None else None
        if layout is not None:
            remember(_LAYOUTS, key, layout, MEMO_LAYOUTS)
    bases = columns.get("base") if layout is not None else None
    if isinstance(bases, (list, tuple)) and len(bases) == len(layout.names):
        _check_int_column("base", bases, ADDRESS_LIMIT)
        return ColumnRegions(layout, list(bases))
    if not isinstance(described, list):
        raise HandshakeError(f"region_classes must be a list of region descriptions, got {type(described).__name__}")
    if not isinstance(columns, Mapping):
        raise HandshakeError(f"region_columns must be a map of the columns {list(REGION_COLUMNS)}, got {type(columns).__name__}")
    described_bytes = [_description_bytes(cd) for cd in described]
    known = [_described_class(k, cd, b) for k, (cd, b) in enumerate(zip(described, described_bytes))]
    # every description remembered (marshal wrote it): then so may the layout be
    plain = key is not None and all(b is not None and _DESCRIBED.get(b) is entry for b, entry in zip(described_bytes, known))
    missing = [c for c in REGION_COLUMNS if c not in columns]
    if missing:
        raise HandshakeError(f"region_columns lacks the columns {missing}")
    cols = [columns[c] for c in REGION_COLUMNS]
    for name, col in zip(REGION_COLUMNS, cols):
        if not isinstance(col, (list, tuple)):
            raise HandshakeError(f"region_columns[{name!r}] must be a list, got {type(col).__name__}")
    names, bases, groups, classes = cols
    n = len(names)
    if any(len(col) != n for col in cols):
        sizes = ", ".join(f"{name} {len(col)}" for name, col in zip(REGION_COLUMNS, cols))
        raise HandshakeError(f"region_columns must be lists of one length, got {sizes}")
    if not n:
        return ()
    names_str = set(map(type, names)) == {str}
    every_int = set(map(type, chain(bases, groups, classes))) == {int}  # one pass over the types of all three
    if not names_str or "" in names:
        i = next(i for i, v in enumerate(names) if type(v) is not str or not v)
        raise HandshakeError(f"region_columns['name'][{i}] must be a non-empty string, got {names[i]!r}")
    if len(set(names)) != n:
        seen: set[str] = set()
        dup = sorted({v for v in names if v in seen or seen.add(v)})
        raise HandshakeError(f"region_columns['name'] repeats region names {dup[:8]}")
    for name, col, limit in (("base", bases, ADDRESS_LIMIT), ("group", groups, ADDRESS_LIMIT), ("class", classes, len(known))):
        _check_int_column(name, col, limit, every_int)
    layout = ColumnLayout(known, list(names), list(groups), list(classes))
    if plain:  # every description remembered, every column exact str / int: the bytes say it all
        remember(_LAYOUTS, key, layout, MEMO_LAYOUTS)
        remember(_SHAPED, key[0], layout, MEMO_LAYOUTS)
    return ColumnRegions(layout, list(bases))


def _layout_key(described: Any, columns: Any) -> tuple[bytes, tuple[int, ...]] | None:
    """A columnar geometry's layout, exactly: the ``marshal`` bytes (version 2) of its class
    descriptions with their block counts zeroed and of every column but the bases, and the block
    counts apart. Exact, as for one description (:func:`_described_class`): the bytes name every
    value's type, marshal refuses subclasses, and the counts are exact ints. The bytes alone are
    the layout's shape: every engine of one model and configuration sends the same, whatever its
    memory holds. None where a description is no plain map with an int count, or marshal cannot
    write it (then the layout is never remembered)."""
    if type(columns) is not dict or type(described) is not list:
        return None
    counts, shapes = [], []
    for cd in described:
        count = cd.get("num_blocks") if type(cd) is dict else None
        if type(count) is not int:
            return None
        counts.append(count)
        shapes.append({**cd, "num_blocks": 0})
    try:
        shape = marshal.dumps((shapes, columns.get("name"), columns.get("group"), columns.get("class")), 2)
    except (ValueError, TypeError):
        return None
    return shape, tuple(counts)


class ColumnLayout:
    """A columnar geometry's per-region columns but its bases, checked (names unique and
    non-empty, groups and class ids in range), with what the geometry derives from them alone:
    every engine of one model sends the same, so a later rank of it skips those checks."""

    __slots__ = ("protos", "keys", "names", "groups", "classes", "class_ids", "firsts", "template", "tail", "shape")

    def __init__(self, known: list[Any], names: list[str], groups: list[int], classes: list[int]) -> None:
        """``known``: per class description, (its validated region, its geometry_key)."""
        self.names, self.groups, self.classes = names, groups, classes
        self.protos = [region for region, _ in known]  # per class: its validated region (name, base, group placeholders)
        self.keys = [key for _, key in known]  # per class: its geometry_key
        self.class_ids = tuple(classes)
        self.firsts: dict[int, int] | None = None  # RankGeometry.class_firsts, once made
        self.template: np.ndarray | None = None  # columns with bases 0 (ends are spans), once made
        self.tail: tuple[Any, ...] | None = None  # RankGeometry._layout_tail, once made
        self.shape: tuple[Any, ...] | None = None  # RankGeometry._shape_tail, once a recount made it

    def recounted(self, counts: tuple[int, ...]) -> ColumnLayout | None:
        """This layout with ``counts`` blocks per class (exact ints): what parsing the same shape
        with those counts makes, its per-region columns checked already. None where a count is
        one a region refuses (parsed then, for the error naming it)."""
        protos, keys, spans = [], [], []
        for proto, key, count in zip(self.protos, self.keys, counts):
            page, stride = proto.page.nbytes, proto.block_stride
            span = (count - 1) * stride + page
            if count < 1 or (count > 1 and page > stride) or span >= ADDRESS_LIMIT:
                return None
            protos.append(replace(proto, num_blocks=count))
            keys.append(counted_in(key, count))
            spans.append(span)
        layout = copy.copy(self)  # the same names, groups, classes and first regions per class
        layout.protos, layout.keys, layout.tail, layout.shape, layout.template = protos, keys, None, None, None
        if self.tail is not None:  # the tail with the new counts in its class keys; the shape is the same
            names, groups, class_ids, old = self.tail
            if self.shape is None:
                self.shape = shape_of_tail(self.tail)
            layout.tail, layout.shape = (names, groups, class_ids, tuple((c, keys[c]) for c, _ in old)), self.shape
        if self.template is not None:
            template = self.template.copy()
            if len(counts) == 1:  # one class (a dense model): every region's count and span
                template[:, COL_BLOCKS], template[:, COL_END] = counts[0], spans[0]
            else:
                of = np.array(self.class_ids, dtype=np.int64)
                template[:, COL_BLOCKS] = np.array(counts, dtype=np.int64)[of]
                template[:, COL_END] = np.array(spans, dtype=np.int64)[of]
            layout.template = template
        return layout


MEMO_LAYOUTS = 16  # column layouts remembered: a decode rank meets a handful
# a layout (_layout_key: its shape's bytes and its block counts) -> the layout, parsed and
# checked: the ranks of every engine of a model send the same, but for their bases.
_LAYOUTS: dict[tuple[bytes, tuple[int, ...]], ColumnLayout] = {}
# a layout's shape bytes -> the first layout parsed with them: an engine of the model whose
# memory holds other block counts sends the same shape (its layout is recounted from this one).
_SHAPED: dict[bytes, ColumnLayout] = {}


MEMO_DESCRIPTIONS = 1024  # class descriptions remembered (a deployment's models have a handful each)
# marshal bytes of a class description -> (its validated region, its geometry_key):
# the ranks of every engine of a model send the same few descriptions.
_DESCRIBED: dict[bytes, tuple[Region, tuple[Any, ...]]] = {}


def forget_parsed() -> None:
    """Empty the memos of class descriptions and column layouts (a process that never parsed a
    handshake: benches)."""
    _DESCRIBED.clear()
    _LAYOUTS.clear()
    _SHAPED.clear()


def _description_bytes(cd: Any) -> bytes | None:
    """A class description's ``marshal`` bytes (version 2: no references), or None where marshal
    cannot write it (never a remembered description)."""
    try:
        return marshal.dumps(cd, 2)
    except (ValueError, TypeError):
        return None


def _described_class(k: int, cd: Any, key: bytes | None) -> tuple[Region, tuple[Any, ...]]:
    """``region_classes[k]`` parsed and checked as a region (its name, base and group left to the
    columns): the region's fields and its :func:`geometry_key`. A description is remembered by its
    ``marshal`` bytes ``key`` (:func:`_description_bytes`), which are exact: they name every
    value's type (``True``, ``1`` and ``1.0`` differ), and marshal writes only the built-in types
    themselves (it refuses subclasses and every other object). Equal bytes are an equal
    description, which parses alike, so one seen before is not parsed again."""
    known = _DESCRIBED.get(key) if key is not None else None
    if known is not None:
        return known
    if not isinstance(cd, Mapping):
        raise HandshakeError(f"region_classes[{k}] must be a map, got {type(cd).__name__}")
    own = sorted(_REGION_OWN & cd.keys())
    if own:
        raise HandshakeError(f"region_classes[{k}] holds {own}: a region's own fields belong in region_columns")
    try:
        region = Region.from_dict({**cd, "name": f"region_classes[{k}]", "base": 0, "group": 0})
    except HandshakeError as exc:
        raise HandshakeError(f"region_classes[{k}]: {exc}") from None
    known = (region, geometry_key(region))
    if key is not None:
        remember(_DESCRIBED, key, known, MEMO_DESCRIPTIONS)
    return known


def _check_int_column(key: str, col: list[Any] | tuple[Any, ...], limit: int, every_int: bool = False) -> None:
    """Every entry an int (not a bool, not a float) in ``[0, limit)``: one pass over the types
    (skipped where the caller saw ``every_int``) and one min and max, all in C (cheaper than
    numpy's per-call cost for a model's layers, as fast beyond), the first bad entry named."""
    if not every_int and set(map(type, col)) != {int}:
        i = next(i for i, v in enumerate(col) if type(v) is not int)
        raise HandshakeError(f"region_columns[{key!r}][{i}] must be a non-negative integer, got {col[i]!r}")
    low, high = min(col), max(col)
    if low < 0:
        i = col.index(low)
        raise HandshakeError(f"region_columns[{key!r}][{i}] must be a non-negative integer, got {low!r}")
    if high >= limit:
        i = col.index(high)
        if key == "class":
            raise HandshakeError(f"region_columns['class'][{i}] = {high} is out of range: the geometry lists {limit} region_classes")
        raise HandshakeError(f"region_columns[{key!r}][{i}] = {high} lies beyond 2**62: no engine has one")


class _NotPlain(Exception):
    """A handshake's regions are not all plain descriptions: parse them one by one."""


_TEMPLATE = itemgetter("strategy", "num_blocks", "block_stride", "page", "facts")
_HEAD = itemgetter("group", "num_blocks", "block_stride", "base")
_SIGNED = itemgetter("group", "base")  # the fields a copy does not share with its template
_OWN = itemgetter("name", "base", "group")


def _parse_shared(items: list[Any]) -> ParsedRegions:
    """:func:`parse_regions` with copies; raises :class:`_NotPlain` where that cannot be exact."""
    if not items:
        return ParsedRegions()
    if set(map(type, items)) != {dict} or any(map(operator.contains, items, repeat("page_parts"))):
        raise _NotPlain
    try:
        described = list(map(_TEMPLATE, items))
        own = list(map(_OWN, items))
    except KeyError:
        raise _NotPlain from None
    if set(map(type, map(itemgetter(3), described))) != {list} or set(map(type, map(itemgetter(4), described))) != {dict}:
        raise _NotPlain
    classes = [-1] * len(items)
    protos: list[Region] = []
    todo = list(range(len(items)))
    while todo:  # one C-level pass per distinct geometry over the descriptions not yet placed
        first = todo[0]
        proto = Region.from_dict(items[first])
        cid = len(protos)
        protos.append(proto)
        same = list(map(operator.eq, [described[i] for i in todo], repeat(described[first])))
        for i, hit in zip(todo, same):
            if hit:
                classes[i] = cid
        todo = [i for i, hit in zip(todo, same) if not hit]
    if not _copies_exact(items, classes):
        raise _NotPlain
    # each region a copy of its class's validated region: name, base and group its own
    regions = [replace(protos[cid], name=name, base=base, group=group) for (name, base, group), cid in zip(own, classes)]
    return ParsedRegions(regions, tuple(classes))


def _copies_exact(items: list[Mapping[str, Any]], classes: list[int]) -> bool:
    """Every description has a valid name, base and group, and values of the same types as its
    class's first (one pass in C over all of them, not a check per field per layer)."""
    names = list(map(itemgetter("name"), items))
    if set(map(type, names)) != {str} or "" in names:
        return False
    if set(map(type, chain.from_iterable(map(_HEAD, items)))) != {int} or min(chain.from_iterable(map(_SIGNED, items))) < 0:
        return False
    firsts: dict[int, Mapping[str, Any]] = {}
    members: dict[int, list[Mapping[str, Any]]] = {}
    for rd, cid in zip(items, classes):
        if cid in firsts:
            members[cid].append(rd)
        else:
            firsts[cid], members[cid] = rd, []
    for cid, copies in members.items():
        if not copies:
            continue
        t = firsts[cid]
        fact_types = list(map(type, t["facts"].values()))
        page_types = list(map(type, chain.from_iterable(t["page"])))
        k = len(copies)
        if list(map(type, chain.from_iterable(rd["facts"].values() for rd in copies))) != fact_types * k:
            return False
        if list(map(type, chain.from_iterable(chain.from_iterable(rd["page"] for rd in copies)))) != page_types * k:
            return False
        if set(map(type, map(itemgetter("strategy"), copies))) != {str}:
            return False
        if any(not isinstance(v, SCALAR_TYPES) for v in t["facts"].values()) and not all(_same_types(rd["facts"], t["facts"]) for rd in copies):
            return False
    return True


def _same_types(a: Any, b: Any) -> bool:
    """Equal values (already compared) hold values of the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return all(_same_types(v, b[k]) for k, v in a.items())
    return True


def shape_of_tail(layout_tail: tuple[Any, ...]) -> tuple[Any, ...]:
    """A rank geometry's layout tail (its :attr:`~RankGeometry.layout_key` but TP size and rank)
    less its block counts: the tail of its :attr:`~RankGeometry.shape_key`."""
    names, groups, classes, keys = layout_tail
    return (names, groups, classes, tuple((c, counted_out(k)) for c, k in keys))

