"""A small OpenAI-completions client (stdlib only) and a Prometheus text reader.

Prompts are token ids, so their lengths are exact (1 token, a block minus one...), and answers
come back as token ids with their logprobs and top alternatives: the serving check compares
those, never decoded text.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOP_LOGPROBS = 5  # the chosen token and its runners-up: enough to tell a near-tie from a wrong KV


class CompletionError(RuntimeError):
    """The server answered with an error status; ``status`` and ``body`` say what it said."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} answered {status}: {body[:400]}")
        self.status, self.body = status, body


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[dict[int, float]]  # per position: token id -> logprob of the top alternatives
    total_s: float
    ttft_s: float | None = None  # streamed answers only: request sent -> first token received
    kv_transfer_params: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def _token_id(key: str) -> int:
    # return_tokens_as_token_ids renders tokens as "token_id:123"
    return int(key.rsplit(":", 1)[1]) if key.startswith("token_id:") else -1


def request_body(model: str, prompt: list[int], max_tokens: int, *, stream: bool = False,
                 kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True, "return_token_ids": True,
        "ignore_eos": True, "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def _post(url: str, body: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise CompletionError(url, exc.code, exc.read().decode(errors="replace")) from None


def _absorb(choice: dict[str, Any], ids: list[int], lps: list[float], top: list[dict[int, float]]) -> None:
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    chosen = [_token_id(t) for t in tokens]
    if choice.get("token_ids") is not None:
        chosen = [int(t) for t in choice["token_ids"]]
    ids.extend(chosen)
    lps.extend(float(x) for x in (lp.get("token_logprobs") or []))
    for alts in lp.get("top_logprobs") or []:
        top.append({_token_id(k): float(v) for k, v in (alts or {}).items()})


def complete(base_url: str, model: str, prompt: list[int], max_tokens: int, *, stream: bool = False,
             kv_transfer_params: dict[str, Any] | None = None, timeout_s: float = 300.0,
             headers: dict[str, str] | None = None) -> Completion:
    """One completion of ``prompt`` (token ids), greedy, with logprobs; streamed if asked (for TTFT).
    ``headers``: further request headers (an ``X-Request-Id`` names the request in the engines)."""
    url = f"{base_url}/v1/completions"
    body = request_body(model, prompt, max_tokens, stream=stream, kv_transfer_params=kv_transfer_params)
    return _exchange(url, body, stream, _absorb, timeout_s, headers)


def forced(base_url: str, model: str, prompt: list[int], answer: list[int], *, timeout_s: float = 300.0) -> Completion:
    """The engine teacher-forced on ``answer``: given ``prompt`` plus the answer's tokens, its logprob
    of each answer token and its top alternatives at each position (``token_ids`` are the answer's).
    The drift judge reads an answer that parted from the engine's own on this path (nixlkv.serving.
    compare). One request: ``prompt_logprobs`` over prompt + answer but its last token (so it fits
    wherever the answer did), whose position is the one generated token's top list; a token the
    engine ranked below its top list gets -inf. vLLM reads no prefix cache for such a request: the
    engine computes all of it."""
    url = f"{base_url}/v1/completions"
    if not answer:
        return Completion([], [], [], 0.0)
    body = {**request_body(model, list(prompt) + list(answer[:-1]), 1), "prompt_logprobs": TOP_LOGPROBS}
    t0 = time.perf_counter()
    with _post(url, body, timeout_s) as resp:
        raw = json.loads(resp.read())
    choice = raw["choices"][0]
    given = choice.get("prompt_logprobs")
    asked = len(prompt) + len(answer) - 1
    if not isinstance(given, list) or len(given) != asked:
        raise CompletionError(url, 200, f"no prompt_logprobs for {asked} tokens: {str(given)[:200]}")
    top = [{int(k): float(v["logprob"]) for k, v in (entry or {}).items()} for entry in given[len(prompt):]]
    ids: list[int] = []
    last: list[dict[int, float]] = []
    _absorb(choice, ids, [], last)
    top.append(last[0] if last else {})
    lps = [alts.get(t, float("-inf")) for alts, t in zip(top, answer)]
    return Completion(list(answer), lps, top, time.perf_counter() - t0, raw=raw)


Absorb = Callable[[dict[str, Any], list[int], list[float], list[dict[int, float]]], None]


def _exchange(url: str, body: dict[str, Any], stream: bool, absorb: Absorb, timeout_s: float,
              headers: dict[str, str] | None = None) -> Completion:
    """Post ``body`` and read the answer, whole or streamed (server-sent events), each choice read
    by ``absorb`` into token ids, logprobs and top alternatives; TTFT where streamed."""
    ids: list[int] = []
    lps: list[float] = []
    top: list[dict[int, float]] = []
    t0 = time.perf_counter()
    ttft = None
    raw: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    with _post(url, body, timeout_s, headers) as resp:
        if not stream:
            raw = json.loads(resp.read())
            absorb(raw["choices"][0], ids, lps, top)
            usage = raw.get("usage") or {}
        else:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise CompletionError(url, 500, json.dumps(chunk["error"]))
                for choice in chunk.get("choices") or []:
                    before = len(ids)
                    absorb(choice, ids, lps, top)
                    if ttft is None and len(ids) > before:
                        ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
                raw = chunk
    return Completion(ids, lps, top, time.perf_counter() - t0, ttft, raw.get("kv_transfer_params"),
                      usage.get("prompt_tokens"), raw)


def _absorb_chat(choice: dict[str, Any], ids: list[int], lps: list[float], top: list[dict[int, float]]) -> None:
    """A chat choice (or streamed chunk's choice): its tokens are ``logprobs.content`` entries."""
    for entry in (choice.get("logprobs") or {}).get("content") or []:
        ids.append(_token_id(entry.get("token", "")))
        lps.append(float(entry.get("logprob", 0.0)))
        top.append({_token_id(a["token"]): float(a["logprob"]) for a in entry.get("top_logprobs") or []})


def chat(base_url: str, model: str, messages: list[dict[str, str]], max_tokens: int, *, stream: bool = False,
         timeout_s: float = 300.0) -> Completion:
    """One chat completion (``/v1/chat/completions``, the API most clients speak), greedy, with
    logprobs as token ids, like :func:`complete`; ``prompt_tokens`` from its usage."""
    url = f"{base_url}/v1/chat/completions"
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
        "top_logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True, "ignore_eos": True, "stream": stream,
        "return_token_ids": True,  # the rendered prompt's ids come back: a teacher-forced reference asks with them
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return _exchange(url, body, stream, _absorb_chat, timeout_s)


def sample_n(base_url: str, model: str, prompt: list[int], max_tokens: int, n: int, seed: int,
             timeout_s: float = 300.0) -> list[list[int]]:
    """``n`` seeded samples of ``prompt`` (temperature 1; vLLM seeds the children from ``seed``), as
    token-id lists in choice order: the same on any engine that holds the same KV."""
    body = {**request_body(model, prompt, max_tokens), "temperature": 1.0, "n": n, "seed": seed}
    del body["logprobs"]
    with _post(f"{base_url}/v1/completions", body, timeout_s) as resp:
        raw = json.loads(resp.read())
    choices = sorted(raw["choices"], key=lambda c: c.get("index", 0))
    return [[int(t) for t in c.get("token_ids") or []] for c in choices]


def reset_prefix_cache(base_url: str, tries: int = 20, timeout_s: float = 10.0) -> None:
    """Empty an engine's local prefix cache (vLLM's dev-mode ``POST /reset_prefix_cache``, served
    when the engine runs with ``VLLM_SERVER_DEV_MODE=1``). vLLM refuses while blocks are still
    held (a request finishing): retried, then an error."""
    url = f"{base_url}/reset_prefix_cache"
    for _ in range(tries):
        with _post(url, {}, timeout_s) as resp:
            if json.loads(resp.read() or b"{}").get("success", False):
                return
        time.sleep(0.1)
    raise CompletionError(url, 409, f"the prefix cache was not reset after {tries} tries (blocks still held)")


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
IGNORED_LABELS = ("engine", "model_name")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value,...}": value}, summed over the engine/model labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        kept = sorted((k, v) for k, v in _LABEL.findall(labels) if k not in IGNORED_LABELS)
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in kept) + "}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as resp:
        return parse_metrics(resp.read().decode(errors="replace"))


def kv_usage(base_url: str) -> float:
    """An engine's own ``vllm:kv_cache_usage_perc`` (NaN where it does not report one)."""
    return scrape(base_url).get("vllm:kv_cache_usage_perc", float("nan"))


def settled_kv_usage(base_url: str, timeout_s: float = 20.0, poll_s: float = 0.5) -> float:
    """An engine's KV usage once its finished requests are freed (polled: frees are asynchronous,
    P's on D's notification)."""
    deadline = time.monotonic() + timeout_s
    usage = kv_usage(base_url)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(poll_s)
        usage = kv_usage(base_url)
    return usage


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
