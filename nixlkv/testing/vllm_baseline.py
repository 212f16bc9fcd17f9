"""vLLM 0.33's own ``NixlConnector`` (or ``NixlPushConnector``) through the nixlkv rehearsal: the
baseline nixlkv is compared with.

The caches, their fill, the decode sentinel and the request's block ids are the rehearsal's
(``engines.build_rank``, ``oracle.fill_prefill`` / ``fill_decode``, ``rehearsal.request_blocks``);
what differs is who plans and moves the bytes. Here vLLM does, with its own classes: one
worker-role ``NixlConnector`` per rank, a scheduler-role one per engine (side channel, block-id
clipping, ``request_finished`` on P, ``update_state_after_alloc`` + ``build_connector_meta`` on
D), P and D in separate processes. Then the same byte oracle judges D. :class:`EngineLayout`
picks the push connector instead, and pipeline stages on either engine: one worker per (stage,
TP rank) over only its stage's layers (``pipeline.stage_layers``).

This is the only module that reaches into vLLM connector internals, so it is pinned to vLLM
0.33.x (:func:`check_vllm_version`). What it sets up around vLLM's code, and nothing else:

- the model config vLLM reads model-wide facts from (KV head count, MLA or not), written as
  the model's real ``config.json`` would declare them (:func:`model_config_json`);
- TP rank and size while a worker is built, and no NUMA pinning (one process hosts all ranks);
  with pipeline stages, the parallel config's global rank (stage x TP + TP rank), from which
  vLLM's worker learns its stage's layers;
- the kernel block sizes of the attention-backend lookup when vLLM's CPU fallback (CPU_ATTN,
  multiples of 32 only) would refuse the scenario's block size: FlashAttention's declared
  ``MultipleOf(16)``, or the scenario's ``kernel_block_size`` (:func:`kernel_lookup`).
  Every result says whether this was needed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from ..core.errors import IncompatibleTopology, NixlkvError
from . import oracle
from .kinds import KINDS, known_kind
from .processes import engine_context, engine_process
from .scenario import Scenario, Side

SUPPORTED_VLLM = "0.33."
OUTCOMES = ("byte-exact", "wrong-bytes", "rejected", "hang", "not-run", "harness-error")
MLA_KINDS = ("mla", "sliding_window_mla", "mla_indexer")
CPU_ATTN_MULTIPLE = 32  # vLLM's CPU_ATTN backend: kernel blocks must be multiples of 32 tokens
FLASH_ATTN_MULTIPLE = 16  # FlashAttention (the GPU backend a deployment selects): multiples of 16
P_ENGINE, D_ENGINE = "P", "D"
SETUP_SECONDS = 600.0  # building an engine's caches and vLLM's workers, on a loaded machine


class VllmVersionError(NixlkvError):
    """The installed vLLM is not the version this harness reaches into."""


class NotRunnable(NixlkvError):
    """vLLM cannot be set up for this scenario faithfully: the message says why."""


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM version, or a clear error when it is not 0.33.x."""
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise VllmVersionError(f"the vLLM baseline needs vLLM {SUPPORTED_VLLM}x installed: {exc}") from None
        version = str(vllm.__version__)
    if not version.startswith(SUPPORTED_VLLM):
        raise VllmVersionError(
            f"the vLLM baseline reaches into vLLM {SUPPORTED_VLLM}x NixlConnector internals; installed vLLM is "
            f"{version}. Install vllm=={SUPPORTED_VLLM}0 (make venv) or port nixlkv/testing/vllm_baseline.py."
        )
    return version


