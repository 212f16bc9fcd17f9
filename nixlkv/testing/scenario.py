"""Scenario files: a model and a P/D pair, in YAML or JSON. See docs/scenarios.md."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import NixlkvError
from ..scenario_kinds import DTYPES as DTYPES  # named here too (the dtypes a scenario's caches may hold)
from ..scenario_kinds import MAX_INT, check_params, show
from .kinds import KINDS, UNIFORM, known_kind, takes_interior

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
INTERIORS = ("k_channel_major",)  # see nixlkv.vllm.model_backend
CONV_LAYOUTS = ("DS", "SD")  # VLLM_SSM_CONV_STATE_LAYOUT


class ScenarioError(NixlkvError):
    """A scenario file is malformed: the message names the field."""


@dataclass(frozen=True)
class LayerKind:
    """``count`` consecutive layers of one kind; ``params`` are the kind's own fields.

    A ``uniform`` entry has no layers of its own: its ``members`` (leaf kinds) are the layers, and
    vLLM must group all of them into one ``UniformTypeKVCacheSpecs`` KV group.
    """

    kind: str
    count: int
    params: Mapping[str, Any]
    members: tuple[LayerKind, ...] = ()

    def leaves(self) -> list[LayerKind]:
        """One leaf entry per layer, in model order."""
        if self.members:
            return [leaf for m in self.members for leaf in m.leaves()]
        return [self] * self.count


@dataclass(frozen=True)
class Side:
    tp: int
    block_size: int
    layout: str
    num_blocks: int | None = None
    kernel_block_size: int | None = None  # attention kernels run on blocks this small
    # The order the attention kernels write inside a page where it is not the view's
    # (``k_channel_major``: vLLM's CPU backend); None: token-major, as the view says.
    interior: str | None = None
    # The engine's VLLM_SSM_CONV_STATE_LAYOUT (DS | SD): every Mamba layer's conv_layout on this
    # side; None: each layer's own (DS unless it says). P and D may differ.
    conv_layout: str | None = None


@dataclass(frozen=True)
class Request:
    num_tokens: int
    seed: int = 0
    cached_blocks: int = 0  # blocks D already holds (prefix hit): only the rest moves
    # Entries of a state (Mamba) group's block list on each side: the last is the running state,
    # earlier ones alternate null placeholders and superseded states that must never move.
    state_blocks: int = 1


@dataclass(frozen=True)
class Scenario:
    name: str
    layers: tuple[LayerKind, ...]
    prefill: Side
    decode: Side
    request: Request
    expect_error: str | None = None
    source: str = field(default="<inline>", compare=False)
    # A different model on the decode side: only for rejection tests (the engines must refuse).
    decode_layers: tuple[LayerKind, ...] | None = None
    # What real engines built, per side (nixlkv capture): the rehearsal must build the same.
    captured: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds())

    def layers_of(self, role: str = "prefill") -> tuple[LayerKind, ...]:
        if role == "decode" and self.decode_layers is not None:
            return self.decode_layers
        return self.layers

    def layer_kinds(self, role: str = "prefill") -> list[LayerKind]:
        """One entry per layer, in model order, on the ``role`` ("prefill" or "decode") side, with
        the side's ``conv_layout`` where it sets one."""
        leaves = [leaf for k in self.layers_of(role) for leaf in k.leaves()]
        layout = (self.prefill if role == "prefill" else self.decode).conv_layout
        if layout is None:
            return leaves
        sided: dict[int, LayerKind] = {}  # one object per distinct leaf, as leaves() gives them
        for leaf in leaves:
            if leaf.kind == "mamba" and id(leaf) not in sided:
                sided[id(leaf)] = replace(leaf, params={**leaf.params, "conv_layout": layout})
        return [sided.get(id(leaf), leaf) for leaf in leaves]

    def uniform_members(self, role: str = "prefill") -> list[tuple[str, range]]:
        """(where in the file, layer indices) of every ``uniform`` entry on the ``role`` side."""
        out, at = [], 0
        for i, k in enumerate(self.layers_of(role)):
            n = len(k.leaves())
            if k.kind == UNIFORM:
                out.append((f"model.layers[{i}]", range(at, at + n)))
            at += n
        return out


MAX_FILE_BYTES = 1 << 20  # a scenario is a page of YAML: anything larger is refused unread
MAX_LAYERS = 4096  # no model has more; the rehearsal builds each layer's spec and tensors in Python


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a few hundred bytes of nested aliases ("billion laughs")
    expand to gigabytes, and a scenario never needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ScenarioError(f"YAML aliases are not allowed in scenario files (line {event.start_mark.line + 1})")
        return super().compose_node(parent, index)


