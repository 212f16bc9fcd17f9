"""vLLM 0.33's own NIXL planner code, called on a stand-in worker: the baseline, never a copy.

``NixlBaseConnectorWorker`` needs a GPU engine to construct, but the functions that turn a
handshake into descriptor lists and block ids into descriptor ids only read plain attributes.
:class:`VllmPlanner` sets those (what ``register_kv_caches`` would have set for an unpadded,
single-group, attention-only LBHNC cache) on a :class:`types.SimpleNamespace` and calls vLLM's
unbound methods on it:

- registration (not timed as a handshake): the local descriptor rows, ``_build_fa_local``, as
  ``register_kv_caches`` makes them once;
- handshake: per remote rank vLLM handshakes with (``handshake_target_ranks``),
  ``_validate_remote_parallel_config`` and vLLM's whole ``add_remote_agent``: the TP mapping,
  the engine registration, the checks, the split local handles (built once per TP ratio and
  block size, as vLLM keeps them) and ``_build_fa_remote``. NIXL's own two calls in it (adding
  the agent, preparing a descriptor list) are left out, as nixlkv's handshake is timed without
  NIXL: they return at once (:class:`NixlCallsLeftOut`);
- per request: what ``pull_worker._read_blocks`` does per READ, ``_compute_desc_ids`` for the
  remote and the local side, once per source rank (``plan.all_source_ranks``).

The vLLM-side counts it reports (reads, descriptor ids, registered descriptors) are therefore
what vLLM's code computes, not a model of it.
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .shapes import Shape


def _decode_topology(planner: object, is_mla: bool, is_mamba: bool) -> object:
    """vLLM's TransferTopology of the measured decode rank (what its worker builds at start-up)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    return TransferTopology(
        tp_rank=planner.d_rank,
        tp_size=planner.d_tp,
        block_size=planner.shape.block_size,
        engine_id="decode",
        is_mla=is_mla,
        is_mamba=is_mamba,
        total_num_kv_heads=planner.shape.total_kv_heads(),
        attn_backends=[],
    )


def _worker_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    return NixlBaseConnectorWorker


class NixlCallsLeftOut:
    """The stand-in worker's ``nixl_wrapper``: NIXL's own calls in ``add_remote_agent`` return at
    once (nixlkv's handshake is timed without NIXL too); each descriptor list vLLM prepares is
    kept, so the counts read vLLM's own rows."""

    def __init__(self) -> None:
        self.lists: list[np.ndarray] = []

    def add_remote_agent(self, agent_metadata: bytes) -> str:
        return "remote-agent"

    def prep_xfer_dlist(self, agent_name: str, descs: np.ndarray, mem_type: str | None = None) -> int:
        self.lists.append(descs)
        return len(self.lists) - 1


# The worker methods a handshake and a request run (bound to the stand-in), and its static helpers.
_METHODS = ("_compute_desc_ids", "_build_fa_local", "_build_fa_remote", "_build_local_splits_from_plan",
            "_fa_desc_replicated", "_is_region_replicated", "_needs_split_local_xfer_handles",
            "add_remote_agent", "_validate_remote_agent_handshake", "_validate_remote_parallel_config")
_STATIC = ("_block_strided_descs", "_strided_desc_starts", "_pack_strided_descs")


def _bind(ns: types.SimpleNamespace, extra: Sequence[str] = ()) -> None:
    W = _worker_class()
    for name in (*_METHODS, *extra):
        setattr(ns, name, types.MethodType(getattr(W, name), ns))
    for name in _STATIC:
        setattr(ns, name, getattr(W, name))


def _handshake_state(ns: types.SimpleNamespace, block_size: int, local_rows: np.ndarray) -> None:
    """What ``add_remote_agent`` reads and fills beside the geometry: the worker's state after
    ``register_kv_caches`` (its local handle and rows) and before any handshake."""
    ns.nixl_wrapper = NixlCallsLeftOut()
    ns.src_blocks_data = local_rows
    ns.src_xfer_handles_by_block_size = {block_size: ns.nixl_wrapper.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows)}
    ns.src_blocks_data_by_block_size = {}
    ns.src_xfer_handles_by_tp_ratio = {}
    ns._dram_src_handles_by_tp_ratio = {}
    ns._remote_agents = {}
    ns.tp_mappings = {}
    ns.dst_num_blocks, ns.dst_region_num_blocks, ns.dst_region_group_ids = {}, {}, {}
    ns.dst_uses_region_group_mapping, ns.dst_region_mem_types = {}, {}
    ns.kv_caches_base_addr = defaultdict(dict)
    ns.dst_xfer_side_handles = defaultdict(dict)


