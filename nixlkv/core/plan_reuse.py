"""Plan reuse: a plan made for one prefill engine, made for another engine of the same model.

Every engine that serves one model with one configuration sends ranks of the same layout
(:attr:`RankGeometry.layout_key <nixlkv.core.geometry.RankGeometry.layout_key>`): where every
strategy's segments depend on page geometry alone (``segments_by_geometry``), a plan made with one
engine's ranks holds for another's. :meth:`ReusablePlan.rebased` moves its remote descriptor rows
to the new engine's addresses; :meth:`ReusablePlan.recounted` remakes what block counts decide
for an engine of the same shape whose memory holds other counts (:attr:`RankGeometry.shape_key
<nixlkv.core.geometry.RankGeometry.shape_key>`). The dispatcher remembers plans and asks for
these; a plan made anew is the reference (``tests/test_plan_rebase.py``).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, TypeVar

import numpy as np

from .errors import PlanError
from .geometry import RankGeometry, check_registered
from .regions import COL_BLOCKS
from .strategy import declared_pairing

_Plan = TypeVar("_Plan", bound="ReusablePlan")


@dataclass(frozen=True)
class PairingLayers:
    """Where the regions of each pairing's layers sit on each source rank, pairing by pairing:
    what a pairing's remote bound (the least block count over them) is read from, for the
    engine planned with or for another of its shape (:meth:`TransferPlan.recounted`)."""

    peers: tuple[np.ndarray | slice, ...]  # per source rank position: its region indices, grouped by pairing
    starts: np.ndarray  # where each pairing's indices start

    def remote_bounds(self, ranks: Sequence[RankGeometry]) -> list[int]:
        """Per pairing, the least block count over its regions on every one of ``ranks``."""
        least = None
        for g, idx in zip(ranks, self.peers):
            blocks = g.columns[idx, COL_BLOCKS]
            least = blocks if least is None else np.minimum(least, blocks)
        if least is None:
            return []
        return np.minimum.reduceat(least, self.starts).tolist()


class ReusablePlan:
    """What a :class:`~nixlkv.core.plan.TransferPlan` does to serve another remote engine of its
    layout without asking the strategies again (TransferPlan derives from it). Reads what the
    plan built: its remote ranks and pairings, each remote rank's rows (``_rank_rows``), whether
    local layers alias (``_aliased``, ``_shared``, ``_shared_rows``), and builds rows anew with the
    plan's own ``_build_rows`` / ``_build_remote_rows``."""

    remote: dict[int, RankGeometry]
    sources: tuple[int, ...]
    pairings: tuple[Any, ...]
    rebasable: bool
    _aliased: bool
    _shared: np.ndarray | None
    _rank_rows: dict[int, Any]
    _pairing_layers: PairingLayers | None

    def _with(self: _Plan, **fields: Any) -> _Plan:
        """A copy of this plan with ``fields`` replaced (arrays shared: a plan never writes them)."""
        plan = copy.copy(self)
        for view in ("segments", "layer_segments"):  # cached views of the geometry and pairings they were made from
            if view in vars(plan):
                delattr(plan, view)
        for name, value in fields.items():
            setattr(plan, name, value)
        return plan

    def rebased(self: _Plan, remote: Mapping[int, RankGeometry]) -> _Plan:
        """This plan, for another remote engine whose source ranks have the same layout
        (:attr:`RankGeometry.layout_key`) as this plan's: the same segments, checks and
        descriptor IDs; the remote rows moved to the new ranks' addresses, whose regions are
        checked against their registered memory. Only for a :attr:`rebasable` plan, and where
        local layers alias, only for an engine that shares rows between the same layers
        (PlanError otherwise: plan anew)."""
        self._require_rebasable()
        covered = self.sources
        for p in covered:
            if remote[p].layout_key != self.remote[p].layout_key:
                raise PlanError(f"remote rank {p} is laid out unlike the rank this plan was made for")
        if self._aliased and not all(_same_partition(self.remote[p], remote[p]) for p in covered):
            # which layers share rows depends on the remote bases too
            shared = self._shared_rows(remote)
            if (shared is None) != (self._shared is None) or (shared is not None and not np.array_equal(shared, self._shared)):
                raise PlanError("the new engine's layers share memory unlike the engine this plan was made for")
        for p in covered:
            check_registered(remote[p])
        peer = remote[covered[0]].regions  # each pairing's representative: the region at the same place
        return self._with(
            origin="rebased",
            remote={p: remote[p] for p in covered},
            remote_descs={p: found.rows(remote[p]).astype(np.uint64) for p, found in self._rank_rows.items()},
            pairings=tuple(replace(g, remote_region=peer[i]) for g, i in zip(self.pairings, self._pairing_peers)),
        )

    def _require_rebasable(self) -> None:
        """PlanError unless this plan's segments are the same for another engine (every strategy
        segments_by_geometry): what :meth:`rebased` and :meth:`recounted` reuse."""
        if not self.rebasable:
            raise PlanError("this plan's segments may depend on addresses (a strategy not segments_by_geometry): "
                            "plan anew for every remote engine")

    def recounted(self: _Plan, remote: Mapping[int, RankGeometry]) -> _Plan:
        """This plan for another remote engine whose source ranks have the same shape
        (:attr:`RankGeometry.shape_key`: the layout, whatever the block counts) as this plan's:
        the same segments and pairings, already checked against the same pages and groups; the
        pairings' remote bounds, every descriptor row and ID start made from the new ranks'
        block counts; their regions checked against their registered memory. Only for a
        :attr:`rebasable` plan the dispatcher made (PlanError otherwise: plan anew)."""
        self._require_rebasable()
        if self._pairing_layers is None:
            raise PlanError("this plan does not know where its pairings' regions lie: plan anew")
        for p in self.sources:
            if remote[p].shape_key != self.remote[p].shape_key:
                raise PlanError(f"remote rank {p} is shaped unlike the rank this plan was made for")
            check_registered(remote[p])
        ranks = [remote[p] for p in self.sources]
        peer = ranks[0].regions  # each pairing's representative: the region at the same place
        pairings = tuple(  # a strategy's declared pairing is asked again: it may read the counts
            replace(g, remote_num_blocks=bound, remote_region=peer[i], declared=declared_pairing(g.strategy, g.local_region, peer[i]))
            for g, bound, i in zip(self.pairings, self._pairing_layers.remote_bounds(ranks), self._pairing_peers)
        )
        plan = self._with(origin="recounted", remote=dict(zip(self.sources, ranks)), pairings=pairings)
        if not self._aliased or all(_same_partition(self.remote[p], remote[p]) for p in self.sources):
            plan._build_remote_rows()  # the local rows and which layers share them stand
        else:
            plan._build_rows()
        return plan

    @cached_property
    def _pairing_peers(self) -> list[int]:
        """Where each pairing's representative remote region sits on the first source rank."""
        index = self.remote[self.sources[0]].index
        return [index[g.remote_region.name] for g in self.pairings]


def _same_partition(a: RankGeometry, b: RankGeometry) -> bool:
    """Whether two ranks' regions share bases between the same regions (equal bases in one
    exactly where equal in the other): then any plan shares rows between the same layers for both.
    The partitions are equal iff each has as many parts as their meet (the distinct base pairs)."""
    bases_a = a.base_list
    parts_a = len(set(bases_a))
    bases_b = b.base_list
    if len(bases_a) != len(bases_b):
        return False
    if len(set(map(operator.sub, bases_b, bases_a))) == 1:  # every base moved by one shift (one allocation)
        return True
    return len(set(bases_b)) == parts_a == len(set(zip(bases_a, bases_b)))
