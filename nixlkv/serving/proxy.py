"""The P/D proxy: one OpenAI endpoint in front of prefill and decode engines.

    python -m nixlkv.serving.proxy --prefill http://P:8100 --decode http://D:8200 --port 8000

For each completion it asks a prefill engine for one token with ``kv_transfer_params``
``{"do_remote_decode": true}`` (P computes the prompt and holds its KV), then sends the original
request to a decode engine with the ``kv_transfer_params`` P returned (D reads the KV and
decodes). A client that hangs up stops both: the engine aborts the request wherever it is.
Both requests carry one ``X-Request-Id`` (the client's, or a new one), so a request's
lines in P's and D's logs share its id (vLLM adds its own suffix inside each engine).
Streaming answers are passed through as they come. Engines are taken in turn, each
kind round-robin, and over every P x D requests every (P, D) pair once (:func:`pairings`), so that
every decode engine meets every prefill engine. An engine the proxy cannot connect to (stopped,
restarting, its host unreachable) never received the request, so the next engine of its kind
takes it; an engine that drops a request it did receive fails that request (502, naming it).
It speaks only the keys vLLM's NixlConnector uses, so it drives either connector.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from aiohttp import (ClientConnectorError, ClientError, ClientResponse, ClientSession, ClientTimeout, ConnectionTimeoutError,
                     TCPConnector, web)

logger = logging.getLogger("nixlkv.proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
UNREACHED = (ClientConnectorError, ConnectionTimeoutError)  # no connection made: the engine never saw the request


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: one token, no stream, one sequence, KV held for a remote
    decode. One sequence: with ``n`` > 1 vLLM would prefill ``n`` children on P and hold every
    child's blocks, but P answers with one child's ``kv_transfer_params``, so the others would stay
    held, read by no decode, until their lease ends (measured: P's KV usage stayed up after an
    ``n=2`` request). D's children share the one prompt's KV (the first loads it, vLLM computes
    the others' from it or anew)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "best_of")}
    out["max_tokens"] = 1
    if "n" in out:
        out["n"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": kv_transfer_params}


def pairings(num_prefill: int, num_decode: int) -> list[tuple[int, int]]:
    """One cycle of (prefill, decode) engine indices: each kind round-robin at every step, and every
    pair exactly once. Two plain round-robins of 2 and 2 would pair P0 with D0 and P1 with D1 for
    ever; here the decode index steps one further after each ``lcm`` requests, which walks every
    pair (the ``gcd`` offsets between the two indices, ``lcm`` pairs each)."""
    cycle = math.lcm(num_prefill, num_decode)
    return [(s % num_prefill, (s + s // cycle) % num_decode) for s in range(num_prefill * num_decode)]


class EngineUnavailable(Exception):
    """A request no engine of a kind answered: ``status`` is what the proxy answers the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @classmethod
    def dropped(cls, kind: str, url: str, exc: BaseException) -> EngineUnavailable:
        """The engine took the request and broke the connection: it may have started it, so the
        request fails (502) rather than go to another engine."""
        return cls(502, f"{kind} engine {url} dropped the request: {type(exc).__name__}: {exc}")


class Proxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill, self.decode = list(prefill), list(decode)
        self._pairs: Iterator[tuple[str, str]] = itertools.cycle(
            [(self.prefill[i], self.decode[j]) for i, j in pairings(len(self.prefill), len(self.decode))])
        self._session: ClientSession | None = None
        self.requests = 0
        self.failures = 0

    async def _start(self, app: web.Application) -> None:
        # A connection per request: an engine closes an idle connection when its keep-alive timeout
        # (vLLM's: 5 s) runs out, and a request sent on one as it closes fails unread.
        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10),
                                      connector=TCPConnector(force_close=True))

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/proxy/stats", self.stats)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "failures": self.failures,
                                  "prefill": self.prefill, "decode": self.decode})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object")
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        headers.setdefault("X-Request-Id", uuid.uuid4().hex)  # one id on P and D, as vLLM's own proxy sends
        if self._session is None:
            return self._error(503, "the proxy is starting")
        p_first, d_first = next(self._pairs)
        try:
            p_url, p_status, p_text = await self._prefill(p_first, request.path, prefill_body(body), headers)
        except EngineUnavailable as exc:
            return self._error(exc.status, str(exc))
        if p_status != 200:
            return self._error(p_status, f"prefill engine {p_url} answered {p_status}: {p_text[:500]}")
        try:
            params = json.loads(p_text).get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return self._error(502, f"prefill engine {p_url} returned no kv_transfer_params (is its "
                                    f"kv_role kv_producer and its connector NIXL-compatible?)")
        try:  # any decode engine can read P's KV: the params name P, not the reader
            d_url, d = await self._connect("decode", d_first, request.path, decode_body(body, params), headers)
        except EngineUnavailable as exc:
            return self._error(exc.status, str(exc))
        async with d:
            if not body.get("stream"):
                try:
                    data = await d.read()
                except ClientError as exc:
                    dropped = EngineUnavailable.dropped("decode", d_url, exc)
                    return self._error(dropped.status, str(dropped))
                if d.status != 200:
                    self.failures += 1
                return web.Response(body=data, status=d.status, content_type=d.content_type)
            out = web.StreamResponse(status=d.status, headers={"Content-Type": d.headers.get("Content-Type", "text/event-stream")})
            await out.prepare(request)
            async for chunk in d.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def _prefill(self, first: str, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[str, int, str]:
        """P's whole answer: (engine, status, text)."""
        url, p = await self._connect("prefill", first, path, body, headers)
        async with p:
            try:
                return url, p.status, await p.text()
            except ClientError as exc:
                raise EngineUnavailable.dropped("prefill", url, exc) from exc

    async def _connect(self, kind: str, first: str, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[str, ClientResponse]:
        """The response of ``first``, or, where no connection to it could be made, of the next engine
        of its kind in turn (the request reached none of those). EngineUnavailable: 503 naming every
        engine tried when none could be reached, or :meth:`EngineUnavailable.dropped`."""
        engines = self.prefill if kind == "prefill" else self.decode
        start = engines.index(first)
        tried = []
        for url in engines[start:] + engines[:start]:
            try:
                return url, await self._session.post(f"{url}{path}", json=body, headers=headers)  # type: ignore[union-attr]
            except UNREACHED as exc:
                tried.append(f"{url} ({exc})")
                logger.warning("nixlkv proxy: %s engine %s unreachable (%s)", kind, url, exc)
            except ClientError as exc:
                raise EngineUnavailable.dropped(kind, url, exc) from exc
        raise EngineUnavailable(503, f"no {kind} engine reachable: {'; '.join(tried)}")

    def _error(self, status: int, message: str) -> web.Response:
        self.failures += 1
        logger.warning("nixlkv proxy: %s", message)
        return web.json_response({"error": {"message": message, "code": status}}, status=status)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nixlkv-proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="prefill engine URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="decode engine URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8000)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # a client that hangs up cancels its handler, which closes the upstream request: the engine then
    # aborts it (P prefilling, D loading or decoding) instead of computing for nobody
    web.run_app(Proxy(args.prefill, args.decode).app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
