"""How one request's READs are posted: as the plan has them (``direct``), through the staging
buffer (``staged``, :mod:`nixlkv.core.staging` lays it out), or whichever the machine's measured
costs say is faster (``auto``), decided per request from figures the plan already holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .plan import TransferPlan
from .request_ids import ResolvedRequest
from .staging import StagedCounts, StagedPlan, StagedRequest, StagingError, check_mode, descriptors_after_merge


@dataclass(frozen=True)
class TransferCosts:
    """What a READ costs on the machine, for ``auto``: seconds per posted descriptor, NIXL and
    local-copy bandwidth, and the fixed cost of one scatter call and one staging round.

    Staging trades descriptors for one extra local copy of every byte, so what decides is the
    descriptor cost against the copy bandwidth. Measured on this project's 2-core VM (UCX
    ``cma``, paused progress threads, docs/performance.md): 8,192 head-slice descriptors of
    16 KiB cost 1.3 us each over the same bytes read as one descriptor per prefill rank when one
    thread posts them, 0.3 us with the agent's ``num_threads=4``; copy bandwidth falls tenfold
    when the machine is shared. The executor therefore measures the copy bandwidth where it runs
    (``nixlkv.transport.reader.measured_costs``); the descriptor cost is the single-thread figure, so that
    ``auto`` stages only where staging wins with either.
    """

    per_descriptor_s: float = 1.5e-6
    nixl_bytes_per_s: float = 6e9
    copy_bytes_per_s: float = 6e9
    per_scatter_s: float = 20e-6
    per_round_s: float = 100e-6

    @property
    def stage_below_bytes(self) -> float:
        """Staging can only win for direct descriptors smaller than this: it saves at most one
        descriptor's cost per direct descriptor and copies each of its bytes once more."""
        return self.per_descriptor_s * self.copy_bytes_per_s

    def direct(self, posted: int, nbytes: int) -> float:
        return posted * self.per_descriptor_s + nbytes / self.nixl_bytes_per_s

    def staged(self, counts: StagedCounts) -> float:
        return (
            counts.posted * self.per_descriptor_s
            + counts.staged_bytes / self.nixl_bytes_per_s
            + counts.scatter_bytes / self.copy_bytes_per_s
            + counts.scatters * self.per_scatter_s
            + counts.rounds * self.per_round_s
        )



def posted_direct(plan: TransferPlan, resolved: ResolvedRequest) -> int:
    """Descriptors NIXL posts for the plan's own READs (after its merge)."""
    return sum(
        descriptors_after_merge(plan.local_descs, r.local_ids, plan.remote_descs[r.remote_rank], r.remote_ids)
        for r in resolved.reads
    )


def request_bytes(plan: TransferPlan, resolved: ResolvedRequest) -> int:
    return sum(plan.read_bytes(r) for r in resolved.reads)


@dataclass(frozen=True)
class Choice:
    """The mode one request runs in, and the figures it was chosen on."""

    mode: str  # direct | staged
    staged: StagedRequest | None
    posted_direct: int | None = None
    posted_staged: int | None = None


def choose(
    mode: str,
    plan: TransferPlan,
    staged_plan: StagedPlan | None,
    resolved: ResolvedRequest,
    costs: TransferCosts | None = None,
) -> Choice:
    """Pick how one request is posted (:func:`decide`), with the staged program built where it
    stages: what a reader posts."""
    choice = decide(mode, plan, staged_plan, resolved, costs)
    if choice.mode == "staged" and choice.staged is None:
        choice = replace(choice, staged=staged_plan.stage(resolved, choice.posted_staged))
    return choice


def decide(
    mode: str,
    plan: TransferPlan,
    staged_plan: StagedPlan | None,
    resolved: ResolvedRequest,
    costs: TransferCosts | None = None,
) -> Choice:
    """How one request is posted, without building its staged program where the block pairs
    tell (:meth:`StagedPlan.counts`). ``staged`` refuses (StagingError) where no staging plan
    could be built; ``auto`` stages only where the plan can merge more that way and the measured
    costs say the extra local copy is cheaper than the descriptors it saves."""
    check_mode(mode)
    if mode == "direct" or not resolved.reads:
        return Choice("direct", None)
    if staged_plan is None:
        if mode == "staged":
            raise StagingError("descriptor_mode 'staged' was asked for, but this plan has no staging buffer")
        return Choice("direct", None)
    if mode == "staged":
        return Choice("staged", None)
    if not staged_plan.can_help:
        return Choice("direct", None)
    costs = costs or TransferCosts()
    if staged_plan.min_direct_bytes >= costs.stage_below_bytes:
        return Choice("direct", None)  # every descriptor staging would save copies slower than it posts
    nbytes = request_bytes(plan, resolved)
    if nbytes / costs.copy_bytes_per_s >= resolved.num_descriptors * costs.per_descriptor_s:
        return Choice("direct", None)  # the copy alone costs more than every descriptor could save
    counts = staged_plan.counts(resolved)  # from the block pairs: no staged program built to decide
    staged = None
    if counts is None:  # pages read by several segments: the program itself says what it posts
        staged = staged_plan.stage(resolved)
        counts = replace(staged.counts(), posted_direct=posted_direct(plan, resolved))
    pd, ps = counts.posted_direct, counts.posted
    return Choice("staged" if costs.staged(counts) < costs.direct(pd, nbytes) else "direct", staged, pd, ps)
