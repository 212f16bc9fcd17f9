"""#16 point 5: a property-based campaign (hypothesis) over scenarios, handshake replies and
kv_transfer_params. See docs/campaign.md.

* Scenarios: random models over every layer kind (uniform groups, Mamba with its parameters,
  windows, MLA), TP pairs, layouts, block sizes, kernel blocks, page interiors and prefix hits,
  each rehearsed end to end (vLLM's planning code, real NIXL over DRAM, every decode byte
  checked). Each must end byte-exact or be refused by nixlkv's own error type: never a mismatch,
  a failed transfer or a traceback.
* Handshake replies: real geometries, mutated as dicts and as msgpack bytes, must decode and plan
  or raise HandshakeError / NixlkvError; a plan made from one never reads outside the registered
  memory the reply advertises, nor writes outside the decode rank's own.
* kv_transfer_params: mutated params raise ParamsError (or pass, checked), and the scheduler
  serves a request with params that do not pass without a transfer, never raising.

Profiles: ``ci`` (default; bounded, derandomized: the same examples every run) and ``long``
(``NIXLKV_CAMPAIGN=long``, ``make campaign-long``). ``NIXLKV_CAMPAIGN_REPORT=path`` writes the
counts as JSON (after every test, so the last write holds the whole run).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from nixlkv.core import Dispatcher
from nixlkv.core.errors import HandshakeError, NixlkvError
from nixlkv.core.geometry import RankGeometry, Region
from nixlkv.scenario_kinds import REQUIRED
from nixlkv.testing.kinds import KINDS
from nixlkv.testing.scenario import ScenarioError, parse
from nixlkv.vllm import handshake as hs
from nixlkv.vllm.params import MAX_BLOCK_ID, NULL_BLOCK_ID, ParamsError, flags, remote

# ----------------------------------------------------------------------------- profiles

PROFILE = os.environ.get("NIXLKV_CAMPAIGN", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"NIXLKV_CAMPAIGN must be 'ci' or 'long', got {PROFILE!r}")

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.large_base_example]
# The CI profile: bounded (under a minute on two cores), derandomized (the same examples every
# run: a red CI is a real regression, never a new draw), no example database.
settings.register_profile("nixlkv-campaign-ci", deadline=None, derandomize=True, database=None,
                          suppress_health_check=_SUPPRESS, print_blob=True)
# The long profile: fresh random examples every run, failures kept in .hypothesis/ and replayed.
settings.register_profile("nixlkv-campaign-long", deadline=None, derandomize=False,
                          suppress_health_check=_SUPPRESS, print_blob=True)
CAMPAIGN = settings.get_profile(f"nixlkv-campaign-{PROFILE}")

# Examples per test and profile (scenarios: per model family, five families);
# NIXLKV_CAMPAIGN_SCENARIOS overrides the scenario count per family.
EXAMPLES = {
    "ci": {"scenarios": 20, "geometry": 300, "wire": 300, "params": 400, "scheduler": 200, "kind_fields": 400,
           "captured": 200},
    "long": {"scenarios": 200, "geometry": 5000, "wire": 5000, "params": 10000, "scheduler": 3000, "kind_fields": 5000,
             "captured": 3000},
}[PROFILE]
if os.environ.get("NIXLKV_CAMPAIGN_SCENARIOS"):
    EXAMPLES["scenarios"] = int(os.environ["NIXLKV_CAMPAIGN_SCENARIOS"])

# ----------------------------------------------------------------------------- counting

COUNTS: dict[str, Counter] = {
    "scenarios": Counter(),  # outcome -> runs
    "rejected": Counter(),  # refusal class (error type: normalised message) -> runs
    "engine_refused": Counter(),  # vLLM itself cannot build the model (normalised message) -> runs
    "scenario_errors": Counter(),  # ScenarioError class -> runs
    "kinds": Counter(),  # layer kind -> scenarios that include it
    "kinds_exact": Counter(),  # layer kind -> byte-exact scenarios that include it
    "features_exact": Counter(),  # feature (TP pair, layout pair, prefix hit...) -> byte-exact runs
    "documented": Counter(),  # what the docs predict -> outcome (see documented())
    "geometry": Counter(),
    "wire": Counter(),
    "hostile_facts": Counter(),
    "params": Counter(),
    "scheduler": Counter(),
    "kind_fields": Counter(),  # kind.field -> wrong-typed values refused with a ScenarioError naming the field
    "captured": Counter(),
}
# Scenario YAML for the report: where the docs' prediction was too strict, and one per refusal class.
SAMPLES: dict[str, Any] = {"documented refusal ran byte-exact": [], "first of each refusal class": {}}
STARTED = time.perf_counter()


def _norm(message: str) -> str:
    """A refusal's class: its message with numbers and quoted names elided, bounded."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", message)
    text = re.sub(r"\d+", "N", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    return text[:110]


@pytest.fixture(autouse=True)
def campaign_report():
    """Write the counts so far after every test of this module (NIXLKV_CAMPAIGN_REPORT=path): the
    last write holds the whole run, and a run cut short still leaves what it counted."""
    yield
    path = os.environ.get("NIXLKV_CAMPAIGN_REPORT")
    if path:
        write_report(path)


def write_report(path: str) -> None:
    scen = COUNTS["scenarios"]
    report = {
        "profile": PROFILE,
        "seconds": round(time.perf_counter() - STARTED, 1),
        "scenarios": {
            "run": sum(scen.values()),
            "byte_exact": scen["byte-exact"],
            "rejected": scen["rejected"],
            "engine_refused": scen["engine-refused"],
            "scenario_errors": scen["scenario-error"],
            "crashes": scen["crash"] + scen["failed"] + scen["mismatch"],
            "outcomes": dict(scen),
            "rejected_by_class": dict(COUNTS["rejected"].most_common()),
            "engine_refused_by_class": dict(COUNTS["engine_refused"].most_common()),
            "scenario_errors_by_class": dict(COUNTS["scenario_errors"].most_common()),
            "kinds": dict(sorted(COUNTS["kinds"].items())),
            "kinds_byte_exact": dict(sorted(COUNTS["kinds_exact"].items())),
            "features_byte_exact": dict(sorted(COUNTS["features_exact"].items())),
            "docs_prediction_vs_outcome": dict(sorted(COUNTS["documented"].items())),
        },
        **{name: dict(COUNTS[name]) for name in ("geometry", "wire", "hostile_facts", "params", "scheduler",
                                                 "kind_fields", "captured")},
        "samples": SAMPLES,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


# ============================================================================= scenarios

def _has_kind(name: str) -> bool:
    """Whether a layer kind exists here (built in, or declared by an installed nixlkv plugin)."""
    try:
        from nixlkv.testing.kinds import known_kind
    except ImportError:
        return name in KINDS
    try:
        return known_kind(name)
    except Exception:
        return False


# The layer kinds the generator draws; a kind added to nixlkv belongs here (and in model_layers),
# and test_campaign_scenarios_reached_every_kind requires each to run byte-exact at least once.
ATTENTION_KINDS = ("full_attention", "sliding_window", *(("chunked_local",) if _has_kind("chunked_local") else ()))
GENERATED_KINDS = frozenset({*ATTENTION_KINDS, "mla", "sliding_window_mla", "mla_indexer", "mamba", "uniform"})
ATTN_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8")
WINDOWS = (64, 8, 16, 17, 33, 100, 128, 256, 1000)


def _maybe(draw, p_one_in: int) -> bool:
    """True about once in ``p_one_in`` draws (shrinks to False)."""
    return draw(st.integers(0, p_one_in - 1)) == p_one_in - 1


@st.composite
def attention_layer(draw, kind: str = "full_attention") -> dict[str, Any]:
    layer: dict[str, Any] = {
        "kind": kind,
        "count": draw(st.integers(1, 2)),
        "num_kv_heads": draw(st.sampled_from([2, 1, 4, 8])),
        "head_size": draw(st.sampled_from([32, 16, 64, 128])),
    }
    if _maybe(draw, 6):
        layer["head_size_v"] = draw(st.sampled_from([16, 32, 64]))
    if _maybe(draw, 3):
        layer["dtype"] = draw(st.sampled_from(ATTN_DTYPES))
    if kind == "sliding_window":
        layer["window"] = draw(st.sampled_from(WINDOWS))
    elif kind == "chunked_local":  # Llama 4's chunked local attention
        layer["chunk"] = draw(st.sampled_from([64, 16, 32, 128]))
    return layer


@st.composite
def mla_layer(draw, kind: str = "mla") -> dict[str, Any]:
    layer: dict[str, Any] = {"kind": kind, "count": draw(st.integers(1, 2))}
    if _maybe(draw, 4):  # DeepSeek's own latent, possibly in a packed cache format
        layer.update(kv_lora_rank=512, qk_rope_head_dim=64,
                     cache_dtype=draw(st.sampled_from(["auto", "fp8_ds_mla", "nvfp4_ds_mla"])))
    else:
        layer.update(kv_lora_rank=draw(st.sampled_from([32, 16, 64, 128])),
                     qk_rope_head_dim=draw(st.sampled_from([16, 8, 32, 64])))
        if _maybe(draw, 3):
            layer["dtype"] = draw(st.sampled_from(["float16", "float32", "bfloat16"]))
    if kind == "sliding_window_mla":
        layer["window"] = draw(st.sampled_from(WINDOWS))
    return layer


@st.composite
def indexer_layer(draw) -> dict[str, Any]:
    return {"kind": "mla_indexer", "count": draw(st.integers(1, 2)),
            "index_head_dim": draw(st.sampled_from([128, 256]))}


@st.composite
def mamba_layer(draw, mamba_type: str | None = None) -> dict[str, Any]:
    """Unsharded model geometry vLLM can shard over TP 1, 2 and 4 (head counts multiples of 4);
    n_groups 1 or 2 makes some TP pairs refusals (vLLM's MambaMixer2 / GDN rules)."""
    mtype = mamba_type or draw(st.sampled_from(["mamba2", "gdn", "mamba1"]))
    layer: dict[str, Any] = {"kind": "mamba", "mamba_type": mtype, "count": draw(st.integers(1, 2)),
                             "d_state": draw(st.sampled_from([16, 8, 32])),
                             "conv_kernel": draw(st.sampled_from([4, 2, 3]))}
    if mtype == "mamba1":
        layer["intermediate_size"] = draw(st.sampled_from([64, 32, 128, 256]))
    else:
        groups = draw(st.sampled_from([4, 1, 2, 8]))
        layer.update(n_groups=groups, num_heads=groups * draw(st.sampled_from([2, 1, 4])) * (4 // min(groups, 4)),
                     head_dim=draw(st.sampled_from([16, 8, 32])))
    if _maybe(draw, 4):
        layer["dtype"] = draw(st.sampled_from(["float16", "float32", "bfloat16"]))
    if _maybe(draw, 4):
        layer["ssm_dtype"] = draw(st.sampled_from(["bfloat16", "float16", "float32"]))
    if _maybe(draw, 12):
        layer["conv_layout"] = "SD"  # vLLM's default (both sides, unless a side sets its own)
    if _maybe(draw, 8):
        layer["tp_replicated"] = True
    elif mtype != "mamba1" and _maybe(draw, 4):
        layer["num_spec"] = draw(st.integers(1, 2))
    return layer


FAMILIES = ("attention", "mla", "mamba", "uniform", "mixed")


@st.composite
def model_layers(draw, family: str) -> list[dict[str, Any]]:
    """A model of one family: ``attention`` (full and windowed GQA), ``mla`` (one latent, windowed
    or beside the V3.2 indexer), ``mamba`` (Mamba2 / GDN / Mamba1, possibly hybrid), ``uniform``
    (groups vLLM must make UniformTypeKVCacheSpecs) and ``mixed`` (any kinds at all)."""
    if family == "attention":
        layers = draw(st.lists(st.sampled_from(ATTENTION_KINDS).flatmap(attention_layer), min_size=1, max_size=3))
    elif family == "mla":
        # One latent per model (vLLM cannot unify MLA pages of different sizes across KV groups);
        # the indexer only beside full latents (one uniform group, pages of different sizes).
        latent = draw(mla_layer())
        windowed = draw(st.booleans())
        entry = st.sampled_from(["mla", "sliding_window_mla" if windowed else "mla_indexer"])
        layers = []
        for kind in draw(st.lists(entry, min_size=1, max_size=3)):
            if kind == "mla_indexer":
                layers.append(draw(indexer_layer()))
            else:
                layer = {**latent, "kind": kind, "count": draw(st.integers(1, 2))}
                if kind == "sliding_window_mla":
                    layer["window"] = draw(st.sampled_from(WINDOWS))
                layers.append(layer)
    elif family == "mamba":
        mtype = draw(st.sampled_from(["mamba2", "gdn", "mamba1"]))
        layers = draw(st.lists(mamba_layer(mtype), min_size=1, max_size=2))
        if draw(st.booleans()):  # hybrid: vLLM aligns pages (engines.align_hybrid)
            layers.insert(draw(st.integers(0, len(layers))), draw(attention_layer()))
        if _maybe(draw, 5):
            layers.append(draw(attention_layer("sliding_window")))
    elif family == "uniform":
        combo = draw(st.sampled_from(["gqa+mla", "mla+gqa", "mla+indexer", "gqa-mixed"]))
        if combo == "gqa+mla":
            members = [draw(attention_layer()), draw(mla_layer())]
        elif combo == "mla+gqa":
            members = [draw(mla_layer()), draw(attention_layer())]
        elif combo == "mla+indexer":
            members = [draw(mla_layer()), draw(indexer_layer())] * draw(st.integers(1, 2))
        else:
            a = draw(attention_layer())
            b = {**draw(attention_layer()), "head_size": a["head_size"] * 2}
            members = [a, b]
        layers = [{"kind": "uniform", "members": members}]
    else:  # anything with anything: vLLM's hybrid grouping decides
        layer = st.one_of(st.sampled_from(ATTENTION_KINDS).flatmap(attention_layer), mla_layer(),
                          mla_layer("sliding_window_mla"), indexer_layer(), mamba_layer())
        layers = draw(st.lists(layer, min_size=1, max_size=3))
    return layers


@st.composite
def side(draw, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    tp = draw(st.sampled_from([1, 2, 4]))
    if _maybe(draw, 12):
        tp = 3  # pairs with 2 or 4 are refused (TP sizes must divide one another)
    if like is not None and draw(st.booleans()):
        block, layout = like["block_size"], like["layout"]
    else:
        block = draw(st.sampled_from([16, 32, 64]))
        if _maybe(draw, 15):
            block = draw(st.sampled_from([24, 48]))  # 16 vs 24: refused; 24 vs 48: pairs
        layout = draw(st.sampled_from(["LBHNC", "BLHNC", "LBNHC", "BLNHC", "LHBNC", "BHLNC"]))
        if _maybe(draw, 2):
            layout = "LBHNC"
    out: dict[str, Any] = {"tp": tp, "block_size": block, "layout": layout}
    if _maybe(draw, 5):
        out["kernel_block_size"] = draw(st.sampled_from([16, 32]))
    return out


def _leaves(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for layer in layers for m in (layer.get("members") or [layer])]


@st.composite
def scenario_dicts(draw, family: str | None = None) -> dict[str, Any]:
    family = family or draw(st.sampled_from(FAMILIES))
    layers = draw(model_layers(family))
    prefill = draw(side())
    decode = draw(side(like=prefill))
    leaves = _leaves(layers)
    attn = [leaf for leaf in leaves if leaf["kind"] in ATTENTION_KINDS]
    one_head_size = all(leaf.get("head_size_v") in (None, leaf["head_size"]) for leaf in attn)
    if attn and one_head_size and _maybe(draw, 5):
        # vLLM's CPU backend writes keys channel-major inside LBHNC pages (mostly on both sides)
        prefill["layout"] = "LBHNC"
        prefill["interior"] = "k_channel_major"
        if draw(st.integers(0, 3)):
            decode["layout"], decode["interior"] = "LBHNC", "k_channel_major"
    num_tokens = draw(st.integers(1, 600))
    request: dict[str, Any] = {"num_tokens": num_tokens, "seed": draw(st.integers(0, 1 << 16))}
    if draw(st.integers(0, 2)) == 0:  # a prefix hit on D (possibly every block, or more)
        request["cached_blocks"] = draw(st.integers(0, -(-num_tokens // decode["block_size"]) + 1))
    spec = max((leaf.get("num_spec") or 0 for leaf in leaves if leaf["kind"] == "mamba"), default=0)
    if any(leaf["kind"] == "mamba" for leaf in leaves) and _maybe(draw, 4):
        # each engine's VLLM_SSM_CONV_STATE_LAYOUT: SD on one side and DS on the other is a transpose
        for one in (prefill, decode):
            one["conv_layout"] = draw(st.sampled_from(["SD", "DS"]))
    if any(leaf["kind"] == "mamba" for leaf in leaves) and draw(st.booleans()):
        request["state_blocks"] = spec + 1 + draw(st.integers(0, 2))
    d = {"name": f"campaign-{family}", "model": {"layers": layers}, "prefill": prefill, "decode": decode,
         "request": request}
    if _maybe(draw, 25):
        _break(draw, d)
    return d


# Values a scenario field never accepts (never a positive integer: no huge allocation can follow).
BAD_VALUES = [None, True, -1, 0, 1.5, "x", "", [], {}, 1 << 41, "LBHNC ", ["full_attention"]]


def _break(draw, d: dict[str, Any]) -> None:
    """A malformed scenario: one leaf replaced by a value no field accepts, or one field dropped."""
    paths = [p for p in _paths(d) if p]
    path = draw(st.sampled_from(paths))
    parent = _at(d, path[:-1])
    if draw(st.booleans()):
        parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(BAD_VALUES)))
    elif isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])


def _features(d: Mapping[str, Any]) -> list[str]:
    p, q, r = d["prefill"], d["decode"], d["request"]
    out = [f"tp {p['tp']}->{q['tp']}", f"layout {p.get('layout', 'LBHNC')}->{q.get('layout', 'LBHNC')}",
           "block sizes differ" if p.get("block_size", 16) != q.get("block_size", 16) else "block sizes equal"]
    if r.get("cached_blocks"):
        out.append("prefix hit")
    if p.get("kernel_block_size") or q.get("kernel_block_size"):
        out.append("kernel_block_size")
    if p.get("interior") or q.get("interior"):
        out.append("interior k_channel_major")
    if r.get("state_blocks", 1) > 1:
        out.append("state_blocks > 1")
    leaves = _leaves(d["model"]["layers"])
    if any(leaf.get("num_spec") for leaf in leaves):
        out.append("mamba num_spec")
    if any(leaf.get("tp_replicated") for leaf in leaves):
        out.append("mamba tp_replicated")
    if any(leaf["kind"] == "mamba" for leaf in leaves):
        layouts = [side.get("conv_layout") for side in (p, q)]
        if "SD" in layouts or any(leaf.get("conv_layout") == "SD" for leaf in leaves):
            out.append("conv layouts differ" if len(set(layouts)) > 1 and None not in layouts else "conv layout SD")
    if any(leaf.get("cache_dtype") in ("fp8_ds_mla", "nvfp4_ds_mla") for leaf in leaves):
        out.append("packed MLA cache")
    if any(leaf.get("head_size_v") not in (None, leaf.get("head_size")) for leaf in leaves):
        out.append("head_size_v differs")
    return out


HEADS_OUTERMOST = ("LBHNC", "BLHNC")
TOKENS_OUTERMOST = ("LBNHC", "BLNHC")


def _shardable(tp: int, heads: int) -> bool:
    return (tp <= heads and heads % tp == 0) or (tp > heads and tp % heads == 0)


def documented(d: Mapping[str, Any]) -> str | None:
    """What docs/scenarios.md and docs/strategies/ say of a scenario: ``run`` (a supported pair,
    which must not be refused), ``refuse`` (a documented refusal), or None (no prediction: Mamba,
    mixed models, uniform groups, interiors on one side only, 24 / 48-token blocks)."""
    try:
        p, q, leaves = d["prefill"], d["decode"], _leaves(d["model"]["layers"])
        tp_p, tp_d = p["tp"], q["tp"]
        bp, bd = p.get("block_size", 16), q.get("block_size", 16)
        lp, ld = p.get("layout", "LBHNC"), q.get("layout", "LBHNC")
        kinds = {leaf["kind"] for leaf in leaves}
        if max(tp_p, tp_d) % min(tp_p, tp_d):
            return "refuse"  # TP sizes must divide one another
        powers = bp in (16, 32, 64) and bd in (16, 32, 64)
        if kinds <= {"full_attention", "sliding_window"}:
            if any(not _shardable(tp, leaf["num_kv_heads"]) for leaf in leaves for tp in (tp_p, tp_d)):
                return "refuse"  # heads vLLM cannot shard
            # Layouts that put heads outside blocks or tokens outside heads matter only where a rank
            # holds more than one head: one head slot is the same bytes in every layout.
            multi = {side_: any(max(1, leaf["num_kv_heads"] // tp) > 1 for leaf in leaves)
                     for side_, tp in (("p", tp_p), ("d", tp_d))}
            if (lp in ("LHBNC", "BHLNC") and multi["p"]) or (ld in ("LHBNC", "BHLNC") and multi["d"]):
                return "refuse"  # a block's page is not one dense run
            if {lp, ld} & {"LHBNC", "BHLNC"}:
                return None
            if max(bp, bd) % min(bp, bd):
                return "refuse"  # block sizes must divide one another
            if p.get("interior") != q.get("interior") or not powers:
                return None
            windows = {leaf.get("window") for leaf in leaves}
            if len(windows) > 1 and (lp, tp_p, bp, p.get("kernel_block_size")) != (ld, tp_d, bd, q.get("kernel_block_size")):
                # Several KV groups (windows beside full attention): vLLM groups layers by page size,
                # which TP and the layout change (LBHNC unifies page sizes, BLHNC packs them), and
                # two engines that group layers differently are refused ("both engines must group
                # layers the same way"; docs/campaign.md, findings).
                return None
            if lp in HEADS_OUTERMOST and ld in HEADS_OUTERMOST:
                return "run"  # whole pages or head slices, any block-size pair that divides
            if lp == ld and tp_p == tp_d and bp == bd:
                return "run"  # whole pages
            if tp_p != tp_d and ((lp in TOKENS_OUTERMOST and multi["p"]) or (ld in TOKENS_OUTERMOST and multi["d"])):
                return "refuse"  # heads not outermost at different TP
            return None
        if kinds <= {"mla", "sliding_window_mla", "mla_indexer"}:
            if bp != bd:
                return "refuse"  # tokens_per_block must match
            pages = {(leaf.get("kv_lora_rank", 512), leaf.get("qk_rope_head_dim", 64), leaf.get("dtype"),
                      leaf.get("cache_dtype"), leaf.get("index_head_dim")) for leaf in leaves}
            windows = {leaf.get("window") for leaf in leaves}
            if len(pages) > 1 and len(windows) > 1 and lp != ld:
                # Several KV groups of different page sizes: LBHNC unifies them (a larger block
                # for the smaller pages), BLHNC packs them; the engines then disagree on a
                # group's block size and are refused (finding 6 of docs/campaign.md).
                return None
            return "run"  # one head slot: any layouts
        return None
    except (KeyError, TypeError, AttributeError, ZeroDivisionError):
        return None


def _origin_is_vllm(exc: BaseException) -> bool:
    """Whether the innermost frame that raised is vLLM's own code (not nixlkv's, nor torch's)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}vllm{os.sep}" in frames[-1].filename


_DISPATCHER: list[Dispatcher] = []


def _dispatcher() -> Dispatcher:
    if not _DISPATCHER:
        _DISPATCHER.append(Dispatcher.from_plugins())
    return _DISPATCHER[0]


def rehearse_case(d: dict[str, Any], mode: str) -> tuple[str, str]:
    """(outcome, message) of one generated scenario, as :func:`nixlkv.testing.rehearsal.rehearse`
    runs it, with the refusals told apart: ``scenario-error`` (the file is invalid, or vLLM does
    not group a ``uniform`` entry as it says), ``rejected`` (nixlkv refused to plan), and
    ``engine-refused`` (vLLM's own code could not build the model, as a real engine would fail
    to start). Any other exception propagates (a crash)."""
    from nixlkv.testing.rehearsal import build, build_failure, transfer_and_check

    try:
        scenario = parse(copy.deepcopy(d), source="campaign.yaml")
    except ScenarioError as exc:
        return "scenario-error", f"parse: {exc}"
    try:
        engines = build(scenario, _dispatcher())
    except ScenarioError as exc:
        return "scenario-error", f"build: {exc}"
    except (NixlkvError, NotImplementedError) as exc:
        if isinstance(exc, NotImplementedError) and _origin_is_vllm(exc):
            return "engine-refused", build_failure(exc)
        return "rejected", f"{type(exc).__name__}: {exc}"
    except (AssertionError, ValueError, NotImplementedError, RuntimeError) as exc:
        if _origin_is_vllm(exc):
            return "engine-refused", build_failure(exc)
        raise
    result = transfer_and_check(scenario, engines, descriptor_mode=mode)
    if result.outcome == "byte-exact":
        assert result.bytes_checked > 0, "byte-exact but no byte checked"
        assert len(result.notifications) == scenario.prefill.tp, result.notifications
    return result.outcome, result.message


class _NoAliasDumper(yaml.SafeDumper):
    """Scenario files may not use YAML aliases (nixlkv.testing.scenario refuses them)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def scenario_yaml(d: Any, mode: str) -> str:
    """The scenario as a file for tests/scenarios/ (the descriptor mode as a comment)."""
    text = yaml.dump(d, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=None, width=120)
    return f"# descriptor mode: {mode}\n{text}"


@pytest.mark.nixl
@pytest.mark.parametrize("family", FAMILIES)
@settings(CAMPAIGN, max_examples=EXAMPLES["scenarios"])
@given(data=st.data(), mode=st.sampled_from(["auto", "direct", "staged"]))
def test_random_scenarios_are_byte_exact_or_refused(family: str, data: st.DataObject, mode: str) -> None:
    """Every generated scenario: byte-exact, or refused with nixlkv's own error; never a
    mismatch, a failed transfer or a traceback (the scenario is printed as YAML to add it to
    tests/scenarios). Where the docs say a pair works, it must not be refused."""
    d = data.draw(scenario_dicts(family), label="scenario")
    note(scenario_yaml(d, mode))
    kinds = _kinds(d)
    try:
        outcome, message = rehearse_case(d, mode)
    except Exception as exc:
        COUNTS["scenarios"]["crash"] += 1
        raise AssertionError(f"crash: {type(exc).__name__}: {exc}\n--- scenario ---\n{scenario_yaml(d, mode)}") from exc
    COUNTS["scenarios"][outcome] += 1
    event(f"outcome: {outcome}")
    said = documented(d) if outcome != "scenario-error" else None
    COUNTS["documented"][f"{said or 'no prediction'} -> {outcome}"] += 1
    if said == "refuse" and outcome == "byte-exact" and len(SAMPLES["documented refusal ran byte-exact"]) < 3:
        SAMPLES["documented refusal ran byte-exact"].append(scenario_yaml(d, mode))
    for kind in kinds:
        COUNTS["kinds"][str(kind)] += 1
    if outcome == "rejected":
        COUNTS["rejected"][_norm(message)] += 1
        SAMPLES["first of each refusal class"].setdefault(_norm(message), f"# {message[:300]}\n{scenario_yaml(d, mode)}")
    elif outcome == "engine-refused":
        COUNTS["engine_refused"][_norm(message)] += 1
    elif outcome == "scenario-error":
        COUNTS["scenario_errors"][_norm(message.split(": ", 1)[0] + ": " + message.rsplit(": ", 1)[-1])] += 1
    elif outcome == "byte-exact":
        for kind in kinds:
            COUNTS["kinds_exact"][str(kind)] += 1
        for feature in _features(d):
            COUNTS["features_exact"][feature] += 1
    assert outcome in ("byte-exact", "rejected", "engine-refused", "scenario-error"), (
        f"{outcome}: {message}\n--- scenario ---\n{scenario_yaml(d, mode)}"
    )
    assert not (said == "run" and outcome == "rejected"), (
        f"refused a pair the docs say works: {message}\n--- scenario ---\n{scenario_yaml(d, mode)}"
    )


def _kinds(d: Any) -> set[str]:
    """Layer kinds a (possibly broken) scenario names, ``uniform`` included."""
    try:
        layers = d["model"]["layers"]
        return {str(x["kind"]) for x in (*layers, *_leaves(layers))}
    except Exception:
        return set()


def test_campaign_scenarios_reached_every_kind() -> None:
    """The generator is no campaign if it only ever builds refusals: most scenarios must run, and
    every layer kind must have run byte-exact at least once."""
    scen = COUNTS["scenarios"]
    run = sum(scen.values())
    if run < 40:
        pytest.skip(f"only {run} scenarios ran in this session (the scenario test was deselected?)")
    assert scen["byte-exact"] >= run // 2, dict(scen)
    missing = sorted(GENERATED_KINDS - set(COUNTS["kinds_exact"]))
    assert not missing, f"no byte-exact scenario with {missing}: {dict(COUNTS['kinds_exact'])}"


# ============================================================================= kinds' own fields

# A valid layer of each kind the generator knows (what a kind requires, and the values its
# relations between fields need). A kind an installed plugin declares that is not listed here is
# given its defaults and, for each required field, the smallest value the field accepts.
KIND_BASES: dict[str, dict[str, Any]] = {
    "full_attention": {"num_kv_heads": 2, "head_size": 64},
    "sliding_window": {"num_kv_heads": 2, "head_size": 64, "window": 32},
    "chunked_local": {"num_kv_heads": 2, "head_size": 64, "chunk": 32},
    "mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 16},
    "sliding_window_mla": {"window": 32},
    "mla_indexer": {},
    "mamba": {"d_state": 16, "num_heads": 8, "head_dim": 16, "n_groups": 2},
    "circular_buffer": {},
}


def _field_kinds() -> list[str]:
    try:
        from nixlkv.testing.kinds import load_plugin_kinds

        load_plugin_kinds()
    except Exception:
        pass
    return sorted(k for k, kd in KINDS.items() if k != "uniform" and getattr(kd, "fields", None))


def _kind_fields() -> list[tuple[str, str]]:
    """Every (kind, field) pair, drawn alike: a kind of many fields gets no fewer examples per field."""
    return [(kind, name) for kind in _field_kinds() for name in sorted(KINDS[kind].fields)]


def kind_base(kind: str) -> dict[str, Any]:
    if kind in KIND_BASES:
        return dict(KIND_BASES[kind])
    fields = KINDS[kind].fields
    return {name: (f.choices[0] if f.choices else f.low * f.multiple_of if f.type is int else False)
            for name, f in fields.items() if f.required}


@st.composite
def wrong_value(draw, f: Any) -> Any:
    """A value the declared field ``f`` never accepts: another type (a bool where a count belongs,
    a float, a string of digits, a list or a mapping around a valid value, bytes), None where it
    is not nullable, a count outside its range or off its multiple, a name not among the choices."""
    good = f.default if f.default not in (None, REQUIRED) else (
        f.choices[0] if f.choices else f.low * f.multiple_of if f.type is int else True)
    wrapped = st.sampled_from([[good], [good, good], {"value": good}, {good: good} if isinstance(good, str) else {"": good},
                               [[good]], []])
    other = [wrapped, st.binary(max_size=3), st.floats(allow_nan=True, allow_infinity=True)]
    if not f.nullable:
        other.append(st.none())
    if f.type is int:
        other += [st.booleans(), st.just(float(good)), st.just(str(good)), st.text(max_size=4),
                  st.integers(max_value=f.low - 1), st.integers(min_value=f.high + 1, max_value=10**40)]
        if f.multiple_of > 1:
            other.append(st.integers(0, 64).map(lambda n: n * f.multiple_of + 1))
    elif f.type is bool:
        other += [st.integers(-2, 2), st.sampled_from(["true", "false", "yes", ""]), st.just(1.0)]
    else:
        other += [st.integers(-2, 2), st.booleans()]
        if f.choices:
            other.append(st.text(max_size=8).filter(lambda t: t not in f.choices))
            other.append(st.sampled_from([c.upper() for c in f.choices] + [c + " " for c in f.choices]).filter(
                lambda t: t not in f.choices))
    return draw(st.one_of(other))


@settings(CAMPAIGN, max_examples=EXAMPLES["kind_fields"])
@given(data=st.data())
def test_wrong_typed_kind_fields_are_named_scenario_errors(data: st.DataObject) -> None:
    """#48 point 2: each field of each kind (the plugins' kinds included) given a value of the
    wrong type, out of range or not among the allowed names, in a plain layer or a uniform member,
    must be a ScenarioError naming the layer and the field: never a traceback, never accepted."""
    kind, name = data.draw(st.sampled_from(_kind_fields()), label="kind.field")
    f = KINDS[kind].fields[name]
    value = data.draw(wrong_value(f), label="value")
    layer = {"kind": kind, **kind_base(kind), name: value}
    in_uniform = data.draw(st.booleans(), label="in a uniform group")
    where = "model.layers[1].members[0]" if in_uniform else "model.layers[1]"
    layers = [{"kind": "full_attention", "num_kv_heads": 2, "head_size": 64},
              {"kind": "uniform", "members": [layer]} if in_uniform else layer]
    d = {"model": {"layers": layers}, "prefill": {"tp": 1}, "decode": {"tp": 1}, "request": {"num_tokens": 10}}
    try:
        parse(copy.deepcopy(d), source="campaign-kind-fields.yaml")
    except ScenarioError as exc:
        text = str(exc)
        assert text.startswith(f"campaign-kind-fields.yaml: {where}.{name}: must be {f.allowed()}, got "), text
        COUNTS["kind_fields"][f"{kind}.{name}"] += 1
        event(f"refused: {kind}")
        return
    except Exception as exc:
        COUNTS["kind_fields"]["crash"] += 1
        raise AssertionError(f"traceback for {kind}.{name} = {value!r}: {type(exc).__name__}: {exc}") from exc
    COUNTS["kind_fields"]["accepted"] += 1
    raise AssertionError(f"{kind}.{name} accepted {value!r}, which is not {f.allowed()}")


def test_campaign_reached_every_kind_field() -> None:
    """Every field of every kind got wrong values, and each was refused naming it."""
    counts = COUNTS["kind_fields"]
    run = sum(counts.values())
    if run < 200:
        pytest.skip(f"only {run} kind-field examples ran in this session (the test was deselected?)")
    missing = sorted(f"{k}.{f}" for k, f in _kind_fields() if not counts[f"{k}.{f}"])
    assert not missing, f"no wrong value drawn for {missing}"


CAPTURED_BASE = "captured-tiny-mamba2-hybrid-p1-d2.yaml"


@settings(CAMPAIGN, max_examples=EXAMPLES["captured"])
@given(data=st.data())
def test_mutated_captured_sections_are_scenario_errors(data: st.DataObject) -> None:
    """#48 point 2: a captured scenario's ``captured`` section (what real engines built) with 1 to 3
    values replaced by garbage of any type, keys dropped, renamed or added, lists reordered:
    parsed or a ScenarioError, never a traceback; a value of the wrong type is never accepted."""
    base = yaml.safe_load((Path(__file__).parent / "scenarios" / CAPTURED_BASE).read_text())
    captured, done = data.draw(mutated(base["captured"], DICT_GARBAGE | st.sampled_from(
        ["²", "١", "9" * 5000, "-1", " 1", "1.0"]), max_mutations=3), label="captured")
    note(f"mutations: {done}")
    d = {**base, "captured": captured}
    try:
        scenario = parse(copy.deepcopy(d), source="campaign-captured.yaml")
    except ScenarioError:
        COUNTS["captured"]["ScenarioError"] += 1
        return
    except Exception as exc:
        COUNTS["captured"]["crash"] += 1
        raise AssertionError(f"traceback for {done}: {type(exc).__name__}: {exc}") from exc
    got = scenario.captured
    if got is None:  # the whole section replaced by null: a scenario without one
        COUNTS["captured"]["no section"] += 1
        return
    COUNTS["captured"]["parsed"] += 1
    assert isinstance(got["source"], str)
    for role in ("prefill", "decode"):
        side = got[role]
        assert isinstance(side["vllm"], str)
        for g in side["groups"]:
            assert isinstance(g["spec"], str) and type(g["block_size"]) is int and g["block_size"] >= 1
            assert all(type(n) is int and n >= 0 for n in g["layers"])
        assert all(type(k) is int and k >= 0 and isinstance(v, str) for k, v in side["pages"].items())


# ============================================================================= handshake

# Real geometries: the ranks of a few small scenarios, built as the rehearsal builds them.
GEOMETRY_BASES = {
    "fa-p2-d1-lbhnc": {"model": {"layers": [{"kind": "full_attention", "count": 2, "num_kv_heads": 4, "head_size": 32}]},
                       "prefill": {"tp": 2}, "decode": {"tp": 1}, "request": {"num_tokens": 64}},
    "fa-p1-d2-blhnc-b32-k16": {"model": {"layers": [{"kind": "full_attention", "num_kv_heads": 2, "head_size": 32}]},
                               "prefill": {"tp": 1, "block_size": 16, "layout": "BLHNC"},
                               "decode": {"tp": 2, "block_size": 32, "kernel_block_size": 16, "layout": "BLHNC"},
                               "request": {"num_tokens": 64}},
    "sw-interior-p1-d1": {"model": {"layers": [{"kind": "sliding_window", "num_kv_heads": 2, "head_size": 16, "window": 33},
                                               {"kind": "full_attention", "num_kv_heads": 2, "head_size": 16}]},
                          "prefill": {"tp": 1, "interior": "k_channel_major"},
                          "decode": {"tp": 1, "interior": "k_channel_major"}, "request": {"num_tokens": 64}},
    "uniform-mla-indexer-p2-d2": {"model": {"layers": [{"kind": "uniform", "members": [
                                      {"kind": "mla", "kv_lora_rank": 32, "qk_rope_head_dim": 16},
                                      {"kind": "mla_indexer"}]}]},
                                  "prefill": {"tp": 2, "block_size": 64}, "decode": {"tp": 2, "block_size": 64},
                                  "request": {"num_tokens": 64}},
    "mamba2-hybrid-p2-d1": {"model": {"layers": [
                                {"kind": "mamba", "mamba_type": "mamba2", "num_heads": 8, "head_dim": 8, "d_state": 8,
                                 "n_groups": 2, "num_spec": 1},
                                {"kind": "full_attention", "num_kv_heads": 2, "head_size": 16}]},
                            "prefill": {"tp": 2}, "decode": {"tp": 1}, "request": {"num_tokens": 64}},
    "swmla-p1-d1": {"model": {"layers": [{"kind": "sliding_window_mla", "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                          "window": 32}]},
                    "prefill": {"tp": 1}, "decode": {"tp": 1}, "request": {"num_tokens": 64}},
}
if "chunked_local" in ATTENTION_KINDS:
    GEOMETRY_BASES["chunked-p2-d1"] = {
        "model": {"layers": [{"kind": "chunked_local", "num_kv_heads": 2, "head_size": 16, "chunk": 32},
                             {"kind": "full_attention", "num_kv_heads": 2, "head_size": 16}]},
        "prefill": {"tp": 2}, "decode": {"tp": 1}, "request": {"num_tokens": 64}}
HASH = "campaign-hash"
_BUILT: dict[str, Any] = {}


def base_geometries(name: str) -> tuple[dict[int, dict[str, Any]], list[RankGeometry], list[dict[tuple[str, int], Any]]]:
    """(prefill rank -> geometry dict, decode rank geometries, what the true reply's plan writes on
    each decode rank) of one base scenario, built once."""
    if name not in _BUILT:
        from nixlkv.testing.engines import build_rank
        from nixlkv.testing.rehearsal import geometry

        scenario = parse(GEOMETRY_BASES[name], source=name)
        disp = _dispatcher()
        prefill = {r: geometry(build_rank(scenario, "prefill", r), disp).to_dict() for r in range(scenario.prefill.tp)}
        decode_ranks = [build_rank(scenario, "decode", r) for r in range(scenario.decode.tp)]
        decode = [geometry(r, disp) for r in decode_ranks]
        # The unmutated pair plans (else the campaign would test nothing): what each decode rank
        # receives, to compare a mutated reply's plan with.
        remote = {r: RankGeometry.from_dict(g) for r, g in prefill.items()}
        truth = [coverage(disp.plan(local, remote)) for local in decode]
        _BUILT[name] = (prefill, decode, truth, decode_ranks)  # the ranks keep the memory the addresses name
    prefill, decode, truth, _ = _BUILT[name]
    return prefill, decode, truth


def base_wires(name: str, columnar: bool) -> dict[int, dict[str, Any]]:
    """Prefill rank -> its geometry as a handshake carries it: columnar (what nixlkv sends) or
    per region (what an earlier nixlkv sent, still accepted)."""
    prefill, _, _ = base_geometries(name)
    if not columnar:
        return prefill
    return {r: RankGeometry.from_dict(g).to_wire() for r, g in prefill.items()}


def coverage(plan: Any) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """The local bytes a plan writes: (local region, phase) -> merged [start, end) byte ranges of its page."""
    runs: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for seg in plan.segments:
        runs.setdefault((seg.local_region, seg.phase), []).append((seg.local_offset, seg.local_offset + seg.nbytes))
    out = {}
    for key, spans in runs.items():
        merged: list[tuple[int, int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[key] = merged
    return out


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _at(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


AXIS_NAMES = ["head", "token", "byte", "kblock", "heads", "tokens", "", "head ", "Head", "x" * 300, "\x00", "é"]
# Values a hostile peer may put anywhere: every one msgpack can carry (ints within 64 bits).
WIRE_GARBAGE = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 1.5, -0.0, float("nan"), float("inf"), "", "x", b"", b"\xff",
                     [], {}, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -(2**63), [0, 1], [[]], {"": None},
                     ["head", 4], [["head", 4]], [0, [["byte", 1, 1]]]]),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.recursive(st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3)),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                 max_leaves=8),
)
# In-process dicts (RankGeometry.from_dict called directly) may hold anything Python has.
DICT_GARBAGE = st.one_of(WIRE_GARBAGE, st.sampled_from([10**30, -(10**30), (1, 2), ("head", 4), {1: 2}, object(),
                                                         bytearray(b"x"), 1j, frozenset()]))


ALL_OPS = ("replace", "drop", "nudge", "rename", "reorder", "extra", "page_parts")
# Mutations that keep every value's type (a reply that decodes, with hostile facts in it).
TYPED_OPS = ("nudge", "nudge", "rename", "reorder", "page_parts", "drop")
FOCUS = {"facts", "page", "page_parts", "group", "num_blocks", "block_stride", "class"}


@st.composite
def mutated(draw, base: Any, garbage: st.SearchStrategy, max_mutations: int = 3,
            ops: tuple[str, ...] = ALL_OPS) -> tuple[Any, list[str]]:
    """``base`` (deep-copied) with 1..max_mutations mutations at random places: keys dropped,
    values replaced by garbage, integers nudged (+-1, x2, negative, 1.5, past 2^63), names
    renamed, lists reordered, duplicated or truncated, extra keys, page_parts garbage.
    With ``ops=TYPED_OPS`` integers stay integers (within 64 bits) and names stay strings (only
    page_parts may be garbage): replies that decode and reach planning with hostile values."""
    obj = copy.deepcopy(base)
    done = []
    typed = ops == TYPED_OPS
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(obj)
        if typed and draw(st.integers(0, 2)):  # mostly what strategies read: facts, pages, groups, blocks
            paths = [p for p in paths if FOCUS.intersection(k for k in p if isinstance(k, str))] or paths
        path = draw(st.sampled_from(paths))
        here = _at(obj, path)
        parent = _at(obj, path[:-1]) if path else None
        op = draw(st.sampled_from(ops))
        if typed and op == "nudge" and isinstance(here, int) and not isinstance(here, bool) and path:
            new = draw(st.sampled_from([here + 1, here - 1, here * 2, here // 2, 0, 1, here + 4096, here * 64,
                                        2**63 - 1, -here, here + 2**32]))
            parent[path[-1]] = new if -(2**63) <= new < 2**64 else here
            done.append(f"nudge at {list(path)}")
            continue
        if op == "drop" and path:
            if isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        elif op == "nudge" and isinstance(here, int) and not isinstance(here, bool) and path:
            parent[path[-1]] = draw(st.sampled_from([here + 1, here - 1, -here, here * 2, here // 2, 0, 1,
                                                     here + 0.5, float(here), 2**63 + here % 7, str(here)]))
        elif op == "rename" and path and isinstance(parent, dict):
            new = draw(st.sampled_from([*AXIS_NAMES, *(k for k in parent if isinstance(k, str))]))
            parent[new] = parent.pop(path[-1])
        elif op == "rename" and path and isinstance(here, str):
            parent[path[-1]] = draw(st.sampled_from(AXIS_NAMES))
        elif op == "reorder" and isinstance(here, list) and here:
            how = draw(st.sampled_from(["swap", "dup", "truncate", "reverse"]))
            if how == "swap" and len(here) > 1:
                i, j = draw(st.integers(0, len(here) - 1)), draw(st.integers(0, len(here) - 1))
                here[i], here[j] = here[j], here[i]
            elif how == "dup":
                here.append(copy.deepcopy(here[draw(st.integers(0, len(here) - 1))]))
            elif how == "truncate":
                del here[draw(st.integers(0, len(here) - 1)):]
            else:
                here.reverse()
        elif op == "extra" and isinstance(here, dict):
            here[draw(st.sampled_from(["page_parts", "facts", "extra", "group", "device_id", "mem_type"]))] = copy.deepcopy(draw(garbage))
        elif op == "page_parts" and isinstance(here, dict) and "page" in here:
            here["page_parts"] = draw(page_parts(here.get("page")))
        elif typed:
            continue  # an op that does not apply here: typed replies get no garbage instead
        elif path:
            parent[path[-1]] = copy.deepcopy(draw(garbage))
            op = "replace"  # (what an op that does not apply here falls back to)
        else:
            obj = copy.deepcopy(draw(garbage))
            op = "replace"
        done.append(f"{op} at {list(path)}")
    return obj, done


@st.composite
def page_parts(draw, page: Any) -> Any:
    """Parts for a page: garbage, or plausible parts (the page's own axes, permuted strides,
    offsets) that may or may not cover it exactly."""
    if not isinstance(page, list) or not all(isinstance(a, list) and len(a) == 2 for a in page) or draw(st.booleans()):
        return copy.deepcopy(draw(st.one_of(WIRE_GARBAGE, st.lists(st.lists(WIRE_GARBAGE, max_size=3), max_size=3))))
    axes = [[n, s] for n, s in page]
    strides, step = [], 1
    for _, size in reversed(axes):
        strides.insert(0, step)
        step = step * size if isinstance(size, int) and size > 0 else step
    perm = draw(st.permutations(range(len(axes))))
    axes3 = [[n, s, strides[perm[i]]] for i, (n, s) in enumerate(axes)]
    split = draw(st.integers(0, 2))
    if split and axes3 and isinstance(axes3[0][1], int) and axes3[0][1] > 1:
        half = axes3[0][1] // 2
        first = [[axes3[0][0], half, axes3[0][2]], *axes3[1:]]
        second = [[axes3[0][0], axes3[0][1] - half, axes3[0][2]], *axes3[1:]]
        return [[0, first], [draw(st.sampled_from([half * axes3[0][2], 0, 1])), second]]
    return [[draw(st.sampled_from([0, 0, 1, 2**40])), axes3]]


@pytest.mark.vllm
@settings(CAMPAIGN, max_examples=EXAMPLES["geometry"])
@given(data=st.data(), name=st.sampled_from(sorted(GEOMETRY_BASES)))
def test_mutated_geometry_dicts_are_handshake_errors(data: st.DataObject, name: str) -> None:
    """RankGeometry.from_dict / Region.from_dict on a real geometry dict with any mutation: a
    RankGeometry or a HandshakeError, never another exception."""
    prefill, _, _ = base_geometries(name)
    rank = data.draw(st.sampled_from(sorted(prefill)))
    target = data.draw(st.sampled_from(["rank", "region", "columnar"]))
    if target == "columnar":  # the rank's geometry as this nixlkv sends it
        base = base_wires(name, columnar=True)[rank]
    else:
        base = prefill[rank] if target == "rank" else prefill[rank]["regions"][0]
    obj, done = data.draw(mutated(base, DICT_GARBAGE))
    note(f"mutations: {done}")
    try:
        (Region if target == "region" else RankGeometry).from_dict(obj)
    except HandshakeError as exc:
        assert str(exc)
        COUNTS["geometry"]["handshake_error"] += 1
        return
    except Exception as exc:
        COUNTS["geometry"]["crash"] += 1
        raise AssertionError(f"{type(exc).__name__} escaped {target} from_dict: {exc}; mutations {done}") from exc
    COUNTS["geometry"]["accepted"] += 1


class _Groups:
    """Block ids for every KV group index a (possibly hostile) plan names, without a list that long."""

    def __init__(self, ids: dict[int, np.ndarray], n: int) -> None:
        self.ids, self.n = ids, n

    def __len__(self) -> int:
        return min(self.n, sys.maxsize)  # a hostile group index may be 2^64 - 1

    def __getitem__(self, group: int) -> np.ndarray:
        return self.ids.get(group, np.zeros(0, dtype=np.int64))


def _inside(addr: int, nbytes: int, memory: Any) -> bool:
    return any(a <= addr and addr + nbytes <= a + n for a, n in memory)


def check_plan_is_memory_safe(plan: Any, remote: Mapping[int, RankGeometry], counts: Counter) -> None:
    """A plan made from a hostile (but accepted) geometry: a request with block ids inside the
    bounds the plan checks resolves to READs that stay inside the registered memory each side
    advertised, or is refused with a RequestError."""
    local_ids: dict[int, np.ndarray] = {}
    remote_ids: dict[int, np.ndarray] = {}
    for pairing in plan.pairings:
        local_ids[pairing.local_group] = np.arange(1, min(5, pairing.local_num_blocks), dtype=np.int64)
        remote_ids[pairing.remote_group] = np.arange(1, min(5, pairing.remote_num_blocks), dtype=np.int64)
    locals_, remotes = _Groups(local_ids, max(local_ids, default=-1) + 1), _Groups(remote_ids, max(remote_ids, default=-1) + 1)
    try:
        resolved = plan.resolve(locals_, remotes, num_tokens=64)
    except NixlkvError:
        counts["request_refused"] += 1
        return
    moves = plan.byte_moves(resolved)
    for laddr, rank, raddr, nbytes in moves:
        assert nbytes > 0
        assert _inside(laddr, nbytes, plan.local.memory), f"writes local [{laddr:#x}, +{nbytes}) outside D's memory"
        assert _inside(raddr, nbytes, remote[rank].memory), (
            f"reads remote rank {rank} [{raddr:#x}, +{nbytes}) outside the memory it advertised")
    counts["planned_memory_safe"] += 1


def _corrupt_strings(inner: bytes, payload: Any, draw) -> bytes:
    """Replace the bytes of one msgpack string of the payload with invalid UTF-8 (same length)."""
    values = (_at(payload, p) for p in _paths(payload))
    strings = sorted({v for v in values if isinstance(v, str) and 0 < len(v.encode()) < 32})
    if not strings:
        return inner
    s = draw(st.sampled_from(strings)).encode()
    bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]))
    replacement = (bad * len(s))[: len(s)]
    at = inner.find(s)
    return inner if at < 0 else inner[:at] + replacement + inner[at + len(s):]


@pytest.mark.vllm
@settings(CAMPAIGN, max_examples=EXAMPLES["wire"])
@given(data=st.data(), name=st.sampled_from(sorted(GEOMETRY_BASES)))
def test_mutated_handshake_replies_are_refused_or_planned_safely(data: st.DataObject, name: str) -> None:
    """A real handshake reply, mutated in its fields and in its msgpack bytes: decode_reply raises
    HandshakeError or returns geometries; planning against them raises a NixlkvError or plans,
    and a plan never reads or writes outside the memory each side registered."""
    prefill = base_wires(name, columnar=data.draw(st.booleans()))  # as sent, or as an earlier nixlkv sent
    engine_id, tp = prefill[0]["engine_id"], prefill[0]["tp_size"]
    payload = [engine_id, tp, [[r, b"agent-%d" % r, g] for r, g in sorted(prefill.items())]]
    typed = data.draw(st.booleans())  # half the replies keep their types: they decode and reach planning
    payload, done = data.draw(mutated(payload, WIRE_GARBAGE, ops=TYPED_OPS if typed else ALL_OPS))
    try:
        inner = msgspec.msgpack.encode(payload)
    except (OverflowError, TypeError, msgspec.EncodeError):
        inner = msgspec.msgpack.encode([engine_id, tp, []])
        done.append("(not encodable: empty rank list)")
    wire = "fields" if typed else data.draw(st.sampled_from(["fields", "utf8", "flip", "truncate", "envelope"]))
    if wire == "utf8":
        inner = _corrupt_strings(inner, payload, data.draw)
    elif wire == "flip" and inner:
        at = data.draw(st.integers(0, len(inner) - 1))
        inner = inner[:at] + bytes([inner[at] ^ data.draw(st.integers(1, 255))]) + inner[at + 1:]
    elif wire == "truncate":
        inner = inner[: data.draw(st.integers(0, len(inner)))]
    envelope: list[Any] = [hs.SCHEMA_VERSION, HASH, inner]
    if wire == "envelope":
        envelope[data.draw(st.integers(0, 2))] = copy.deepcopy(data.draw(WIRE_GARBAGE))
    raw = msgspec.msgpack.encode(envelope)
    note(f"mutations: {done}; wire: {wire}")
    check_reply(name, raw, f"mutations {done}, wire {wire}", enforce_hash=data.draw(st.booleans()))


class _memory_cap:
    """Address space limited to what the process maps now plus ``extra`` bytes, while a hostile
    reply is decoded and planned: an allocation it provokes past that is a MemoryError (a crash
    the campaign reports) instead of the kernel's OOM killer ending the whole test session.
    Linux only (/proc); elsewhere a no-op."""

    def __init__(self, extra: int = 2 << 30) -> None:
        self.extra = extra
        self.saved: tuple[int, int] | None = None

    def __enter__(self) -> None:
        try:
            import resource

            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            self.saved = resource.getrlimit(resource.RLIMIT_AS)
            hard = self.saved[1]
            cap = vm + self.extra
            resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
        except (ImportError, OSError, StopIteration, ValueError):
            self.saved = None

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self.saved)


def check_reply(name: str, raw: bytes, what: str, enforce_hash: bool = True, counts: Counter | None = None) -> None:
    """decode_reply + Dispatcher.plan for every decode rank of base ``name`` on one (mutated)
    reply: HandshakeError, a NixlkvError, or a plan that stays inside registered memory and
    fills exactly the decode bytes the true reply's plan fills."""
    _, decode, truth = base_geometries(name)
    counts = COUNTS["wire"] if counts is None else counts
    with _memory_cap():
        try:
            engine = hs.decode_reply(raw, HASH, enforce_hash=enforce_hash)
        except HandshakeError as exc:
            assert str(exc)
            counts["handshake_error"] += 1
            return
        except Exception as exc:
            counts["crash"] += 1
            raise AssertionError(f"{type(exc).__name__} escaped decode_reply: {exc}; {what}") from exc
        counts["decoded"] += 1
        for local, received in zip(decode, truth):
            try:
                plan = _dispatcher().plan(local, engine.geometry)
            except NixlkvError as exc:
                assert str(exc)
                counts[f"plan_refused: {type(exc).__name__}"] += 1
                continue
            except Exception as exc:
                counts["crash"] += 1
                raise AssertionError(f"{type(exc).__name__} escaped Dispatcher.plan: {exc}; {what}") from exc
            check_plan_is_memory_safe(plan, engine.geometry, counts)
            # A reply may move where P's bytes are, never what D receives: a plan that fills less
            # (or other bytes) of D's pages than the true reply's plan leaves D computing with holes.
            got = coverage(plan)
            if got != received:
                counts["crash"] += 1
                differ = {k: v for k, v in received.items() if got.get(k) != v}
                raise AssertionError(f"a mutated reply changed the bytes decode rank {local.tp_rank} receives without "
                                     f"a refusal (the true plan's ranges that differ: {differ}); {what}")
            counts["planned_same_bytes"] += 1


def _reply_with_fact(name: str, region: int, fact: str, value: Any, columnar: bool = False) -> bytes:
    p = copy.deepcopy(base_wires(name, columnar))
    if columnar:  # the region's class: every layer of that geometry advertises it
        p[0]["region_classes"][p[0]["region_columns"]["class"][region]]["facts"][fact] = value
    else:
        p[0]["regions"][region]["facts"][fact] = value
    payload = [p[0]["engine_id"], p[0]["tp_size"], [[r, b"agent-%d" % r, g] for r, g in sorted(p.items())]]
    return msgspec.msgpack.encode([hs.SCHEMA_VERSION, HASH, msgspec.msgpack.encode(payload)])


# Hostile facts the campaign found (docs/campaign.md, "Findings"): each alone, in an otherwise true
# reply, must be refused (or plan the true bytes). Kept as explicit cases so CI checks them every
# run, whatever the derandomized draw.
HOSTILE_FACTS = [("tokens_per_block", 0), ("tokens_per_block", None), ("tokens_per_block", -16),
                 ("tokens_per_block", 2**40), ("total_kv_heads", None)]


@pytest.mark.vllm
@pytest.mark.parametrize("columnar", [True, False], ids=["columnar", "per-region"])
@pytest.mark.parametrize(("fact", "value"), HOSTILE_FACTS, ids=[f"{f}={v}" for f, v in HOSTILE_FACTS])
def test_hostile_fact_found_by_the_campaign_is_refused(fact: str, value: Any, columnar: bool) -> None:
    check_reply("fa-p2-d1-lbhnc", _reply_with_fact("fa-p2-d1-lbhnc", 0, fact, value, columnar), f"facts.{fact}={value!r}",
                counts=COUNTS["hostile_facts"])


# ============================================================================= kv_transfer_params

GOOD_PARAMS = [
    {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "10.0.0.7",
     "remote_port": 5600, "remote_block_ids": [[1, 2, 3], [0, 0, 9]], "tp_size": 2, "remote_num_tokens": 40,
     "remote_lease_s": 30, "remote_generation": "g1"},
    {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-1",
     "remote_host": "prefill-0.svc", "remote_port": 1, "remote_block_ids": [4, 5, 6]},
    {"do_remote_decode": True},
    {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "[::1]",
     "remote_port": 65535, "remote_block_ids": [[]], "remote_num_tokens": 0},
]
# JSON values (what a client, proxy or router can send), and Python values a broken plugin could.
PARAMS_GARBAGE = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 1.5, float("nan"), float("inf"), -float("inf"), "", "0", "true",
                     "false", "5600", "a b", "h:1", "http://h", "\n", [], {}, [[]], [[-1]], [[1, 1]], [[1.0]],
                     [["1"]], [[True]], [[2**31]], [[0, 0]], 2**31, 2**64, 10**30, [1, [2]], {"0": [1]}]),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 2**32), st.text(max_size=3)),
                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                 max_leaves=10),
    st.sampled_from([(1, 2), b"x", object()]),
)


