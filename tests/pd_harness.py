"""vLLM's real v1 Scheduler + one NixlkvConnector worker per TP rank, stepped the way vLLM's engine
core and model runner step them, with no forward pass: the test plays the model (fills prefill
blocks with the oracle pattern, samples a fixed token).

Used by the P/D acceptance tests: P runs in a separate process (``run_prefill``), D in the test.
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM's default conv state layout is SD; each engine of a case sets its own (PDCase), DS unless it says.
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")

from nixlkv.testing import oracle  # noqa: E402
from nixlkv.testing.engines import DATA, build_rank  # noqa: E402
from nixlkv.testing.kinds import vllm_conv_state_layout  # noqa: E402
from nixlkv.testing.pipeline import stage_layers  # noqa: E402
from nixlkv.testing.processes import engine_context, engine_process  # noqa: E402
from nixlkv.testing.scenario import parse  # noqa: E402

EOS = 2


MODELS_DIR = Path(__file__).parent / "models"


@dataclass(frozen=True)
class TinyModel:
    """A tiny model both engines serve: the config.json vLLM's ModelConfig reads, and the scenario
    layers that give the same per-rank KV specs its layers would report."""

    config_dir: Path
    layers: tuple[dict[str, Any], ...]
    layout: str  # the KV layout the engine resolves (the connector's required one, else vLLM's default)
    # Off for a Mamba model in mamba_cache_mode "none" (one state per request): vLLM's Mamba prefix
    # caching needs "align" (one state entry per block), which the "-align" models run.
    prefix_caching: bool = True


_FA = {"kind": "full_attention", "num_kv_heads": 8, "head_size": 32}
_MAMBA2 = {"kind": "mamba", "mamba_type": "mamba2", "num_heads": 8, "head_dim": 16, "n_groups": 1, "d_state": 16,
           "conv_kernel": 4, "dtype": "bfloat16", "ssm_dtype": "float32", "conv_layout": "DS"}
MODELS = {
    # The shipped tiny-llama: 4 layers, 8 KV heads, head_dim 32, bfloat16.
    "llama": TinyModel(DATA / "tiny-llama", ({**_FA, "count": 4},), "LBHNC"),
    # The same config with 3 sliding-window layers + 1 full-attention layer (several KV groups).
    "llama-sw": TinyModel(DATA / "tiny-llama", (
        {**_FA, "kind": "sliding_window", "count": 3, "window": 64}, {**_FA, "count": 1}), "LBHNC"),
    # DeepSeek-V2-like MLA: one replicated latent head of kv_lora_rank + qk_rope_head_dim per token.
    "deepseek-mla": TinyModel(MODELS_DIR / "tiny-deepseek-v2", (
        {"kind": "mla", "count": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 32},), "LBNHC"),
    # Nemotron-H-like hybrid "M*M": Mamba2 (one B/C group, replicated on every rank), attention, Mamba2.
    "nemotron-h": TinyModel(MODELS_DIR / "tiny-nemotron-h", (
        _MAMBA2, {**_FA, "num_kv_heads": 4}, _MAMBA2), "LBHNC", prefix_caching=False),
    # The same hybrid with vLLM's Mamba prefix caching: mamba_cache_mode "align", one state entry
    # per attention block of tokens, so a request's state list holds several entries.
    "nemotron-h-align": TinyModel(MODELS_DIR / "tiny-nemotron-h", (
        {**_MAMBA2, "cache_mode": "align"}, {**_FA, "num_kv_heads": 4}, {**_MAMBA2, "cache_mode": "align"}), "LBHNC"),
    # Gemma4-like: 3 sliding layers (8 KV heads x 32, window 64) + 1 full layer (2 KV heads x 64,
    # per_layer_config), so the full layer's heads are replicated from TP 4 on.
    # The tiny-llama config with compressor rings beside its attention layers (DeepSeek-V4.1-like:
    # 8 rows of 1024 fp32, one block per request, whole on every rank): vLLM's real scheduler runs
    # its CircularBufferManager, so the ring block lists the connector gets are vLLM's own.
    "llama-ring": TinyModel(DATA / "tiny-llama", (
        {**_FA, "count": 2}, {"kind": "circular_buffer", "count": 2, "capacity": 8, "head_size": 1024}), "LBHNC"),
    "gemma4": TinyModel(MODELS_DIR / "tiny-gemma4", (
        {**_FA, "kind": "sliding_window", "count": 3, "window": 64},
        {"kind": "full_attention", "count": 1, "num_kv_heads": 2, "head_size": 64}), "LBHNC"),
}


@dataclass(frozen=True)
class PDCase:
    """One P/D pairing of a tiny model: what the prefill process and the test both build from."""

    model: str = "llama"
    p_tp: int = 1
    d_tp: int = 1
    p_block: int = 16
    d_block: int = 16
    num_blocks: int = 96
    # Each engine's VLLM_SSM_CONV_STATE_LAYOUT (Mamba models): its caches and its connector see it.
    p_conv_layout: str = "DS"
    d_conv_layout: str = "DS"
    # Pipeline stages of each engine: one worker per (stage, TP rank), each over its stage's layers.
    p_pp: int = 1
    d_pp: int = 1
    # Negative control: the prefill engine's model leaves this stage's caches unwritten (its
    # layers never computed), so what D reads from that stage is not the prompt's KV.
    p_idle_stage: int | None = None

    def scenario(self):
        m = MODELS[self.model]
        return parse({
            "name": f"pd-{self.model}-p{self.p_tp}b{self.p_block}-d{self.d_tp}b{self.d_block}",
            "model": {"layers": [dict(layer) for layer in m.layers]},
            "prefill": {"tp": self.p_tp, "block_size": self.p_block, "layout": m.layout, "num_blocks": self.num_blocks,
                        "conv_layout": self.p_conv_layout},
            "decode": {"tp": self.d_tp, "block_size": self.d_block, "layout": m.layout, "num_blocks": self.num_blocks,
                       "conv_layout": self.d_conv_layout},
            "request": {"num_tokens": 16},
        })


def mamba_cache_mode(tiny: TinyModel) -> str:
    """vLLM's mamba_cache_mode the model's Mamba layers are built for ("none" without any)."""
    modes = {layer.get("cache_mode", "none") for layer in tiny.layers if layer["kind"] == "mamba"}
    assert len(modes) <= 1, modes
    return modes.pop() if modes else "none"


def vllm_config(role: str, engine_id: str, tp: int, block_size: int, extra: dict[str, Any], model: str = "llama",
                pp: int = 1):
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig,
    )

    tiny = MODELS[model]
    model_config = ModelConfig(model=str(tiny.config_dir), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=4096)
    vc = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=4096,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=tiny.prefix_caching,
                                 mamba_cache_mode=mamba_cache_mode(tiny)),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlkvConnector", kv_connector_module_path="nixlkv.connector",
            kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra,
        ),
    )
    vc.cache_config.kv_cache_layout = tiny.layout
    return vc


def request_seed(rid: str) -> int:
    return zlib.crc32(rid.encode()) & 0xFFFF


def state_seed(rid: str, num_tokens: int) -> int:
    """A running state's pattern depends on how many tokens it has taken: the oracle tells the
    state after N - 1 prompt tokens from the state after N."""
    return request_seed(rid) ^ ((num_tokens + 1) << 16)


class PDEngine:
    """One engine: vLLM's Scheduler (its connector built by vLLM from the kv-transfer config) and
    one worker-role NixlkvConnector per TP rank over fabricated KV caches."""

    def __init__(self, case: PDCase, role: str, engine_id: str, extra: dict[str, Any]):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        import nixlkv.connector as nc

        sc = case.scenario()
        side = sc.prefill if role == "prefill" else sc.decode
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        self.case = case
        self.role = role
        self.tp = side.tp
        self.pp = case.p_pp if role == "prefill" else case.d_pp
        # One rank per (stage, TP rank), stage-major as vLLM numbers them; each stage's over its
        # layers (the whole model's KV groups narrowed to them), the scheduler's over every layer.
        stages = stage_layers(len(sc.layer_kinds(role)), self.pp) if self.pp > 1 else [None]
        self.stages = [s for s in range(len(stages)) for _ in range(side.tp)]
        self.ranks = [build_rank(sc, role, r, stage_layers=layers) for layers in stages for r in range(side.tp)]
        self.vc = vllm_config(kv_role, engine_id, side.tp, side.block_size, extra, case.model, self.pp)
        required = nc.NixlkvConnector.get_required_kvcache_layout(self.vc)
        assert required in (None, side.layout), (required, side.layout)
        kcc = (self.ranks[0] if self.pp == 1 else build_rank(sc, role, 0)).kv_cache_config
        self.vc.cache_config.num_gpu_blocks = kcc.num_blocks
        # What vLLM's engine core does once the caches are sized: the block size is the smallest
        # prefix-cacheable group's, the scheduler steps in the LCM of the groups' block sizes.
        cacheable = [g.kv_cache_spec.block_size for g in kcc.kv_cache_groups if g.kv_cache_spec.prefix_cacheable]
        self.vc.cache_config.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in kcc.kv_cache_groups])
        self.block_size, self.hash_block_size = resolve_kv_cache_block_sizes(kcc, self.vc)
        for rank in self.ranks:
            rank.kv_cache_config.hash_block_size = self.hash_block_size
        init_none_hash(sha256)
        self.scheduler = Scheduler(
            vllm_config=self.vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(self.vc),
            block_size=self.block_size, hash_block_size=self.hash_block_size, log_stats=True,
        )
        assert isinstance(self.scheduler.connector, nc.NixlkvConnector)
        self.workers = []
        for rank, stage in zip(self.ranks, self.stages):
            with (mock.patch.object(nc, "tp_rank_and_size", return_value=(rank.tp_rank, side.tp)),
                  mock.patch.object(nc, "pp_rank_and_size", return_value=(stage, self.pp)),
                  vllm_conv_state_layout(side.conv_layout)):  # what the engine's env would say
                w = nc.NixlkvConnector(self.vc, KVConnectorRole.WORKER, rank.kv_cache_config)
            w.register_kv_caches(rank.kv_caches)
            self.workers.append(w)
        # What vLLM's engine core does after the workers registered their caches (0.32 and 0.33:
        # keyed by (pipeline stage, TP rank)).
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
            {(stage, w._worker.topology.tp_rank): w.get_handshake_metadata() for w, stage in zip(self.workers, self.stages)}
        )
        self.aggregator = KVOutputAggregator(expected_finished_count=side.tp * self.pp)
        self.recv_blocks: dict[str, tuple[list[int], ...]] = {}
        self.recv_tokens: dict[str, int] = {}  # tokens each loaded request's blocks hold once read
        self.held_blocks: dict[str, tuple[list[int], ...]] = {}  # each loaded request's whole lists at its load
        # Prompt tokens the scheduler counted as computed when it first ran the model on a request:
        # the state a running-state group must hold then is the state after exactly these.
        self.computes_from: dict[str, int] = {}
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.invalid_blocks: set[int] = set()
        self.stats = []
        self.outputs: dict[str, Any] = {}

    @property
    def port(self) -> int:
        return self.scheduler.connector._scheduler.side_channel_port

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.hash_block_size, sha256))
        req.kv_transfer_params = params
        self.scheduler.add_request(req)

    def fill(self, rid: str, block_ids: tuple[list[int], ...], num_tokens: int) -> None:
        """Play the prefill forward pass of ``num_tokens`` tokens: the request's blocks get its oracle
        pattern on every rank, a running state the pattern of the state after ``num_tokens``."""
        for rank, stage in zip(self.ranks, self.stages):
            if self.role == "prefill" and stage == self.case.p_idle_stage:
                continue
            ids = [np.asarray(g, dtype=np.int64) for g in block_ids]
            gb = [oracle.GroupBlocks(g, 0, g != 0) for g in ids]  # vLLM's null block 0 holds nothing
            _write_split(rank, rank.buffer, gb, request_seed(rid), state_seed(rid, num_tokens))

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        for rid, recv in getattr(meta, "reqs_to_recv", {}).items():
            if recv.report:
                self.recv_blocks[rid] = recv.local_block_ids
                self.recv_tokens[rid] = recv.num_tokens
                # The request's whole lists as vLLM holds them (prefix-hit and null entries included).
                self.held_blocks[rid] = tuple(list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(rid))
        for new in so.scheduled_new_reqs:
            self.computes_from.setdefault(new.req_id, new.num_computed_tokens)
            if self.role == "prefill":
                self.fill(new.req_id, new.block_ids, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        if self.role == "prefill":  # a prefill's later chunks (Mamba "align" splits at block boundaries)
            for rid in so.scheduled_cached_reqs.req_ids:
                ids = self.scheduler.kv_cache_manager.get_block_ids(rid)
                self.fill(rid, ids, self.scheduler.requests[rid].num_computed_tokens)
        req_ids = list(so.num_scheduled_tokens)
        # The model runner samples nothing for a chunk that ends before its prompt does.
        sampled = [[] if self.scheduler.requests[r].num_computed_tokens < self.scheduler.requests[r].num_prompt_tokens
                   else [7] for r in req_ids]
        outs = []
        for w in self.workers:  # the model runner's order (kv_connector_model_runner_mixin)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            from vllm.v1.outputs import KVConnectorOutput

            kvo = KVConnectorOutput(
                finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            w.clear_connector_metadata()
            outs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled, kv_connector_output=kvo,
            ))
        out = self.aggregator.aggregate(outs)
        kvo = out.kv_connector_output
        if kvo is not None:
            self.finished_recving |= set(kvo.finished_recving or ())
            self.failed_recving |= set(kvo.failed_recving or ())
            self.finished_sending |= set(kvo.finished_sending or ())
            self.invalid_blocks |= set(kvo.invalid_block_ids or ())
            if kvo.kv_connector_stats is not None:
                self.stats.append(kvo.kv_connector_stats)
        for eco in self.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finished:
                    self.outputs[o.request_id] = o

    def leaks(self) -> dict[str, Any]:
        """What vLLM's own tests check after a run: no requests left, every block back in the pool."""
        s = self.scheduler
        pool = s.kv_cache_manager.block_pool
        return {
            "requests": len(s.requests), "waiting": len(s.waiting), "running": len(s.running),
            "free_blocks": pool.get_num_free_blocks(), "expected_free": pool.num_gpu_blocks - 1,
            "nonzero_refs": sum(1 for b in pool.blocks if b.ref_cnt),
        }

    def expected(self, rank_index: int, seeds: dict[str, tuple[list[int], ...]],
                 num_tokens: dict[str, int] | None = None, computes_from: dict[str, int] | None = None) -> torch.Tensor:
        """Sentinel everywhere but in what each request's load must write (oracle.decode_receives):
        with ``num_tokens`` the token slots the prefill engine's blocks hold (its block size may
        differ), and for a sliding-window group only the window's last cdiv(window, block_size) + 1
        blocks, never a null block; without it, whole blocks. A state (Mamba) group: its running
        state after the prompt tokens this engine counted as computed when it went on from there
        (``computes_from``: those counts where they are not known yet)."""
        rank = self.ranks[rank_index]
        computes_from = self.computes_from if computes_from is None else computes_from
        target = torch.full_like(rank.buffer, oracle.SENTINEL)
        for rid, block_ids in seeds.items():
            gb = []
            for group, g in enumerate(block_ids):
                ids = np.asarray(g, dtype=np.int64)
                holds, first = ids != 0, 0
                if num_tokens is not None and not rank.is_state_group(group) and rank.fixed_blocks(group) is None:
                    # The list ends with the request's last block; vLLM may leave out the null
                    # blocks below a window, so positions are counted from the tail.
                    bs = rank.group_block_size(group)
                    first = -(-num_tokens[rid] // bs) - ids.size
                    assert first >= 0, (rid, group, ids.size)
                    receives = oracle.decode_receives(first + np.arange(ids.size), num_tokens[rid],
                                                      oracle.window_of(rank, group), bs, self.peer_block_sizes[group])
                    holds = holds[:, None] & receives
                gb.append(oracle.GroupBlocks(ids, first, holds))
            has_state = any(rank.is_state_group(g) for g in range(rank.num_groups))
            after = state_seed(rid, computes_from[rid]) if has_state else request_seed(rid)
            _write_split(rank, target, gb, request_seed(rid), after)
        return target

    @functools.cached_property
    def peer_block_sizes(self) -> list[int]:
        """Tokens per block of each KV group on the other engine (vLLM sizes them per TP)."""
        peer = build_rank(self.case.scenario(), "prefill" if self.role == "decode" else "decode", 0)
        return [peer.group_block_size(g) for g in range(peer.num_groups)]

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.scheduler.connector.shutdown()


def _write_split(rank, target: torch.Tensor, blocks: list, token_seed: int, state_seed_: int) -> None:
    """Token groups with one seed, running-state groups with another."""
    empty = oracle.GroupBlocks(np.zeros(0, dtype=np.int64), 0, np.zeros(0, dtype=bool))
    states = [rank.is_state_group(g) for g in range(rank.num_groups)]
    oracle.write_pattern(rank, target, [empty if s else b for b, s in zip(blocks, states)], token_seed)
    if any(states):
        oracle.write_pattern(rank, target, [b if s else empty for b, s in zip(blocks, states)], state_seed_)


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * t) % 900 + 10 for t in range(n)]


