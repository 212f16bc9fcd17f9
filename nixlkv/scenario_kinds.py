"""Scenario layer kinds: how a strategy plugin describes the spec its layer type reports.

A plugin that serves a new vLLM spec type ships, beside its strategy, the *kind* engines of that
type report (:class:`KindDef`), through the hook :func:`nixlkv_scenario_kinds`. Scenario files,
``nixlkv rehearse`` and the contract kit (:mod:`nixlkv.testing`) then fabricate engines with it.

A kind declares its parameters (:class:`Field`: a count, a flag or a choice of names, with its
range and default); :func:`check_params` is the one checker every kind's parameters go through
(type, range and allowed names) before the kind's own code (``build``, ``check``) reads them, so
a plugin's kind gets the same checks by declaring its fields, never by writing them.

This module is neutral ground: plain data and one hook spec, importing only the standard library
and pluggy's marker, so production plugins declare their kinds without importing the test kit,
and the test kit reads them without importing a plugin's engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .core.hookspecs import hookspec

MAX_INT = 1 << 40  # counts and sizes beyond this are typos or attacks, never a cache to build
# torch dtypes a scenario's caches may hold (attention-like kinds; a kind may allow fewer)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "uint8", "int8")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a Field's default when the scenario must give it


@dataclass(frozen=True)
class Field:
    """One parameter of a scenario kind, declared: what :func:`check_params` accepts for it.

    ``type``: ``int`` (an integer in [``low``, ``high``], a multiple of ``multiple_of``; never a
    bool, a float or a string of digits), ``bool`` (true or false) or ``str`` (one of
    ``choices``, or any string when ``choices`` is empty). ``nullable``: None is accepted (the
    kind derives the value). ``default``: :data:`REQUIRED` when a scenario must give it. Build
    them with :func:`count`, :func:`flag` and :func:`choice`.
    """

    type: type
    default: Any = REQUIRED
    low: int = 1
    high: int = MAX_INT
    multiple_of: int = 1
    choices: tuple[str, ...] = ()
    nullable: bool = False

    def __post_init__(self) -> None:
        if self.type not in (int, bool, str):
            raise TypeError(f"a scenario kind's field is an int, a bool or a str, not {self.type!r}")
        if self.default is not REQUIRED and self.problem(self.default) is not None:
            raise ValueError(f"the default {self.default!r} is not {self.allowed()}")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def allowed(self) -> str:
        """The values this field accepts, for a message."""
        if self.type is bool:
            text = "true or false"
        elif self.type is str:
            text = f"one of {', '.join(map(repr, self.choices))}" if self.choices else "a string"
        else:
            if (self.low, self.high) == (1, MAX_INT):
                text = "a positive integer up to " + str(MAX_INT)
            else:
                text = f"an integer in [{self.low}, {self.high}]"
            if self.multiple_of > 1:
                text = text.replace("integer", f"multiple of {self.multiple_of}", 1)
        return f"{text} or null" if self.nullable else text

    def problem(self, value: Any) -> str | None:
        """None where ``value`` is accepted; else what is wrong with it, naming what is allowed."""
        if value is None and self.nullable:
            return None
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is str:
            ok = isinstance(value, str) and (not self.choices or value in self.choices)
        else:
            ok = (isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high
                  and value % self.multiple_of == 0)
        return None if ok else f"must be {self.allowed()}, got {show(value)}"


def count(default: Any = REQUIRED, *, low: int = 1, high: int = MAX_INT, multiple_of: int = 1,
          nullable: bool = False) -> Field:
    """An integer field (heads, sizes, tokens...): positive and at most 2**40 unless told."""
    return Field(int, default, low=low, high=high, multiple_of=multiple_of, nullable=nullable)


def flag(default: Any = REQUIRED) -> Field:
    return Field(bool, default)


def choice(choices: Any, default: Any = REQUIRED, *, nullable: bool = False) -> Field:
    """A name among ``choices`` (a dtype, a cache format, a layout...)."""
    return Field(str, default, choices=tuple(choices), nullable=nullable)


def infer_fields(required: tuple[str, ...], optional: Mapping[str, Any]) -> dict[str, Field]:
    """The fields of a kind declared the earlier way, by names (``required``) and defaults
    (``optional``): ``dtype`` is one of :data:`DTYPES`, a field whose default is a bool is a flag,
    a string default any string (declare a :func:`choice` to name the allowed ones), and every
    other field a positive integer (None allowed where it is the default)."""
    def one(name: str, default: Any) -> Field:
        if name == "dtype":
            return choice(DTYPES, default)
        if isinstance(default, bool):
            return flag(default)
        if isinstance(default, str):
            return Field(str, default)
        return count(default, nullable=default is None)

    return {**{name: one(name, REQUIRED) for name in required},
            **{name: one(name, default) for name, default in optional.items()}}


def check_params(fields: Mapping[str, Field], given: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The one checker of a kind's parameters: ``(params with defaults, [(field, problem)])``.

    Every given name must be a declared field, every required field given, and every value one
    its field accepts (type, range, allowed names). A kind's own code reads ``params`` only when
    the problems are none.
    """
    problems: list[tuple[str, str]] = []
    for name in given:
        if name not in fields:
            problems.append((show(name) if not isinstance(name, str) else name, f"unknown field; allowed: {sorted(fields)}"))
    params: dict[str, Any] = {}
    for name, f in fields.items():
        if name in given:
            params[name] = given[name]
            problem = f.problem(given[name])
            if problem is not None:
                problems.append((name, problem))
        elif f.required:
            problems.append((name, f"missing required field {name!r} ({f.allowed()})"))
        else:
            params[name] = f.default
    return params, problems


