"""One progress-thread pause for every NIXL agent of an engine, vLLM's NixlConnector's included.

vLLM's NixlConnector builds its agents with NIXL's default progress thread, which polls without
pause: one busy core per agent (0.97-0.98 of a core each, idle, on the 2-core AMD EPYC VM,
2026-11-28). On a machine with few cores the engines then compute on what those threads leave, so a
served comparison run with vLLM's setting measures contention more than connectors. nixlkv's
connector takes a pause (``nixl_progress_delay_us``); vLLM's has no such key.

This module is a vLLM general plugin (entry point ``vllm.general_plugins``, loaded in every engine
process before its connector is built): where ``NIXLKV_NIXL_PROGRESS_DELAY_US`` is set it makes
every NIXL agent of the process pause that many microseconds between polls
(:func:`nixlkv.transport.agents.pause_every_agent`). ``serve-bench`` sets it for both connectors'
engines when asked for a pause, so the two run with the same setting; anywhere else it is unset and
the plugin does nothing.
"""

from __future__ import annotations

import os

ENV = "NIXLKV_NIXL_PROGRESS_DELAY_US"  # microseconds; unset: NIXL's own progress thread, untouched


def register() -> None:
    """vLLM's general-plugin hook: pause every NIXL agent of this process where ``ENV`` is set."""
    value = os.environ.get(ENV)
    if value is None:
        return
    from ..transport.agents import AgentConfigError, pause_every_agent

    try:
        delay = int(value)
    except ValueError:
        raise AgentConfigError(f"{ENV} must be a whole number of microseconds >= 0, got {value!r}") from None
    pause_every_agent(delay, setting=ENV)