def run_prefill(conn, case: PDCase, prompts: dict[str, int], lease_s: float = 30.0, port: int = 0,
                first_prompt: int = 0, extra: dict[str, Any] | None = None, wait_for_go: bool = False) -> None:
    """The prefill engine process: prefill every prompt (``prompt(first_prompt + i, n)``), publish
    kv_transfer_params to the parent, then keep stepping until every consumer notified (or
    ``stop``); report the leak check. ``port``: the side channel's (0: any free one).
    ``wait_for_go``: build the engine, then prefill only when the parent says ``go`` (its decode
    engine is built and waiting), so P's hold starts when a router would forward the decode leg."""
    try:
        engine = PDEngine(case, "prefill", "P",
                          {"side_channel_host": "127.0.0.1", "side_channel_port": port, "lease_s": lease_s, **(extra or {})})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    try:
        if wait_for_go and conn.recv() != "go":
            return
        for i, (rid, n) in enumerate(prompts.items()):
            engine.add(rid, prompt(first_prompt + i, n), 1, {"do_remote_decode": True, "do_remote_prefill": False})
        deadline = time.monotonic() + 60
        while len(engine.outputs) < len(prompts) and time.monotonic() < deadline:
            engine.step()
        conn.send({rid: o.kv_transfer_params for rid, o in engine.outputs.items()})
        while time.monotonic() < deadline:
            engine.step()
            if engine.finished_sending >= set(prompts) and not engine.scheduler.requests:
                break
            if conn.poll(0.002):
                if conn.recv() == "stop":
                    break
        expired = sum(s.reduce()["expired_leases"] for s in engine.stats)
        writes = sum(s.reduce()["push_writes"] for s in engine.stats)
        conn.send({"finished_sending": sorted(engine.finished_sending), "expired_leases": expired,
                   "push_writes": writes, **engine.leaks()})
        conn.recv()  # wait for the parent to say goodbye before tearing NIXL down
    finally:
        engine.close()


