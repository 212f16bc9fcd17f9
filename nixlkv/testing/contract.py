"""The strategy contract kit: the invariants every strategy must hold, checked over a matrix.

A :class:`ContractCase` names a strategy and how to fabricate layers it serves (a scenario
layer kind: a per-rank sample-spec factory, see :mod:`nixlkv.testing.kinds`). For every
:class:`Point` of its matrix (TP pair, layouts, block sizes, request length, prefix hit) the
kit fabricates every rank the way vLLM 0.33 lays it out, asks the strategy for regions and
segments, builds the plan, resolves a request, and checks the invariants below. Each check
raises :class:`ContractViolation` whose message starts with ``contract: <invariant> violated``,
so a failing test says which promise was broken. docs/contract.md explains each invariant and
the bug it exists to prevent.

This module is pytest-free: the pytest suite (``nixlkv.testing.suite.StrategyContract``) and
nixlkv's own tests call these functions; so can any other runner.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import numpy as np

from ..core import (
    Dispatcher,
    NixlkvError,
    PlanError,
    PlanValidationError,
    RankGeometry,
    Region,
    RequestError,
    Segment,
    Strategy,
    Topology,
    TransferPlan,
)
from ..core.registry import plugin_manager
from .kinds import KINDS, KindDef, load_plugin_kinds, register_kind

# Invariant names: stable identifiers, used in messages, docs/contract.md and exemptions.
DISPATCH = "dispatch"
DOCUMENTED_ERRORS = "documented-errors"
INSIDE_REGIONS = "segments-inside-regions"
NO_OVERLAP = "no-overlapping-writes"
EVERY_BYTE_ONCE = "every-byte-once"
READS_INSIDE_REQUEST = "reads-inside-request"
DETERMINISTIC = "deterministic"
SERIALISABLE = "serialisable"
BYTE_ORACLE = "byte-oracle"
PENDING = "pending-refuses"
INVARIANTS = (
    DISPATCH, DOCUMENTED_ERRORS, INSIDE_REGIONS, NO_OVERLAP, EVERY_BYTE_ONCE,
    READS_INSIDE_REQUEST, DETERMINISTIC, SERIALISABLE, BYTE_ORACLE, PENDING,
)
# What a strategy may exempt itself from, with a reason (``Strategy.contract_exempt``): only
# completeness. Memory safety, determinism and the byte oracle are never negotiable.
EXEMPTABLE = {"full-coverage"}

# The companion of a wrapped point: one replicated head (servable at every TP pair) of a head size
# no built-in sample uses, so its page differs from the case's layers'.
WRAP_COMPANION = {"kind": "full_attention", "count": 1, "num_kv_heads": 1, "head_size": 48}
FULL_MATRIX_ENV = "NIXLKV_CONTRACT_MATRIX"  # "full" runs the full matrix; see docs/contract.md
ALL_LAYOUTS = ("LBHNC", "BLHNC", "LBNHC", "BLNHC", "LHBNC", "BHLNC")


class ContractViolation(AssertionError):
    """A strategy broke an invariant. ``invariant`` is one of :data:`INVARIANTS`.

    An AssertionError subclass so pytest reports it as a plain test failure with the message.
    """

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"contract: {invariant} violated: {message}")


@dataclass(frozen=True)
class Point:
    """One cell of the matrix: a P/D pair and one request."""

    prefill_tp: int
    decode_tp: int
    prefill_layout: str = "LBHNC"
    decode_layout: str = "LBHNC"
    prefill_block_size: int = 16
    decode_block_size: int = 16
    num_tokens: int = 100
    cached_blocks: int = 0
    # The page interior both sides' attention kernels write (``k_channel_major``: vLLM's CPU
    # backend); applies to attention-like kinds with LBHNC pages, as in a scenario's sides.
    interior: str | None = None
    # A companion layer of another page size beside the case's layers: with a block-outermost
    # layout vLLM packs them into UniformTypeKVCacheSpecs groups, which must be seen per layer.
    wrapped: bool = False

    @property
    def id(self) -> str:
        layout = self.prefill_layout if self.prefill_layout == self.decode_layout else f"{self.prefill_layout}-{self.decode_layout}"
        bs = (
            f"bs{self.prefill_block_size}" if self.prefill_block_size == self.decode_block_size
            else f"bs{self.prefill_block_size}-{self.decode_block_size}"
        )
        hit = f"-hit{self.cached_blocks}" if self.cached_blocks else ""
        extra = (f"-{self.interior}" if self.interior else "") + ("-wrapped" if self.wrapped else "")
        return f"P{self.prefill_tp}-D{self.decode_tp}-{layout}-{bs}-t{self.num_tokens}{hit}{extra}"


def attention_refusals(point: Point, params: Mapping[str, Any]) -> str | None:
    """Where an attention-like strategy (full attention and its subclasses) must refuse, and
    with which error type: tokens per block where neither side's divides the other's (blocks
    pair by token range otherwise); a layer's block page that is not one
    contiguous run (the head axis outside the block or layer axes); pages whose axes are
    ordered differently (a permute, not a copy); and, where ranks hold different head counts,
    head slices that are not one byte run (heads not outermost in the page). A page holding a
    single head has no head order, so it is compatible with either."""
    from ..core.topology import heads_per_rank

    heads = int(params.get("num_kv_heads", 1))
    sides = [
        (point.prefill_layout, heads_per_rank(point.prefill_tp, heads)),
        (point.decode_layout, heads_per_rank(point.decode_tp, heads)),
    ]
    small, large = sorted((point.prefill_block_size, point.decode_block_size))
    if large % small:
        return "IncompatibleGeometry"
    if not all(_page_dense(layout, held) for layout, held in sides):
        return "IncompatibleGeometry"
    heads_outer = [held == 1 or layout.index("H") < layout.index("N") for layout, held in sides]
    if heads_outer[0] != heads_outer[1]:
        return "IncompatibleGeometry"
    if sides[0][1] != sides[1][1] and not all(heads_outer):
        return "IncompatibleGeometry"
    return None


def _page_dense(layout: str, heads_held: int) -> bool:
    """One layer's block page is one contiguous run when the head axis sits inside the block
    and layer axes, or holds a single head (then its position does not matter)."""
    return heads_held == 1 or layout.index("H") > max(layout.index("B"), layout.index("L"))


@dataclass(frozen=True)
class ContractCase:
    """What a strategy author declares; the kit derives the matrix and every check from it.

    - ``strategy``: the strategy's ``name`` (what dispatch must pick for ``kind``'s specs).
    - ``kind``: the scenario layer kind that fabricates its layers; with ``kind_def`` a new
      kind is registered under that name (spec factory, parameters, and, for a layout that is
      not attention-like, the oracle's element-coordinate function); without it, a kind a
      plugin declares (hook ``nixlkv_scenario_kinds``) is looked up.
    - ``params``: the kind's parameters for the sample model (head counts, sizes, window...).
      Keep the head count small and a divisor-friendly number: 2 heads with TP 4 exercises
      replication.
    - matrix limits: ``tp_pairs`` (prefill, decode), ``layouts``, ``block_sizes``,
      ``token_counts``, ``prefix_hits`` (blocks decode already holds); ``extra_points`` are
      added as given.
    - ``refuses(point, params)``: the error type name the strategy documents for a combination
      it does not serve, or None where it must plan and move bytes (:meth:`refusal`).
    - ``plugins``: extra pluggy plugins (modules or objects with ``@hookimpl`` functions)
      registered on top of the installed ones, e.g. a strategy not yet installed.
    """

    strategy: str
    kind: str
    params: Mapping[str, Any]
    kind_def: KindDef | None = None
    num_layers: int = 2
    tp_pairs: tuple[tuple[int, int], ...] = ((2, 2), (1, 2), (2, 1), (2, 4), (4, 2))
    layouts: tuple[str, ...] = ("LBHNC", "BLHNC")
    block_sizes: tuple[int, ...] = (16, 32)
    token_counts: tuple[int, ...] = (1, 37, 100)
    prefix_hits: tuple[int, ...] = (0, 3)
    extra_points: tuple[Point, ...] = ()
    refuses: Callable[[Point, Mapping[str, Any]], str | None] = attention_refusals
    plugins: tuple[Any, ...] = ()
    # Token caches must refuse more local than remote blocks; a state cache (one running state
    # per request) pairs any two lists by their running entries, so it sets this False.
    refuses_longer_local_list: bool = True
    # Add a point whose layers vLLM packs with a full-attention companion of another page size
    # (UniformTypeKVCacheSpecs under a block-outermost layout). Off by default: a spec vLLM
    # cannot group with full attention (a third party's own kind) would fail in vLLM, not here.
    wrapped_points: bool = False
    seed: int = 7
    full_tp_pairs: tuple[tuple[int, int], ...] = (
        (1, 1), (2, 2), (4, 4), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 8), (8, 2),
    )
    full_layouts: tuple[str, ...] = ALL_LAYOUTS
    full_token_counts: tuple[int, ...] = (1, 16, 37, 100, 333)

    def __post_init__(self) -> None:
        if not self.strategy or not self.kind:
            raise ValueError("a contract case needs the strategy's name and a layer kind")
        if not self.tp_pairs or not self.layouts or not self.block_sizes or not self.token_counts:
            raise ValueError(f"contract case {self.strategy!r}: every matrix axis needs at least one value")

    @property
    def id(self) -> str:
        return f"{self.strategy}[{self.kind}]"

    def refusal(self, point: Point) -> str | None:
        """The documented error type for ``point``, or None where the strategy must serve it."""
        return self.refuses(point, self.params)

    def points(self, full: bool | None = None) -> list[Point]:
        """The matrix. Default: small enough for CI, yet both TP directions, equal TP,
        replication (from ``tp_pairs`` and the head count), every layout in ``layouts``,
        each block size, request length and prefix hit at least once, a cross-layout pair
        and the refusal probes. ``full`` (or ``NIXLKV_CONTRACT_MATRIX=full``): the product."""
        if full is None:
            full = full_matrix_requested()
        return _dedup(self._full_points() if full else self._default_points()) + [
            p for p in self.extra_points
        ]

    def _default_points(self) -> list[Point]:
        bs, tokens, hit, lay0 = self.block_sizes[0], self.token_counts[-1], max(self.prefix_hits), self.layouts[0]
        # Variations (request lengths, block sizes, prefix hits...) go where the strategy serves
        # the base point, preferring TP pairs of different sizes (the hard case).
        served = [pr for pr in self.tp_pairs if self.refusal(Point(*pr, lay0, lay0, bs, bs, tokens)) is None]
        hetero = [pr for pr in served if pr[0] != pr[1]] or served or list(self.tp_pairs)
        pts = [Point(p, d, lay, lay, bs, bs, tokens) for (p, d) in self.tp_pairs for lay in self.layouts[:2]]
        pts += [Point(p, d, lay0, lay0, bs, bs, tokens, hit) for (p, d) in hetero[:2]]
        p0, d0 = hetero[-1]
        pts += [Point(p0, d0, self.layouts[0], self.layouts[0], bs, bs, t) for t in self.token_counts[:-1]]
        pts += [Point(p0, d0, self.layouts[0], self.layouts[0], b, b, tokens, hit) for b in self.block_sizes[1:]]
        pts += [Point(p0, d0, lay, lay, bs, bs, tokens) for lay in self.layouts[2:]]
        if len(self.layouts) > 1:
            pts.append(Point(p0, d0, self.layouts[0], self.layouts[1], bs, bs, tokens))
        # Refusal probes: tokens per block where neither side's divides the other's (16 vs 24),
        # and a page with tokens outside heads. Sizes that divide are served (token ranges).
        equal = next((pr for pr in self.tp_pairs if pr[0] == pr[1]), (2, 2))
        pts.append(Point(*equal, lay0, lay0, bs, bs + bs // 2, tokens))
        pts += [Point(p, d, "LBNHC", "LBNHC", bs, bs, tokens) for (p, d) in _dedup([hetero[0], equal])]
        # vLLM's CPU attention pages (keys channel-major) with P and D at different block sizes,
        # and groups vLLM wraps (a companion layer of another page size, block-outermost layout).
        pts.append(Point(p0, d0, "LBHNC", "LBHNC", bs, 2 * bs, tokens, interior="k_channel_major"))
        if "BLHNC" in self.layouts:
            if self.wrapped_points:
                pts.append(Point(p0, d0, "LBHNC", "BLHNC", bs, bs, tokens, wrapped=True))
        return pts

    def _full_points(self) -> list[Point]:
        pts = [
            Point(p, d, lay, lay, b, b, t, h)
            for (p, d), lay, b, t, h in product(
                self.full_tp_pairs, self.full_layouts, self.block_sizes, self.full_token_counts, self.prefix_hits
            )
        ]
        pts += [
            Point(p, d, a, c, self.block_sizes[0], self.block_sizes[0], self.full_token_counts[-1])
            for (p, d) in self.full_tp_pairs for a in self.full_layouts for c in self.full_layouts if a != c
        ]
        pts += [Point(2, 2, "LBHNC", "LBHNC", b, 2 * b, 100) for b in self.block_sizes]
        return pts

    def scenario(self, point: Point) -> Any:
        """The point as a rehearsal scenario (a one-kind model of ``num_layers`` layers)."""
        from .scenario import parse

        self.register()
        tokens_per_block = max(point.prefill_block_size, point.decode_block_size)
        cached = min(point.cached_blocks, max(0, -(-point.num_tokens // tokens_per_block) - 1))
        layers = [{"kind": self.kind, "count": self.num_layers, **dict(self.params)}]
        if point.wrapped:
            layers.append(WRAP_COMPANION)
        interior = {"interior": point.interior} if point.interior else {}
        return parse(
            {
                "name": f"contract-{self.strategy}-{point.id}",
                "model": {"layers": layers},
                "prefill": {"tp": point.prefill_tp, "block_size": point.prefill_block_size, "layout": point.prefill_layout,
                            **(interior if point.prefill_layout == "LBHNC" else {})},
                "decode": {"tp": point.decode_tp, "block_size": point.decode_block_size, "layout": point.decode_layout,
                           **(interior if point.decode_layout == "LBHNC" else {})},
                "request": {"num_tokens": point.num_tokens, "seed": self.seed, "cached_blocks": cached},
            },
            source=f"contract case {self.id}",
        )

    def register(self) -> None:
        """Register ``kind_def`` (idempotent) and check the kind exists."""
        if self.kind_def is not None:
            register_kind(self.kind, self.kind_def)
        if self.kind not in KINDS:  # a kind the installed plugins (or the case's own) declare
            load_plugin_kinds(self.plugins)
        if self.kind not in KINDS:
            raise ValueError(
                f"contract case {self.strategy!r}: layer kind {self.kind!r} is unknown (known: {sorted(KINDS)}); "
                "give kind_def=KindDef(...), or declare it in the plugin's nixlkv_scenario_kinds hook"
            )

    def dispatcher(self) -> Dispatcher:
        """Installed plugins (entry points) plus the case's extra ``plugins``."""
        pm = plugin_manager()
        for plugin in self.plugins:
            if not pm.is_registered(plugin):
                pm.register(plugin, name=getattr(plugin, "__name__", None) or f"contract-{type(plugin).__name__}-{id(plugin)}")
        return Dispatcher.from_plugins(pm)

    def sample_spec(self, tp: int = 1, block_size: int = 16) -> Any:
        self.register()
        kind = KINDS[self.kind]
        return kind.build({**kind.optional, **self.params}, tp, block_size)


def full_matrix_requested() -> bool:
    return os.environ.get(FULL_MATRIX_ENV, "").strip().lower() == "full"


def _dedup(points: Iterable[Point]) -> list[Point]:
    seen: dict[Point, None] = {}
    for p in points:
        seen.setdefault(p, None)
    return list(seen)


def exemptions(strategy: Strategy) -> dict[str, str]:
    """The strategy's declared exemptions, validated: known names, non-empty reasons."""
    declared = dict(getattr(strategy, "contract_exempt", {}) or {})
    for name, reason in declared.items():
        if name not in EXEMPTABLE:
            raise ContractViolation(
                DOCUMENTED_ERRORS,
                f"strategy {strategy.name!r} declares contract_exempt[{name!r}]; only {sorted(EXEMPTABLE)} may be exempted",
            )
        if not isinstance(reason, str) or not reason.strip():
            raise ContractViolation(DOCUMENTED_ERRORS, f"strategy {strategy.name!r}: exemption {name!r} needs a reason")
    return declared


# ---------------------------------------------------------------------------- building a point


@dataclass
class PointRun:
    """Everything the per-point checks read: built once per (case, point)."""

    case: ContractCase
    point: Point
    scenario: Any
    dispatcher: Dispatcher
    strategy: Strategy
    prefill: list[Any] = field(default_factory=list)  # FabricatedRank
    decode: list[Any] = field(default_factory=list)
    prefill_geometry: dict[int, RankGeometry] = field(default_factory=dict)
    decode_geometry: list[RankGeometry] = field(default_factory=list)
    raw_segments: list[dict[str, list[Segment]]] = field(default_factory=list)  # per decode rank, per region
    plans: list[TransferPlan] = field(default_factory=list)
    refusal: BaseException | None = None  # what planning raised, if it refused
    plan_error: ContractViolation | None = None  # a violation found while building


def build_point(case: ContractCase, point: Point) -> PointRun:
    """Fabricate both engines and plan every decode rank, recording (not raising) a refusal or
    a violation, so each check can report its own invariant."""
    from .engines import build_rank
    from .rehearsal import geometry

    scenario = case.scenario(point)
    dispatcher = case.dispatcher()
    strategy = dispatcher.registry.by_name(case.strategy)
    run = PointRun(case, point, scenario, dispatcher, strategy)
    try:  # a model the engine itself cannot shard at this TP is refused before any strategy runs
        run.prefill = [build_rank(scenario, "prefill", r) for r in range(point.prefill_tp)]
        run.decode = [build_rank(scenario, "decode", r) for r in range(point.decode_tp)]
    except NixlkvError as exc:
        run.refusal = exc
        return run
    try:
        run.prefill_geometry = {r.tp_rank: geometry(r, dispatcher) for r in run.prefill}
        run.decode_geometry = [geometry(d, dispatcher) for d in run.decode]
        for geo in run.decode_geometry:
            run.raw_segments.append(_raw_segments(run, geo))
        run.plans = [dispatcher.plan(geo, run.prefill_geometry) for geo in run.decode_geometry]
    except PlanValidationError as exc:
        run.plan_error = ContractViolation(_invariant_of(exc), f"{point.id}: the core refused the plan: {exc}")
    except NixlkvError as exc:
        run.refusal = exc
    except Exception as exc:  # an assert, KeyError, NotImplementedError... from a strategy
        run.plan_error = ContractViolation(
            DOCUMENTED_ERRORS,
            f"{point.id}: planning raised {type(exc).__name__}: {exc}; a strategy must raise "
            "IncompatibleGeometry / IncompatibleTopology (or RequestError per request), never assert or crash",
        )
    return run


def _raw_segments(run: PointRun, local: RankGeometry, more_blocks: int = 0) -> dict[str, list[Segment]]:
    """The strategy's own answer per local region, before the core validates anything; with
    ``more_blocks``, asked of the same regions holding that many more blocks on both sides."""
    from ..core.topology import covered_remote_ranks

    remote_tp = run.point.prefill_tp
    covered = covered_remote_ranks(local.tp_rank, local.tp_size, remote_tp)
    out = {}
    topo = Topology(local.tp_size, local.tp_rank)
    for region in local.regions:
        if region.strategy != run.strategy.name:
            continue
        peers = {p: run.prefill_geometry[p].region(region.name) for p in covered}
        if any(peer is None for peer in peers.values()):
            continue  # the dispatcher reports missing layers
        if more_blocks:
            region = dataclasses.replace(region, num_blocks=region.num_blocks + more_blocks)
            peers = {p: dataclasses.replace(peer, num_blocks=peer.num_blocks + more_blocks) for p, peer in peers.items()}
        out[region.name] = list(run.strategy.segments(region, peers, topo, remote_tp))
    return out


def _invariant_of(exc: PlanValidationError) -> str:
    text = str(exc)
    if "same bytes" in text:
        return NO_OVERLAP
    return INSIDE_REGIONS


def _require_plan(run: PointRun, invariant: str) -> None:
    """Checks that need a plan fail loudly when there is none (never skip)."""
    if run.plan_error is not None:
        if run.plan_error.invariant == invariant:
            raise run.plan_error
        raise ContractViolation(invariant, f"{run.point.id}: not checkable, planning broke another invariant first: {run.plan_error}")
    if run.refusal is not None:
        raise ContractViolation(
            DOCUMENTED_ERRORS,
            f"{run.point.id}: the case declares this combination supported, but planning refused it: "
            f"{type(run.refusal).__name__}: {run.refusal}",
        )


# ---------------------------------------------------------------------------- the checks


def check_dispatch(case: ContractCase) -> None:
    """The sample spec must dispatch to the named strategy, and its regions must say so."""
    dispatcher = case.dispatcher()
    spec = case.sample_spec()
    try:
        got = dispatcher.strategy_for(spec, "contract.layer")
    except NixlkvError as exc:
        raise ContractViolation(DISPATCH, f"no strategy for {type(spec).__name__}: {exc}") from None
    if got.name != case.strategy:
        raise ContractViolation(
            DISPATCH,
            f"a {type(spec).__module__}.{type(spec).__qualname__} is served by {got.name!r}, not {case.strategy!r}: "
            "is the plugin installed (its `nixlkv` entry point), and does spec_types name this class or a base of it?",
        )
    exemptions(got)


def check_refusal(run: PointRun) -> None:
    """At a point the case declares unsupported, planning must refuse with the documented type."""
    expected = run.case.refusal(run.point)
    if run.plan_error is not None:
        raise run.plan_error
    if expected is None:
        _require_plan(run, DOCUMENTED_ERRORS)
        return
    if run.refusal is None:
        raise ContractViolation(
            DOCUMENTED_ERRORS,
            f"{run.point.id}: the case documents a refusal ({expected}) here, but planning succeeded; "
            "fix the strategy or the case's `refuses`",
        )
    names = {k.__name__ for k in type(run.refusal).__mro__}
    if expected not in names:
        raise ContractViolation(
            DOCUMENTED_ERRORS,
            f"{run.point.id}: refused with {type(run.refusal).__name__} ({run.refusal}), documented: {expected}",
        )
    if not str(run.refusal).strip():
        raise ContractViolation(DOCUMENTED_ERRORS, f"{run.point.id}: refusal {type(run.refusal).__name__} has no message")


def check_segments_inside_regions(run: PointRun) -> None:
    """Every segment stays inside its local page and the remote page it reads, and names only
    covered remote ranks (the strategy's raw answer, before the core's own validation)."""
    from ..core.topology import covered_remote_ranks

    _require_plan_or_raw(run, INSIDE_REGIONS)
    for geo, per_region in zip(run.decode_geometry, run.raw_segments):
        covered = set(covered_remote_ranks(geo.tp_rank, geo.tp_size, run.point.prefill_tp))
        for name, segs in per_region.items():
            local = geo.region(name)
            for s in segs:
                if s.local_region != name:
                    raise ContractViolation(INSIDE_REGIONS, f"{run.point.id}: segments() for {name!r} returned a segment of {s.local_region!r}")
                if s.remote_rank not in covered:
                    raise ContractViolation(
                        INSIDE_REGIONS,
                        f"{run.point.id}: decode rank {geo.tp_rank} layer {name!r} reads prefill rank {s.remote_rank}, "
                        f"outside its covered ranks {sorted(covered)}",
                    )
                peer = run.prefill_geometry[s.remote_rank].region(s.remote_region)
                if peer is None:
                    raise ContractViolation(INSIDE_REGIONS, f"{run.point.id}: segment reads unknown region {s.remote_region!r}")
                if s.nbytes <= 0 or s.local_offset < 0 or s.local_offset + s.nbytes > local.page.nbytes:
                    raise ContractViolation(
                        INSIDE_REGIONS,
                        f"{run.point.id}: decode rank {geo.tp_rank} layer {name!r}: segment writes "
                        f"[{s.local_offset}, {s.local_offset + s.nbytes}) of a {local.page.nbytes}-byte page",
                    )
                if s.remote_offset < 0 or s.remote_offset + s.nbytes > peer.page.nbytes:
                    raise ContractViolation(
                        INSIDE_REGIONS,
                        f"{run.point.id}: decode rank {geo.tp_rank} layer {name!r}: segment reads "
                        f"[{s.remote_offset}, {s.remote_offset + s.nbytes}) of prefill rank {s.remote_rank}'s "
                        f"{peer.page.nbytes}-byte page",
                    )
    _after_raw(run, INSIDE_REGIONS)


def _after_raw(run: PointRun, invariant: str) -> None:
    """After the raw checks passed: the core's own finding for this invariant (e.g. a region
    outside registered memory) still fails it; another invariant's finding is that test's."""
    if run.plan_error is not None:
        if run.plan_error.invariant == invariant:
            raise run.plan_error
        return
    _require_plan(run, invariant)


def _require_plan_or_raw(run: PointRun, invariant: str) -> None:
    """Static segment checks run on the raw answer even when the core then refused the plan."""
    if run.raw_segments and len(run.raw_segments) == len(run.decode_geometry):
        return
    _require_plan(run, invariant)


def check_no_overlapping_writes(run: PointRun) -> None:
    """No two segments of one phase of a local region write the same byte of its page.

    Segments of different phases apply to different block pairs (a decode block smaller than the
    prefill's takes one phase); when one decode block takes several phases, a double write shows
    up per request in every-byte-once."""
    _require_plan_or_raw(run, NO_OVERLAP)
    for geo, per_region in zip(run.decode_geometry, run.raw_segments):
        for name, segs in per_region.items():
            by_phase: dict[int, list[Segment]] = {}
            for seg in segs:
                by_phase.setdefault(seg.phase, []).append(seg)
            for phase_segs in by_phase.values():
                _check_disjoint_writes(run, geo.tp_rank, name, phase_segs)
    _after_raw(run, NO_OVERLAP)


def _check_disjoint_writes(run: PointRun, rank: int, name: str, segs: Sequence[Segment]) -> None:
    ordered = sorted(segs, key=lambda s: (s.local_offset, s.nbytes))
    for a, b in zip(ordered, ordered[1:]):
        if a.local_offset + a.nbytes > b.local_offset:
            raise ContractViolation(
                NO_OVERLAP,
                f"{run.point.id}: decode rank {rank} layer {name!r}: bytes "
                f"[{b.local_offset}, {min(a.local_offset + a.nbytes, b.local_offset + b.nbytes)}) of every "
                f"block are written twice (from prefill rank {a.remote_rank} offset {a.remote_offset} and "
                f"prefill rank {b.remote_rank} offset {b.remote_offset})",
            )


def _resolved(run: PointRun):
    from .oracle import id_lists
    from .rehearsal import Engines, request_blocks

    p_blocks, d_blocks = request_blocks(run.scenario, Engines(run.prefill, run.decode, run.plans))
    resolved = []
    for plan in run.plans:
        try:
            resolved.append(plan.resolve(id_lists(d_blocks), id_lists(p_blocks), run.scenario.request.num_tokens))
        except RequestError as exc:
            raise ContractViolation(
                EVERY_BYTE_ONCE, f"{run.point.id}: a well-formed request was refused: RequestError: {exc}"
            ) from None
        except NixlkvError:
            raise
        except Exception as exc:
            raise ContractViolation(
                DOCUMENTED_ERRORS, f"{run.point.id}: resolving a request raised {type(exc).__name__}: {exc}"
            ) from None
    return p_blocks, d_blocks, resolved


def _page_counts(regions: Sequence[Region]) -> dict[str, np.ndarray]:
    return {r.name: np.zeros((r.num_blocks, r.page.nbytes), dtype=np.int32) for r in regions}


def _locate(
    regions: Sequence[Region], addr: int, nbytes: int, owns: Callable[[Region, int], bool] | None = None
) -> tuple[Region, int, int] | None:
    """(region, block, offset in page) of a byte run lying wholly inside one page, or None.
    Regions of a blocks-first layout (BL...) interleave, and groups vLLM packs into one tensor
    alias the same bytes (block ``b`` is whichever group's the pool gave it to), so every region
    is tried and one whose group ``owns`` the block in this request wins."""
    found = None
    for r in regions:
        if r.base <= addr < r.end:
            block, offset = divmod(addr - r.base, r.block_stride)
            if offset + nbytes <= r.page.nbytes and block < r.num_blocks:
                if owns is None or owns(r, block):
                    return r, block, offset
                found = found or (r, block, offset)
    return found


def _wanted_bytes(region: Region, gb: Any) -> np.ndarray:
    """bool ``[num_blocks, page bytes]``: the bytes the decode engine must receive. ``gb.holds``
    says which token slots of each block are delivered (a decode block larger than the prefill's
    last block is only partly fed); pages with a token axis map slots to bytes, others are
    delivered whole."""
    wanted = np.zeros((region.num_blocks, region.page.nbytes), dtype=bool)
    rows = gb.holds.any(axis=1)
    if not rows.any():
        return wanted
    held = gb.holds[rows]
    token = _token_of_byte(region.page)
    if token is None or held.all():
        wanted[gb.ids[rows]] = True
    else:
        wanted[gb.ids[rows]] = held[:, token]
    return wanted


def _token_of_byte(page: Any) -> np.ndarray | None:
    """The token slot every byte of a page belongs to, from where its parts put each element
    (``kblock`` pages of ``token`` slots each), or None for a page without tokens."""
    if "token" not in page.names:
        return None
    tokens = page.size("token")
    out = np.full(page.nbytes, -1, dtype=np.int64)
    for part in page.memory_parts:
        names = [n for n, _, _ in part.axes]
        idx = np.indices(tuple(size for _, size, _ in part.axes)).reshape(len(names), -1)
        offset = part.offset + sum(idx[i] * stride for i, (_, _, stride) in enumerate(part.axes))
        token = idx[names.index("token")]
        if "kblock" in names:
            token = idx[names.index("kblock")] * tokens + token
        out[offset] = token
    return out


def check_every_byte_once(run: PointRun) -> None:
    """Per decode rank: every byte of every page of the request's blocks that the decode engine
    must receive is written exactly once, and no other byte is written (sentinel bytes stay).
    A strategy may exempt itself from completeness only (``contract_exempt = {"full-coverage": reason}``)."""
    _require_plan(run, EVERY_BYTE_ONCE)
    exempt = "full-coverage" in exemptions(run.strategy)
    _, d_blocks, resolved = _resolved(run)
    for plan, res in zip(run.plans, resolved):
        regions = list(plan.local.regions)  # the case's layers and a wrapped point's companion
        counts = _page_counts(regions)
        mine = [set(gb.ids.tolist()) for gb in d_blocks]
        for la, _, _, n in plan.byte_moves(res):
            hit = _locate(regions, la, n, lambda r, b: b in mine[r.group])
            if hit is None:
                raise ContractViolation(
                    EVERY_BYTE_ONCE,
                    f"{run.point.id}: decode rank {plan.local.tp_rank} writes {n} bytes at {la:#x}, outside every page of its regions",
                )
            region, block, offset = hit
            counts[region.name][block, offset : offset + n] += 1
        for region in regions:
            gb = d_blocks[region.group]
            wanted = _wanted_bytes(region, gb)
            c = counts[region.name]
            twice = np.argwhere(c > 1)
            if twice.size:
                b, o = (int(x) for x in twice[0])
                raise ContractViolation(
                    EVERY_BYTE_ONCE,
                    f"{run.point.id}: decode rank {plan.local.tp_rank} layer {region.name!r} block {b} byte {o} "
                    f"is written {int(c[b, o])} times ({int((c > 1).sum())} bytes written more than once)",
                )
            stray = np.argwhere((c > 0) & ~wanted)
            if stray.size:
                b, o = (int(x) for x in stray[0])
                raise ContractViolation(
                    EVERY_BYTE_ONCE,
                    f"{run.point.id}: decode rank {plan.local.tp_rank} layer {region.name!r} block {b} is written "
                    f"(byte {o}) but is not one of the request's blocks the decode engine must receive "
                    f"({int(((c > 0) & ~wanted).sum())} stray bytes)",
                )
            if exempt:
                continue
            missing = np.argwhere((c == 0) & wanted)
            if missing.size:
                b, o = (int(x) for x in missing[0])
                position = int(gb.first_position + np.nonzero(gb.ids == b)[0][0])
                raise ContractViolation(
                    EVERY_BYTE_ONCE,
                    f"{run.point.id}: decode rank {plan.local.tp_rank} layer {region.name!r}: "
                    f"{int(((c == 0) & wanted).sum())} bytes of the request's blocks are never written; "
                    f"first: block {b} (request block position {position}) byte {o}. A strategy that "
                    "deliberately leaves bytes unwritten declares contract_exempt = {'full-coverage': '<why>'}",
                )


def check_reads_inside_request(run: PointRun) -> None:
    """Every byte read on a prefill rank lies in a page of one of the request's blocks that the
    prefill engine holds (never a freed, null or foreign block)."""
    _require_plan(run, READS_INSIDE_REQUEST)
    p_blocks, _, resolved = _resolved(run)
    held = [set(gb.ids[gb.holds.any(axis=1)].tolist()) for gb in p_blocks]
    for plan, res in zip(run.plans, resolved):
        for la, rank, ra, n in plan.byte_moves(res):
            regions = list(plan.remote[rank].regions)
            hit = _locate(regions, ra, n, lambda r, b: b in held[r.group])
            if hit is None:
                raise ContractViolation(
                    READS_INSIDE_REQUEST,
                    f"{run.point.id}: decode rank {plan.local.tp_rank} reads {n} bytes at {ra:#x} on prefill rank {rank}, "
                    "outside every page of its regions",
                )
            region, block, _ = hit
            if block not in held[region.group]:
                raise ContractViolation(
                    READS_INSIDE_REQUEST,
                    f"{run.point.id}: decode rank {plan.local.tp_rank} reads block {block} of layer {region.name!r} on "
                    f"prefill rank {rank}, which holds no KV of this request",
                )


def check_deterministic(run: PointRun) -> None:
    """Same inputs, same answers: regions, segments, plans and resolved descriptor IDs."""
    from .oracle import id_lists
    from .rehearsal import geometry

    _require_plan(run, DETERMINISTIC)
    for d, geo, raw, plan in zip(run.decode, run.decode_geometry, run.raw_segments, run.plans):
        again = geometry(d, run.dispatcher)
        if again != geo:
            raise ContractViolation(DETERMINISTIC, f"{run.point.id}: decode rank {geo.tp_rank}: local_region() answered differently twice")
        if _raw_segments(run, geo) != raw:
            raise ContractViolation(DETERMINISTIC, f"{run.point.id}: decode rank {geo.tp_rank}: segments() answered differently twice")
        if getattr(run.strategy, "segments_by_geometry", False) and _raw_segments(run, geo, more_blocks=3) != raw:
            raise ContractViolation(
                DETERMINISTIC,
                f"{run.point.id}: decode rank {geo.tp_rank}: segments() answered otherwise for regions holding 3 more "
                "blocks; a segment maps bytes of one page pair, and segments_by_geometry promises the block count "
                "does not enter it (set segments_by_geometry = False if it must)",
            )
        replan = run.dispatcher.plan(geo, run.prefill_geometry)
        if replan.to_dict() != plan.to_dict():
            raise ContractViolation(DETERMINISTIC, f"{run.point.id}: decode rank {geo.tp_rank}: two plans from the same geometry differ")
    p_blocks, d_blocks, first = _resolved(run)
    _, _, second = _resolved(run)
    for a, b in zip(first, second):
        if not _same_reads(a, b):
            raise ContractViolation(DETERMINISTIC, f"{run.point.id}: resolving the same request twice gave different descriptors")
    # A pairing the strategy declared for the core to apply (Strategy.block_pairing) pairs as its
    # own pair_blocks does.
    for plan, a in zip(run.plans, first):
        if all(g.declared is None for g in plan.pairings):
            continue
        b = plan.undeclared().resolve(id_lists(d_blocks), id_lists(p_blocks), run.scenario.request.num_tokens)
        if not _same_reads(a, b):
            raise ContractViolation(
                DETERMINISTIC,
                f"{run.point.id}: decode rank {plan.local.tp_rank}: the pairing block_pairing declares "
                f"({[g.declared for g in plan.pairings]}) pairs otherwise than pair_blocks",
            )


def _same_reads(a: Any, b: Any) -> bool:
    return a.notify_only == b.notify_only and len(a.reads) == len(b.reads) and all(
        x.remote_rank == y.remote_rank and np.array_equal(x.local_ids, y.local_ids) and np.array_equal(x.remote_ids, y.remote_ids)
        for x, y in zip(a.reads, b.reads)
    )


def check_serialisable(run: PointRun) -> None:
    """Geometry survives the handshake (JSON round trip, equal after decoding) and plans print
    as JSON; a plan built from round-tripped geometry equals the original."""
    _require_plan(run, SERIALISABLE)
    prefill = {}
    for rank, geo in run.prefill_geometry.items():
        prefill[rank] = _round_trip(run, geo, f"prefill rank {rank}")
    for geo, plan in zip(run.decode_geometry, run.plans):
        local = _round_trip(run, geo, f"decode rank {geo.tp_rank}")
        try:
            text = json.dumps(plan.to_dict(), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ContractViolation(SERIALISABLE, f"{run.point.id}: plan of decode rank {geo.tp_rank} is not JSON: {exc}") from None
        replanned = run.dispatcher.plan(local, prefill)
        if json.dumps(replanned.to_dict(), sort_keys=True) != text:
            raise ContractViolation(
                SERIALISABLE, f"{run.point.id}: decode rank {geo.tp_rank}: the plan from handshake-decoded geometry differs"
            )


def _round_trip(run: PointRun, geo: RankGeometry, who: str) -> RankGeometry:
    """The geometry through both wire forms: the columnar one a handshake sends (to_wire) and the
    per-region one older peers send (to_dict); each must come back equal."""
    back = geo
    for form, encode in (("per-region", geo.to_dict), ("columnar", geo.to_wire)):
        try:
            wire = json.loads(json.dumps(encode()))
        except (TypeError, ValueError) as exc:
            raise ContractViolation(
                SERIALISABLE, f"{run.point.id}: {who}'s geometry is not JSON (facts must be plain str/int/float/bool/list): {exc}"
            ) from None
        back = RankGeometry.from_dict(wire)
        if back != geo:
            diff = [r.name for r, s in zip(geo.regions, back.regions) if r != s]
            raise ContractViolation(
                SERIALISABLE,
                f"{run.point.id}: {who}'s geometry changes over the wire ({form} form; regions {diff[:3]}): use plain fact values",
            )
    return back


def check_byte_oracle(run: PointRun) -> None:
    """Real NIXL READs, then every byte of every decode rank compared with the physics."""
    from .rehearsal import Engines, transfer_and_check

    _require_plan(run, BYTE_ORACLE)
    result = transfer_and_check(run.scenario, Engines(run.prefill, run.decode, run.plans))
    if result.outcome == "mismatch" and "full-coverage" in exemptions(run.strategy):
        message = _exempt_mismatches(run)
        if message is None:
            return
        raise ContractViolation(BYTE_ORACLE, f"{run.point.id}: mismatch: {message}")
    if result.outcome != "byte-exact":
        raise ContractViolation(BYTE_ORACLE, f"{run.point.id}: {result.outcome}: {result.message}")


def _exempt_mismatches(run: PointRun) -> str | None:
    """For a strategy exempt from full coverage: every byte it writes must be right, and every
    byte it leaves unwritten must still hold the sentinel (untouched), nothing else."""
    from . import oracle

    _, d_blocks, resolved = _resolved(run)
    wrong = []
    for d, plan, res in zip(run.decode, run.plans, resolved):
        actual = d.buffer.numpy().view(np.uint8)
        expected = oracle.expected_decode(d, d_blocks, run.scenario.request.seed).numpy().view(np.uint8)
        written = np.zeros(actual.size, dtype=bool)
        base = int(d.buffer.data_ptr())
        for la, _, _, n in plan.byte_moves(res):
            written[la - base : la - base + n] = True
        bad = (actual != expected) & ~(~written & (actual == oracle.SENTINEL))
        if bad.any():
            first = int(np.argmax(bad))
            wrong.append(
                f"decode rank {d.tp_rank}: {int(bad.sum())} wrong bytes; first at buffer offset {first}: "
                f"expected {int(expected[first]):#04x} (or the untouched sentinel), got {int(actual[first]):#04x}"
            )
    return "; ".join(wrong) or None


def check_documented_errors_probe(case: ContractCase) -> None:
    """Hostile inputs straight at the strategy: every refusal must be a documented nixlkv error.

    - ``pair_blocks`` with more local blocks than remote ones must raise ``RequestError``;
    - a peer advertising any fact with another value must be accepted or refused with a
      ``PlanError`` (IncompatibleGeometry / IncompatibleTopology), never assert or crash.
    """
    point = Point(2, 2, case.layouts[0], case.layouts[0], case.block_sizes[0], case.block_sizes[0], case.token_counts[-1])
    run = build_point(case, point)
    _require_plan(run, DOCUMENTED_ERRORS)
    pairing = next(p for p in run.plans[0].pairings if p.strategy.name == case.strategy)
    if case.refuses_longer_local_list:
        _probe_longer_local_list(run, pairing)
    geo = run.decode_geometry[0]
    region = next(r for r in geo.regions if r.strategy == case.strategy)
    peers = {p: run.prefill_geometry[p].region(region.name) for p in run.plans[0].covered}
    for key, value in region.facts.items():
        for rank, peer in peers.items():
            tampered = dict(peers)
            tampered[rank] = dataclasses.replace(peer, facts={**peer.facts, key: _other(value)})
            try:
                run.strategy.segments(region, tampered, Topology(geo.tp_size, geo.tp_rank), point.prefill_tp)
            except PlanError:
                continue
            except Exception as exc:
                raise ContractViolation(
                    DOCUMENTED_ERRORS,
                    f"a peer advertising {key}={_other(value)!r} (here {value!r}) made segments() raise "
                    f"{type(exc).__name__}: {exc}; refuse with IncompatibleGeometry naming the fact",
                ) from None
        try:
            stripped = {p: dataclasses.replace(r, facts={k: v for k, v in r.facts.items() if k != key}) for p, r in peers.items()}
            run.strategy.segments(region, stripped, Topology(geo.tp_size, geo.tp_rank), point.prefill_tp)
        except PlanError:
            pass
        except Exception as exc:
            raise ContractViolation(
                DOCUMENTED_ERRORS,
                f"a peer not advertising fact {key!r} made segments() raise {type(exc).__name__}: {exc}; "
                "use region.fact(key), which raises IncompatibleGeometry",
            ) from None


def _probe_longer_local_list(run: PointRun, pairing: Any) -> None:
    local_ids, remote_ids = np.arange(1, 6, dtype=np.int64), np.arange(1, 3, dtype=np.int64)
    try:
        run.strategy.pair_blocks(local_ids, remote_ids, pairing.local_region, pairing.remote_region)
    except RequestError:
        return
    except Exception as exc:
        raise ContractViolation(
            DOCUMENTED_ERRORS, f"pair_blocks with 5 local and 2 remote blocks raised {type(exc).__name__}: {exc}; expected RequestError"
        ) from None
    raise ContractViolation(DOCUMENTED_ERRORS, "pair_blocks paired 5 local blocks with 2 remote ones instead of raising RequestError")


def _other(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    return None


def check_pending_refuses(strategy: Strategy, spec: Any) -> None:
    """A placeholder strategy must refuse its kind cleanly (``NotImplementedError`` with a
    reason naming the strategy) at the first question, so it is never half-served."""
    from ..core import LayerCache, PageLayout

    layer = LayerCache("contract.layer", 0, spec, base=4096, num_blocks=4, block_stride=4096, page=PageLayout((("byte", 4096),)), hints={"total_kv_heads": 1})
    try:
        strategy.local_region(layer, Topology(1, 0))
    except NotImplementedError as exc:
        if strategy.name not in str(exc) or "not implemented" not in str(exc):
            raise ContractViolation(PENDING, f"placeholder {strategy.name!r} refuses without naming itself and why: {exc}") from None
        return
    except Exception as exc:
        raise ContractViolation(PENDING, f"placeholder {strategy.name!r} raised {type(exc).__name__}: {exc}, not NotImplementedError") from None
    raise ContractViolation(PENDING, f"placeholder {strategy.name!r} described a layer instead of refusing")


PER_POINT_CHECKS: dict[str, Callable[[PointRun], None]] = {
    INSIDE_REGIONS: check_segments_inside_regions,
    NO_OVERLAP: check_no_overlapping_writes,
    EVERY_BYTE_ONCE: check_every_byte_once,
    READS_INSIDE_REQUEST: check_reads_inside_request,
    DETERMINISTIC: check_deterministic,
    SERIALISABLE: check_serialisable,
    BYTE_ORACLE: check_byte_oracle,
}


def check_point(case: ContractCase, point: Point) -> None:
    """Every per-point invariant in order (the refusal check first); raises the first violation."""
    run = build_point(case, point)
    if case.refusal(point) is not None:
        check_refusal(run)
        return
    if run.plan_error is not None and run.plan_error.invariant not in (INSIDE_REGIONS, NO_OVERLAP):
        raise run.plan_error  # the raw segment checks below name those two more precisely
    for check in PER_POINT_CHECKS.values():
        check(run)


def check_case(case: ContractCase, points: Sequence[Point] | None = None) -> None:
    """The whole suite for one case, outside pytest (raises the first violation)."""
    check_dispatch(case)
    check_documented_errors_probe(case)
    for point in points if points is not None else case.points():
        check_point(case, point)
