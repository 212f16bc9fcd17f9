"""The strategy contract: what a per-spec-type plugin answers. Geometry only, no I/O, no NIXL."""

from __future__ import annotations

import functools

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .errors import PlanError, RequestError
from .regions import LayerCache, Region, Segment
from .topology import Topology


class Strategy:
    """Base class of every strategy. Subclass it, set the class attributes, override the methods.

    - ``name``: unique, stable (it travels in the handshake: both sides must agree per layer).
    - ``spec_types``: the spec classes served; subclasses are served too unless another
      strategy claims a more specific class (dispatch walks the spec type's MRO).
    - ``overrides``: names of strategies this one deliberately replaces for the same types.
    - ``segments_by_geometry``: set it where :meth:`segments` is a function of the regions'
      pages, strides and facts only (not of their names, base addresses or block counts), so
      layers alike are planned once, and engines that differ only in block counts share
      segments; default False (asked per layer).
    - ``contract_exempt``: invariants of the contract suite (docs/contract.md) this strategy
      deliberately does not hold, each with the reason. Only ``"full-coverage"`` may be
      exempted (a strategy that leaves some bytes of a request's blocks to the decode engine);
      the suite then checks that those bytes stay untouched instead.
    """

    name: ClassVar[str] = ""
    spec_types: ClassVar[tuple[type, ...]] = ()
    overrides: ClassVar[tuple[str, ...]] = ()
    contract_exempt: ClassVar[Mapping[str, str]] = {}
    # True where segments() depends only on the regions' pages, strides and facts, never on
    # their names, bases or block counts: the dispatcher then asks once per distinct layer
    # geometry (an 80-layer model has a handful) and gives every layer of that geometry the same
    # segments, for every engine of that shape.
    segments_by_geometry: ClassVar[bool] = False

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        """Describe one local layer as a region, with the facts a peer needs to pair with it."""
        raise NotImplementedError(f"strategy {self.name!r} does not implement local_region")

    def local_regions(self, layer: LayerCache, topology: Topology) -> Sequence[Region]:
        """Every region of one local layer; by default the single one :meth:`local_region` gives.

        A layer whose page packs differently-sharded parts (a Mamba page is ``[conv | ssm | pad]``,
        each part split over TP by its own unit) describes each part as its own region over the
        same blocks, so every region stays one row-major array of named axes.
        """
        return (self.local_region(layer, topology),)

    def segments(
        self,
        local: Region,
        remote: Mapping[int, Region],
        local_topology: Topology,
        remote_tp: int,
    ) -> list[Segment]:
        """Which bytes of ``local``'s page come from which remote rank's page.

        ``remote`` holds the same-named region on every remote rank this local rank covers
        (only those :meth:`source_ranks` names, where it names some).
        Raise :class:`IncompatibleGeometry` / :class:`IncompatibleTopology` for what cannot be
        served; never assert.
        """
        raise NotImplementedError(f"strategy {self.name!r} does not implement segments")

    def source_ranks(self, local: Region, local_topology: Topology, remote_tp: int) -> Sequence[int] | None:
        """The covered remote ranks whose regions :meth:`segments` reads for ``local``, where it
        reads from fewer than all (a replicated cache is read from one): the dispatcher then
        plans with those ranks' geometry only, and the other covered ranks are only told when a
        request's blocks may be freed. None (the default): every covered rank."""
        return None

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        """Pair a request's local and remote block IDs of one KV group (vectorised).

        Returns ``(local, remote)`` or ``(local, remote, phase)`` arrays of equal length; a
        pair applies the segments of its phase. ``local`` / ``remote`` are one region of the
        group on each side, for the facts the pairing depends on (tokens per block, window...);
        ``num_tokens`` is the request's length when known. Default: blocks aligned at the tail.
        The local list may be shorter than the remote one (the local engine already holds a
        prefix); it may not be longer.
        """
        return tail_aligned(local_ids, remote_ids)

    def block_pairing(self, local: Region, remote: Region) -> OwnedTail | RunningState | None:
        """A pairing the core applies itself for this group, asked once per plan (``local`` /
        ``remote``: a region of the group on each side, as for :meth:`pair_blocks`), or None
        (the default): :meth:`pair_blocks` is called per request. The answer (:class:`OwnedTail`,
        :class:`RunningState`) must pair exactly as :meth:`pair_blocks` would for every request;
        the core then converts and checks the ids of every declared group in one step, without
        a call per request (the contract kit compares them)."""
        return None

    def decode_recomputes(self, spec: Any) -> int:
        """Trailing prompt tokens the decode engine must compute itself, from a cache that holds
        everything before them (``spec``: the layer's own spec). Default 0.

        A decode engine that loads a whole prompt computes its last token again to get the
        logits. Token KV is simply rewritten by that, but a running state (Mamba, GDN, short
        conv) would take the token twice: such a strategy returns 1, and the prefill engine then
        stops that many tokens short of the prompt's end. Declaring more than is needed is
        always correct (the decode engine computes more); declaring less is a wrong answer.
        """
        return 0

    def __repr__(self) -> str:
        return f"<strategy {self.name} for {', '.join(t.__name__ for t in self.spec_types)}>"


