"""Mamba-style state caches (Mamba2, GDN, Mamba1): a conv state and a temporal (SSM) state.

vLLM packs one layer's page as ``[conv | ssm | padding]`` (``MambaBase.bind_kv_cache``). With
the dim-first (DS) conv layout the conv state is ``channels x (kernel - 1 + num_spec)``, each
rank's channels ordered ``[x_r | B_r | C_r]`` (GDN: ``[Q_r | K_r | V_r]``, Mamba1: ``[x_r]``),
and the SSM state is ``units x ...`` (Mamba2 / GDN heads, Mamba1 channels). Every part is split
over TP by its *own* unit: x by heads, B and C by groups. With ``n_groups = 1`` every rank holds
group 0 whole (vLLM replicates it), so B/C do not shrink with TP — reading them at offsets
scaled by TP (what vLLM's own connector does) fetches wrong columns. Here each part is planned
per unit with :func:`nixlkv.core.unit_sources`, so replicated and sharded groups are both exact.

Each layer becomes two regions over the same blocks: ``<layer>:conv`` (axes channel x byte)
and ``<layer>:ssm`` (axes unit x byte), each one row-major page. A ``tp_replicated`` state
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
        conv_rows_bytes = facts["conv_rows"] * facts["conv_itemsize"]
        channels = sum(n * per for _, _, n, per, _ in rank_conv_layout(facts, topology.tp_size))
        unit_name, units, elems = ssm_unit(facts)
        ssm_units = units_per_rank(topology.tp_size, units, "num_heads" if unit_name == "head" else "intermediate_size")
        conv = PageLayout((("channel", channels), ("byte", conv_rows_bytes)))
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
        if layout != "DS":
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state layout is {layout!r}; nixlkv needs the dim-first layout "
                "(VLLM_SSM_CONV_STATE_LAYOUT=DS) so each conv sub-projection is one contiguous byte run"
            )
        facts: dict[str, Any] = {k: int(model[k]) for k in MODEL_FACTS}
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
        if conv_shape[0] != channels or (conv_shape[1] == channels and conv_shape[0] != conv_shape[1]):
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state shape {conv_shape} is state-first (SD layout); nixlkv needs "
                "the dim-first layout (VLLM_SSM_CONV_STATE_LAYOUT=DS) so each sub-projection is one byte run"
            )
        facts["conv_rows"] = conv_shape[1]
        if conv_shape[1] < facts["conv_kernel"] - 1:
            raise IncompatibleGeometry(
                f"layer {layer.name!r}: conv state holds {conv_shape[1]} positions, fewer than conv_kernel - 1 = "
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
            if peer.page.nbytes != local.page.nbytes:
                raise IncompatibleGeometry(
                    f"layer {local.name!r}: replicated state of {local.page.nbytes} B here, {peer.page.nbytes} B remotely"
                )
            return [Segment(local.name, 0, source, peer.name, 0, local.page.nbytes)]
        facts = local.facts
        if part == "conv":
            row = local.page.size("byte")
            local_parts = rank_conv_layout(facts, local_topology.tp_size)
            remote_parts = rank_conv_layout(facts, remote_tp)
            out = []
            for (name, lstart, _, per, single), (_, rstart, rn, _, _) in zip(local_parts, remote_parts):
                units = next(u for n, u, _, _ in conv_parts(facts) if n == name)
                for run in unit_sources(rank, local_topology.tp_size, remote_tp, units, part_what(facts, name), single):
                    peer = remote[run.remote_rank]
                    self._check_peer_page(local, peer, "channel", sum(n * p for _, _, n, p, _ in remote_parts))
                    out.append(
                        Segment(
                            local.name, (lstart + run.local_slot * per) * row, run.remote_rank, peer.name,
                            (rstart + run.remote_slot * per) * row, run.count * per * row,
                        )
                    )
            return out
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
