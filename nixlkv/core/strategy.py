"""The strategy contract: what a per-spec-type plugin answers. Geometry only, no I/O, no NIXL."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from .errors import RequestError
from .geometry import LayerCache, Region, Segment
from .topology import Topology


class Strategy:
    """Base class of every strategy. Subclass it, set the class attributes, override the methods.

    - ``name``: unique, stable (it travels in the handshake: both sides must agree per layer).
    - ``spec_types``: the spec classes served; subclasses are served too unless another
      strategy claims a more specific class (dispatch walks the spec type's MRO).
    - ``overrides``: names of strategies this one deliberately replaces for the same types.
    - ``segments_by_geometry``: set it where :meth:`segments` is a function of the regions'
      geometry and facts only (not of their names or base addresses), so layers alike are
      planned once; default False (asked per layer).
    - ``contract_exempt``: invariants of the contract suite (docs/contract.md) this strategy
      deliberately does not hold, each with the reason. Only ``"full-coverage"`` may be
      exempted (a strategy that leaves some bytes of a request's blocks to the decode engine);
      the suite then checks that those bytes stay untouched instead.
    """

    name: ClassVar[str] = ""
    spec_types: ClassVar[tuple[type, ...]] = ()
    overrides: ClassVar[tuple[str, ...]] = ()
    contract_exempt: ClassVar[Mapping[str, str]] = {}
    # True where segments() depends only on the regions' geometry and facts, never on their
    # names or bases: the dispatcher then asks once per distinct layer geometry (an 80-layer
    # model has a handful) and gives every layer of that geometry the same segments.
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

        ``remote`` holds the same-named region on every remote rank this local rank covers.
        Raise :class:`IncompatibleGeometry` / :class:`IncompatibleTopology` for what cannot be
        served; never assert.
        """
        raise NotImplementedError(f"strategy {self.name!r} does not implement segments")

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


def tail_aligned(local_ids: np.ndarray, remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair the last ``len(local_ids)`` remote blocks with the local ones, position by position."""
    if len(local_ids) > len(remote_ids):
        raise RequestError(
            f"block count mismatch: {len(local_ids)} local blocks to fill but the remote engine "
            f"sent only {len(remote_ids)} block ids; the remote must send at least as many"
        )
    return local_ids, remote_ids[len(remote_ids) - len(local_ids) :]
