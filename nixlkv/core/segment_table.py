"""Every layer's segments as int64 columns: what the dispatcher hands a plan.

The dispatcher asks a strategy for one template of segments per distinct layer geometry and
assembles the table from them (:meth:`SegmentTable.assemble`), so that a plan never loops over
layers in Python to check its segments or lay out its descriptor rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SegmentTable:
    """Every layer's segments as int64 columns (one entry per segment, in layer order): built by
    the dispatcher from one template per distinct layer geometry, so a plan never loops over
    layers in Python to check or lay out its descriptors."""

    local_idx: np.ndarray  # index into the local geometry's regions
    rank_pos: np.ndarray  # index into the plan's source ranks (TransferPlan.sources)
    remote_idx: np.ndarray  # index into that remote rank's regions
    local_offset: np.ndarray
    remote_offset: np.ndarray
    nbytes: np.ndarray
    phase: np.ndarray
    key: np.ndarray  # the pairing (local group, remote group, strategy) the segment belongs to
    # Segments whose checks stand for all: each class's first layer where a class's segments name
    # only its own layer's regions (every layer of it then has the same offsets and sizes over
    # pages of the same sizes), every segment of any other class.
    check_idx: np.ndarray
    # Where every class's segments name only its own layer's regions: per layer, its class and
    # first segment, and per remote rank each layer's peer index (None: the layer's own index).
    layer_class: np.ndarray | None = None
    layer_start: np.ndarray | None = None
    peer_idx: tuple[np.ndarray, ...] | None = None
    every_layer: bool = False  # every layer has segments, naming its own region: all local regions are written

    @classmethod
    def assemble(
        cls, layer_class: Sequence[int], templates: Sequence[np.ndarray], layer_key: Sequence[int],
        peer_idx: Sequence[Sequence[int]] | None, covered: Sequence[int], own: Sequence[bool] | None = None,
    ) -> SegmentTable:
        """Layer ``i`` gets template ``layer_class[i]``, its own region where the template says -1
        (local) and its peer on each rank (``peer_idx[rank position][i]``, or ``i`` itself where
        ``peer_idx`` is None) likewise; its segments belong to pairing ``layer_key[i]``. ``own``
        (per template: every row names only its layer's regions) is derived where not given."""
        if own is None:
            own = [bool(t.size == 0 or ((t[:, 0] < 0) & (t[:, 2] < 0)).all()) for t in templates]
        tlens = [len(t) for t in templates]
        n = len(layer_class)
        if n and all(own) and min(tlens) == max(tlens) > 0:
            return cls._assemble_own(layer_class, templates, layer_key, peer_idx, covered, tlens[0])
        tlen = np.array(tlens, dtype=np.int64)
        tstart = np.cumsum(tlen) - tlen
        table = np.concatenate(templates) if templates else np.zeros((0, 7), dtype=np.int64)
        lc = np.asarray(layer_class, dtype=np.int64)
        if n and (tlen == tlen[0]).all():  # every class has k segments (one geometry, or alike)
            k = int(tlen[0])
            layer = np.repeat(np.arange(n, dtype=np.int64), k)
            row = (tstart[lc][:, None] + np.arange(k, dtype=np.int64)).ravel()
            key = np.repeat(np.asarray(layer_key, dtype=np.int64), k)
        else:
            counts = tlen[lc] if n else np.zeros(0, dtype=np.int64)
            layer = np.repeat(np.arange(n, dtype=np.int64), counts)
            row = np.repeat(tstart[lc] - (np.cumsum(counts) - counts), counts) + np.arange(layer.size, dtype=np.int64)
            key = np.repeat(np.asarray(layer_key, dtype=np.int64), counts) if n else layer
        rows = table[row]
        rank_pos = rows[:, 1]
        extra: dict[str, Any] = {}
        if n and all(own):
            first = {c: i for i, c in reversed(list(enumerate(layer_class)))}  # class -> first layer
            seg_start = np.cumsum(tlen[lc]) - tlen[lc]
            check_idx = np.concatenate([np.arange(k, dtype=np.int64) + seg_start[i]
                                        for c, i in first.items() for k in [int(tlen[c])]])
            pidx = None if peer_idx is None else tuple(np.asarray(x, dtype=np.int64) for x in peer_idx)
            extra = dict(layer_class=lc, layer_start=seg_start, peer_idx=pidx)
        else:
            check_idx = np.arange(layer.size, dtype=np.int64)
        local_idx = np.where(rows[:, 0] < 0, layer, rows[:, 0]) if (table[:, 0] >= 0).any() else layer
        if peer_idx is None:
            peers = layer
        else:
            peers = np.asarray(peer_idx, dtype=np.int64).reshape(len(covered), -1)[rank_pos, layer]
        remote_idx = np.where(rows[:, 2] < 0, peers, rows[:, 2]) if (table[:, 2] >= 0).any() else peers
        return cls(local_idx, rank_pos, remote_idx, rows[:, 3], rows[:, 4], rows[:, 5], rows[:, 6], key, check_idx, **extra)

    @classmethod
    def _assemble_own(
        cls, layer_class: Sequence[int], templates: Sequence[np.ndarray], layer_key: Sequence[int],
        peer_idx: Sequence[Sequence[int]] | None, covered: Sequence[int], k: int,
    ) -> SegmentTable:
        """:meth:`assemble` where every template has ``k`` rows naming only its layer's regions
        (every built-in strategy): the same table with a few whole-array operations."""
        n = len(layer_class)
        lc = np.fromiter(layer_class, dtype=np.int64, count=n)
        rows = np.empty((n, k, 7), dtype=np.int64)
        if len(templates) == 1:  # one geometry: the template repeated per layer
            rows[:] = templates[0]
            check_idx = np.arange(k, dtype=np.int64)
        else:
            rows[:] = np.stack(templates)[lc]
            first = {c: i for i, c in reversed(list(enumerate(layer_class)))}  # class -> first layer
            check_idx = (np.fromiter(first.values(), dtype=np.int64)[:, None] * k + np.arange(k, dtype=np.int64)).ravel()
        rows = rows.reshape(n * k, 7)
        ar = np.arange(n, dtype=np.int64)
        layer = ar.repeat(k)  # the method: np.repeat's wrapper costs more than the copy
        seg_start = ar * k
        rank_pos = rows[:, 1]
        if peer_idx is None:
            pidx, remote_idx = None, layer  # own rows: every index is the layer's own (-1)
        else:
            pidx = tuple(np.asarray(x, dtype=np.int64) for x in peer_idx)
            remote_idx = np.asarray(peer_idx, dtype=np.int64).reshape(len(covered), -1)[rank_pos, layer]
        return cls(layer, rank_pos, remote_idx, rows[:, 3], rows[:, 4], rows[:, 5], rows[:, 6],
                   np.fromiter(layer_key, dtype=np.int64, count=n).repeat(k), check_idx,
                   layer_class=lc, layer_start=seg_start, peer_idx=pidx, every_layer=True)

    def __len__(self) -> int:
        return int(self.local_idx.size)

