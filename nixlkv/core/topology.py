"""Parallel math for a P/D pair: who holds which heads and layers, who reads from whom, who frees when.

Pure functions of (rank, TP size, head count). Both directions (local TP larger or smaller than
remote TP) and replication (TP larger than the number of KV heads) are covered. With pipeline
parallelism, which remote stage each layer is read from (:func:`stage_sources`). "Local" is the
reading side (the decode engine), "remote" the side read from (the prefill engine).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .errors import IncompatibleTopology

# No engine runs a larger tensor-parallel group. A bound, because a TP size sizes what planning
# allocates (the ranks a decode rank covers): a peer advertising 2**40 ranks is refused, not obeyed.
MAX_TP_SIZE = 4096


@dataclass(frozen=True)
class Topology:
    """One rank's place in its engine's tensor-parallel group."""

    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise IncompatibleTopology(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise IncompatibleTopology(
                f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}"
            )


@dataclass(frozen=True)
class HeadRun:
    """``count`` consecutive local head slots filled from consecutive slots of one remote rank."""

    remote_rank: int
    remote_slot: int
    local_slot: int
    count: int


def check_tp_pair(local_tp: int, remote_tp: int) -> None:
    """P and D TP sizes must divide one another (vLLM's own rule, for the same reason: every
    rank of the larger side maps onto exactly one rank of the smaller side)."""
    for side, tp in (("local", local_tp), ("remote", remote_tp)):
        if not 1 <= tp <= MAX_TP_SIZE:
            raise IncompatibleTopology(f"{side} tp={tp} is outside [1, {MAX_TP_SIZE}]: no engine runs such a TP group")
    big, small = max(local_tp, remote_tp), min(local_tp, remote_tp)
    if big % small:
        raise IncompatibleTopology(
            f"TP sizes must divide one another: local tp={local_tp}, remote tp={remote_tp}. "
            f"With local tp={local_tp}, a remote tp of "
            f"{sorted({d for d in range(1, local_tp + 1) if local_tp % d == 0} | {local_tp * 2, local_tp * 4})} works."
        )


def check_heads_shardable(tp: int, num_heads: int) -> None:
    """vLLM shards KV heads evenly (tp <= heads) or replicates each head on tp/heads ranks."""
    if num_heads < 1:
        raise IncompatibleTopology(f"num_kv_heads must be >= 1, got {num_heads}")
    if (tp <= num_heads and num_heads % tp) or (tp > num_heads and tp % num_heads):
        raise IncompatibleTopology(
            f"num_kv_heads={num_heads} cannot be sharded over tp={tp}: vLLM needs num_kv_heads "
            f"divisible by tp, or tp a multiple of num_kv_heads."
        )


def heads_per_rank(tp: int, num_heads: int) -> int:
    """Head slots one rank holds (at least one: replicated heads)."""
    check_heads_shardable(tp, num_heads)
    return max(1, num_heads // tp)


def heads_held(rank: int, tp: int, num_heads: int) -> range:
    """Global KV heads held by ``rank`` (slot i holds head ``start + i``)."""
    per_rank = heads_per_rank(tp, num_heads)
    if tp <= num_heads:
        return range(rank * per_rank, (rank + 1) * per_rank)
    replicas = tp // num_heads
    head = rank // replicas
    return range(head, head + 1)


def covered_remote_ranks(local_rank: int, local_tp: int, remote_tp: int) -> range:
    """The remote ranks this local rank answers for: it may read only from them and it notifies
    each of them once per request, so every remote rank hears from a fixed number of readers."""
    check_tp_pair(local_tp, remote_tp)
    if remote_tp >= local_tp:
        k = remote_tp // local_tp
        return range(local_rank * k, (local_rank + 1) * k)
    k = local_tp // remote_tp
    return range(local_rank // k, local_rank // k + 1)


def consumers_per_remote_rank(local_tp: int, remote_tp: int, local_pp: int = 1) -> int:
    """How many local ranks cover (read from or notify) each remote rank for one request: the
    TP ranks that cover it, on every local pipeline stage (each stage tells every remote stage,
    whether it read layers there or not, so a remote rank knows the count without knowing how
    the local engine split its layers)."""
    check_tp_pair(local_tp, remote_tp)
    return max(1, local_tp // remote_tp) * local_pp


@functools.lru_cache(maxsize=4096)
def head_sources(local_rank: int, local_tp: int, remote_tp: int, num_heads: int) -> tuple[HeadRun, ...]:
    """Where each local head slot is read from, de-duplicated: one remote copy per head.

    Cached: a plan asks the same question for every layer (pure function of four integers).

    Among the covered remote ranks that hold a head, the first is chosen, so reads are
    deterministic and a replicated head is read once, not once per replica.
    """
    check_heads_shardable(local_tp, num_heads)
    check_heads_shardable(remote_tp, num_heads)
    covered = covered_remote_ranks(local_rank, local_tp, remote_tp)
    held = {p: heads_held(p, remote_tp, num_heads) for p in covered}  # each a range of consecutive heads
    mine = heads_held(local_rank, local_tp, num_heads)
    runs: list[HeadRun] = []
    head = mine.start
    while head < mine.stop:  # one run per stretch of heads one remote rank holds: O(runs), not O(heads)
        holder = next((p for p in covered if head in held[p]), None)
        if holder is None:  # unreachable for divisible pairs; kept as a clear failure, not a guess
            raise IncompatibleTopology(
                f"no remote rank among {list(covered)} holds KV head {head} "
                f"(local tp={local_tp}, remote tp={remote_tp}, num_kv_heads={num_heads})"
            )
        theirs = held[holder]
        count = min(mine.stop, theirs.stop) - head  # every head of it has this holder first: ranks' ranges
        runs.append(HeadRun(holder, head - theirs.start, head - mine.start, count))  # are disjoint or one head
        head += count
    return tuple(runs)


def check_units_shardable(tp: int, units: int, what: str, replicate_single: bool) -> None:
    """A model dimension split over TP in whole units (heads, groups, channels).

    vLLM shards such a dimension evenly (``units % tp == 0``); where the layer allows it
    (``replicate_single``: Mamba2's B/C groups), a single unit is instead replicated on every
    rank. Any other combination — e.g. 2 groups over tp=4 — is a model vLLM refuses to run, so
    it is refused here too rather than guessed at.
    """
    if units < 1:
        raise IncompatibleTopology(f"{what} must be >= 1, got {units}")
    if units % tp == 0 or (replicate_single and units == 1):
        return
    allowed = f"{what} divisible by tp" + (f", or {what} == 1" if replicate_single else "")
    raise IncompatibleTopology(f"{what}={units} cannot be sharded over tp={tp}: vLLM needs {allowed}")


def unit_sources(
    local_rank: int, local_tp: int, remote_tp: int, units: int, what: str, replicate_single: bool = False
) -> tuple[HeadRun, ...]:
    """Where each local unit slot of an evenly sharded (or single, replicated) dimension comes
    from: runs of consecutive slots, one remote copy per unit (see :func:`head_sources`).

    A replicated single unit is read once, from the first covered remote rank: every D rank then
    reads the same bytes from one P rank, never from a rank it does not cover.
    """
    check_units_shardable(local_tp, units, what, replicate_single)
    check_units_shardable(remote_tp, units, what, replicate_single)
    return head_sources(local_rank, local_tp, remote_tp, units)


def units_per_rank(tp: int, units: int, what: str, replicate_single: bool = False) -> int:
    """Unit slots one rank holds: ``units / tp``, or 1 for a replicated single unit."""
    check_units_shardable(tp, units, what, replicate_single)
    return max(1, units // tp)


# ---------------------------------------------------------------- pipeline stages
#
# With pipeline parallelism an engine's ranks are (stage, TP rank): every stage holds some of the
# model's layers, and its TP ranks split those layers' heads as a TP-only engine would. Which
# stage a layer is read from is decided here and nowhere else: a plan is then made per remote
# stage, for the layers that stage holds, with the TP math above.

MAX_PP_SIZE = 1024  # no engine runs more pipeline stages: a bound, as for TP


@dataclass(frozen=True)
class Stage:
    """One rank's pipeline stage: ``pp_rank`` of ``pp_size`` (1 and 0 without pipeline parallelism)."""

    pp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.pp_size, int) or isinstance(self.pp_size, bool) or not 1 <= self.pp_size <= MAX_PP_SIZE:
            raise IncompatibleTopology(f"pp_size must be an integer in [1, {MAX_PP_SIZE}], got {self.pp_size!r}")
        if not isinstance(self.pp_rank, int) or isinstance(self.pp_rank, bool) or not 0 <= self.pp_rank < self.pp_size:
            raise IncompatibleTopology(f"pp_rank must be in [0, pp_size={self.pp_size}), got {self.pp_rank!r}")