def check_remote(r: Any) -> None:
    """What a RemoteParams that passed must be: typed, bounded, no block named twice."""
    assert isinstance(r.engine_id, str) and r.engine_id and isinstance(r.request_id, str) and r.request_id
    assert isinstance(r.port, int) and not isinstance(r.port, bool) and 1 <= r.port <= 65535
    assert isinstance(r.host, str) and r.host and not any(c.isspace() for c in r.host) and "/" not in r.host
    for group in r.block_ids:
        assert all(type(b) is int and 0 <= b <= MAX_BLOCK_ID for b in group), group
        real = [b for b in group if b != NULL_BLOCK_ID]
        assert len(set(real)) == len(real), group
    assert r.tp_size is None or (type(r.tp_size) is int and r.tp_size >= 1)
    assert r.num_tokens is None or (type(r.num_tokens) is int and r.num_tokens >= 0)
    assert r.lease_s is None or (isinstance(r.lease_s, float) and 0 < r.lease_s < math.inf)
    assert r.generation is None or (isinstance(r.generation, str) and r.generation)


@settings(CAMPAIGN, max_examples=EXAMPLES["params"])
@given(data=st.data(), base=st.sampled_from(range(len(GOOD_PARAMS))))
def test_mutated_params_raise_params_error(data: st.DataObject, base: int) -> None:
    """flags / remote / recv_from_params on mutated kv_transfer_params: a checked value or a
    ParamsError naming the field, never another exception and never a coercion."""
    from nixlkv.vllm.metadata import recv_from_params

    params, done = data.draw(mutated(GOOD_PARAMS[base], PARAMS_GARBAGE))
    note(f"params: {params!r}; mutations {done}")
    counts = COUNTS["params"]
    for name, fn in (("flags", flags), ("remote", remote),
                     ("recv_from_params", lambda p: recv_from_params(p, [[1, 2]], report=False, arrived=1.0, now=2.0))):
        try:
            out = fn(params)
        except ParamsError as exc:
            assert str(exc)
            counts[f"{name}: ParamsError"] += 1
            continue
        except Exception as exc:
            counts["crash"] += 1
            raise AssertionError(f"{type(exc).__name__} escaped {name}: {exc}; params {params!r}") from exc
        counts[f"{name}: accepted"] += 1
        if name == "flags":
            assert isinstance(out, tuple) and all(type(x) is bool for x in out)
        elif name == "remote":
            check_remote(out)