# ---------------------------------------------------------------- what vLLM is told about the model
def model_config_json(scenario: Scenario, role: str) -> tuple[dict[str, Any], str]:
    """The config.json a real deployment of this side's model would hand vLLM, and a note.

    vLLM's connector reads two model-wide facts from it: ``use_mla`` and one total KV head
    count (``get_total_num_kv_heads``, the ``num_key_value_heads`` field). Per-layer specs come
    from the fabricated caches. Raises :class:`NotRunnable` where no real config says it.
    """
    kinds = scenario.layer_kinds(role)
    names = {k.kind for k in kinds}
    attention = [k for k in kinds if k.kind in ("full_attention", "sliding_window")]
    base = {"vocab_size": 1000, "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
            "num_hidden_layers": len(kinds), "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    if names & set(MLA_KINDS):
        if attention:
            raise NotRunnable(
                "GQA layers next to an MLA target are a speculative draft model: vLLM reads the draft's heads "
                "from a separate draft model config (speculative_config), which this harness does not build"
            )
        mla = next(k for k in kinds if k.kind in ("mla", "sliding_window_mla"))
        cfg = {**base, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "kv_lora_rank": mla.params["kv_lora_rank"], "qk_rope_head_dim": mla.params["qk_rope_head_dim"],
               "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": None, "hidden_size": 1024,
               "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 1024,
               "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
               "topk_group": 1, "first_k_dense_replace": len(kinds)}  # all layers dense: no MoE weights matter
        return cfg, "DeepSeek-V3 config (use_mla)"
    if not attention:
        raise NotRunnable("no attention layer: no model-wide KV head count to give vLLM")
    counts = {(k.kind, k.params["num_kv_heads"]) for k in attention}
    heads = {h for _, h in counts}
    if len(heads) == 1:
        total, note = heads.pop(), ""
    else:
        by_kind = {kind: {h for kk, h in counts if kk == kind} for kind in ("sliding_window", "full_attention")}
        if len(by_kind["sliding_window"]) == 1 and len(by_kind["full_attention"]) == 1:
            # Gemma4's config: num_key_value_heads (sliding layers), num_global_key_value_heads (full)
            total = next(iter(by_kind["sliding_window"]))
            note = (f"model-wide KV heads {total}: Gemma4's num_key_value_heads (sliding layers; full layers "
                    f"have {next(iter(by_kind['full_attention']))}, num_global_key_value_heads, which vLLM's connector does not read)")
        else:
            raise NotRunnable(
                f"layers with KV head counts {sorted(heads)} in one kind: no model config declares them, and vLLM's "
                "connector reads one model-wide count"
            )
    first = next(k for k in attention if k.params["num_kv_heads"] == total)
    cfg = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": total,
           "num_attention_heads": total * 8, "head_dim": first.params["head_size"],
           "hidden_size": total * 8 * first.params["head_size"], "intermediate_size": 512}
    return cfg, note


def kernel_lookup(original: Callable[..., list[type]], side: Side, attention_block: int, notes: list[str]) -> Callable[..., list[type]]:
    """vLLM's attention-backend lookup, left alone when its backends serve the fabricated caches.

    The caches hold whole ``attention_block``-token pages, or ``side.kernel_block_size`` kernel
    pages. When vLLM's own choice (``select_common_block_size``) differs — CPU_ATTN takes only
    multiples of 32 — the backends are handed back with only their declared kernel block sizes
    replaced: FlashAttention's ``MultipleOf(16)``, or the scenario's kernel size. ``notes`` says so.
    """
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.worker.utils import select_common_block_size

    want = side.kernel_block_size or attention_block

    def lookup(vllm_config: Any, layer_names: Any = None) -> list[type]:
        backends = original(vllm_config, layer_names)
        try:
            chosen = select_common_block_size(attention_block, backends)
        except ValueError:
            chosen = None
        if chosen == want:
            return backends
        sizes = [side.kernel_block_size] if side.kernel_block_size else [MultipleOf(FLASH_ATTN_MULTIPLE)]
        names = sorted({b.get_name() for b in backends})
        note = (f"{names} kernel block sizes {[b.get_supported_kernel_block_sizes() for b in backends]} -> {sizes} "
                f"(lookup patched: vLLM's own would pick {chosen} for {attention_block}-token blocks)")
        if note not in notes:
            notes.append(note)
        return [_backend_accepting(b, sizes) for b in backends]

    return lookup


# ---------------------------------------------------------------- which connector, which pipeline sizes
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}


@dataclass(frozen=True)
class EngineLayout:
    """Which vLLM connector moves the KV, and each engine's pipeline-parallel size (the TP sizes
    are the scenario's). Each stage's workers hold only that stage's layers, as vLLM gives them."""

    connector: str = "pull"  # a key of CONNECTORS
    prefill_pp: int = 1
    decode_pp: int = 1

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector {self.connector!r}: use one of {sorted(CONNECTORS)}")
        if self.prefill_pp < 1 or self.decode_pp < 1:
            raise ValueError(
                f"pipeline sizes must be >= 1, got prefill_pp={self.prefill_pp}, decode_pp={self.decode_pp}"
            )

    def pp(self, role: str) -> int:
        return self.prefill_pp if role == "prefill" else self.decode_pp

    def __str__(self) -> str:
        return f"{self.connector} P PP{self.prefill_pp} -> D PP{self.decode_pp}"