def layer_of(region_name: str) -> str:
    """The model layer a region belongs to: a layer's regions are named ``<layer>`` or
    ``<layer>:<part>`` (:meth:`Region.of_layer`), and a stage holds whole layers."""
    return region_name.split(":", 1)[0]


def stage_sources(local_layers: Sequence[str], remote_stages: Mapping[int, Collection[str]]) -> dict[int, tuple[str, ...]]:
    """Per remote stage, the local layers read from it (in local order; stages with none left out).

    Every local layer must be held by exactly one remote stage: a layer no stage holds is a
    model the two engines do not share, and a layer two stages claim is a handshake that cannot
    be true (vLLM gives each layer to one stage). Both are refused naming the layer.
    """
    holder: dict[str, int] = {}
    for stage in sorted(remote_stages):
        for layer in remote_stages[stage]:
            other = holder.setdefault(layer, stage)
            if other != stage:
                raise IncompatibleTopology(
                    f"layer {layer!r} is claimed by remote pipeline stages {other} and {stage}: each layer "
                    "lives on one stage; the remote engine's handshakes disagree"
                )
    out: dict[int, list[str]] = {}
    missing = []
    for layer in local_layers:
        stage = holder.get(layer)
        if stage is None:
            missing.append(layer)
        else:
            out.setdefault(stage, []).append(layer)
    if missing:
        raise IncompatibleTopology(
            f"no remote pipeline stage holds layers {missing[:3]}{' ...' if len(missing) > 3 else ''} "
            f"(remote stages {sorted(remote_stages)} seen): P and D must serve the same model, and D must "
            "handshake every stage of P"
        )
    return {stage: tuple(layers) for stage, layers in sorted(out.items())}
