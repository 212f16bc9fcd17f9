"""Engine-agnostic core: numpy and pluggy only; no engine, tensor or transfer library (enforced by tests)."""

from .byte_runs import box_copy_runs
from .dispatcher import Dispatcher
from .errors import (
    HandshakeError,
    IncompatibleGeometry,
    IncompatibleTopology,
    MalformedRemoteFact,
    NixlkvError,
    NoStrategyError,
    PlanError,
    PlanValidationError,
    RegistryError,
    RequestError,
    StrategyConflict,
)
from .geometry import RankGeometry
from .hookspecs import hookimpl, hookspec
from .plan import TransferPlan
from .regions import LayerCache, PageLayout, PagePart, Region, Segment
from .registry import StrategyRegistry, plugin_manager
from .request_ids import IdScratch, ReadOp, ResolvedRequest
from .stages import StagePlans
from .strategy import OwnedTail, RunningState, Strategy, check_owned, tail_aligned
from .topology import (
    HeadRun,
    Stage,
    Topology,
    check_units_shardable,
    consumers_per_remote_rank,
    covered_remote_ranks,
    head_sources,
    heads_held,
    heads_per_rank,
    stage_sources,
    unit_sources,
    units_per_rank,
)

__all__ = [
    "Dispatcher", "HandshakeError", "HeadRun", "IncompatibleGeometry", "IncompatibleTopology",
    "LayerCache", "MalformedRemoteFact", "NixlkvError", "NoStrategyError", "PageLayout", "PagePart", "PlanError", "PlanValidationError",
    "RankGeometry", "ReadOp", "Region", "RegistryError", "RequestError", "ResolvedRequest", "Segment", "Stage", "StagePlans",
    "IdScratch", "OwnedTail", "RunningState", "Strategy", "StrategyConflict", "StrategyRegistry", "Topology", "TransferPlan", "box_copy_runs",
    "check_owned", "check_units_shardable", "consumers_per_remote_rank", "covered_remote_ranks", "head_sources", "heads_held",
    "heads_per_rank", "hookimpl", "stage_sources", "hookspec", "plugin_manager", "tail_aligned", "unit_sources", "units_per_rank",
]