def show(x: Any) -> str:
    """A value for a message, bounded (a huge integer is not even converted to text), with its
    type where that is the problem (a list, a mapping...)."""
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_INT:
        return f"an integer of {x.bit_length()} bits"
    text = repr(x)
    text = text if len(text) <= 80 else text[:77] + "..."
    if isinstance(x, (list, tuple)):
        return f"{text} (a list)"
    if isinstance(x, Mapping):
        return f"{text} (a mapping)"
    if isinstance(x, float):
        return f"{text} (a float)"
    return text


@dataclass(frozen=True)
class KindDef:
    """A scenario layer kind: its parameters and the per-rank spec factory.

    ``build(params, tp, block_size)`` returns the spec one rank of an engine with that TP size
    and block size reports for a layer of this kind: the "sample spec factory" a strategy's
    contract suite fabricates engines from. ``coordinates`` (optional) tells the byte oracle
    which logical element each byte of a layer's ``[B, H, N, C]`` view holds; leave it out
    when the layout is attention-like (``nixlkv.testing.oracle.attention_coordinates``).
    """

    required: tuple[str, ...] = ()
    optional: Mapping[str, Any] = field(default_factory=dict)
    build: Callable[[Mapping[str, Any], int, int], Any] | None = None  # (params, tp, block_size) -> spec
    # Errors in a kind's parameter values the field checks cannot see, as messages naming the field.
    check: Callable[[Mapping[str, Any]], list[str]] | None = None
    replicated: bool = False  # one cache on every rank (MLA): the oracle's "global head 0"
    coordinates: Callable[..., Mapping[str, Any]] | None = None  # see oracle.Coordinates
    # Model facts the engine hands the strategy per layer (what a per-rank spec cannot tell).
    hints: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    # (params, num_tokens) -> leading tokens vLLM's block manager for this kind has freed once
    # num_tokens are computed (its get_num_skipped_tokens). The rehearsal then nulls the prefill
    # blocks wholly below them, and leaves them out of the decode engine's list (its own manager
    # frees them too, and the connector sees only real blocks). None: every block is kept. A kind
    # that frees blocks is planned under vLLM's hybrid KV-cache manager, as a deployment whose
    # connector supports it runs (without it vLLM promotes such a layer to full attention).
    skipped_tokens: Callable[[Mapping[str, Any], int], int] | None = None
    # Blocks vLLM's block manager for this kind gives a request whatever its length (a ring, vLLM's
    # CircularBufferManager: 1), each wholly the request's: the rehearsal lists that many, never
    # trims them for a prefix hit, and every byte of them must arrive. None: one block per
    # block_size tokens. Such a kind is planned under vLLM's hybrid KV-cache manager, as above.
    blocks_per_request: int | None = None
    # Attention pages a backend writes in its own order (K and V of one head size per head): a
    # scenario side's ``interior`` (vLLM's CPU kernels: k_channel_major) applies to this kind.
    interior: bool = False
    # What ``nixlkv capture`` reports for this kind: the vLLM spec class name, and the kind's
    # parameters from a captured layer, ``(spec facts, layer hints, model facts) -> params``.
    captured_spec: str | None = None
    from_capture: Callable[[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None = None
    # The declared schema: every parameter's type, range or allowed names, and default
    # (:func:`count`, :func:`flag`, :func:`choice`). ``required`` and ``optional`` are derived from
    # it; a kind declared by ``required`` and ``optional`` alone gets fields inferred from them
    # (:func:`infer_fields`). :func:`check_params` checks a scenario's values against it before
    # ``check`` (relations between fields) or ``build`` read them.
    fields: Mapping[str, Field] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fields:
            for name, f in self.fields.items():
                if not isinstance(f, Field):
                    raise TypeError(f"field {name!r} must be declared as a nixlkv.scenario_kinds.Field, got {f!r}")
            declared = (tuple(n for n, f in self.fields.items() if f.required),
                        {n: f.default for n, f in self.fields.items() if not f.required})
            if (self.required or self.optional) and (tuple(self.required), dict(self.optional)) != declared:
                raise ValueError("give a kind's fields, or its required and optional names, not both")
            object.__setattr__(self, "required", declared[0])
            object.__setattr__(self, "optional", declared[1])
        else:
            object.__setattr__(self, "fields", infer_fields(tuple(self.required), self.optional))

    def total_kv_heads(self, params: Mapping[str, Any]) -> int:
        if self.replicated:
            return 1
        return int(params.get("num_kv_heads", 1))


@hookspec
def nixlkv_scenario_kinds() -> Mapping[str, Any]:
    """Return the scenario layer kinds this plugin adds: ``{name: KindDef}``.

    A kind fabricates the spec vLLM's layer of that type reports on one rank (and says what
    vLLM's block manager frees), so scenario files and contract cases can name the plugin's
    spec type. Asked only by the test tooling (scenario files, the rehearsal, the contract kit),
    when a scenario names a kind nixlkv does not build in; serving never calls it.
    """
