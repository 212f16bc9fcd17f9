"""Which strategy serves which spec type: pluggy discovery plus MRO dispatch, most specific wins."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .errors import NoStrategyError, RegistryError, StrategyConflict
from .strategy import Strategy

ENTRY_POINT_GROUP = "nixlkv"
BUILTIN_ENTRY_POINT = "builtin"  # nixlkv's own strategies, an entry point of its distribution like any plugin


@dataclass(frozen=True)
class Registered:
    """A strategy and where it came from (plugin name and, for entry points, the distribution)."""

    strategy: Strategy
    origin: str


def plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A plugin manager with nixlkv's hooks and every installed ``nixlkv`` entry point; without
    them (``load_entry_points`` False), nixlkv's own built-in strategies only."""
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    if pm.get_plugin(BUILTIN_ENTRY_POINT) is None:
        pm.register(builtin_plugin(), name=BUILTIN_ENTRY_POINT)
    return pm


def builtin_plugin() -> Any:
    """nixlkv's built-in strategies, found where its distribution declares them: core names no
    strategy module, so the strategies stand above it like any third party's."""
    try:
        points = importlib.metadata.distribution("nixlkv").entry_points
    except importlib.metadata.PackageNotFoundError:
        raise RegistryError("nixlkv's built-in strategies are an entry point of the nixlkv distribution, which "
                            "is not installed in this environment: install it (pip install -e .)") from None
    for point in points:
        if point.group == ENTRY_POINT_GROUP and point.name == BUILTIN_ENTRY_POINT:
            return point.load()
    raise RegistryError(f"the installed nixlkv declares no {ENTRY_POINT_GROUP!r} entry point "
                        f"{BUILTIN_ENTRY_POINT!r} (its built-in strategies): reinstall it (pip install -e .)")


def _origins(pm: pluggy.PluginManager) -> dict[int, str]:
    origins = {id(p): pm.get_name(p) or repr(p) for p in pm.get_plugins()}
    for plugin, dist in pm.list_plugin_distinfo():
        origins[id(plugin)] = f"{pm.get_name(plugin)} ({dist.project_name} {dist.version})"
    return origins


class StrategyRegistry:
    """Resolves a spec type to one strategy.

    ``pins`` maps a spec class name (bare, or ``module.QualName`` to tell apart classes that
    share a name) to a strategy name to force (it must serve that class or a
    base of it); ``disabled`` removes strategies by name; ``allow`` (when given) keeps only
    strategies from plugins whose name is listed.
    """

    def __init__(
        self,
        registered: Iterable[Registered],
        pins: Mapping[str, str] | None = None,
        disabled: Iterable[str] = (),
    ) -> None:
        registered = list(registered)
        disabled = set(disabled)
        self._all = [r for r in registered if r.strategy.name not in disabled]
        names = [r.strategy.name for r in self._all]
        for r in self._all:
            if not r.strategy.name:
                raise RegistryError(f"strategy {r.strategy!r} from {r.origin} has no name")
            if names.count(r.strategy.name) > 1:
                origins = [x.origin for x in self._all if x.strategy.name == r.strategy.name]
                raise StrategyConflict(f"two strategies are named {r.strategy.name!r}: from {origins}")
        unknown = disabled - {r.strategy.name for r in registered}
        if unknown:
            raise RegistryError(f"cannot disable unknown strategies {sorted(unknown)}; known: {sorted(names)}")
        self._by_type = self._resolve_claims()
        self._pins = dict(pins or {})
        for type_name, strategy_name in self._pins.items():
            self.by_name(strategy_name)  # raises with the known names

    @classmethod
    def from_plugins(
        cls,
        pm: pluggy.PluginManager | None = None,
        pins: Mapping[str, str] | None = None,
        disabled: Iterable[str] = (),
        allow: Iterable[str] | None = None,
    ) -> StrategyRegistry:
        pm = pm or plugin_manager()
        origins = _origins(pm)
        allowed = None if allow is None else set(allow) | {"builtin"}
        registered: list[Registered] = []
        for impl in pm.hook.nixlkv_strategies.get_hookimpls():
            if allowed is not None and impl.plugin_name not in allowed:
                continue
            for strategy in impl.function() or ():
                if not isinstance(strategy, Strategy):
                    raise RegistryError(
                        f"plugin {impl.plugin_name!r} returned {strategy!r}, not a nixlkv Strategy instance"
                    )
                registered.append(Registered(strategy, origins.get(id(impl.plugin), impl.plugin_name)))
        return cls(registered, pins=pins, disabled=disabled)

    def _resolve_claims(self) -> dict[type, Registered]:
        claims: dict[type, list[Registered]] = {}
        for r in self._all:
            for spec_type in r.strategy.spec_types:
                claims.setdefault(spec_type, []).append(r)
        by_type: dict[type, Registered] = {}
        for spec_type, rs in claims.items():
            winners = [r for r in rs if not any(r.strategy.name in o.strategy.overrides for o in rs)]
            if len(winners) != 1:
                listed = ", ".join(f"{r.strategy.name!r} from {r.origin}" for r in rs)
                raise StrategyConflict(
                    f"spec type {spec_type.__qualname__} is claimed by {listed}; one of them must "
                    "declare `overrides = (\"<other name>\",)`, or disable one by name"
                )
            by_type[spec_type] = winners[0]
        return by_type

    def registered(self) -> list[Registered]:
        return list(self._all)

    def by_name(self, name: str) -> Strategy:
        for r in self._all:
            if r.strategy.name == name:
                return r.strategy
        raise RegistryError(f"no strategy named {name!r}; installed: {sorted(r.strategy.name for r in self._all)}")

    def for_type(self, spec_type: type) -> Strategy:
        """The strategy of the most specific class along ``spec_type``'s MRO (or the pinned one)."""
        pinned = self._pins.get(f"{spec_type.__module__}.{spec_type.__qualname__}", self._pins.get(spec_type.__name__))
        if pinned is not None:
            strategy = self.by_name(pinned)
            if not any(issubclass(spec_type, t) for t in strategy.spec_types):
                raise RegistryError(
                    f"strategy {pinned!r} is pinned for {spec_type.__name__} but serves only "
                    f"{[t.__name__ for t in strategy.spec_types]}"
                )
            return strategy
        for klass in spec_type.__mro__:
            hit = self._by_type.get(klass)
            if hit is not None:
                return hit.strategy
        served = sorted(f"{t.__name__} -> {r.strategy.name}" for t, r in self._by_type.items())
        raise NoStrategyError(
            f"no strategy serves KV-cache spec type {spec_type.__module__}.{spec_type.__qualname__}; "
            f"installed: {served or 'none'}. Install a plugin for it, or pin a strategy that serves a base class of it (registry pins)."
        )
