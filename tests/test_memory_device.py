"""The worker registers KV memory as the device it lives on: DRAM on the CPU, VRAM with its index on CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connector_helpers import fa_scenario, make_worker
from nixlkv.testing.engines import build_rank
from nixlkv.vllm.kv_views import memory_device


def _view(device: str) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device))


def test_cpu_caches_are_dram() -> None:
    assert memory_device({"a": torch.zeros(4), "b": torch.zeros(4)}) == ("DRAM", 0)


def test_cuda_caches_are_vram_with_their_device_index() -> None:
    # No GPU here: only the device attribute is read, so stand-in views carry it.
    assert memory_device({"a": _view("cuda:1"), "b": _view("cuda:1")}) == ("VRAM", 1)
    assert memory_device({"a": _view("cuda")}) == ("VRAM", 0)


def test_caches_on_two_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="span 2 devices"):
        memory_device({"a": _view("cuda:0"), "b": _view("cuda:1")})


def test_an_unsupported_device_is_named() -> None:
    with pytest.raises(ValueError, match="meta"):
        memory_device({"a": _view("meta")})


def test_worker_geometry_carries_the_memory_kind() -> None:
    rank = build_rank(fa_scenario(1, 1), "decode", 0)
    w = make_worker(rank, "mem-kind")
    try:
        assert (w.geometry.mem_type, w.geometry.device_id) == ("DRAM", 0)
        assert w.nixl.mem_type == "DRAM"
        # what a peer learns in the handshake
        assert w.handshake_info().geometry.to_dict()["mem_type"] == "DRAM"
    finally:
        w.shutdown()
