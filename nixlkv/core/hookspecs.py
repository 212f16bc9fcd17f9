"""Every hook nixlkv calls. Plugins implement them with ``@nixlkv.core.hookimpl``.

Third-party packages are found through the ``nixlkv`` entry-point group::

    [project.entry-points.nixlkv]
    my_plugin = "my_package.nixlkv_plugin"

The built-in strategies are registered the same way (``nixlkv.strategies``).
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("nixlkv")
hookimpl = pluggy.HookimplMarker("nixlkv")


@hookspec
def nixlkv_strategies() -> list[Any]:
    """Return the :class:`~nixlkv.core.strategy.Strategy` instances this plugin provides.

    Called once when the registry is built. Each strategy names the spec types it serves;
    dispatch picks, for a spec, the strategy of the most specific class along the spec type's
    MRO. Two strategies for the same exact type are an error unless one lists the other's name
    in its ``overrides``.
    """


@hookspec(firstresult=True)
def nixlkv_unwrap_spec(spec: Any, layer_name: str) -> Any | None:
    """Return the per-layer spec hidden inside a group-level wrapper spec, or ``None``.

    Engines may describe a KV group with a wrapper (vLLM's ``UniformTypeKVCacheSpecs`` holds
    one spec per layer). Dispatch must see the layer's own spec type, so the dispatcher asks
    this hook first; the first non-``None`` answer wins and is unwrapped again if needed.
    """
