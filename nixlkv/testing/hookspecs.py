"""Hooks of the test tooling, beside nixlkv's own (:mod:`nixlkv.core.hookspecs`).

Plugins implement them with ``@nixlkv.core.hookimpl`` in the module their ``nixlkv`` entry point
names, the same module that hands nixlkv its strategies. nixlkv calls them only from its test
tooling (scenario files, the rehearsal, the contract kit), never while serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.hookspecs import hookspec


@hookspec
def nixlkv_scenario_kinds() -> Mapping[str, Any]:
    """Return the scenario layer kinds this plugin adds: ``{name: nixlkv.testing.kinds.KindDef}``.

    A kind fabricates the spec vLLM's layer of that type reports on one rank (and says what
    vLLM's block manager frees), so scenario files and contract cases can name the plugin's
    spec type. Asked when a scenario names a kind nixlkv does not build in. Import
    ``nixlkv.testing`` inside the implementation, not at module level: serving never loads it.
    """
