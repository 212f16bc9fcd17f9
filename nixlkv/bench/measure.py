"""Measurements: interleaved timings, descriptors NIXL posts after its merge, memcpy reference."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.staging import descriptors_after_merge


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median and 99th percentile over the repetitions."""

    p50: float
    p99: float
    reps: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        a = np.asarray(samples, dtype=np.float64)
        return cls(float(np.median(a)), float(np.percentile(a, 99)), int(a.size))


@dataclass(frozen=True)
class Untimed:
    """A timed call with a setup that is not part of what is measured: ``setup()`` runs first,
    untimed, and ``call`` gets what it returned (e.g. a fresh worker state each repetition)."""

    setup: Callable[[], Any]
    call: Callable[[Any], object]


def interleaved(fns: Sequence[Callable[[], object] | Untimed], reps: int, warmup: int = 2, seed: int = 0) -> list[Timing]:
    """Time each function ``reps`` times, taking turns in an order shuffled every repetition
    (seeded): load from the rest of a shared machine hits all of them alike, and each runs
    after each other one as often (what ran before warms or evicts the caches a call starts
    with; an order that only alternates gives every function fixed predecessors). An
    :class:`Untimed` entry's setup runs just before its call, outside the timing."""
    for _ in range(warmup):
        for fn in fns:
            fn.call(fn.setup()) if isinstance(fn, Untimed) else fn()
    samples: list[list[float]] = [[] for _ in fns]
    orders = np.random.default_rng(seed).permuted(np.tile(np.arange(len(fns)), (reps, 1)), axis=1).tolist()
    for order in orders:
        for i in order:
            fn = fns[i]
            if isinstance(fn, Untimed):
                state = fn.setup()
                t0 = time.perf_counter()
                fn.call(state)
            else:
                t0 = time.perf_counter()
                fn()
            samples[i].append(time.perf_counter() - t0)
    return [Timing.of(s) for s in samples]


def posted_after_merge(local_rows: np.ndarray, local_ids: np.ndarray, remote_rows: np.ndarray, remote_ids: np.ndarray) -> int:
    """Descriptors NIXL 1.5.1's ``make_prepped_xfer`` posts for one READ, computed.

    NIXL joins neighbouring entries of the request when both sides continue in the same dense
    strided row (``stride == len``) with the next id. Measured on this machine with
    ``get_xfer_telemetry().descCount``: rows adjacent in memory are *not* joined across, and a
    row with ``len < stride`` (a head slice) never merges. ``tests/test_bench.py`` checks this
    computation against NIXL's own count. (The computation lives in ``nixlkv.core.staging``,
    where ``auto`` uses it to choose a descriptor mode.)
    """
    return descriptors_after_merge(local_rows, local_ids, remote_rows, remote_ids)


def memcpy_seconds(dst: np.ndarray, src: np.ndarray) -> float:
    """One single-thread ``numpy.copyto`` of ``src`` into ``dst``: the physical reference."""
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0
