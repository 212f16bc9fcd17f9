"""#48 point 1: every field of every scenario kind (built in, and those a plugin declares through
the ``nixlkv_scenario_kinds`` hook) is declared (``KindDef.fields``) and checked in one place,
``nixlkv.scenario_kinds.check_params``, before the kind's own code reads it. A wrong type, a list
or mapping where a scalar belongs, None, a bool where a count belongs, a name not among the
allowed ones: a ScenarioError naming the file, the layer and the field, with the allowed values."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from nixlkv.core import hookimpl
from nixlkv.scenario_kinds import MAX_INT, REQUIRED, Field, KindDef, check_params, choice, count, flag
from nixlkv.testing.kinds import KINDS, UNIFORM, load_plugin_kinds
from nixlkv.testing.scenario import ScenarioError, load, parse

# A third party's kind, declared through the hook the way a plugin module declares it: fields
# only, no check of its own. It gets every check the built-in kinds get.
TOY = KindDef(
    fields={"slots": count(), "width": count(64, multiple_of=16), "mode": choice(("dense", "sparse"), "dense"),
            "pinned": flag(False), "spill": count(None, nullable=True), "dtype": choice(("float32",), "float32")},
    build=lambda params, tp, block_size: None,
)
TOY_PLUGIN = types.SimpleNamespace(nixlkv_scenario_kinds=hookimpl(lambda: {"toy_schema_kind": TOY}))

# A valid layer of each kind (the fields a kind requires, and the values its relations need).
VALID: dict[str, dict[str, Any]] = {
    "full_attention": {"num_kv_heads": 2, "head_size": 64},
    "sliding_window": {"num_kv_heads": 2, "head_size": 64, "window": 32},
    "mla": {},
    "sliding_window_mla": {"window": 32},
    "mla_indexer": {},
    "mamba": {"d_state": 16, "num_heads": 8, "head_dim": 16, "n_groups": 2},
    "chunked_local": {"num_kv_heads": 2, "head_size": 64, "chunk": 32},
    "circular_buffer": {},
    "toy_schema_kind": {"slots": 4},
}
BASE = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "request": {"num_tokens": 10}}


def all_kinds() -> list[str]:
    load_plugin_kinds((TOY_PLUGIN,))
    return sorted(k for k in KINDS if k != UNIFORM)


def wrong_values(f: Field) -> list[Any]:
    """Values ``f`` never accepts, whatever its kind: other types, containers, and for counts and
    names the values just outside what is allowed."""
    good = f.default if f.default not in (REQUIRED, None) else (f.choices[0] if f.choices else f.low if f.type is int else True)
    out: list[Any] = [[good], {"value": good}, 1.5, b"x"]
    if not f.nullable:
        out.append(None)
    if f.type is int:
        out += [True, False, float(good), str(good), f.low - 1, f.high + 1, -1, 10**30]
        if f.multiple_of > 1:
            out.append(f.low * f.multiple_of + 1)
    elif f.type is bool:
        out += [0, 1, "true", "yes"]
    else:
        out += [1, True, "", f"{good} ", str(good).upper() + "_not_a_name", [str(good)]]
    if f.type is str and not f.choices:  # any string is a value of a field that names no choices
        out = [v for v in out if not isinstance(v, str)]
    return out


# The kinds scenario files can name: the built-ins, the installed plugins' and the toy plugin's,
# taken when this module is collected (other tests register kinds of their own for the process).
SCENARIO_KINDS = all_kinds()


def test_every_kind_declares_its_fields() -> None:
    for name in SCENARIO_KINDS:
        kind = KINDS[name]
        assert kind.fields, name
        assert set(kind.fields) == set(kind.required) | set(kind.optional), name
        params, problems = check_params(kind.fields, VALID[name])
        assert not problems, (name, problems)  # the controls below start from a valid layer
        assert not (kind.check(params) if kind.check else []), name


CASES = [(kind, name) for kind in SCENARIO_KINDS for name in KINDS[kind].fields]


@pytest.mark.parametrize(("kind", "field"), CASES, ids=[f"{k}.{f}" for k, f in CASES])
def test_a_wrong_value_in_any_field_of_any_kind_is_a_named_scenario_error(kind: str, field: str) -> None:
    load_plugin_kinds((TOY_PLUGIN,))
    f = KINDS[kind].fields[field]
    parse({**BASE, "model": {"layers": [{"kind": kind, **VALID[kind]}]}}, source="ok.yaml")  # the control
    for value in wrong_values(f):
        layers = [{"kind": "full_attention", "num_kv_heads": 2, "head_size": 64}, {"kind": kind, **VALID[kind], field: value}]
        with pytest.raises(ScenarioError) as info:
            parse({**BASE, "model": {"layers": layers}}, source="hostile.yaml")
        text = str(info.value)
        assert text.startswith("hostile.yaml: model.layers[1]."), text  # the file and the layer
        assert f"model.layers[1].{field}: must be {f.allowed()}" in text, text  # the field and what it accepts
        assert f"({kind} layer)" in text, text


def test_a_missing_required_field_and_an_unknown_one_are_named() -> None:
    with pytest.raises(ScenarioError, match=r"x.yaml: model.layers\[0\].chunk: missing required field 'chunk' "
                                            r"\(a positive integer up to \d+\) \(chunked_local layer\)"):
        parse({**BASE, "model": {"layers": [{"kind": "chunked_local", "num_kv_heads": 2, "head_size": 64}]}}, "x.yaml")
    with pytest.raises(ScenarioError, match=r"model.layers\[0\].chunk_size: unknown field; allowed: \['chunk', "):
        parse({**BASE, "model": {"layers": [{"kind": "chunked_local", **VALID["chunked_local"], "chunk_size": 3}]}})
    with pytest.raises(ScenarioError, match=r"model.layers\[0\].7: unknown field"):
        parse({**BASE, "model": {"layers": [{"kind": "mla", 7: 3}]}})


def test_the_mamba_type_as_a_list_is_a_named_error_in_a_file(tmp_path: Path) -> None:
    """The case issue #48 met: ``mamba_type: [mamba2]`` ended in ``TypeError: unhashable type``."""
    path = tmp_path / "mamba-list.yaml"
    path.write_text(
        "model:\n  layers:\n  - {kind: full_attention, num_kv_heads: 2, head_size: 64}\n"
        "  - {kind: mamba, mamba_type: [mamba2], d_state: 16, num_heads: 8, head_dim: 16, n_groups: 2}\n"
        "prefill: {tp: 1}\ndecode: {tp: 1}\nrequest: {num_tokens: 10}\n"
    )
    with pytest.raises(ScenarioError) as info:
        load(path)
    assert str(info.value) == (
        f"{path}: model.layers[1].mamba_type: must be one of 'mamba2', 'gdn', 'mamba1', got ['mamba2'] (a list) "
        "(mamba layer)"
    )