# ---------------------------------------------------------------- results
@dataclass
class BaselineResult:
    scenario: str
    outcome: str  # one of OUTCOMES
    message: str = ""
    first_request_s: float | None = None  # includes vLLM's handshake
    steady_state_s: float | None = None  # median of the later requests
    descriptors: int | None = None  # posted for one request, summed over decode ranks (vLLM's telemetry)
    bytes_checked: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome == "byte-exact"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- running it
def run_baseline(
    scenario: Scenario, timeout: float = 90.0, requests: int = 4, corrupt: str | None = None,
    layout: EngineLayout | None = None,
) -> BaselineResult:
    """P and D in two processes, vLLM's connector between them, the oracle on D.

    ``requests``: the first (with handshake) plus ``requests - 1`` timed repeats. ``corrupt``
    (tests only) proves the check can fail: ``"prefill-byte"`` flips one P byte of the request
    after the fill, ``"block-ids"`` hands vLLM P's block ids reversed, ``"last-stage-byte"``
    flips one byte of the request's first block in the first layer of P's last pipeline stage,
    ``"idle-last-stage"`` leaves that stage's caches unfilled (it never computed its layers).
    ``layout``: which of vLLM's connectors, and each engine's pipeline size (default: pull, PP 1).
    """
    check_vllm_version()
    layout = layout or EngineLayout()
    result = BaselineResult(scenario.name if layout == EngineLayout() else f"{scenario.name} {layout}", "not-run")
    try:
        for role in ("prefill", "decode"):
            model_config_json(scenario, role)
    except NotRunnable as exc:
        result.message = str(exc)
        return result
    ctx = _context()
    p_parent, p_child = ctx.Pipe()
    d_parent, d_child = ctx.Pipe()
    args = (scenario, requests, corrupt, timeout, layout)
    procs = [engine_process(_prefill_main, (p_child, *args)), engine_process(_decode_main, (d_child, *args))]
    for p in procs:
        p.start()
    try:  # set-up (process start, caches, vLLM's workers) is not the transfer: its own allowance
        ready = _recv(p_parent, procs[0], time.monotonic() + SETUP_SECONDS, "prefill")
        if "params" not in ready:
            d_parent.send({"stop": True})
            return _from_failure(result, ready)
        d_parent.send(ready)
        done = _recv(d_parent, procs[1], time.monotonic() + SETUP_SECONDS + timeout, "decode")
        p_parent.send("stop")
        sent = _recv(p_parent, procs[0], time.monotonic() + 15, "prefill")
        if "error" in done:
            result = _from_failure(result, done)
            if sent.get("reason", "no message") != "no message" and result.outcome in ("hang", "rejected"):
                # in push mode P's workers fail on their own threads: their reason is in P's log only
                result.notes.append(f"the prefill engine's vLLM said: {sent['reason']}")
            return result
        result.__dict__.update({k: v for k, v in done.items() if k in result.__dict__})
        if layout.connector == "push" and sent.get("descriptors"):  # posted by P, per request
            result.descriptors = sent["descriptors"] // requests
        missing = {r: n for r, n in sent.get("done_sending", {}).items() if n < requests}
        if result.outcome == "byte-exact" and missing:
            result.notes.append(f"prefill ranks never released the request (done_sending counts {missing})")
        return result
    except _Timeout as exc:
        result.outcome, result.message = "hang", str(exc)
        return result
    finally:
        for conn in (p_parent, d_parent):
            try:
                conn.send("bye")
            except (OSError, EOFError, BrokenPipeError):
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


class _Timeout(Exception):
    pass


def _recv(conn, proc, deadline: float, who: str) -> dict[str, Any]:
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            return conn.recv()
        if not proc.is_alive():
            if conn.poll(0):
                return conn.recv()
            return {"error": f"the {who} process died (exit code {proc.exitcode})", "outcome": "harness-error"}
    raise _Timeout(f"no answer from the {who} process within the time limit")


def _from_failure(result: BaselineResult, msg: dict[str, Any]) -> BaselineResult:
    result.outcome = msg.get("outcome", "harness-error")
    result.message = msg.get("error", "")
    result.notes += msg.get("notes", [])
    return result


def _context():
    """Forkserver with vLLM preloaded (``nixlkv.testing.processes``): each scenario's processes
    skip the ~10 s import."""
    _environment()
    return engine_context()


def _stdout_to_stderr() -> None:
    """An engine process's stdout (file descriptor 1, where UCX logs its errors) goes to stderr:
    stdout belongs to the parent, whose ``--json`` output must stay parseable."""
    sys.stdout.flush()
    os.dup2(2, 1)