BACKEND = "FLASH_ATTN"  # the attention backend both sides advertise


def _worker_settings(block_size: int, kv_cache_layout: str) -> dict[str, object]:
    """The worker settings ``add_remote_agent`` and its checks read: no PP, DCP, PCP, host
    buffer, packed rows or draft regions; pull mode; DRAM descriptors."""
    return dict(
        block_size=block_size,
        pp_size=1,
        dcp_size=1,
        pcp_size=1,
        _TRANSFER_MODE="pull",
        _packed_member_layouts={},
        use_host_buffer=False,
        kv_cache_layout=kv_cache_layout,
        backend_name=BACKEND,
        kv_transfer_config=types.SimpleNamespace(enable_permute_local_kv=False),
        _is_hma_required=False,
        nixl_memory_type="DRAM",
        _mixed_mem_types=False,
    )


@dataclass(frozen=True)
class VllmRead:
    remote_rank: int
    local_ids: np.ndarray
    remote_ids: np.ndarray
    local_rows: np.ndarray  # the local handle this READ uses (a split handle for P_TP > D_TP)


class VllmPlanner:
    """vLLM's planner for decode rank ``d_rank`` of ``d_tp`` reading from a prefill engine of ``p_tp``.

    ``local_base`` / ``remote_bases`` are region base addresses per layer (fake for planning,
    real for transfers); ``num_blocks`` is the block count of every region on both sides.
    """

    KV_CACHE_LAYOUT = "LBHNC"  # the layout the bench fabricates, both sides alike (a block-contiguous one)

    def __init__(
        self,
        shape: Shape,
        p_tp: int,
        d_tp: int,
        d_rank: int,
        num_blocks: int,
        local_bases: Sequence[int],
        remote_bases: dict[int, Sequence[int]],
        num_layers: int | None = None,
    ) -> None:
        self.shape = shape
        self.p_tp, self.d_tp, self.d_rank = p_tp, d_tp, d_rank
        self.num_blocks = num_blocks
        self.num_layers = num_layers or shape.num_layers
        self._local_bases = list(local_bases)
        self._remote_bases = {r: list(b) for r, b in remote_bases.items()}
        self.worker = self._stand_in()
        self.local_rows = self._register()  # register_kv_caches: once per worker, not per handshake
        _handshake_state(self.worker, self.shape.block_size, self.local_rows)
        self._engines = 0
        self.engine_id: str | None = None  # the prefill engine last handshaken

    def _stand_in(self) -> types.SimpleNamespace:
        local_page = self.shape.page(self.d_tp).nbytes
        spec = self.shape.spec(self.d_tp)
        ns = types.SimpleNamespace(
            transfer_topo=_decode_topology(self, is_mla=self.shape.is_mla, is_mamba=False),
            tp_rank=self.d_rank,
            # attention only, one KV group, no layer-name routing, no mamba, no padding
            _has_mamba=False,
            _conv_decomp=None,
            _ssm_region_indices=None,
            _transfer_layer_group_ids=[],
            _transfer_layer_region_indices=[],
            num_regions=self.num_layers,
            block_len_per_layer=[local_page] * self.num_layers,
            block_stride_per_layer=[local_page] * self.num_layers,
            region_num_blocks=[self.num_blocks] * self.num_layers,
            region_group_ids=[0] * self.num_layers,
            _uses_region_group_mapping=False,
            _region_is_mla=[self.shape.is_mla] * self.num_layers,
            _group_spec_types=(type(spec),),
            _logical_num_blocks=self.num_blocks,
            _physical_blocks_per_logical_kv_block=1,
            _ple_region_index=None,
            _ple_group_index=None,
            device_id=0,
            use_mla=self.shape.is_mla,
            draft_tp_mappings={},
            _head_sharded_draft_regions=set(),
            num_descs=self.num_blocks * self.num_layers,
            _layer_specs=dict.fromkeys((f"model.layers.{i}.attn" for i in range(self.num_layers)), spec),
            **_worker_settings(self.shape.block_size, self.KV_CACHE_LAYOUT),
        )
        _bind(ns)
        return ns

    def _register(self) -> np.ndarray:
        """The local descriptor rows ``register_kv_caches`` prepares (its local handle)."""
        return self.worker._build_fa_local(self._local_bases, 1)

    def _metadata(self, engine_id: str, rank: int) -> object:
        """Prefill rank ``rank``'s ``NixlAgentMetadata``, as vLLM decodes it from the handshake."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

        return NixlAgentMetadata(
            engine_id=engine_id,
            agent_metadata=b"",
            kv_caches_base_addr=self._remote_bases[rank],
            device_id=0,
            num_blocks=self.num_blocks,
            kv_cache_layout=self.KV_CACHE_LAYOUT,
            block_size=self.shape.block_size,
            attn_backend_name=BACKEND,
            physical_blocks_per_logical_kv_block=1,
            **self._remote_regions_meta(),
        )

    def _remote_regions_meta(self) -> dict[str, object]:
        """The metadata fields that describe a prefill rank's regions (every layer one page)."""
        page = self.shape.page(self.p_tp).nbytes
        return dict(block_lens=[page] * self.num_layers, block_strides=[page] * self.num_layers, ssm_sizes=(0, 0))

    # ------------------------------------------------------------------ handshake
    def handshake(self, first: bool = False) -> None:
        """What vLLM's decode worker does with a new prefill engine's handshake, per remote rank
        it handshakes with: the parallel-config check and ``add_remote_agent`` (NIXL's own calls
        left out). ``first``: as the worker's first handshake with an engine of this TP size
        (the split local handles are built; vLLM keeps them for later engines)."""
        ns = self.worker
        if first:
            ns.src_xfer_handles_by_tp_ratio.clear()
            ns._dram_src_handles_by_tp_ratio.clear()
        self._engines += 1
        engine = f"prefill-{self._engines}"
        agents = ns._remote_agents.setdefault(engine, {})
        for rank in ns.transfer_topo.handshake_target_ranks(self.p_tp):
            meta = self._metadata(engine, rank)
            ns._validate_remote_parallel_config(meta)
            agents[(0, rank)] = ns.add_remote_agent(meta, rank, self.p_tp, meta.dcp_size)
        self.engine_id = engine

    def handshake_first(self) -> None:
        """:meth:`handshake` as the worker's first with an engine of this TP size."""
        self.handshake(first=True)

    @property
    def mapping(self):
        """vLLM's TP mapping for the engine last handshaken (None before a handshake)."""
        return None if self.engine_id is None else self.worker.tp_mappings[self.engine_id]

    @property
    def split_rows(self) -> list[np.ndarray]:
        """The split local handles' rows vLLM keeps for this TP ratio (P_TP > D_TP), else none."""
        ns = self.worker
        key = (ns.transfer_topo.tp_ratio(self.p_tp), self.shape.block_size)
        return [ns.nixl_wrapper.lists[h] for h in ns.src_xfer_handles_by_tp_ratio.get(key, [])]

    @property
    def remote_rows(self) -> dict[int, np.ndarray]:
        """The remote rows vLLM prepared for every rank of the engine last handshaken."""
        ns = self.worker
        if self.engine_id is None:
            return {}
        return {rank: ns.nixl_wrapper.lists[h] for rank, h in ns.dst_xfer_side_handles[self.engine_id].items()}

    def _mapping(self):
        if self.mapping is None:
            raise RuntimeError("VllmPlanner.handshake() must run before requests are planned")
        return self.mapping

    @property
    def source_ranks(self) -> tuple[int, ...]:
        return tuple(self._mapping().all_source_ranks)

    def registered_descriptors(self) -> int:
        """Descriptors vLLM prepares for this pair: the local handle, the split handles, the remote handles."""
        self._mapping()
        rows = [self.local_rows, *self.split_rows, *self.remote_rows.values()]
        return int(sum(int(r[:, 4].sum()) for r in rows))

    # ------------------------------------------------------------------ per request
    def desc_ids(self, local_block_ids: list[list[int]], remote_block_ids: list[list[int]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per READ, what ``_read_blocks`` computes: (remote rank, local ids, remote ids).

        The timed path: one READ per source rank, two ``_compute_desc_ids`` calls each, with the
        arguments ``_read_blocks`` passes for an attention-only engine without DCP.
        """
        ns = self.worker
        out = []
        for rank in self._mapping().all_source_ranks:
            remote_ids = ns._compute_desc_ids(
                block_ids=remote_block_ids,
                dst_num_blocks=self.num_blocks,
                block_size_ratio=None,
                physical_blocks_per_logical=1,
                region_num_blocks=None,
                region_group_ids=None,
                uses_region_group_mapping=False,
            )
            local_ids = ns._compute_desc_ids(
                block_ids=local_block_ids,
                dst_num_blocks=self.num_blocks,
                block_size_ratio=1,
                physical_blocks_per_logical=1,
                region_num_blocks=None,
                region_group_ids=None,
                uses_region_group_mapping=False,
            )
            out.append((rank, local_ids, remote_ids))
        return out

    def reads(self, local_block_ids: list[list[int]], remote_block_ids: list[list[int]]) -> list[VllmRead]:
        """The READs vLLM posts, each with the local handle ``_read_blocks_for_req`` picks for it."""
        tp_ratio = self.worker.transfer_topo.tp_ratio(self.p_tp)
        splits = self.split_rows  # read off the worker once, not per READ
        out = []
        for i, (rank, lids, rids) in enumerate(self.desc_ids(local_block_ids, remote_block_ids)):
            rows = splits[i] if splits and tp_ratio < 0 else self.local_rows
            out.append(VllmRead(rank, lids, rids, rows))
        return out


@dataclass(frozen=True)
class VllmRegion:
    """One region as vLLM's ``register_kv_caches`` would record it: a distinct base address."""

    offset: int  # from the rank's allocation base
    block_len: int
    block_stride: int
    group: int  # the owning group, or -1 when layers of several groups alias it
    holds_mamba: bool


def vllm_regions(layout) -> list[VllmRegion]:
    """The regions ``register_kv_caches`` records for a hybrid layout (no PP, no kernel split).

    It walks the layers in ``_region_sort_key`` order and keeps one region per distinct base
    address; layers of other groups at the same address mark it shared (group -1). Every layer
    here has a dense page at its base, so a region's block length is the unified page.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import _region_sort_key
    from vllm.v1.kv_cache_interface import MambaSpec

    regions: dict[int, VllmRegion] = {}
    for layer in sorted(layout.layers, key=lambda x: _region_sort_key(x.name)):
        mamba = isinstance(layer.spec, MambaSpec)
        seen = regions.get(layer.offset)
        if seen is None:
            regions[layer.offset] = VllmRegion(layer.offset, int(layer.spec.page_size_bytes), layer.block_stride, layer.group, mamba)
        else:
            group = seen.group if seen.group == layer.group else -1
            regions[layer.offset] = VllmRegion(seen.offset, seen.block_len, seen.block_stride, group, seen.holds_mamba or mamba)
    return list(regions.values())


class HybridVllmPlanner(VllmPlanner):
    """vLLM's planner for a Mamba + attention hybrid (``_has_mamba``): attention descriptors for
    every region, then x / B / C / SSM descriptors per Mamba-bearing region (``_build_mamba_local``
    / ``_build_mamba_remote``), ids from ``_compute_desc_ids``'s Mamba path.

    ``local_layout`` / ``remote_layout`` are :func:`nixlkv.bench.hybrid.hybrid_layout` of the two
    sides; ``local_base`` / ``remote_bases`` the ranks' allocation bases.
    """

    def __init__(self, shape, p_tp: int, d_tp: int, d_rank: int, num_blocks: int, local_layout, remote_layout,
                 local_base: int, remote_bases: dict[int, int]) -> None:
        self.local_layout, self.remote_layout = local_layout, remote_layout
        self.local_regions, self.remote_regions = vllm_regions(local_layout), vllm_regions(remote_layout)
        local = [local_base + r.offset for r in self.local_regions]
        remote = {k: [b + r.offset for r in self.remote_regions] for k, b in remote_bases.items()}
        super().__init__(shape, p_tp, d_tp, d_rank, num_blocks, local, remote, num_layers=len(self.local_regions))

    def _stand_in(self) -> types.SimpleNamespace:
        from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

        from ..testing.kinds import vllm_conv_state_layout

        regions = self.local_regions
        n = len(regions)
        with vllm_conv_state_layout("DS"):  # NIXL's Mamba transfer requires it (asserted by vLLM)
            conv = derive_mamba_conv_split(self.local_layout.mamba_spec, self.d_tp)
            self.remote_ssm_sizes = derive_mamba_conv_split(self.remote_layout.mamba_spec, self.p_tp).ssm_sizes
        group_ids = [r.group for r in regions]
        ns = types.SimpleNamespace(
            transfer_topo=_decode_topology(self, is_mla=False, is_mamba=True),
            tp_rank=self.d_rank,
            _has_mamba=True,
            _conv_decomp=conv,
            _mamba_ssm_size=conv.ssm_sizes,
            _ssm_region_indices=[i for i, r in enumerate(regions) if r.holds_mamba],
            _scratch_region_indices=[],
            _transfer_layer_group_ids=[],
            _transfer_layer_region_indices=[],
            num_regions=n,
            block_len_per_layer=[r.block_len for r in regions],
            block_stride_per_layer=[r.block_stride for r in regions],
            region_num_blocks=[self.num_blocks] * n,  # register_kv_caches: every region, with mamba
            region_group_ids=group_ids,
            _uses_region_group_mapping=len(set(group_ids)) > 1,
            _region_is_mla=[False] * n,
            _group_spec_types=self.local_layout.group_spec_types,
            _logical_num_blocks=self.num_blocks,
            _physical_blocks_per_logical_kv_block=1,
            _ple_region_index=None,
            _ple_group_index=None,
            device_id=0,
            use_mla=False,
            draft_tp_mappings={},
            _head_sharded_draft_regions=set(),
            num_descs=self.num_blocks * n,
            _layer_specs={layer.name: layer.spec for layer in self.local_layout.layers},
            **_worker_settings(self.shape.block_size, self.KV_CACHE_LAYOUT),
        )
        _bind(ns, ("_build_mamba_local", "_build_mamba_remote"))
        return ns

    def _register(self) -> np.ndarray:
        """``register_local_xfer_handler``'s rows: attention rows, then Mamba rows."""
        ns = self.worker
        return np.concatenate([ns._build_fa_local(self._local_bases, 1), ns._build_mamba_local(self._local_bases)])

    def _remote_regions_meta(self) -> dict[str, object]:
        regions = self.remote_regions
        return dict(
            block_lens=[r.block_len for r in regions],
            block_strides=[r.block_stride for r in regions],
            ssm_sizes=self.remote_ssm_sizes,
            region_num_blocks=[self.num_blocks] * len(regions),
            region_group_ids=[r.group for r in regions],
        )

    def desc_ids(self, local_block_ids: list[list[int]], remote_block_ids: list[list[int]]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per READ, what ``_read_blocks_for_req`` / ``_read_blocks`` compute for a hybrid: each
        group's ids kept only for the source ranks that serve it, then two ``_compute_desc_ids``."""
        ns = self.worker
        mapping = self._mapping()
        n = ns.num_regions
        out = []
        for rank in mapping.all_source_ranks:
            serves = [rank in ranks for ranks in mapping.source_ranks_per_group]
            rids = [list(g) if s else [] for g, s in zip(remote_block_ids, serves)]
            lids = [list(g) if s else [] for g, s in zip(local_block_ids, serves)]
            remote_ids = ns._compute_desc_ids(
                block_ids=rids,
                dst_num_blocks=self.num_blocks,
                block_size_ratio=None,
                physical_blocks_per_logical=1,
                region_num_blocks=[self.num_blocks] * n,
                region_group_ids=ns.region_group_ids,
                uses_region_group_mapping=ns._uses_region_group_mapping,
            )
            local_ids = ns._compute_desc_ids(
                block_ids=lids,
                dst_num_blocks=self.num_blocks,
                block_size_ratio=1,
                physical_blocks_per_logical=1,
                region_num_blocks=[self.num_blocks] * n,
                region_group_ids=ns.region_group_ids,
                uses_region_group_mapping=ns._uses_region_group_mapping,
            )
            out.append((rank, local_ids, remote_ids))
        return out