def load(path: str | Path) -> Scenario:
    """Read and check a scenario file: any malformed file is a ScenarioError naming it, in
    bounded time and memory (size, depth, integer length and aliases limited before building)."""
    path = Path(path)
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ScenarioError(f"{path}: {size} B is larger than a scenario file may be ({MAX_FILE_BYTES} B)")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot be read: {exc}") from None
    try:
        data = json.loads(text) if kind == "JSON" else yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - safe loader
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: not valid {kind}: {exc}") from None
    except RecursionError:
        raise ScenarioError(f"{path}: not valid {kind}: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise ScenarioError(f"{path}: not valid {kind}: {exc}") from None
    try:
        return parse(data, source=str(path))
    except RecursionError:
        raise ScenarioError(f"{path}: nested too deeply to be a scenario") from None


def parse(data: Any, source: str = "<inline>") -> Scenario:
    where = source
    d = _mapping(data, where)
    _only(d, {"name", "model", "decode_model", "prefill", "decode", "request", "expect", "captured"}, where)
    layers = _model(_req(d, "model", where), f"{where}: model")
    expect = d.get("expect", "ok")
    expect_error = None
    if expect != "ok":
        e = _mapping(expect, f"{where}: expect")
        _only(e, {"error"}, f"{where}: expect")
        expect_error = str(_req(e, "error", f"{where}: expect"))
    decode_layers = None
    if "decode_model" in d:
        if expect_error is None:
            raise ScenarioError(
                f"{where}: decode_model (a different model on the decode side) is only for rejection "
                "tests; add expect: {error: <text of the expected planning error>}"
            )
        decode_layers = _model(d["decode_model"], f"{where}: decode_model")
    req = _mapping(_req(d, "request", where), f"{where}: request")
    _only(req, {"num_tokens", "seed", "cached_blocks", "state_blocks"}, f"{where}: request")
    for role in ("prefill", "decode"):
        side = d.get(role)
        if isinstance(side, Mapping) and side.get("interior") is not None:
            for i, leaf in enumerate(k for layer in (decode_layers if role == "decode" and decode_layers else layers)
                                     for k in layer.leaves()):
                hv = leaf.params.get("head_size_v")
                if takes_interior(leaf.kind) and hv is not None and hv != leaf.params.get("head_size"):
                    raise ScenarioError(
                        f"{where}: {role}.interior {side['interior']} stores K and V of one head size, but layer {i} "
                        f"has head_size {leaf.params.get('head_size')} and head_size_v {hv}"
                    )
    return Scenario(
        name=str(d.get("name") or Path(source).stem),
        layers=layers,
        prefill=_side(_req(d, "prefill", where), f"{where}: prefill"),
        decode=_side(_req(d, "decode", where), f"{where}: decode"),
        request=Request(
            num_tokens=_pos(_req(req, "num_tokens", f"{where}: request"), f"{where}: request.num_tokens"),
            seed=_nonneg(req.get("seed", 0), f"{where}: request.seed"),
            cached_blocks=_nonneg(req.get("cached_blocks", 0), f"{where}: request.cached_blocks"),
            state_blocks=_pos(req.get("state_blocks", 1), f"{where}: request.state_blocks"),
        ),
        expect_error=expect_error,
        source=source,
        decode_layers=decode_layers,
        captured=None if d.get("captured") is None else _captured(d["captured"], f"{where}: captured"),
    )


def _captured(x: Any, where: str) -> dict[str, Any]:
    """What real engines built (nixlkv capture): checked by the rehearsal, so checked for type here
    (every field: a wrong type is a ScenarioError naming it, never a value converted to fit)."""
    d = _mapping(x, where)
    _only(d, {"source", "prefill", "decode"}, where)
    out: dict[str, Any] = {"source": _str(d.get("source", ""), f"{where}.source")}
    for role in ("prefill", "decode"):
        w = f"{where}.{role}"
        side = _mapping(_req(d, role, where), w)
        _only(side, {"vllm", "groups", "pages"}, w)
        groups = _req(side, "groups", w)
        if not isinstance(groups, list) or not groups:
            raise ScenarioError(f"{w}.groups must be a non-empty list, got {_show(groups)}")
        parsed = []
        for i, g in enumerate(groups):
            wg = f"{w}.groups[{i}]"
            gm = _mapping(g, wg)
            _only(gm, {"spec", "block_size", "layers"}, wg)
            layers = _req(gm, "layers", wg)
            if not isinstance(layers, list):
                raise ScenarioError(f"{wg}.layers: must be a list of layer positions, got {_show(layers)}")
            parsed.append({"spec": _str(_req(gm, "spec", wg), f"{wg}.spec"),
                           "block_size": _pos(_req(gm, "block_size", wg), f"{wg}.block_size"),
                           "layers": [_nonneg(n, f"{wg}.layers[{j}]") for j, n in enumerate(layers)]})
        pages = _mapping(side.get("pages", {}), f"{w}.pages")
        out[role] = {
            "vllm": _str(side.get("vllm", ""), f"{w}.vllm"),
            "groups": parsed,
            "pages": {_layer_position(k, f"{w}.pages"): _str(v, f"{w}.pages[{_show(k)}]") for k, v in pages.items()},
        }
    return out


def _layer_position(k: Any, where: str) -> int:
    """A page's key: a layer position, as YAML writes it (an integer) or JSON (a string of digits)."""
    if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 13:
        k = int(k)
    return _nonneg(k, f"{where} key")


def _str(x: Any, where: str) -> str:
    if not isinstance(x, str):
        raise ScenarioError(f"{where}: must be a string, got {_show(x)}")
    return x


def _model(x: Any, where: str) -> tuple[LayerKind, ...]:
    model = _mapping(x, where)
    _only(model, {"layers"}, where)
    raw_layers = _req(model, "layers", where)
    if not isinstance(raw_layers, list) or not raw_layers:
        raise ScenarioError(f"{where}.layers must be a non-empty list")
    kinds = tuple(_layer(x, f"{where}.layers[{i}]") for i, x in enumerate(raw_layers))
    total = sum(map(_layer_count, kinds))
    if total > MAX_LAYERS:
        raise ScenarioError(f"{where}: {total} layers; a scenario's model has at most {MAX_LAYERS} (lower a count)")
    return kinds


def _layer_count(kind: LayerKind) -> int:
    """Layers an entry stands for, without listing them (a count may be up to MAX_INT)."""
    return sum(map(_layer_count, kind.members)) if kind.members else kind.count


def _layer(x: Any, where: str, in_uniform: bool = False) -> LayerKind:
    d = dict(_mapping(x, where))
    kind = d.pop("kind", None)
    if not isinstance(kind, str) or not known_kind(kind):  # a plugin's kind: from its nixlkv_scenario_kinds
        raise ScenarioError(f"{where}: kind must be one of {sorted(KINDS)}, got {_show(kind)}")
    if kind == UNIFORM:
        return _uniform(d, where, in_uniform)
    count = _pos(d.pop("count", 1), f"{where}.count")
    # One checker for every kind's own fields, built in or a plugin's (its declared schema):
    # type, range and allowed names, before the kind's own check or build reads a value.
    params, problems = check_params(KINDS[kind].fields, d)
    if problems:
        raise ScenarioError("; ".join(f"{where}.{name}: {problem} ({kind} layer)" for name, problem in problems))
    check = KINDS[kind].check
    errors = check(params) if check is not None else []
    if errors:
        raise ScenarioError(f"{where} ({kind}): {'; '.join(errors)}")
    return LayerKind(kind, count, params)


def _uniform(d: Mapping[str, Any], where: str, in_uniform: bool) -> LayerKind:
    if in_uniform:
        raise ScenarioError(f"{where}: a uniform group cannot contain another uniform group; list its members directly")
    _only(d, {"members"}, where)
    raw = _req(d, "members", where)
    if not isinstance(raw, list) or not raw:
        raise ScenarioError(f"{where}.members must be a non-empty list of layer kinds")
    members = tuple(_layer(m, f"{where}.members[{j}]", in_uniform=True) for j, m in enumerate(raw))
    return LayerKind(UNIFORM, 1, {}, members)


def _side(x: Any, where: str) -> Side:
    d = _mapping(x, where)
    _only(d, {"tp", "block_size", "layout", "num_blocks", "kernel_block_size", "interior", "conv_layout"}, where)
    layout = d.get("layout", "LBHNC")
    if layout not in LAYOUTS:
        raise ScenarioError(f"{where}: layout must be one of {LAYOUTS}, got {_show(layout)}")
    interior = d.get("interior")
    if interior is not None and interior not in INTERIORS:
        raise ScenarioError(f"{where}: interior must be one of {INTERIORS} or absent, got {_show(interior)}")
    if interior is not None and layout != "LBHNC":
        raise ScenarioError(f"{where}: interior {interior} is a backend's order inside LBHNC pages; set layout: LBHNC")
    conv_layout = d.get("conv_layout")
    if conv_layout is not None and conv_layout not in CONV_LAYOUTS:
        raise ScenarioError(f"{where}: conv_layout must be one of {CONV_LAYOUTS} or absent, got {_show(conv_layout)}")
    nb = d.get("num_blocks")
    kb = d.get("kernel_block_size")
    return Side(
        tp=_pos(_req(d, "tp", where), f"{where}.tp"),
        block_size=_pos(d.get("block_size", 16), f"{where}.block_size"),
        layout=layout,
        num_blocks=None if nb is None else _pos(nb, f"{where}.num_blocks"),
        kernel_block_size=None if kb is None else _pos(kb, f"{where}.kernel_block_size"),
        interior=interior,
        conv_layout=conv_layout,
    )


def _mapping(x: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(x, Mapping):
        raise ScenarioError(f"{where}: expected a mapping, got {type(x).__name__}")
    return x


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ScenarioError(f"{where}: missing required field {key!r}")
    return d[key]


def _only(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = set(d) - allowed
    if extra:
        raise ScenarioError(f"{where}: unknown field(s) {sorted(extra)}; allowed: {sorted(allowed)}")


def _pos(x: Any, where: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= MAX_INT:
        raise ScenarioError(f"{where}: must be a positive integer up to {MAX_INT}, got {_show(x)}")
    return x


def _nonneg(x: Any, where: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= MAX_INT:
        raise ScenarioError(f"{where}: must be a non-negative integer up to {MAX_INT}, got {_show(x)}")
    return x


_show = show  # a value for a message, bounded (nixlkv.scenario_kinds.show)