def _environment() -> None:
    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "NIXL_LOG_LEVEL": "WARN",
                       "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)


# ---------------------------------------------------------------- inside the engine processes
class _LogCapture(logging.Handler):
    """vLLM's warnings and errors: its reason when it refuses or fails a request."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.errors: list[str] = []  # distinct exceptions vLLM logged, with where they were raised

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = _describe(record.exc_info[1])
            text += f" [{error}]"
            if error not in self.errors:
                self.errors.append(error)
        self.lines.append(text)

    def reason(self) -> str:
        return " | ".join(self.errors or _distinct(self.lines)[-3:]) or "no message"


def _describe(exc: BaseException) -> str:
    """Type, message and where it was raised (the source line: a bare assert says nothing else)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} `{frames[-1].line}`" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _capture_logs() -> _LogCapture:
    handler = _LogCapture()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    return handler


def _vllm_failure(exc: BaseException, logs: _LogCapture) -> dict[str, Any]:
    """An exception while vLLM set up or ran: 'rejected' when vLLM's own code raised it, 'not-run'
    when it was vLLM's CPU platform (a GPU deployment would get past it) or when the scenario's
    model cannot be sharded at its TP (no cache exists to move), else a harness error."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1].filename if frames else ""
    text = _describe(exc)
    if isinstance(exc, IncompatibleTopology):
        return {"outcome": "not-run", "error": f"no such cache to move: the model cannot be sharded at this TP, "
                f"so vLLM cannot build it either: {text}"}
    if last.endswith(os.path.join("vllm", "platforms", "cpu.py")):
        return {"outcome": "not-run", "error": f"vLLM's CPU platform refuses this set-up: {text}"}
    in_vllm = f"{os.sep}vllm{os.sep}" in last and "nixlkv" not in last
    return {"outcome": "rejected" if in_vllm else "harness-error", "error": text}


@contextmanager
def _worker_patches(tp_rank: int, side: Side, attention_block: int, notes: list[str]) -> Iterator[None]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.platforms.cpu import CpuPlatform

    lookup = kernel_lookup(base_worker.get_current_attn_backends, side, attention_block, notes)
    with mock.patch.object(base_worker, "get_tensor_model_parallel_rank", return_value=tp_rank), \
         mock.patch.object(base_worker, "get_tensor_model_parallel_world_size", return_value=side.tp), \
         mock.patch.object(CpuPlatform, "discover_numa_topology", return_value=[]), \
         mock.patch.object(base_worker, "get_current_attn_backends", lookup):
        yield


def _backend_accepting(backend: type, sizes: list[Any]) -> type:
    """vLLM's backend class with only its declared kernel block sizes replaced."""
    return type(backend.__name__, (backend,), {"get_supported_kernel_block_sizes": staticmethod(lambda spec=None: list(sizes))})


def model_dir(cfg: dict[str, Any]) -> Path:
    """A directory holding ``cfg`` as config.json, named by its content: P and D of the same model
    get the same path, which vLLM's handshake compatibility hash includes."""
    text = json.dumps(cfg, sort_keys=True)
    path = Path(tempfile.gettempdir()) / f"nixlkv-vllm-model-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    path.mkdir(exist_ok=True)
    if not (path / "config.json").exists():
        tmp = path / f"config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(path / "config.json")
    return path


def _vllm_config(scenario: Scenario, role: str, layout: EngineLayout | None = None) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    side = scenario.prefill if role == "prefill" else scenario.decode
    layout = layout or EngineLayout()
    cfg, _ = model_config_json(scenario, role)
    mla = [k for k in scenario.layer_kinds(role) if k.kind in ("mla", "sliding_window_mla")]
    cache_dtype = mla[0].params["cache_dtype"] if mla and mla[0].params["cache_dtype"] != "auto" else "auto"
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model_dir(cfg)), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=65536),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=side.block_size, cache_dtype=cache_dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=side.tp, pipeline_parallel_size=layout.pp(role)),
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTORS[layout.connector], kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            engine_id=P_ENGINE if role == "prefill" else D_ENGINE, kv_buffer_device="cpu",
            kv_connector_extra_config={"num_threads": 1},
        ),
    )
    vc.cache_config.kv_cache_layout = side.layout
    if any(k.kind == "mamba" or (known_kind(k.kind) and KINDS[k.kind].skipped_tokens is not None)
           for k in scenario.layer_kinds(role)):
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # as engines.build_rank planned it
    return vc


