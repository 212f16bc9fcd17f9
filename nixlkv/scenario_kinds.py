"""Scenario layer kinds: how a strategy plugin describes the spec its layer type reports.

A plugin that serves a new vLLM spec type ships, beside its strategy, the *kind* engines of that
type report (:class:`KindDef`), through the hook :func:`nixlkv_scenario_kinds`. Scenario files,
``nixlkv rehearse`` and the contract kit (:mod:`nixlkv.testing`) then fabricate engines with it.

This module is neutral ground: plain data and one hook spec, importing only the standard library
and pluggy's marker, so production plugins declare their kinds without importing the test kit,
and the test kit reads them without importing a plugin's engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .core.hookspecs import hookspec


@dataclass(frozen=True)
class KindDef:
    """A scenario layer kind: its parameters and the per-rank spec factory.

    ``build(params, tp, block_size)`` returns the spec one rank of an engine with that TP size
    and block size reports for a layer of this kind: the "sample spec factory" a strategy's
    contract suite fabricates engines from. ``coordinates`` (optional) tells the byte oracle
    which logical element each byte of a layer's ``[B, H, N, C]`` view holds; leave it out
    when the layout is attention-like (``nixlkv.testing.oracle.attention_coordinates``).
    """

    required: tuple[str, ...]
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