def spawn_prefill(case: PDCase, prompts: dict[str, int], new_image: bool = False, **kw):
    """The prefill engine in a separate process (forked from the warm engine-process server:
    vLLM and torch already imported, nothing built), building itself; it prefills when
    :func:`publish` says go. ``new_image``: a spawned interpreter instead, with addresses of its
    own (a restarted engine: see ``engine_process``). Returns the process and its pipe."""
    parent, child = engine_context().Pipe()
    proc = engine_process(run_prefill, (child, case, prompts), {**kw, "wait_for_go": True}, new_image=new_image)
    proc.start()
    return proc, parent


def publish(proc, parent) -> dict[str, dict]:
    """Let a started prefill engine prefill; returns the kv_transfer_params it published."""
    if not parent.poll(0):  # an engine that failed to build has said so already
        try:
            parent.send("go")
        except (BrokenPipeError, OSError):
            pass  # it failed meanwhile: its message is in the pipe
    # A prefill engine of several (stage, TP rank) workers builds them all, with their NIXL agents,
    # before it prefills: on the loaded 2-core machine that took over 180 s (PP 2 x TP 2, 2026-11-28).
    deadline = time.monotonic() + 420
    while not parent.poll(0.2):
        assert proc.is_alive() and time.monotonic() < deadline, "the prefill process published nothing"
    params = parent.recv()
    assert "error" not in params, params
    return params