def _deploy_conv_layout(scenario: Scenario, role: str) -> None:
    """Mamba: the conv-state layout the deployment runs (VLLM_SSM_CONV_STATE_LAYOUT), as the scenario says."""
    from vllm.model_executor.layers.mamba import mamba_utils

    layouts = {k.params["conv_layout"] for k in scenario.layer_kinds(role) if k.kind == "mamba"}
    if layouts:
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = layouts.pop()
        mamba_utils.get_conv_state_layout.cache_clear()


class _Engine:
    """One side: the rehearsal's fabricated ranks, and vLLM's connectors over them.

    With pipeline stages, one worker per (stage, TP rank) over only its stage's layers (the
    rehearsal's stage ranks, ``pipeline.stage_layers``), built while vLLM's parallel config
    names its global rank (stage x TP + TP rank), as each of vLLM's worker processes has it; the
    scheduler-role connector sees the whole model's groups, as vLLM's scheduler does.
    """

    def __init__(self, scenario: Scenario, role: str, layout: EngineLayout | None = None) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nixl_connector

        from .engines import build_rank
        from .pipeline import stage_layers
        from .rehearsal import Engines, request_blocks

        self.scenario, self.role = scenario, role
        self.layout = layout or EngineLayout()
        self.push = self.layout.connector == "push"
        pp = self.layout.pp(role)
        _deploy_conv_layout(scenario, role)
        self.side = scenario.prefill if role == "prefill" else scenario.decode
        peer_role = "decode" if role == "prefill" else "prefill"
        whole = build_rank(scenario, role, 0)  # block IDs are the scheduler's, one space for every stage
        peer = build_rank(scenario, peer_role, 0)
        pair = Engines([whole], [peer], []) if role == "prefill" else Engines([peer], [whole], [])
        self.p_blocks, self.d_blocks = request_blocks(scenario, pair)
        del peer, pair
        if pp == 1:
            self.places = [(0, r) for r in range(self.side.tp)]
            self.ranks = [whole] + [build_rank(scenario, role, r) for r in range(1, self.side.tp)]
        else:
            ranges = stage_layers(len(scenario.layer_kinds(role)), pp)
            self.places = [(s, r) for s in range(pp) for r in range(self.side.tp)]
            self.ranks = [build_rank(scenario, role, r, stage_layers=ranges[s]) for s, r in self.places]
        self.vc = _vllm_config(scenario, role, self.layout)
        self.notes = [n for n in (model_config_json(scenario, role)[1],) if n]
        cls = getattr(nixl_connector, CONNECTORS[self.layout.connector])
        self.workers = []
        for (stage, tp_rank), rank in zip(self.places, self.ranks):
            with _worker_patches(tp_rank, self.side, _attention_block(rank), self.notes), \
                    mock.patch.object(self.vc.parallel_config, "rank", stage * self.side.tp + tp_rank), \
                    set_current_vllm_config(self.vc):
                w = cls(self.vc, KVConnectorRole.WORKER, rank.kv_cache_config)
                w.register_kv_caches(rank.kv_caches)
            self.workers.append(w)
        with set_current_vllm_config(self.vc):
            self.scheduler = cls(self.vc, KVConnectorRole.SCHEDULER, whole.kv_cache_config)
        if role == "prefill" or self.push:
            # what the engine core does once the workers registered: serve the side channel (in push
            # mode D's too: P's workers handshake with D before they WRITE)
            self.scheduler.set_xfer_handshake_metadata_pp_aware(
                {place: w.get_handshake_metadata() for place, w in zip(self.places, self.workers)}
            )

    def step(self, meta: Any, forward: bool = False) -> list[Any]:
        """What the model runner does with the connector each step, without a forward pass. With
        ``forward`` (push: the step that computed the request), the per-layer hook each attention
        layer calls, with the worker's own layers, then ``wait_for_save``, in the runner's order."""
        out = []
        for w, rank in zip(self.workers, self.ranks):
            w.bind_connector_metadata(meta)
            if self.push:
                if forward:
                    for name, tensor in rank.kv_caches.items():
                        w.save_kv_layer(name, tensor, None)
                w.start_load_kv(None)  # async loads start after the forward
                w.wait_for_save()
            else:
                w.start_load_kv(None)
            out.append(w.get_transfer_results(set()))
            w.clear_connector_metadata()
        return out

    def descriptors(self) -> int:
        total = 0
        for w in self.workers:
            stats = w.get_kv_connector_stats()
            if stats is not None:
                total += int(sum(stats.data.get("num_descriptors", [])))
        return total

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.scheduler.shutdown()


