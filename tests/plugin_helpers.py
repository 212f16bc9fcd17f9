"""Checks shared by the tests of strategies that ship as plugins of their own (an entry point in
nixlkv's ``pyproject.toml``, not the ``builtin`` module): chunked_local, circular_buffer."""

from __future__ import annotations

import importlib.metadata

import pytest

REINSTALL = "pip install --no-deps -e . (or make venv)"


def check_installed_as_own_plugin(name: str, module: str) -> None:
    """Installed metadata names the module; a stale install fails here by name, not as a dispatch
    to another strategy somewhere else. Every distribution is read, as pluggy reads them."""
    eps = {(ep.name, ep.value) for dist in importlib.metadata.distributions() for ep in dist.entry_points
           if ep.group == "nixlkv"}
    if (name, module) not in eps:
        pytest.fail(f"nixlkv's installed 'nixlkv' entry points are {sorted(eps)}, without {(name, module)}: {REINSTALL}",
                    pytrace=False)
    from nixlkv.core import StrategyRegistry

    origins = {r.strategy.name: r.origin for r in StrategyRegistry.from_plugins().registered()}
    assert origins[name].startswith(f"{name} ")


def check_neither_builtin_nor_placeholder(name: str) -> None:
    from nixlkv.core import StrategyRegistry
    from nixlkv.core.registry import plugin_manager
    from nixlkv.strategies.pending import PENDING

    assert name not in {s.name for s in PENDING}
    builtin = {r.strategy.name for r in StrategyRegistry.from_plugins(plugin_manager(load_entry_points=False)).registered()}
    assert name not in builtin