def start_prefill(case: PDCase, prompts: dict[str, int], **kw):
    """The prefill engine in a separate process (:func:`spawn_prefill`); returns it, its pipe and what it published."""
    proc, parent = spawn_prefill(case, prompts, **kw)
    return proc, parent, publish(proc, parent)


def stop(proc, parent) -> None:
    try:
        parent.send("bye")
    except (BrokenPipeError, OSError):
        pass
    proc.join(15)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def run_decode(d: PDEngine, params: dict[str, dict], prompts: dict[str, int], timeout: float = 60,
               on_report: Callable[[set[str]], None] | None = None) -> None:
    """Step D until every prompt's request finished; ``on_report`` is given the requests each step
    newly reported loaded (finished_recving), before the next step."""
    for i, (rid, n) in enumerate(prompts.items()):
        d.add(rid, prompt(i, n), 2, dict(params[rid]))
    deadline = time.monotonic() + timeout
    reported: set[str] = set()
    while not set(prompts) <= set(d.outputs) and time.monotonic() < deadline:
        d.step()
        new = d.finished_recving - d.failed_recving - reported
        if new and on_report is not None:
            on_report(new)
        reported |= new
        time.sleep(0.001)


def judge_when_reported(d: PDEngine) -> Callable[[set[str]], None]:
    """An ``on_report`` for :func:`run_decode`: the moment D reports requests loaded, every byte of
    every request reported so far is P's on every rank (a load reported before its bytes all
    landed fails here, though they land later); blocks of requests not reported yet are taken as
    they stand."""
    reported: set[str] = set()

    def check(new: set[str]) -> None:
        reported.update(new)
        loaded = {rid: b for rid, b in d.recv_blocks.items() if rid in reported}
        pending = {b for rid, groups in d.recv_blocks.items() if rid not in reported for g in groups for b in g}
        # D has not computed a reported request yet: its state must be the state after what it loaded
        computed = {**d.recv_tokens, **d.computes_from}
        for r in range(len(d.ranks)):
            expected = d.expected(r, loaded, d.recv_tokens, computed)
            keep_blocks(expected, d.ranks[r], pending)
            mismatch = oracle.compare(d.ranks[r], expected)
            assert mismatch is None, f"reported {sorted(new)} loaded before its bytes landed: {mismatch}"

    return check