def _attention_block(rank: Any) -> int:
    """Tokens per block of the rank's token (non-state) groups, as vLLM's worker computes it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = [g.kv_cache_spec.block_size for g in rank.kv_cache_config.kv_cache_groups
             if not isinstance(g.kv_cache_spec, MambaSpec)]
    return math.lcm(*sizes) if sizes else rank.side.block_size


def _request(rid: str, num_tokens: int, params: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id=rid, prompt_token_ids=[7] * num_tokens, sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None)
    req.kv_transfer_params = dict(params)
    return req


def _ids(groups: list[oracle.GroupBlocks]) -> tuple[list[int], ...]:
    return tuple([int(i) for i in g.ids] for g in groups)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# After D is done, how long P keeps stepping for the release notifications D already sent (they
# arrive asynchronously; on a loaded machine the last one can trail D's answer by a few steps).
RELEASE_GRACE_SECONDS = 10.0


def _prefill_main(conn, scenario: Scenario, requests: int, corrupt: str | None, timeout: float,
                  layout: EngineLayout) -> None:
    _stdout_to_stderr()
    _environment()
    logs = _capture_logs()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())  # read when the scheduler is built
    engine = None
    try:
        engine = _Engine(scenario, "prefill", layout)
        idle_stage = max(s for s, _ in engine.places) if corrupt == "idle-last-stage" else None
        for (stage, _), rank in zip(engine.places, engine.ranks):
            if stage != idle_stage:  # an idle stage's caches keep the bytes they were built with
                oracle.fill_prefill(rank, engine.p_blocks, scenario.request.seed)
        if corrupt == "prefill-byte":
            _flip_one_request_byte(engine, engine.ranks[0])
        if corrupt == "last-stage-byte":
            _flip_one_request_byte(engine, engine.ranks[-1])
        block_ids = _ids(engine.p_blocks)
        if corrupt == "block-ids":
            block_ids = tuple(list(reversed(g)) for g in block_ids)
        params = _prefill_requests(engine, requests, block_ids)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, never swallowed
        conn.send(_vllm_failure(exc, logs))
        if engine is not None:
            engine.close()
        return
    conn.send({"params": params, "notes": engine.notes})
    deadline = time.monotonic() + SETUP_SECONDS + timeout  # D may still be building its workers
    done: dict[tuple[int, int], set[str]] = {place: set() for place in engine.places}
    posted = 0  # push: P's workers post the WRITEs, and their telemetry counts the descriptors
    try:
        stopping = None  # when D is done: the notifications it sent may still be on their way
        while time.monotonic() < deadline:
            for place, res in zip(engine.places, engine.step(engine.scheduler.build_connector_meta(None))):
                done[place] |= set(res.finished_sending)
            posted += engine.descriptors()
            if stopping is None and conn.poll(0.002) and conn.recv() in ("stop", "bye"):
                stopping = time.monotonic()
            if stopping is not None and (all(len(s) >= requests for s in done.values())
                                         or time.monotonic() > stopping + RELEASE_GRACE_SECONDS):
                break
        conn.send({"done_sending": {_place_name("P", place, engine): len(s) for place, s in done.items()},
                   "descriptors": posted, "log": logs.lines[-5:], "reason": logs.reason()})
        while conn.poll(15) and conn.recv() != "bye":
            pass
    except (EOFError, BrokenPipeError, OSError):
        pass
    finally:
        engine.close()


def _prefill_requests(engine: _Engine, requests: int, block_ids: tuple[list[int], ...]) -> dict[str, dict[str, Any]]:
    """Every request through P's scheduler-role connector, as vLLM's scheduler calls it: allocated
    (joins the batch), prefilled, finished (its blocks held for D), then one step's metadata. Push:
    the prefill is a step of its own (the workers see the request in the batch and each layer's
    save hook), and the finished blocks reach the workers in the next step's metadata."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import RequestStatus

    sched = engine.scheduler
    out = {}
    for i in range(requests):
        rid = _request_id("prefill", i, engine.push)
        req = _request(rid, engine.scenario.request.num_tokens, {"do_remote_decode": True, "do_remote_prefill": False})
        sched.update_state_after_alloc(req, KVCacheBlocks(tuple([] for _ in block_ids)), 0)
        if engine.push:
            engine.step(sched.build_connector_meta(None), forward=True)
        req.num_computed_tokens = engine.scenario.request.num_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = sched.request_finished_all_groups(req, block_ids)
        if not delay or params is None:
            raise RuntimeError(f"vLLM's scheduler did not hold {rid}'s blocks for D: {params}")
        out[rid] = params
    engine.step(sched.build_connector_meta(None))
    return out


