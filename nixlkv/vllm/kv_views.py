"""vLLM 0.33 KV caches as nixlkv layers: read each layer's geometry off its real tensor view.

With the strategies (and, once it lands, the connector), the only code that knows vLLM's objects. The page
structure is taken from the tensor strides vLLM built (``create_kv_cache_views``), so whatever
layout the engine resolved is what the plan sees.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.errors import IncompatibleGeometry
from ..core.regions import LayerCache, PageLayout, PagePart
from .model_backend import K_CHANNEL_MAJOR

# Logical axes of a vLLM per-layer view [B, H, N, C]; C is counted in bytes after a uint8 view.
VIEW_AXES = ("head", "token", "byte")


def page_of(view: torch.Tensor, num_blocks: int, interior: str | None = None) -> tuple[PageLayout, int]:
    """(page layout, block stride in bytes) of one layer's ``[B, H, N, C]`` view.

    When the view holds kernel blocks (``B = num_blocks * ratio``), a logical block is
    ``ratio`` consecutive kernel pages and the page gets an outer ``kblock`` axis. ``interior``
    names the order the backend's kernels really write inside a page, where it is not the
    view's (see :mod:`nixlkv.vllm.model_backend`); the page then carries parts saying so.
    """
    if view.dim() != 4:
        raise IncompatibleGeometry(f"expected a [B, H, N, C] view, got shape {tuple(view.shape)}")
    raw = view.view(torch.uint8) if view.dtype != torch.uint8 else view
    sizes = list(raw.shape[1:])
    strides = list(raw.stride()[1:])
    order = sorted(range(3), key=lambda i: -strides[i])
    axes = tuple((VIEW_AXES[i], int(sizes[i])) for i in order)
    page = PageLayout(axes)
    expected = page.strides()
    for i in range(3):
        if sizes[i] > 1 and strides[i] != expected[VIEW_AXES[i]]:
            raise IncompatibleGeometry(
                f"page of shape {tuple(raw.shape)} with byte strides {tuple(raw.stride())} is not dense; "
                "nixlkv needs each block's page to be one contiguous run"
            )
    if interior is not None:
        page = PageLayout(page.axes, interior_parts(page, interior, view.element_size()))
    kernel_stride = int(raw.stride(0))
    blocks = int(raw.shape[0])
    if blocks == num_blocks:
        return page, kernel_stride
    ratio, rem = divmod(blocks, num_blocks)
    if rem or kernel_stride != page.nbytes:
        raise IncompatibleGeometry(
            f"view holds {blocks} kernel blocks for {num_blocks} logical blocks with stride "
            f"{kernel_stride} and page {page.nbytes}: kernel pages are not dense"
        )
    parts = tuple(PagePart(p.offset, (("kblock", ratio, page.nbytes), *p.axes)) for p in page.parts)
    return PageLayout((("kblock", ratio), *axes), parts), kernel_stride * ratio


def interior_parts(page: PageLayout, interior: str, element_size: int) -> tuple[PagePart, ...]:
    """Page parts of a ``head x token x byte`` page whose kernels write it in ``interior`` order.

    ``k_channel_major``: per head, the keys as ``[head_size, tokens]`` elements, then the values
    as ``[tokens, head_size]`` (K and V of one size, as the view's ``2 x head_size`` says). The
    parts' innermost axes are not the page's ``byte`` axis (each holds part of it), so a box that
    takes part of ``byte`` is refused rather than misread."""
    if interior != K_CHANNEL_MAJOR:
        raise IncompatibleGeometry(f"unknown page interior {interior!r}; known: {[K_CHANNEL_MAJOR]}")
    if page.names != VIEW_AXES or page.size("byte") % (2 * element_size):
        raise IncompatibleGeometry(
            f"a {interior} page must be head x token x (2 x head_size) elements, got {page.describe()}"
        )
    heads, tokens, content = page.size("head"), page.size("token"), page.size("byte")
    half = content // 2  # one of K or V per token, in bytes
    head_stride = tokens * content
    keys = PagePart(0, (("head", heads, head_stride), ("channel", half // element_size, tokens * element_size),
                        ("token", tokens, element_size), ("element", element_size, 1)))
    values = PagePart(tokens * half, (("head", heads, head_stride), ("token", tokens, half), ("value", half, 1)))
    return keys, values


def layer_caches(
    kv_cache_config: Any,
    kv_caches: Mapping[str, torch.Tensor],
    total_kv_heads: Callable[[str], int] | int,
    model_hints: Callable[[str], Mapping[str, Any]] | None = None,
) -> list[LayerCache]:
    """One :class:`LayerCache` per layer of every transferable KV group, in group then layer order.

    ``total_kv_heads`` gives the model's KV head count of a layer (per layer, since models
    like Gemma4 mix head counts): a per-rank spec cannot tell it when heads are replicated.
    ``model_hints`` adds other per-layer model facts a strategy needs (e.g. ``mamba``: heads,
    groups and d_state of a Mamba layer, from the model config).
    """
    heads_of = total_kv_heads if callable(total_kv_heads) else (lambda _name: total_kv_heads)
    layers = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        for name in group.layer_names:
            view = kv_caches[name]
            hints = model_hints(name) if model_hints else {}
            page, stride = page_of(view, kv_cache_config.num_blocks, hints.get("page_interior"))
            layers.append(
                LayerCache(
                    name=name,
                    group=group_id,
                    spec=group.kv_cache_spec,
                    base=int(view.data_ptr()),
                    num_blocks=int(kv_cache_config.num_blocks),
                    block_stride=stride,
                    page=page,
                    hints={"total_kv_heads": int(heads_of(name)), **hints},
                )
            )
    return layers


def registered_memory(kv_caches: Mapping[str, torch.Tensor]) -> list[tuple[int, int]]:
    """The distinct backing allocations under the layer views, as (address, nbytes)."""
    seen: dict[int, int] = {}
    for view in kv_caches.values():
        storage = view.untyped_storage()
        seen[int(storage.data_ptr())] = int(storage.nbytes())
    return sorted(seen.items())


def memory_device(kv_caches: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """(NIXL memory type, device id) of the KV caches: ``("DRAM", 0)`` on the CPU, ``("VRAM", i)`` on
    CUDA device ``i``. NIXL registers and moves each kind differently, so all layers must share one."""
    devices = {view.device for view in kv_caches.values()}
    if len(devices) != 1:
        raise ValueError(
            f"the KV caches span {len(devices)} devices ({sorted(str(d) for d in devices)}); "
            "nixlkv registers one device per worker"
        )
    (device,) = devices
    if device.type == "cpu":
        return "DRAM", 0
    if device.type == "cuda":
        return "VRAM", int(device.index or 0)
    raise ValueError(f"KV caches on {device} cannot be registered with NIXL by nixlkv: only cpu and cuda are supported")