def assert_failed_not_hung(d: PDEngine, rid: str, timeout_s: float = 30.0) -> None:
    """Step D until ``rid`` finishes: it must, within ``timeout_s``, as a failed load whose blocks
    were reported invalid (its prefill engine is dead)."""
    deadline = time.monotonic() + timeout_s
    while rid not in d.outputs and time.monotonic() < deadline:
        d.step()
        time.sleep(0.002)
    assert rid in d.outputs, "the decode engine hung on a dead prefill engine"
    assert d.failed_recving == {rid}
    assert d.invalid_blocks == set(d.recv_blocks[rid][0])


LOOPBACK_CHANNEL = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}  # any free port


def prefilled(p: PDEngine, rid: str, index: int, tokens: int) -> dict[str, Any]:
    """Prefill ``prompt(index, tokens)`` on the in-process prefill engine ``p`` for a remote
    decode; returns (a copy of) the kv_transfer_params it published."""
    p.add(rid, prompt(index, tokens), 1, {"do_remote_decode": True, "do_remote_prefill": False})
    while rid not in p.outputs:
        p.step()
    return dict(p.outputs[rid].kv_transfer_params)


def step_until(done: Callable[[], bool], engines: Sequence[PDEngine], timeout_s: float, pause_s: float = 0.0) -> bool:
    """Step ``engines`` in turn until ``done()`` or ``timeout_s`` passed; returns ``done()``."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        for engine in engines:
            engine.step()
        if pause_s:
            time.sleep(pause_s)
    return done()


def counted(engine: PDEngine, key: str) -> int:
    """One of an engine's connector counters, summed over its workers."""
    return sum(s.reduce()[key] for s in engine.stats)