def _request_id(role: str, i: int, push: bool) -> str:
    """Request ``i``'s id on one engine. Push: P and D name it as a proxy does, one id with each
    engine's random ``-<8 hex>`` suffix (P's worker matches D's registration by the id without it)."""
    if push:
        return f"req-{i}-{'0000000a' if role == 'prefill' else '0000000d'}"
    return f"{role[0]}-req-{i}"


def _place_name(engine_letter: str, place: tuple[int, int], engine: _Engine) -> str:
    """``P1`` for TP rank 1 of a one-stage engine, ``P1.0`` for stage 1's TP rank 0."""
    stage, tp_rank = place
    return f"{engine_letter}{stage}.{tp_rank}" if engine.layout.pp(engine.role) > 1 else f"{engine_letter}{tp_rank}"


def _flip_one_request_byte(engine: _Engine, rank: Any) -> None:
    """Flip one byte of the request's first block in ``rank``'s first layer (of its first group)."""
    name = rank.group_layers(0)[0]
    block = int(next(i for i in engine.p_blocks[0].ids if i))
    import torch

    view = rank.kv_caches[name].view(torch.uint8)
    view[block].view(-1)[0] ^= 0xFF


def _decode_main(conn, scenario: Scenario, requests: int, corrupt: str | None, timeout: float,
                 layout: EngineLayout) -> None:
    _stdout_to_stderr()
    _environment()
    logs = _capture_logs()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
    engine = None
    try:
        engine = _Engine(scenario, "decode", layout)
        for rank in engine.ranks:
            oracle.fill_decode(rank)
    except Exception as exc:  # noqa: BLE001
        conn.send(_vllm_failure(exc, logs))
        if engine is not None:
            engine.close()
        return
    try:
        ready = conn.recv()
        if "params" not in ready:
            return
        deadline = time.monotonic() + timeout  # the time limit covers the transfers, not the set-up
        conn.send(_decode_requests(engine, ready["params"], deadline, logs, ready.get("notes", [])))
        while conn.poll(20) and conn.recv() != "bye":
            pass
    except (EOFError, BrokenPipeError, OSError):
        pass
    except Exception as exc:  # noqa: BLE001
        conn.send(_vllm_failure(exc, logs))
    finally:
        engine.close()


