"""The bytes of a request's KV blocks, written down inside the engine so a judge can compare P and D.

With ``dump_kv_dir`` set in ``kv_connector_extra_config``, a prefill worker writes the blocks of
each request it hands over (when it starts holding them: the prefill's forward pass has written
them, nothing has read them), and a decode worker writes the blocks it loaded (when its READs
completed, before any forward pass of the request). Each file holds, per layer of every
transferable group, the layer's view rows of those blocks as raw bytes; the capture record
(:mod:`nixlkv.vllm.capture`, written to the same directory) says what each layer is. The judge,
``nixlkv.serving.bytecheck``, reads them per token and head, from the layers' own specs.

Both files of a request are named by the prefill engine's request id, the one name both sides
know: ``<dir>/requests/<P request id>/<role>-<engine id>-tp<rank>.npz``. A debugging aid: it
copies every loaded byte once more and writes it to disk, per request.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .capture import write_atomically

META_KEY = "__meta__"


def request_dir(directory: str | os.PathLike, prefill_request_id: str) -> Path:
    """Where the files of one prefill request go (the id made safe as one path component)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in prefill_request_id)
    return Path(directory) / "requests" / safe


def dump_request(
    directory: str | os.PathLike,
    *,
    role: str,
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    prefill_request_id: str,
    request_id: str,
    num_tokens: int,
    block_ids: Sequence[Sequence[int]],
    kv_cache_config: Any,
    kv_caches: Mapping[str, torch.Tensor],
) -> Path:
    """Write the rows of ``block_ids`` (per KV group) of every transferable layer; returns the file.

    ``num_tokens``: the tokens the blocks hold (P: the prefill's computed tokens; D: its prefix
    hit plus what it loaded, the ids being the blocks after the hit)."""
    num_blocks = int(kv_cache_config.num_blocks)
    arrays: dict[str, np.ndarray] = {}
    groups, layers = [], {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        ids = [int(b) for b in block_ids[gid]] if gid < len(block_ids) else []
        transfer = bool(getattr(group, "enable_kv_transfer", True))
        groups.append({"block_ids": ids, "block_size": int(group.kv_cache_spec.block_size), "transfer": transfer})
        if not transfer or not ids:
            continue
        for name in group.layer_names:
            view = kv_caches[name]
            raw = view.view(torch.uint8) if view.dtype != torch.uint8 else view
            ratio = int(raw.shape[0]) // num_blocks  # kernel blocks per logical block
            rows = (torch.tensor(ids, dtype=torch.long)[:, None] * ratio + torch.arange(ratio)).reshape(-1)
            arrays[f"layer:{name}"] = raw.index_select(0, rows).cpu().numpy()
            layers[name] = {"group": gid, "kernel_blocks_per_block": ratio}
    meta = {
        "role": role, "engine_id": engine_id, "tp_rank": tp_rank, "tp_size": tp_size,
        "prefill_request_id": prefill_request_id, "request_id": request_id, "num_tokens": int(num_tokens),
        "groups": groups, "layers": layers,
    }
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    data = io.BytesIO()
    np.savez(data, **arrays)
    return write_atomically(request_dir(directory, prefill_request_id) / f"{role}-{engine_id}-tp{tp_rank}.npz",
                            data.getvalue())


def load_dump(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, {layer name: rows as uint8 [rows, H, N, C bytes]}) of one file."""
    with np.load(path) as data:
        meta = json.loads(bytes(data[META_KEY]).decode())
        layers = {k.removeprefix("layer:"): data[k] for k in data.files if k.startswith("layer:")}
    return meta, layers