def load_from_a_healthy_prefill(d: PDEngine, failed: str, extra: dict[str, Any] | None = None) -> None:
    """After D's request "a" loaded and ``failed`` failed: a fresh prefill engine prefills "c" and D
    loads it byte-exact; "a" is intact, the failed request's blocks hold whatever they hold (vLLM
    treats them as invalid), and neither engine holds a request or block afterwards."""
    healthy = PDEngine(PDCase(), "prefill", "P2", {**LOOPBACK_CHANNEL, **(extra or {})})
    try:
        d.add("c", prompt(2, 40), 2, prefilled(healthy, "c", 2, 40))
        step_until(lambda: "c" in d.outputs and "c" in healthy.finished_sending, (d, healthy), 30)
        assert "c" in d.finished_recving and "c" not in d.failed_recving
        assert healthy.finished_sending == {"c"}
        expected = d.expected(0, {"a": d.recv_blocks["a"], "c": d.recv_blocks["c"]})
        keep_blocks(expected, d.ranks[0], set(d.recv_blocks[failed][0]) - set(d.recv_blocks["c"][0]))
        assert oracle.compare(d.ranks[0], expected) is None
        for engine in (d, healthy):
            assert_no_leaks(engine.leaks(), engine.role)
    finally:
        healthy.close()


