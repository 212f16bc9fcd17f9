"""Plans with a pipeline-parallel engine: one TransferPlan per remote stage a local rank reads.

With pipeline parallelism each stage of an engine holds some of the model's layers on its own
ranks (its own NIXL agents). A local rank reads every layer it holds from the one remote stage
that holds it (:func:`~nixlkv.core.topology.stage_sources` decides which), so its plans are one
ordinary TP plan per such stage, made for those layers alone. Every remote stage is told once
per request by every covered local rank, whether anything was read there or not, so a remote
rank frees a request after a fixed count of notifications (:func:`consumers_per_remote_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .plan import TransferPlan
from .request_ids import ResolvedRequest


@dataclass(frozen=True)
class StagePlans:
    """One local rank's plans with a remote engine of one or more pipeline stages."""

    plans: Mapping[int, TransferPlan]  # remote stage -> the plan for the layers read there
    told: tuple[int, ...]  # remote stages nothing is read from: their covered ranks are only told
    covered: tuple[int, ...]  # remote TP ranks this rank covers, on every stage
    consumers: int  # notifications every remote rank waits for before it frees a request
    layers: Mapping[int, tuple[str, ...]]  # remote stage -> the local layers read from it

    @property
    def stages(self) -> tuple[int, ...]:
        """Every remote stage this rank tells per request, in order."""
        return tuple(sorted((*self.plans, *self.told)))

    def resolve(
        self,
        local_block_ids: Sequence[Sequence[int] | Any],
        remote_block_ids: Sequence[Sequence[int] | Any],
        num_tokens: int | None = None,
    ) -> dict[int, ResolvedRequest]:
        """Per remote stage, what one request needs there: its plan's READs, or only telling its
        covered ranks. Block IDs are the engine's (one scheduler for every stage)."""
        out = {s: p.resolve(local_block_ids, remote_block_ids, num_tokens) for s, p in self.plans.items()}
        for s in self.told:
            out[s] = ResolvedRequest((), self.covered, self.consumers)
        return dict(sorted(out.items()))