def _decode_blocks(engine: _Engine) -> tuple[Any, tuple[int, ...]]:
    """D's blocks for the request as vLLM's KV cache manager hands them to the connector: a
    prefix hit's blocks carry a hash (already held), the rest are fresh; nulls are null blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

    used = {int(i) for g in engine.d_blocks for i in g.ids}
    spare = iter(i for i in range(1, engine.ranks[0].kv_cache_config.num_blocks) if i not in used)
    groups, cached = [], []
    for g, gb in enumerate(engine.d_blocks):
        blocks = []
        for _ in range(gb.first_position):  # held by D already: hashed blocks never to be written
            b = KVCacheBlock(next(spare))
            b.set_block_hash(make_block_hash_with_group_id(b"held", g))
            blocks.append(b)
        blocks += [KVCacheBlock(int(i), is_null=not i) for i in gb.ids]
        groups.append(blocks)
        cached.append(gb.first_position)
    return KVCacheBlocks(tuple(groups)), tuple(cached)


def _decode_requests(
    engine: _Engine, params: dict[str, dict[str, Any]], deadline: float, logs: _LogCapture, notes: list[str]
) -> dict[str, Any]:
    scenario = engine.scenario
    sched = engine.scheduler
    num_tokens = scenario.request.num_tokens
    times, descriptors, mismatch = [], [], None
    notes = list(dict.fromkeys([*notes, *engine.notes]))
    for i, (p_rid, p_params) in enumerate(params.items()):
        rid = _request_id("decode", i, engine.push)
        req = _request(rid, num_tokens, p_params)
        blocks, cached = _decode_blocks(engine)
        computed = sum(b.block_hash is not None for b in blocks.blocks[0]) if blocks.blocks else 0
        external = num_tokens - computed * engine.ranks[0].group_block_size(0)
        sched.update_state_after_alloc(req, blocks, max(external, 1))
        t0 = time.perf_counter()
        pending = set(engine.places)
        failed: set[tuple[int, int]] = set()
        meta = sched.build_connector_meta(None)
        while pending:
            if time.monotonic() > deadline:
                return {"outcome": "hang", "error": f"request {i}: decode ranks "
                        f"{[_place_name('D', p, engine) for p in sorted(pending)]} never finished "
                        f"receiving; vLLM said: {logs.reason()}", "notes": notes}
            for place, res in zip(engine.places, engine.step(meta)):
                if rid in res.finished_recving:
                    pending.discard(place)
                if rid in res.failed_recving:
                    failed.add(place)
            meta = sched.build_connector_meta(None)
            time.sleep(0.0005)
        times.append(time.perf_counter() - t0)
        descriptors.append(engine.descriptors())
        if failed:
            return {"outcome": "rejected", "notes": notes, "error": f"vLLM failed the request on decode ranks "
                    f"{[_place_name('D', p, engine) for p in sorted(failed)]}: {logs.reason()}"}
        if i == 0 or i == len(params) - 1:
            mismatch = mismatch or _check(engine)
    result = {
        "outcome": "wrong-bytes" if mismatch else "byte-exact",
        "message": mismatch or f"{sum(r.buffer.numel() for r in engine.ranks)} decode bytes checked",
        "first_request_s": times[0],
        "steady_state_s": statistics.median(times[1:]) if len(times) > 1 else None,
        "descriptors": descriptors[0] or None,
        "bytes_checked": sum(r.buffer.numel() for r in engine.ranks),
        "notes": notes,
    }
    if descriptors[0] == 0 and not engine.push:  # push: P posts them (run_baseline reads P's count)
        result["notes"].append("vLLM's telemetry reported no descriptors")
    return result


def _check(engine: _Engine) -> str | None:
    """The oracle on every decode rank: None when byte-exact, else each rank's first mismatch. When
    every wrong byte lies past the request's last token (in its last block), the message says so."""
    wrong, past_end_only = [], True
    for rank in engine.ranks:
        expected = oracle.expected_decode(rank, engine.d_blocks, engine.scenario.request.seed)
        m = oracle.compare(rank, expected)
        if m is not None:
            wrong.append(str(m))
            _accept_past_end(engine, rank, expected)
            past_end_only &= oracle.compare(rank, expected) is None
    if not wrong:
        return None
    prefix = ("every byte of the request's tokens is right; the wrong bytes are all token slots past its last "
              "token, in its last block: " if past_end_only else "")
    return prefix + "; ".join(wrong)


def _accept_past_end(engine: _Engine, rank: Any, expected: Any) -> None:
    """Let ``expected`` take whatever D holds in the token slots after the request's last token."""
    num_tokens = engine.scenario.request.num_tokens
    for group, gb in enumerate(engine.d_blocks):
        if rank.is_state_group(group):
            continue
        bs = rank.group_block_size(group)
        last = -(-num_tokens // bs) - 1
        index = last - gb.first_position
        first_free = num_tokens - last * bs
        if not 0 <= index < gb.ids.size or first_free >= bs:
            continue
        block = int(gb.ids[index])
        for name in rank.group_layers(group):
            actual = oracle.bytes_view(rank.kv_caches[name], rank.kv_cache_config.num_blocks)
            target = oracle.bytes_view(oracle.same_view(rank.kv_caches[name], rank.buffer, expected),
                                       rank.kv_cache_config.num_blocks)
            per_page = actual.shape[3]
            for slot in range(first_free, bs):
                target[block, slot // per_page, :, slot % per_page] = actual[block, slot // per_page, :, slot % per_page]


def _distinct(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(lines))


# ---------------------------------------------------------------- comparison
def compare_scenario(scenario: Scenario, timeout: float, requests: int = 4,
                     nixlkv: Callable[[Scenario], Any] | None = None) -> dict[str, Any]:
    """One row: nixlkv's rehearsal and vLLM's baseline on the same scenario."""
    from .rehearsal import rehearse

    n = (nixlkv or rehearse)(scenario)
    v = run_baseline(scenario, timeout=timeout, requests=requests)
    return {
        "scenario": scenario.name,
        "pairing": f"P{scenario.prefill.tp}->D{scenario.decode.tp}",
        "expect": "reject" if scenario.expect_error else "ok",
        "nixlkv": {"outcome": n.outcome, "message": n.message, "transfer_s": n.transfer_seconds or None,
                   "descriptors": n.descriptors or None},
        "vllm": v.to_dict(),
        "agree": _agree(n.outcome, v.outcome),
    }


def _agree(nixlkv_outcome: str, vllm_outcome: str) -> bool | None:
    if vllm_outcome in ("not-run", "harness-error"):
        return None
    return (nixlkv_outcome == "byte-exact") == (vllm_outcome == "byte-exact")