@dataclass(frozen=True)
class OwnedTail:
    """The pairing of blocks a request owns outright (:meth:`Strategy.block_pairing`): no id is
    vLLM's null block 0, both sides hold the same tokens per block, and the local blocks pair in
    order with the last as many remote blocks (:func:`check_owned`, then :func:`tail_aligned`)."""

    kind: str  # what the group holds, as refusals name it ("full-attention")


@dataclass(frozen=True)
class RunningState:
    """The pairing of a group that holds one running state per request (a Mamba SSM or conv
    state; :meth:`Strategy.block_pairing`): each side's list pairs only its running-state entry,
    the last before that side's speculative scratch slots (``local_speculative`` /
    ``remote_speculative``, vLLM's ``num_speculative_blocks``). An empty local list pairs nothing.
    The core applies it only to requests it fits (a remote entry, neither running state the null
    block 0, ids in bounds); any other request is paired by the strategy's own ``pair_blocks``,
    which names what is wrong."""

    local_speculative: int = 0
    remote_speculative: int = 0

    def __post_init__(self) -> None:
        for name in ("local_speculative", "remote_speculative"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"RunningState.{name} must be an integer >= 0 (scratch slots after the running state), got {value!r}")


DeclaredPairing = OwnedTail | RunningState


@functools.lru_cache(maxsize=None)
def _answers_its_pairing(cls: type) -> bool:
    """Whether the class in ``cls``'s MRO that answers ``block_pairing`` is the one that pairs
    (``pair_blocks``) or a subclass of it: a fact of the class, found once."""
    mro = cls.__mro__
    declares = next((c for c in mro if "block_pairing" in c.__dict__), None)
    pairs = next((c for c in mro if "pair_blocks" in c.__dict__), None)
    return declares is not None and pairs is not None and mro.index(pairs) >= mro.index(declares)


def declared_pairing(strategy: Any, local: Region, remote: Region) -> DeclaredPairing | None:
    """``strategy.block_pairing(local, remote)``, trusted only where the class that answers it also
    pairs: a subclass that overrides ``pair_blocks`` below that class pairs its own way."""
    if not _answers_its_pairing(type(strategy)):
        return None
    found = strategy.block_pairing(local, remote)
    if found is not None and not isinstance(found, (OwnedTail, RunningState)):
        raise PlanError(f"strategy {strategy.name!r}: block_pairing must return an OwnedTail, a RunningState or None, got {found!r}")
    return found


def check_owned(local_ids: np.ndarray, remote_ids: np.ndarray, kind: str) -> None:
    """Refuse vLLM's null block (id 0) in a group whose requests own every block."""
    if np.count_nonzero(local_ids) != local_ids.size or np.count_nonzero(remote_ids) != remote_ids.size:
        raise RequestError(null_block_message(kind))


def null_block_message(kind: str) -> str:
    return (
        f"block id 0 (vLLM's null block) in a {kind} group: such a request owns every one of "
        "its blocks; a windowed cache needs its own strategy"
    )


def tail_aligned(local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair the last ``len(local_ids)`` remote blocks with the local ones, position by position."""
    if len(local_ids) > len(remote_ids):
        raise RequestError(count_mismatch_message(len(local_ids), len(remote_ids)))
    return local_ids, remote_ids[len(remote_ids) - len(local_ids) :]


def count_mismatch_message(local: int, remote: int) -> str:
    return (
        f"block count mismatch: {local} local blocks to fill but the remote engine "
        f"sent only {remote} block ids; the remote must send at least as many"
    )
