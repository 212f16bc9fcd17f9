"""``nixlkv capture``: start a real vLLM engine per TP size, let each worker write what it built
for the KV cache (``capture_dir``, :mod:`nixlkv.vllm.capture`), and turn the records into
scenarios (:mod:`nixlkv.testing.captured`) for every ordered P/D pair of those TP sizes.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from . import models
from .check import build_model
from .launch import EngineSpec, ServeError, engine_process

CAPTURE_TOKENS = 300  # a request of several blocks, past every tiny model's window, within max_model_len


def capture_engine(
    model: str, tp: int, python: str, models_dir: Path, work_dir: Path, port: int,
    block_size: int | None = None, start_timeout: float = 900.0,
) -> list[dict[str, Any]]:
    """Start ``model`` at TP ``tp`` with capture on; return each rank's record (rank order)."""
    rec = models.recipe(model)
    model_dir = build_model(model, models_dir, python)
    block = block_size or rec.block_size
    out = (work_dir / f"capture-{model}-tp{tp}-b{block}").resolve()
    shutil.rmtree(out, ignore_errors=True)
    spec = EngineSpec(model_dir, "kv_producer", port, port + 10, "nixlkv", tp, block, rec.max_model_len,
                      extra_config={"capture_dir": str(out)}, env=dict(rec.env))
    proc = engine_process(f"capture-{model}-tp{tp}", spec, python, work_dir).start()
    try:
        proc.wait_ready(start_timeout)
        deadline = time.monotonic() + 60
        while len(list(out.glob("*.json"))) < tp:
            if time.monotonic() > deadline:
                raise ServeError(f"{model} tp={tp}: the engine started but wrote {len(list(out.glob('*.json')))} "
                                 f"of {tp} captures to {out}\n{proc.log_tail()}")
            time.sleep(0.5)
    finally:
        proc.stop()
    return sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["tp_rank"])


def write_scenarios(model: str, captures: dict[int, list[dict[str, Any]]], out_dir: Path,
                    block_size: int | None = None) -> list[Path]:
    """One scenario per ordered (P TP, D TP) pair of the captured engines."""
    from ..testing.captured import scenario_from_captures

    rec = models.recipe(model)
    suffix = f"-b{block_size}" if block_size and block_size != rec.block_size else ""
    written = []
    for p_tp, p in sorted(captures.items()):
        for d_tp, d in sorted(captures.items()):
            name = f"captured-{model}-p{p_tp}-d{d_tp}{suffix}"
            source = f"{model} ({rec.kind}), vllm {p[0]['vllm_version']} serve --block-size {block_size or rec.block_size}"
            scenario = scenario_from_captures(p, d, name, CAPTURE_TOKENS, seed=p_tp * 10 + d_tp, source=source)
            header = (f"# Captured with `nixlkv capture --model {model}`: the KV groups, block sizes and pages\n"
                      f"# below are what vLLM {p[0]['vllm_version']} built for {model} at TP {p_tp} (P) and "
                      f"TP {d_tp} (D);\n# the rehearsal fails if it builds anything else.\n")
            path = out_dir / f"{name}.yaml"
            path.write_text(header + yaml.safe_dump(scenario, sort_keys=False, default_flow_style=None, width=120))
            written.append(path)
    return written


def run(models_: Sequence[str], tps: Sequence[int], python: str, models_dir: Path, work_dir: Path, out_dir: Path,
        port: int, block_size: int | None = None, start_timeout: float = 900.0) -> list[Path]:
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for model in models_:
        captures = {tp: capture_engine(model, tp, python, models_dir, work_dir, port, block_size, start_timeout)
                    for tp in tps}
        written += write_scenarios(model, captures, out_dir, block_size)
    return written