def _scheduler():
    from nixlkv.vllm.config import ConnectorConfig
    from nixlkv.vllm.scheduler import NixlkvScheduler

    vc = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                         cache_config=SimpleNamespace(enable_prefix_caching=True))  # vLLM's default
    return NixlkvScheduler(vc, "D", ConnectorConfig(), "compat", SimpleNamespace(kv_cache_groups=[]))


class _Blocks:
    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[7, 8, 9]]


@pytest.mark.vllm
@settings(CAMPAIGN, max_examples=EXAMPLES["scheduler"])
@given(data=st.data(), base=st.sampled_from(range(len(GOOD_PARAMS))))
def test_scheduler_serves_invalid_params_without_a_transfer(data: st.DataObject, base: int) -> None:
    """The scheduler's hooks with mutated kv_transfer_params: never an exception; params that do
    not pass (flags or remote fields) claim no remote tokens and queue no transfer (the request
    is served as a plain one: docs/vllm.md, nixlkv/vllm/params.py)."""
    from vllm.v1.request import RequestStatus

    params, done = data.draw(mutated(GOOD_PARAMS[base], PARAMS_GARBAGE))
    note(f"params: {params!r}; mutations {done}")
    state = "flags invalid"
    try:
        prefill, _ = flags(params)
        state = "remote fields invalid"
        remote(params)
        state = "remote fields valid" if prefill else "no remote prefill"
    except ParamsError:
        if state == "remote fields invalid" and not prefill:
            state = "no remote prefill"
    valid = state == "remote fields valid"
    sched = _scheduler()
    req = SimpleNamespace(request_id="req-0", kv_transfer_params=params, prompt_token_ids=list(range(48)),
                          num_prompt_tokens=48, num_computed_tokens=0, status=RequestStatus.FINISHED_STOPPED,
                          skip_reading_prefix_cache=False, resumable=False, mm_features=None)
    counts = COUNTS["scheduler"]
    try:
        sched.on_new_request(req)
        dropped = req.kv_transfer_params is None and params is not None
        claimed, asynchronous = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, _Blocks(), claimed)
        meta = sched.build_connector_meta(None)
        sched.request_finished(req, [[7, 8, 9]])
    except Exception as exc:
        counts["crash"] += 1
        raise AssertionError(f"{type(exc).__name__} escaped the scheduler: {exc}; params {params!r}") from exc
    finally:
        sched.shutdown()
    assert type(claimed) is int and claimed >= 0 and isinstance(asynchronous, bool)
    # Params whose flags do not pass are dropped before vLLM's own scheduler reads them (a plain request).
    assert dropped == (state == "flags invalid"), (state, dropped)
    if not valid:
        assert (claimed, asynchronous) == (0, False), (claimed, asynchronous)
        assert "req-0" not in meta.reqs_to_recv, meta.reqs_to_recv  # nothing queued for the workers
        counts[f"{state}: no transfer"] += 1
    else:
        counts[f"{state}: transfer claimed" if claimed else f"{state}: nothing to claim"] += 1
