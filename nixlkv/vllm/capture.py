"""What a running engine built for its KV cache, written down so a rehearsal can replay it.

With ``capture_dir`` set in ``kv_connector_extra_config``, each worker writes
``<engine_id>-tp<rank>.json`` when vLLM registers its caches: the ``KVCacheConfig`` (groups,
their spec types and block sizes after page-size unification, block count), every layer's own
spec, KV head count, model hints (page interior, Mamba geometry), tensor view (shape, strides,
dtype) and the page nixlkv read off it. ``nixlkv capture`` turns such files into scenarios
(:mod:`nixlkv.serving.capture`): a geometry a real engine built, not one a scenario author imagined.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CAPTURE_VERSION = 1


def jsonable(value: Any) -> Any:
    """Spec field values as JSON: dtypes and enums by name, tuples as lists."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value).removeprefix("torch.")


def spec_facts(spec: Any) -> dict[str, Any]:
    """Every field of a spec dataclass (nested specs of a wrapped group are listed per layer)."""
    if not dataclasses.is_dataclass(spec):
        return {}
    return {f.name: jsonable(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name != "kv_cache_specs"}


def engine_capture(
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    layers: Sequence[Any],
    model: Mapping[str, Any],
) -> dict[str, Any]:
    """The capture record of one worker (``layers``: its :class:`~nixlkv.core.LayerCache` list)."""
    import vllm

    by_name = {layer.name: layer for layer in layers}
    groups, layer_records = [], {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        groups.append({
            "spec": type(spec).__name__,
            "block_size": int(spec.block_size),
            "layers": list(group.layer_names),
            "transfer": bool(getattr(group, "enable_kv_transfer", True)),
        })
        for name in group.layer_names:
            own = getattr(spec, "kv_cache_specs", {}).get(name, spec)
            view = kv_caches[name]
            record: dict[str, Any] = {
                "group": gid,
                "spec": type(own).__name__,
                "facts": spec_facts(own),
                "view": {"shape": list(view.shape), "stride": list(view.stride()), "dtype": jsonable(view.dtype)},
            }
            layer = by_name.get(name)
            if layer is not None:
                record["page"] = layer.page.describe()
                record["hints"] = jsonable(dict(layer.hints))
            layer_records[name] = record
    return {
        "nixlkv_capture": CAPTURE_VERSION,
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "engine_id": engine_id,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "num_blocks": int(kv_cache_config.num_blocks),
        "model": jsonable(dict(model)),
        "groups": groups,
        "layers": layer_records,
    }


def model_facts(vllm_config: Any) -> dict[str, Any]:
    """Model config facts a spec does not carry (MLA's latent / rope split) and how it was served."""
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    out: dict[str, Any] = {"name": str(getattr(mc, "model", "")), "architectures": list(getattr(text, "architectures", None) or [])}
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        if getattr(text, key, None) is not None:
            out[key] = int(getattr(text, key))
    out["block_size"] = int(vllm_config.cache_config.block_size)
    return out


def write_capture(directory: str, record: Mapping[str, Any]) -> Path:
    """Write one worker's record (atomically, :func:`write_atomically`)."""
    path = Path(directory) / f"{record['engine_id']}-tp{record['tp_rank']}.json"
    return write_atomically(path, json.dumps(record, indent=1, sort_keys=True).encode())


def write_atomically(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all: a reader polling the directory never sees
    half a file (its folders are made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
