"""Scenarios from engine captures (:mod:`nixlkv.vllm.capture`), and the check that a rehearsal
builds exactly what the captured engines built.

A captured scenario carries, per side, the KV groups the real engine made (spec type, block size
after page-size unification, member layers) and every layer's page. ``build_rank`` compares its
own vLLM's result with them and fails, naming the difference, where they part: a rehearsal of a
geometry no engine builds proves less than it claims.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .kinds import KINDS, load_plugin_kinds
from .scenario import ScenarioError

_INDEX = re.compile(r"\.(\d+)\.")
MAMBA_KINDS = {"MAMBA2": "mamba2", "GDN_ATTN": "gdn", "MAMBA1": "mamba1"}


def layer_order(records: Mapping[str, Any]) -> list[str]:
    """Captured layer names in model order (by the layer index in the name, then by name)."""
    def key(name: str) -> tuple[int, str]:
        m = _INDEX.search(name)
        return (int(m.group(1)) if m else 1 << 30, name)
    return sorted(records, key=key)


def layer_kind(name: str, rec: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """The scenario layer entry of one captured layer's own spec."""
    spec, f, hints = rec["spec"], rec["facts"], rec.get("hints", {})
    if spec in ("FullAttentionSpec", "SlidingWindowSpec"):
        entry: dict[str, Any] = {"kind": "sliding_window" if spec == "SlidingWindowSpec" else "full_attention",
                                 "num_kv_heads": int(hints["total_kv_heads"]), "head_size": int(f["head_size"]),
                                 "dtype": f["dtype"]}
        if f.get("head_size_v") not in (None, f["head_size"]):
            entry["head_size_v"] = int(f["head_size_v"])
        if spec == "SlidingWindowSpec":
            entry["window"] = int(f["sliding_window"])
        return entry
    if spec == "MLAAttentionSpec":
        if "kv_lora_rank" not in model or "qk_rope_head_dim" not in model:
            raise ScenarioError(f"{name}: an MLA capture needs the model's kv_lora_rank and qk_rope_head_dim")
        return {"kind": "mla", "kv_lora_rank": model["kv_lora_rank"], "qk_rope_head_dim": model["qk_rope_head_dim"],
                "dtype": f["dtype"], "cache_dtype": f.get("cache_dtype_str") or "auto"}
    if spec == "MambaSpec":
        m = hints["mamba"]
        kind = MAMBA_KINDS[f["mamba_type"]]
        entry = {"kind": "mamba", "mamba_type": kind, "d_state": m["d_state"], "conv_kernel": m["conv_kernel"],
                 "dtype": f["dtypes"][0], "ssm_dtype": f["dtypes"][-1], "conv_layout": m["conv_state_layout"],
                 "tp_replicated": bool(f.get("tp_replicated", False))}
        if kind == "mamba1":
            entry["intermediate_size"] = m["intermediate_size"]
        else:
            entry.update(num_heads=m["num_heads"], head_dim=m["head_dim"], n_groups=m["n_groups"])
        if f.get("num_speculative_blocks"):
            entry["num_spec"] = int(f["num_speculative_blocks"])
        entry["state_tokens"] = int(f["block_size"])
        return entry
    load_plugin_kinds()  # a plugin's kind says which captured spec it fabricates
    for kind_name, kind in KINDS.items():
        if kind.captured_spec == spec and kind.from_capture is not None:
            return {"kind": kind_name, **kind.from_capture(f, hints, model)}
    raise ScenarioError(f"{name}: no scenario layer kind for captured spec {spec}")


def side_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a scenario keeps of one rank's capture: groups by layer position, pages by position."""
    order = layer_order(record["layers"])
    pos = {name: i for i, name in enumerate(order)}
    return {
        "vllm": record["vllm_version"],
        "groups": [{"spec": g["spec"], "block_size": g["block_size"], "layers": sorted(pos[n] for n in g["layers"])}
                   for g in record["groups"] if g["transfer"]],
        "pages": {pos[n]: rec["page"] for n, rec in record["layers"].items() if "page" in rec and rec["spec"] != "MambaSpec"},
    }


def scenario_from_captures(
    prefill: Sequence[Mapping[str, Any]], decode: Sequence[Mapping[str, Any]], name: str, num_tokens: int,
    seed: int = 0, source: str = "",
) -> dict[str, Any]:
    """A scenario (as a mapping) whose sides are what the captured P and D engines built (rank 0 of
    each; every rank of a TP engine builds the same groups)."""
    p, d = prefill[0], decode[0]
    entries: list[dict[str, Any]] = []
    for name_, rec in ((n, p["layers"][n]) for n in layer_order(p["layers"])):
        entry = layer_kind(name_, rec, p["model"])
        if entries and {k: v for k, v in entries[-1].items() if k != "count"} == entry:
            entries[-1]["count"] = entries[-1].get("count", 1) + 1
        else:
            entries.append(entry)

    def side(r: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"tp": r["tp_size"], "block_size": r["model"]["block_size"],
                               "layout": r["model"].get("kv_cache_layout") or "LBHNC"}
        interiors = {rec.get("hints", {}).get("page_interior") for rec in r["layers"].values()} - {None}
        if len(interiors) > 1:
            raise ScenarioError(f"{r['engine_id']}: layers of several page interiors {sorted(interiors)}")
        if interiors:
            out["interior"] = interiors.pop()
        return out

    return {
        "name": name,
        "model": {"layers": entries},
        "prefill": side(p),
        "decode": side(d),
        "request": {"num_tokens": num_tokens, "seed": seed},
        "expect": "ok",
        "captured": {"source": source or str(p["model"].get("name", "")), "prefill": side_record(p), "decode": side_record(d)},
    }


def check_built(scenario_name: str, role: str, captured: Mapping[str, Any], groups: Sequence[Any],
                pages: Mapping[int, str]) -> None:
    """Fail, naming the difference, where this rehearsal builds other KV groups or pages than the
    captured engine did. ``groups``: the built KV cache groups; ``pages``: layer position -> page."""
    want = [(g["spec"], int(g["block_size"]), tuple(g["layers"])) for g in captured["groups"]]
    got = []
    for g in groups:
        layers = tuple(sorted(int(_INDEX.search(n).group(1)) for n in g.layer_names))
        got.append((type(g.kv_cache_spec).__name__, int(g.kv_cache_spec.block_size), layers))
    if sorted(want) != sorted(got):
        raise ScenarioError(
            f"{scenario_name}: the {role} engine captured from vLLM {captured.get('vllm')} built KV groups "
            f"{sorted(want)}, this rehearsal's vLLM builds {sorted(got)}"
        )
    for pos, page in captured.get("pages", {}).items():
        built = pages.get(int(pos))
        if built != page:
            raise ScenarioError(
                f"{scenario_name}: layer {pos} on the {role} side: the captured engine's page is {page}, "
                f"this rehearsal builds {built}"
            )