def assert_no_leaks(leaks: dict[str, Any], side: str) -> None:
    assert leaks["requests"] == leaks["waiting"] == leaks["running"] == leaks["nonzero_refs"] == 0, (side, leaks)
    assert leaks["free_blocks"] == leaks["expected_free"], (side, leaks)


@dataclass
class PDRun:
    """What a whole P/D run observed, for checks beyond the ones ``run_pd`` makes itself."""

    params: dict[str, dict]
    decode_groups: int
    state_groups: list[int]  # Mamba groups (one running state per request)
    recv_blocks: dict[str, tuple[list[int], ...]]  # D's blocks per request and group
    held_blocks: dict[str, tuple[list[int], ...]]  # D's whole lists at each load (hits and nulls included)
    loaded_tokens: dict[str, int]  # prompt tokens D loaded from P, per loaded request
    computes_from: dict[str, int]  # prompt tokens D counted as computed when it first ran the model
    transfers: dict[str, int]  # D's stats, summed
    prefill_report: dict[str, Any]
    failed: set[str]


def run_pd(case: PDCase, prompts: dict[str, int], fail: set[str] = frozenset(), lease_s: float = 30.0,
           local: set[str] = frozenset(), d_warm: dict[int, int] | None = None, extra: dict[str, Any] | None = None,
           judge_on_report: bool = False) -> PDRun:
    """P (separate process) prefills ``prompts``, D loads them through the connector. Checked here:
    every byte of every D rank against the oracle (requests in ``fail`` must fail and write
    nothing; requests in ``local`` D computes itself, loading nothing), the others received, every
    prefill request freed by notification, no request or block left on either side.
    ``d_warm``: prompt index -> tokens D computes itself first (``prompt(index, tokens)``, the start
    of the P/D prompt of that index), so that vLLM's prefix cache on D holds their whole blocks; the
    model is played on P only, so the oracle expects those blocks untouched. ``extra``: further
    ``kv_connector_extra_config`` keys for both engines. ``judge_on_report``: also judge the bytes
    the moment each load is reported (:func:`judge_when_reported`)."""
    # P builds itself while D does, and prefills only once D is built and warm: P's hold (lease_s)
    # then covers what it covers in serving (the decode leg on its way, D queueing and reading it),
    # not the seconds a loaded machine takes to build a decode engine.
    proc, parent = spawn_prefill(case, prompts, lease_s=lease_s, extra=extra)
    d = None
    try:
        d = PDEngine(case, "decode", "D", {"side_channel_host": "127.0.0.1", "side_channel_port": 0, **(extra or {})})
        for r in d.ranks:
            oracle.fill_decode(r)
        warm = {f"warm-{i}": (i, n) for i, n in (d_warm or {}).items()}
        for rid, (i, n) in warm.items():
            d.add(rid, prompt(i, n), 1, None)
        deadline = time.monotonic() + 60
        while not set(warm) <= set(d.outputs) and time.monotonic() < deadline:
            d.step()
        assert set(warm) <= set(d.outputs), sorted(d.outputs)
        params = publish(proc, parent)
        assert set(params) == set(prompts), params
        run_decode(d, params, prompts, on_report=judge_when_reported(d) if judge_on_report else None)
        assert set(d.outputs) - set(warm) == set(prompts), sorted(d.outputs)
        assert d.finished_recving == set(prompts) - set(local) and d.failed_recving == set(fail), \
            (d.finished_recving, d.failed_recving)
        loaded = {rid: b for rid, b in d.recv_blocks.items() if rid not in fail}
        for r in range(len(d.ranks)):  # every (stage, TP rank)
            mismatch = oracle.compare(d.ranks[r], d.expected(r, loaded, d.recv_tokens))
            assert mismatch is None, str(mismatch)
        assert_no_leaks(d.leaks(), "decode")
        total: dict[str, int] = {}
        for s in d.stats:
            for k, v in s.reduce().items():
                total[k] = total.get(k, 0) + v
        assert parent.poll(60), "the prefill process never reported"
        report = parent.recv()
        assert report["finished_sending"] == sorted(prompts), report
        if not fail:  # every hold ended by D's notification (read or not), none by the lease
            assert report["expired_leases"] == 0, report
        assert_no_leaks(report, "prefill")
        rank = d.ranks[0]
        states = [g for g in range(rank.num_groups) if rank.is_state_group(g)]
        return PDRun(params, rank.num_groups, states, dict(d.recv_blocks), dict(d.held_blocks), dict(d.recv_tokens),
                     dict(d.computes_from), total, report, set(d.failed_recving))
    finally:
        if d is not None:
            d.close()
        stop(proc, parent)


def keep_blocks(expected: torch.Tensor, rank, block_ids: set[int]) -> None:
    """Copy what ``rank`` holds in ``block_ids`` into ``expected`` (blocks a failed load may have
    left in any state: vLLM treats them as invalid and recomputes or fails them)."""
    ids = sorted(block_ids)
    for view in rank.kv_caches.values():
        v8 = view.view(torch.uint8)
        e8 = expected.view(torch.uint8).as_strided(v8.size(), v8.stride(), v8.data_ptr() - rank.buffer.data_ptr())
        e8[ids] = v8[ids]
