"""Engine processes for tests and rehearsals, forked from one warm server instead of spawned.

A spawned process is a fresh interpreter that imports vLLM, torch and nixlkv again: ~16 s on a
2-core VM, paid by every prefill engine a test starts. Here one ``forkserver`` per parent process
imports them once (``PRELOAD``) and each engine process is a fork of it.

Why the fork is safe: the server only imports. NIXL is left out of ``PRELOAD`` (its import is
0.2 s), so no NIXL agent, UCX context, progress thread or vLLM engine exists before the fork; each
engine process builds its own after it, as a spawned one does. :func:`engine_process` checks in
every child, before its target runs, that no UCX library is mapped yet (NIXL maps them when it
builds an agent, not when it is imported: :class:`ForkedStateError`), and hands the child the
parent's environment as it is at start (a spawned child's), not the server's from its own start.
Settings vLLM reads once at import come from the environment the server started in: the first
engine process's parent's, which is set by then (``tests/conftest.py`` sets it at collection).
What forks share that spawned processes do not: the server's address-space layout (see
``new_image``) and its numpy and torch global random state (Python's ``random`` is reseeded at
fork); the engines here draw nothing from either (their fills are seeded per request).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
from collections.abc import Callable
from typing import Any

# What an engine process imports before it builds anything (vLLM's config, scheduler, requests
# and connector base; torch; nixlkv's connector and test kit). Never NIXL: see the module's note.
PRELOAD = [
    "torch",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.structured_output",
    "vllm.v1.request",
    "vllm.v1.outputs",
    "vllm.v1.core.kv_cache_manager",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "nixlkv.connector",
    "nixlkv.testing.engines",
    "nixlkv.testing.oracle",
    "nixlkv.testing.rehearsal",
    "nixlkv.testing.vllm_baseline",
]

# UCX's shared objects: NIXL maps them when it builds an agent with its UCX backend.
_UCX_LIB = re.compile(r"/libuc[mpst][._-][^/]*$")


class ForkedStateError(RuntimeError):
    """An engine process inherited transport state from the server it was forked from."""


def engine_context() -> Any:
    """The multiprocessing context engine processes start from: a forkserver with ``PRELOAD``.

    One server per parent process (multiprocessing keeps one); it starts with the first process
    and stops when the parent exits. The preload list is read at that start only."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def engine_process(target: Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None,
                   daemon: bool = True, new_image: bool = False) -> Any:
    """An unstarted engine process of :func:`engine_context` running ``target(*args, **kwargs)``.

    ``new_image``: a spawned interpreter instead, paying the import. Forks of one server share its
    address-space layout, so the same allocations land at the same addresses in each; an engine
    restarted in production is a new process image with a layout of its own (ASLR), which a test
    of a restart needs when it checks that D reads the new engine's addresses."""
    ctx = mp.get_context("spawn") if new_image else engine_context()
    return ctx.Process(target=_run_fresh, args=(dict(os.environ), target, args, kwargs or {}), daemon=daemon)


def ucx_libraries() -> list[str]:
    """UCX shared objects mapped in this process (Linux; none elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if _UCX_LIB.search(p))


def check_fresh() -> None:
    """Raise :class:`ForkedStateError` if UCX is mapped: a NIXL agent was built before the fork."""
    libs = ucx_libraries()
    if libs:
        raise ForkedStateError(
            f"the engine process was forked with UCX already loaded ({libs}): a NIXL agent was built in the "
            "forkserver; keep NIXL out of nixlkv.testing.processes.PRELOAD and out of what it runs at import"
        )


def _run_fresh(environ: dict[str, str], target: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    check_fresh()
    os.environ.clear()
    os.environ.update(environ)
    target(*args, **kwargs)
