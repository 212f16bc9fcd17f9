"""Creating NIXL agents, including the one setting NIXL's Python wrapper does not expose.

NIXL 1.5's ``nixl_agent`` always starts its progress thread with ``pthrDelay = 0``: the thread
polls its UCX worker without pausing, one busy core per agent. On a machine with few cores that
hosts several agents (a CPU rehearsal, the bench, small CPU P/D pairs) those threads take the
cores the copies need: on this project's 2-core VM every transfer ran at about half its speed
(docs/performance.md, "Progress threads"). ``progress_delay_us`` sets the pause between polls.
NIXL's agent config has the field; the wrapper fills it from a constant, so the agent is built
with a config class whose ``pthrDelay`` setter substitutes the requested value. 0 keeps NIXL's
default. :func:`pause_every_agent` installs that class for the whole process, so that agents
nixlkv does not make (vLLM's NixlConnector's) pause too.
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
    """A ``nixl_agent`` named ``name``; its progress thread pauses ``progress_delay_us`` between polls
    (0: the process's pause, :func:`pause_every_agent`, where one was set; else NIXL's busy poll)."""
    from nixl import _api

    _check(progress_delay_us, "progress_delay_us")
    config = _api.nixl_agent_config(backends=list(backends), num_threads=num_threads, capture_telemetry=capture_telemetry)
    if progress_delay_us == 0:
        return _api.nixl_agent(name, config)
    base = _config_class(_api)
    with _build_lock:
        _api.nixlBind.nixlAgentConfig = _paused(base, progress_delay_us)
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base


def pause_every_agent(progress_delay_us: int, setting: str = "progress_delay_us") -> None:
    """From now on every NIXL agent this process makes pauses ``progress_delay_us`` between polls,
    whoever makes it (vLLM's NixlConnector too, which cannot be given the pause); an agent made
    with a pause of its own keeps that. 0 restores NIXL's busy poll. ``setting``: the name a bad
    value is refused under (an environment variable, for one)."""
    from nixl import _api

    _check(progress_delay_us, setting)
    with _build_lock:
        original = getattr(_api.nixlBind.nixlAgentConfig, "nixlkv_original", _api.nixlBind.nixlAgentConfig)
        _config_class(_api, original)
        _api.nixlBind.nixlAgentConfig = _paused(original, progress_delay_us) if progress_delay_us else original


def _check(progress_delay_us: object, setting: str) -> None:
    if not isinstance(progress_delay_us, int) or isinstance(progress_delay_us, bool) or progress_delay_us < 0:
        raise AgentConfigError(
            f"{setting} must be a whole number of microseconds >= 0 (0: NIXL's busy poll), got {progress_delay_us!r}"
        )


def _config_class(_api: Any, base: Any = None) -> Any:
    """NIXL's agent config class (``base``, else the current one), refused where it has no ``pthrDelay``."""
    base = base if base is not None else getattr(getattr(_api, "nixlBind", None), "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        raise AgentConfigError(
            "progress_delay_us needs NIXL's agent config with a pthrDelay field (nixl 1.5); this NIXL has none: "
            "set progress_delay_us to 0"
        )
    return base


def _paused(base: Any, progress_delay_us: int) -> Any:
    """``base`` whose ``pthrDelay`` setter puts ``progress_delay_us`` where the wrapper writes its 0."""

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        nixlkv_original = getattr(base, "nixlkv_original", base)

        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, progress_delay_us if value == 0 else value)

    return _DelayedConfig