def test_nixlkv_explain_says_so_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """What the new user of #48 ran: ``nixlkv explain`` on that file (a traceback before)."""
    from nixlkv.cli import main

    path = tmp_path / "mamba-list.yaml"
    path.write_text("model: {layers: [{kind: mamba, mamba_type: [mamba2], d_state: 16, num_heads: 8, head_dim: 16, "
                    "n_groups: 2}]}\nprefill: {tp: 1}\ndecode: {tp: 1}\nrequest: {num_tokens: 10}\n")
    assert main(["explain", "--scenario", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: model.layers[0].mamba_type: must be one of 'mamba2', 'gdn', 'mamba1'"), err
    assert "Traceback" not in err


def test_every_problem_of_a_layer_is_named_at_once() -> None:
    with pytest.raises(ScenarioError) as info:
        parse({**BASE, "model": {"layers": [{"kind": "mamba", "d_state": True, "ssm_dtype": {"a": 1}, "conv_layout": None}]}})
    text = str(info.value)
    for name in ("d_state", "ssm_dtype", "conv_layout"):
        assert f"model.layers[0].{name}: must be" in text, text


def test_uniform_members_are_checked_as_their_own_kinds() -> None:
    with pytest.raises(ScenarioError, match=r"model.layers\[0\].members\[1\].index_head_dim: must be a positive "
                                            r"multiple of 128 .*got 100"):
        parse({**BASE, "model": {"layers": [{"kind": "uniform", "members": [{"kind": "mla"},
                                                                           {"kind": "mla_indexer", "index_head_dim": 100}]}]}})


def test_kinds_declared_the_earlier_way_get_the_same_checks() -> None:
    """A plugin written before fields existed (``required`` and ``optional`` only) gets them inferred:
    counts, flags, the dtypes, and strings."""
    old = KindDef(("heads",), {"dtype": "bfloat16", "on": False, "size": None, "tag": "a"}, build=lambda p, t, b: None)
    assert old.fields == {"heads": count(), "dtype": old.fields["dtype"], "on": flag(False),
                          "size": count(None, nullable=True), "tag": Field(str, "a")}
    _, problems = check_params(old.fields, {"heads": [2], "dtype": "bf16", "on": 1, "size": True, "tag": ["a"]})
    assert [name for name, _ in problems] == ["heads", "dtype", "on", "size", "tag"], problems
    assert old.required == ("heads",) and old.optional["size"] is None


def test_a_kind_cannot_declare_a_field_badly() -> None:
    with pytest.raises(ValueError, match="the default 0 is not a positive integer"):
        count(0)
    with pytest.raises(TypeError):
        Field(float)
    with pytest.raises(TypeError, match="must be declared as a nixlkv.scenario_kinds.Field"):
        KindDef(fields={"x": 3}, build=lambda p, t, b: None)
    assert count(high=MAX_INT).allowed() == f"a positive integer up to {MAX_INT}"


def test_the_campaign_base_layers_cover_every_kind() -> None:
    """The campaign mutates every field of every kind from these valid layers (tests/test_campaign.py)."""
    assert set(SCENARIO_KINDS) <= set(VALID)
    json.dumps(VALID)
