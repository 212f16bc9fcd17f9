"""Creating NIXL agents, including the one setting NIXL's Python wrapper does not expose.

NIXL 1.5's ``nixl_agent`` always starts its progress thread with ``pthrDelay = 0``: the thread
polls its UCX worker without pausing, one busy core per agent. On a machine with few cores that
hosts several agents (a CPU rehearsal, the bench, small CPU P/D pairs) those threads take the
cores the copies need: on this project's 2-core VM every transfer ran at about half its speed
(docs/performance.md, "Progress threads"). ``progress_delay_us`` sets the pause between polls.
NIXL's agent config has the field; the wrapper fills it from a constant, so the agent is built
with a config class whose ``pthrDelay`` setter substitutes the requested value. 0 keeps NIXL's
default.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

_build_lock = threading.Lock()  # the config class is swapped module-wide while one agent is built


class AgentConfigError(ValueError):
    """An agent setting this NIXL cannot honour."""


def make_agent(
    name: str,
    backends: Sequence[str] = ("UCX",),
    num_threads: int = 0,
    capture_telemetry: bool = False,
    progress_delay_us: int = 0,
) -> Any:
    """A ``nixl_agent`` named ``name``; its progress thread pauses ``progress_delay_us`` between polls."""
    from nixl import _api

    if not isinstance(progress_delay_us, int) or isinstance(progress_delay_us, bool) or progress_delay_us < 0:
        raise AgentConfigError(
            f"progress_delay_us must be a whole number of microseconds >= 0 (0: NIXL's busy poll), got {progress_delay_us!r}"
        )
    config = _api.nixl_agent_config(backends=list(backends), num_threads=num_threads, capture_telemetry=capture_telemetry)
    if progress_delay_us == 0:
        return _api.nixl_agent(name, config)
    base = getattr(getattr(_api, "nixlBind", None), "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        raise AgentConfigError(
            "progress_delay_us needs NIXL's agent config with a pthrDelay field (nixl 1.5); this NIXL has none: "
            "set progress_delay_us to 0"
        )

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, progress_delay_us if value == 0 else value)

    with _build_lock:
        _api.nixlBind.nixlAgentConfig = _DelayedConfig
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base
