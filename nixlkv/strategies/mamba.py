"""Mamba-style state caches (Mamba2, GDN, Mamba1): a conv state and a temporal (SSM) state.

vLLM packs one layer's page as ``[conv | ssm | padding]`` (``MambaBase.bind_kv_cache``). The conv
state holds ``channels`` x ``rows`` elements (rows = kernel - 1 + num_spec), each rank's channels
ordered ``[x_r | B_r | C_r]`` (GDN: ``[Q_r | K_r | V_r]``, Mamba1: ``[x_r]``), in the engine's
``VLLM_SSM_CONV_STATE_LAYOUT``: dim-first ``DS`` (channel-major: a channel's rows together) or
state-first ``SD`` (row-major: a row holds every channel of the rank; vLLM's default). Where an
element lies is :class:`ConvPage` alone; each side may use either layout, and the SSM state is
``units x ...`` (Mamba2 / GDN heads, Mamba1 channels). Every part is split
over TP by its *own* unit: x by heads, B and C by groups. With ``n_groups = 1`` every rank holds
group 0 whole (vLLM replicates it), so B/C do not shrink with TP — reading them at offsets
scaled by TP (what vLLM's own connector does) fetches wrong columns. Here each part is planned
per unit with :func:`nixlkv.core.unit_sources`, so replicated and sharded groups are both exact.

Each layer becomes two regions over the same blocks: ``<layer>:conv`` (DS: axes channel x row x
byte, SD: row x channel x byte) and ``<layer>:ssm`` (axes unit x byte), each one row-major page. A TP
channel run is one byte run when both sides are DS, one per row when both are SD; between DS and
SD every element is a run of its own (a transpose), bounded by :data:`MAX_TRANSPOSED_ELEMENTS`. A ``tp_replicated`` state
(held whole on every rank) is one ``<layer>:state`` region copied whole from one remote rank.

The state after a prompt's last token cannot be the decode engine's starting point: vLLM's
decode engine computes that token again to get its logits, which would apply it twice. The
strategy declares it (:meth:`MambaStrategy.decode_recomputes` is 1): the prefill engine stops one
token short and the decode engine computes the last token from the state before it.

Only the request's running state block moves: a state group's block list is not a list of
token blocks (older entries are null placeholders or superseded states, trailing entries
speculative scratch), so it is never expanded to kernel blocks, trimmed for a prefix hit or
paired by token range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
from vllm.v1.kv_cache_interface import MambaSpec

from ..core import (
    IncompatibleGeometry,
    LayerCache,
    PageLayout,
    Region,
    RequestError,
    RunningState,
    Segment,
    Strategy,
    Topology,
    check_units_shardable,
    covered_remote_ranks,
    unit_sources,
    units_per_rank,
)
from .full_attention import check_matching_facts

MAMBA_TYPES = ("MAMBA2", "GDN_ATTN", "MAMBA1")
# Model facts an engine must give per mamba layer (hint "mamba"); a per-rank spec cannot tell
# them (a replicated group looks the same as a sharded one).
MODEL_FACTS = ("num_heads", "head_dim", "d_state", "n_groups", "intermediate_size", "conv_kernel")
MATCHING_FACTS = {
    "mamba_type": "mamba type",
    "tp_replicated": "whether the state is replicated on every rank",
    "num_heads": "SSM head count",
    "head_dim": "SSM head dim",
    "d_state": "SSM state size",
    "n_groups": "B/C group count (n_groups)",
    "intermediate_size": "intermediate size",
    "conv_kernel": "conv kernel size",
    "conv_rows": "conv state length (kernel - 1 + speculative tokens)",
    "conv_dtype": "conv state dtype",
    "ssm_dtype": "SSM state dtype",
    "num_speculative_blocks": "speculative state blocks",
    "state_bytes": "bytes of a replicated state page",
}

Part = tuple[str, int, int, bool]  # (name, units in the model, channels per unit, single unit replicated)


def conv_parts(facts: Mapping[str, Any]) -> list[Part]:
    """The conv state's sub-projections in channel order, each with its TP unit."""
    kind, h, hd, n, g = (facts[k] for k in ("mamba_type", "num_heads", "head_dim", "d_state", "n_groups"))
    if kind == "MAMBA2":
        return [("x", h, hd, False), ("B", g, n, True), ("C", g, n, True)]
    if kind == "GDN_ATTN":  # Q and K by key heads (n_groups), V by value heads (num_heads)
        return [("Q", g, n, False), ("K", g, n, False), ("V", h, hd, False)]
    return [("x", facts["intermediate_size"], 1, False)]


def ssm_unit(facts: Mapping[str, Any]) -> tuple[str, int, int]:
    """(unit name, units in the model, elements per unit) of the temporal state."""
    if facts["mamba_type"] == "MAMBA1":  # (intermediate / tp, d_state)
        return "channel", facts["intermediate_size"], facts["d_state"]
    return "head", facts["num_heads"], facts["head_dim"] * facts["d_state"]  # (heads/tp, hd, d_state)


def part_what(facts: Mapping[str, Any], part: str) -> str:
    """The model field a part is sharded by, for error messages."""
    if facts["mamba_type"] == "MAMBA1":
        return "intermediate_size"
    return {"x": "num_heads", "V": "num_heads"}.get(part, "n_groups")


def rank_conv_layout(facts: Mapping[str, Any], tp: int) -> list[tuple[str, int, int, int, bool]]:
    """(part, first channel on a rank, units per rank, channels per unit, replicated) for tp."""
    out, at = [], 0
    for name, units, per_unit, single in conv_parts(facts):
        n = units_per_rank(tp, units, part_what(facts, name), single)
        out.append((name, at, n, per_unit, single))
        at += n * per_unit
    return out


CONV_LAYOUTS = ("DS", "SD")  # VLLM_SSM_CONV_STATE_LAYOUT: dim-first, state-first (vLLM's default)
# Between a DS and an SD engine every conv element is a descriptor of its own. Above this many
# per layer (a real model's conv state is ~10k channels x 3 rows) the plan is refused, naming the
# setting that makes both sides alike.
MAX_TRANSPOSED_ELEMENTS = 1 << 12


@dataclass(frozen=True)
class ConvPage:
    """One block's conv state as an engine lays it out: ``channels`` x ``rows`` elements of
    ``itemsize`` bytes, channel-major (DS) or row-major (SD). :meth:`offsets` is where every conv
    byte offset of the strategy is computed."""

    layout: str
    channels: int
    rows: int
    itemsize: int

    def offsets(self, channel: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Byte offset in the page of element (channel, row), channels counted on this rank."""
        if self.layout == "DS":
            return (channel * self.rows + row) * self.itemsize
        return (row * self.channels + channel) * self.itemsize

    @property
    def page(self) -> PageLayout:
        """The same axes in the layout's order (row-major): a peer sees which layout it is."""
        channel, row, element = ("channel", self.channels), ("row", self.rows), ("byte", self.itemsize)
        return PageLayout((channel, row, element) if self.layout == "DS" else (row, channel, element))

    @classmethod
    def of(cls, region: Region) -> ConvPage:
        """The conv page a region advertises (a peer without ``conv_layout`` is DS: older nixlkv)."""
        layout = region.facts.get("conv_layout", "DS")
        if layout not in CONV_LAYOUTS:
            raise IncompatibleGeometry(f"region {region.name!r}: conv_layout {layout!r} is not one of {CONV_LAYOUTS}")
        return cls(layout, region.page.size("channel"), int(region.fact("conv_rows")), int(region.fact("conv_itemsize")))


def conv_runs(local: ConvPage, local_first: int, remote: ConvPage, remote_first: int, count: int) -> np.ndarray:
    """Byte runs ``[n, 3]`` (local offset, remote offset, nbytes) that copy channels
    ``[remote_first, +count)`` of the remote page into ``[local_first, +count)`` of the local one,
    every row: each element placed by :meth:`ConvPage.offsets`, then runs that continue each other
    on both sides joined (one run per channel run when both are DS, one per row when both are SD,
    one per element between DS and SD)."""
    channel = np.repeat(np.arange(count, dtype=np.int64), local.rows)
    row = np.tile(np.arange(local.rows, dtype=np.int64), count)
    lo = local.offsets(local_first + channel, row)
    ro = remote.offsets(remote_first + channel, row)
    order = np.argsort(lo, kind="stable")
    lo, ro = lo[order], ro[order]
    size = local.itemsize
    follows = (lo[1:] == lo[:-1] + size) & (ro[1:] == ro[:-1] + size)
    starts = np.flatnonzero(np.concatenate([[True], ~follows]))
    ends = np.concatenate([starts[1:], [lo.size]])
    return np.stack([lo[starts], ro[starts], (ends - starts) * size], axis=1)


class MambaStrategy(Strategy):
    name = "mamba"
    spec_types = (MambaSpec,)
    segments_by_geometry = True  # segments read pages and facts only, never names or bases

    def local_regions(self, layer: LayerCache, topology: Topology) -> Sequence[Region]:
        spec: MambaSpec = layer.spec
        facts = self._facts(layer, topology)
        real = spec.state_content_size_bytes
        if layer.page.nbytes != real:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: its view holds {layer.page.nbytes} B per block but the spec's states "
                f"take {real} B ({spec.shapes})"
            )
        if spec.tp_replicated:
            page = PageLayout((("byte", real),))
            return (Region.of_layer(layer, self.name, {**facts, "part": "state"}, page=page, part="state"),)
        channels = sum(n * per for _, _, n, per, _ in rank_conv_layout(facts, topology.tp_size))
        unit_name, units, elems = ssm_unit(facts)
        ssm_units = units_per_rank(topology.tp_size, units, "num_heads" if unit_name == "head" else "intermediate_size")
        conv = ConvPage(facts["conv_layout"], channels, facts["conv_rows"], facts["conv_itemsize"]).page
        ssm = PageLayout(((unit_name, ssm_units), ("byte", elems * facts["ssm_itemsize"])))
        return (  # each block: the conv state, then the SSM state
            Region.of_layer(layer, self.name, {**facts, "part": "conv"}, page=conv, part="conv"),
            Region.of_layer(layer, self.name, {**facts, "part": "ssm"}, page=ssm, part="ssm", offset=conv.nbytes),
        )

    def local_region(self, layer: LayerCache, topology: Topology) -> Region:
        raise IncompatibleGeometry(f"layer {layer.name!r}: a mamba layer is several regions; use local_regions")

    def _facts(self, layer: LayerCache, topology: Topology) -> dict[str, Any]:
        """The layer's model geometry, checked against the per-rank shapes vLLM actually built."""
        spec: MambaSpec = layer.spec
        kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
        if kind not in MAMBA_TYPES:
            raise IncompatibleGeometry(f"layer {layer.name!r}: mamba_type {kind} is not one of {MAMBA_TYPES}")
        model = layer.hints.get("mamba")
        if not isinstance(model, Mapping) or any(not isinstance(model.get(k), int) for k in MODEL_FACTS):
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: the engine must give the layer's model geometry as hint 'mamba' with "
                f"integer fields {MODEL_FACTS}; per-rank shapes cannot tell a replicated B/C group from a sharded one"
            )
        layout = model.get("conv_state_layout", "DS")
        if layout not in CONV_LAYOUTS:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state layout {layout!r} is not one of {CONV_LAYOUTS} "
                "(VLLM_SSM_CONV_STATE_LAYOUT)"
            )
        facts: dict[str, Any] = {k: int(model[k]) for k in MODEL_FACTS}
        facts["conv_layout"] = layout
        facts["mamba_type"] = kind
        facts["tp_replicated"] = bool(spec.tp_replicated)
        facts["num_speculative_blocks"] = int(spec.num_speculative_blocks)
        if len(spec.shapes) != 2 or len(spec.dtypes) != 2:
            if spec.tp_replicated:
                facts["state_bytes"] = spec.state_content_size_bytes
                return facts
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: {len(spec.shapes)} states {spec.shapes}; the mamba strategy moves a "
                "(conv, ssm) pair only (ReplaySSM ring states are not supported)"
            )
        conv_shape, ssm_shape = (tuple(int(x) for x in s) for s in spec.shapes)
        conv_dtype, ssm_dtype = spec.dtypes
        facts["conv_dtype"] = str(conv_dtype).removeprefix("torch.")
        facts["ssm_dtype"] = str(ssm_dtype).removeprefix("torch.")
        facts["conv_itemsize"] = int(conv_dtype.itemsize)
        facts["ssm_itemsize"] = int(ssm_dtype.itemsize)
        if spec.tp_replicated:
            facts["state_bytes"] = spec.state_content_size_bytes
            return facts
        tp = topology.tp_size
        for name, units, _, single in conv_parts(facts):
            check_units_shardable(tp, units, part_what(facts, name), single)
        channels = sum(n * per for _, _, n, per, _ in rank_conv_layout(facts, tp))
        if len(conv_shape) != 2 or channels not in conv_shape:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state shape {conv_shape} does not hold the {channels} channels "
                f"{[p[0] for p in conv_parts(facts)]} a {kind} layer has per rank at tp={tp}"
            )
        rows, held_channels = conv_shape if layout == "SD" else conv_shape[::-1]
        if held_channels != channels:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state shape {conv_shape} is not {layout} "
                f"({'rows x channels' if layout == 'SD' else 'channels x rows'}) with {channels} channels, but "
                f"the engine reports VLLM_SSM_CONV_STATE_LAYOUT={layout}"
            )
        facts["conv_rows"] = rows
        if rows < facts["conv_kernel"] - 1:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state holds {rows} positions, fewer than conv_kernel - 1 = "
                f"{facts['conv_kernel'] - 1}"
            )
        unit_name, units, elems = ssm_unit(facts)
        held = units_per_rank(tp, units, "num_heads" if unit_name == "head" else "intermediate_size")
        if not ssm_shape or ssm_shape[0] != held or prod(ssm_shape) != held * elems:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: SSM state shape {ssm_shape}, but {units} {unit_name}s over tp={tp} "
                f"with {elems} elements each give ({held}, ...) of {held * elems} elements"
            )
        return facts

    def segments(
        self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int
    ) -> list[Segment]:
        for peer in remote.values():
            check_matching_facts(local, peer, MATCHING_FACTS)
            if peer.facts.get("part") != local.fact("part"):
                raise IncompatibleGeometry(
                    f"region {local.name!r} is the {local.fact('part')} state here but {peer.facts.get('part')!r} remotely"
                )
        part = local.fact("part")
        rank = local_topology.tp_rank
        if part == "state":
            source = covered_remote_ranks(rank, local_topology.tp_size, remote_tp)[0]
            peer = remote[source]
            theirs = peer.facts.get("conv_layout", "DS")
            if theirs != local.facts.get("conv_layout", "DS"):
                raise IncompatibleGeometry(
                    f"layer {local.name!r}: a replicated conv state laid out {local.facts.get('conv_layout', 'DS')} "
                    f"here and {theirs} remotely is not moved (a transpose); set VLLM_SSM_CONV_STATE_LAYOUT to the "
                    "same value (DS or SD) on both engines"
                )
            if peer.page.nbytes != local.page.nbytes:
                raise IncompatibleGeometry(
                    f"layer {local.name!r}: replicated state of {local.page.nbytes} B here, {peer.page.nbytes} B remotely"
                )
            return [Segment(local.name, 0, source, peer.name, 0, local.page.nbytes)]
        facts = local.facts
        if part == "conv":
            return self._conv_segments(local, remote, local_topology, remote_tp)
        unit_name, units, _ = ssm_unit(facts)
        what = "num_heads" if unit_name == "head" else "intermediate_size"
        size = local.page.size("byte")
        out = []
        for run in unit_sources(rank, local_topology.tp_size, remote_tp, units, what):
            peer = remote[run.remote_rank]
            self._check_peer_page(local, peer, unit_name, units_per_rank(remote_tp, units, what))
            out.append(
                Segment(local.name, run.local_slot * size, run.remote_rank, peer.name, run.remote_slot * size, run.count * size)
            )
        return out

    def _conv_segments(
        self, local: Region, remote: Mapping[int, Region], local_topology: Topology, remote_tp: int
    ) -> list[Segment]:
        """Every TP channel run of every sub-projection, as the byte runs :func:`conv_runs` gives
        between the two sides' conv pages (each in its own layout)."""
        facts = local.facts
        rank = local_topology.tp_rank
        mine = ConvPage.of(local)
        remote_parts = rank_conv_layout(facts, remote_tp)
        remote_channels = sum(n * p for _, _, n, p, _ in remote_parts)
        out, transposed = [], 0
        for (name, lstart, _, per, single), (_, rstart, _, _, _) in zip(rank_conv_layout(facts, local_topology.tp_size), remote_parts):
            units = next(u for n, u, _, _ in conv_parts(facts) if n == name)
            for run in unit_sources(rank, local_topology.tp_size, remote_tp, units, part_what(facts, name), single):
                peer = remote[run.remote_rank]
                theirs = ConvPage.of(peer)
                if peer.page != ConvPage(theirs.layout, remote_channels, mine.rows, mine.itemsize).page:
                    raise IncompatibleGeometry(
                        f"region {peer.name!r} on the remote engine has page {peer.page.describe()}, but the model's "
                        f"geometry at its TP size gives {remote_channels} channels x {mine.rows} rows of "
                        f"{mine.itemsize} B ({theirs.layout})"
                    )
                count = run.count * per
                runs = conv_runs(mine, lstart + run.local_slot * per, theirs, rstart + run.remote_slot * per, count)
                out += [Segment(local.name, lo, run.remote_rank, peer.name, ro, n) for lo, ro, n in runs.tolist()]
                transposed += count * mine.rows if theirs.layout != mine.layout else 0
        if transposed > MAX_TRANSPOSED_ELEMENTS:
            raise IncompatibleGeometry(
                f"layer {local.name!r}: the conv state is {mine.layout} here and "
                f"{'SD' if mine.layout == 'DS' else 'DS'} on the remote engine, so each of its {transposed} "
                f"elements would be a descriptor of its own (more than {MAX_TRANSPOSED_ELEMENTS} per layer); set "
                "VLLM_SSM_CONV_STATE_LAYOUT to the same value (SD, vLLM's default, or DS) on both engines"
            )
        return out

    @staticmethod
    def _check_peer_page(local: Region, peer: Region, axis: str, expected: int) -> None:
        """The remote page must be what its TP size implies (its advertised facts are the model's)."""
        names = peer.page.names
        if axis not in names or peer.page.size(axis) != expected or peer.page.size("byte") != local.page.size("byte"):
            raise IncompatibleGeometry(
                f"region {peer.name!r} on the remote engine has page {peer.page.describe()}, but the model's "
                f"geometry at its TP size gives {axis}{expected}xbyte{local.page.size('byte')}"
            )

    def decode_recomputes(self, spec: Any) -> int:
        """One: a running state after N tokens has taken token N, and the decode engine computes
        the last prompt token again for its logits, so it must start from the state after N - 1."""
        return 1

    def pair_blocks(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local: Region,
        remote: Region,
        num_tokens: int | None = None,
    ) -> tuple[np.ndarray, ...]:
        """The running state slot of each side's list, and nothing else (never token-paired)."""
        if local_ids.size == 0:
            return local_ids[:0], remote_ids[:0]
        i = running_state_index(local_ids, speculative_blocks(local), "local")
        j = running_state_index(remote_ids, speculative_blocks(remote), "remote")
        return local_ids[i : i + 1], remote_ids[j : j + 1]  # the ids' own dtype: no conversion

    def block_pairing(self, local: Region, remote: Region) -> RunningState:
        """:meth:`pair_blocks` as a pairing the core applies itself: the running state of each
        side, before that side's speculative scratch slots."""
        return RunningState(speculative_blocks(local), speculative_blocks(remote))


def speculative_blocks(region: Region) -> int:
    """Scratch slots after the running state in a request's state list (vLLM's
    ``num_speculative_blocks``; 0 where the region does not say)."""
    return int(region.facts.get("num_speculative_blocks", 0))


def running_state_index(ids: np.ndarray, num_speculative_blocks: int, side: str) -> int:
    """Where in a request's state list its running state is: the last entry before the
    speculative scratch slots (vLLM's ``clip_ssm_state_blocks``). Earlier entries are nulls or
    superseded states; the running state itself is never the null block."""
    if ids.size == 0:
        raise RequestError(f"{side} state group has no block for the request: its running state cannot move")
    k = ids.size - 1 - min(num_speculative_blocks, ids.size - 1)
    if ids[k] == 0:
        raise RequestError(f"{side} running state block is vLLM's null block 0: the request holds no state to move")
    return k


def running_state_block(ids: np.ndarray, num_speculative_blocks: int, side: str) -> int:
    """The block holding a request's running state (:func:`running_state_index`)."""
    return int(ids[running_state_index(ids, num_speculative_blocks, side)])
