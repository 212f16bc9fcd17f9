"""Scheduler side of pull-mode P/D: which requests to read (D), which blocks to hold (P), the side channel.

Decode (D): a request arriving with ``do_remote_prefill`` and the remote keys gets the prompt
tokens P holds reported as matched remote tokens, loaded asynchronously; after allocation its
unhashed block ids and the remote's are handed to the workers in the next step's metadata.
Prefill (P): a request finishing with ``do_remote_decode`` keeps its blocks (``request_finished``
returns True) and publishes kv_transfer_params under the keys vLLM's NixlConnector uses; the
workers report it as sent once every consumer notified, or its lease expired.
Trailing tokens D computes itself (:func:`decode_recomputes`): a model with a running state
(Mamba, GDN) must not have its last prompt token applied twice, so P prefills the prompt without
its last ``k`` tokens (:func:`stop_short`), publishes how many tokens it holds
(``remote_num_tokens``), and D claims exactly those and computes the rest (:func:`tokens_to_load`).
With ``k = 0`` (attention only) D claims the whole prompt, as before.
Heartbeats (D): every request waiting for remote KV, from its arrival until its load finished,
is named in a heartbeat to its P every ``heartbeat_interval_s`` (sent by the workers), so P
keeps its blocks however long D queues it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import msgspec

from .config import ConnectorConfig
from . import damage
from .handshake import HeldReply, SideChannelServer
from .kvdump import DumpOrder, write_expectation
from .metadata import (
    LeaseView, NixlkvMetadata, RecvRequest, RemoteKey, block_id_groups, lease_view, recv_from_params,
)
from .params import GENERATION_KEY, HELD_UNTIL_KEY, LEASE_KEY, ParamsError, RemoteParams, flags, remote

logger = logging.getLogger("nixlkv.connector")

# D: prefill requests remembered as read (engine id, request id -> the decode request reading them);
# the oldest forgotten beyond this, long after P freed them (a lease is seconds, this is hours of requests)
READ_ONCE_MEMORY = 1 << 16


def decode_recomputes(vllm_config: Any, kv_cache_config: Any, dispatcher: Any) -> int:
    """Trailing prompt tokens this model's decode engine must compute itself: what its layers'
    strategies declare (a running state: 1), and at least a multi-module MTP drafter's lookahead
    less one (vLLM's ``num_prefill_lookahead_tokens``: P would otherwise write the drafter's
    unverified guesses into the MTP layers' KV, which D never rewrites)."""
    layers = [(g.kv_cache_spec, name) for g in kv_cache_config.kv_cache_groups for name in g.layer_names]
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    return max(dispatcher.decode_recomputes(layers), lookahead - 1)


def stop_short(request: Any, k: int) -> bool:
    """P: make ``request`` the prefill of its prompt without the last ``k`` tokens, so the KV
    and states P publishes are the ones D needs; False (left whole) when it cannot or need not.

    Left whole: nothing to hold back (``k`` 0, or a prompt of ``k`` tokens or fewer, which D
    computes itself); a request that skips the prefix cache (prompt logprobs: P needs the whole
    prompt, and D, asked the same, loads nothing); a resumable (streaming-input) session; a
    multimodal input reaching into the held-back tokens (it cannot be cut). The cut is made once,
    at arrival: preemption recomputes the shortened request, never cuts again. P samples one
    token (``max_tokens`` 1, from the wrong position: the proxy discards it), because each further
    token would advance its state past what it publishes.
    """
    keep = int(request.num_prompt_tokens) - k
    if k <= 0 or keep <= 0:
        return False
    if getattr(request, "skip_reading_prefix_cache", False) or getattr(request, "resumable", False):
        return False
    for feature in getattr(request, "mm_features", None) or ():
        pos = getattr(feature, "mm_position", None)
        if pos is None or pos.offset + pos.length > keep:
            return False
    if request.prompt_token_ids is not None:
        request.prompt_token_ids = list(request.prompt_token_ids[:keep])  # a new list: the caller's stays whole
    elif request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:keep]
    else:
        return False
    if getattr(request, "prompt_is_token_ids", None) is not None:
        request.prompt_is_token_ids = request.prompt_is_token_ids[:keep]
    del request._all_token_ids[keep:]  # in place: all_token_ids is a read-only view of this list
    request.num_prompt_tokens = keep
    request.max_tokens = 1
    # The block hashes were computed for the whole prompt: make them the shortened prompt's.
    del request.block_hashes[:]
    request.update_block_hashes()
    return True


def tokens_to_load(num_prompt_tokens: int, k: int, remote_tokens: int | None) -> int | None:
    """D: how many leading prompt tokens to take from P, or None to compute the prompt here.

    ``k`` 0: the whole prompt (P holds it). Otherwise P's count (``remote_num_tokens``), and only
    if it leaves at least ``k`` tokens for D: a state after more tokens already holds tokens D
    computes again, and cannot be taken back. P leaves prompts of ``k`` tokens or fewer whole, so
    D computes those (P's blocks are freed by a notification)."""
    if k == 0:
        return num_prompt_tokens
    if remote_tokens is None or remote_tokens > num_prompt_tokens - k:
        return None
    return remote_tokens


class NixlkvScheduler:
    def __init__(self, vllm_config: Any, engine_id: str, config: ConnectorConfig, compat: str,
                 kv_cache_config: Any) -> None:
        self.engine_id = engine_id
        self.config = config
        self.compat = compat
        # Trailing prompt tokens D computes itself (P stops that many short); 0: attention only.
        self.recompute = decode_recomputes(vllm_config, kv_cache_config, config.dispatcher())
        if self.recompute:
            logger.info("nixlkv engine=%s: the decode engine computes the last %d prompt token(s) itself; "
                        "the prefill engine stops short of them", engine_id, self.recompute)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        self.side_channel_host = config.side_channel_host
        self.side_channel_port = config.side_channel_port + int(getattr(parallel, "data_parallel_index", 0) or 0)
        self._recv: dict[str, RecvRequest] = {}
        self._send: dict[str, float] = {}
        self._dump: dict[str, DumpOrder] = {}  # with dump_kv_dir: the blocks to write down (P) or once loaded (D)
        self._damage = damage.enabled()  # the graded controls' test hook (off unless its variable is set)
        self._server: SideChannelServer | None = None
        self._reply: bytes = b""
        self.generation: str | None = None  # this engine's, published to consumers
        # D: request waiting for remote KV -> (its checked params, its arrival on this scheduler's clock)
        self._awaiting: dict[str, tuple[RemoteParams, float]] = {}
        self._last_heartbeat = float("-inf")
        self._short: set[str] = set()  # P: requests whose prompt stop_short cut, until they finish
        # D: request -> the tokens of its prompt D's own prefix cache held when it claimed the rest
        # from P (its blocks are not read; the claimed ones follow them)
        self._local_hit: dict[str, int] = {}
        # D: which decode request reads each prefill request's blocks. P frees them on the first
        # reader's notification, so a second request naming them (vLLM's n > 1 children, params
        # sent again) computes its prompt here rather than read blocks P may have reused.
        self._read_by: OrderedDict[tuple[str, str], str] = OrderedDict()
        # D with its own prefix cache: readers whose load is under way. Another request naming the
        # same prefill request waits for it (vLLM asks again next step), then finds the loaded
        # blocks in D's prefix cache, rather than compute the whole prompt again.
        self._share_loads = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        self._loading: set[str] = set()
        self._invalid: set[str] = set()  # requests whose kv_transfer_params were refused (logged once)
        self._held: set[str] = set()  # P in push mode: requests whose blocks are held until sent

    # ------------------------------------------------------------------ side channel
    def serve_handshake(self, reply: bytes, generation: str | None = None) -> None:
        """Serve this engine's handshake reply (all ranks) on the side channel."""
        self._reply = reply
        self.generation = generation
        if self._server is None:
            self._server = SideChannelServer(self.side_channel_host, self.side_channel_port, lambda: self._reply,
                                             self._held_reply)
            self.side_channel_port = self._server.port
            logger.info("nixlkv side channel engine=%s listening on %s", self.engine_id, self._server.endpoint)

    # ------------------------------------------------------------------ arrival (both), decode side
    def on_new_request(self, request: Any) -> None:
        """P: stop a prefill for a remote decode short of what D computes itself. D: start
        heartbeating for a request that will read from a remote engine."""
        prefill, decode = self._flags(request)
        if request.request_id in self._invalid:
            # Served as a plain request: vLLM's own scheduler reads these params next (``.get``).
            request.kv_transfer_params = None
            self._invalid.discard(request.request_id)
            return
        if decode and not prefill:
            # Cut once: a request seen again (vLLM calls this at arrival only) keeps its cut prompt.
            if request.request_id not in self._short and stop_short(request, self.recompute):
                self._short.add(request.request_id)
                logger.debug("nixlkv req=%s prefills %d of its prompt tokens; decode computes the last %d",
                             request.request_id, request.num_prompt_tokens, self.recompute)
            return
        if not prefill:
            return
        try:
            r = remote(request.kv_transfer_params)
        except ParamsError:
            return  # get_num_new_matched_tokens logs it and prefills locally
        self._awaiting[request.request_id] = (r, time.monotonic())

    def _flags(self, request: Any) -> tuple[bool, bool]:
        """(do_remote_prefill, do_remote_decode) of a request; params that do not pass count as
        neither (the request is served without a transfer), logged once per request."""
        try:
            return flags(request.kv_transfer_params)
        except ParamsError as exc:
            if request.request_id not in self._invalid:
                self._invalid.add(request.request_id)
                logger.warning("nixlkv serves %s without a transfer: invalid kv_transfer_params: %s",
                               request.request_id, exc)
            return False, False

    def _reader(self, key: tuple[str, str], rid: str) -> str:
        """The decode request that reads prefill request ``key``'s blocks: ``rid`` unless another
        named it first (remembered for the last READ_ONCE_MEMORY prefill requests)."""
        reader = self._read_by.setdefault(key, rid)
        if len(self._read_by) > READ_ONCE_MEMORY:
            self._read_by.popitem(last=False)
        return reader

    def update_connector_output(self, finished_recving: Any, finished_sending: Any = ()) -> None:
        for rid in finished_recving or ():  # loaded or failed
            self._awaiting.pop(rid, None)
            self._loading.discard(rid)
        for rid in finished_sending or ():
            self._held.discard(rid)

    def _held_reply(self, ids: tuple[str, ...]) -> bytes:
        """P, on the side-channel thread: which of ``ids`` are still held for a push. A request
        leaves the set only once every worker freed it, which a worker does only with no WRITE of it
        in flight, and a freed request is never written: so "not held" is final."""
        held = self._held
        return msgspec.msgpack.encode(HeldReply(self.engine_id, [rid in held for rid in ids]))

    def holds_for_push(self) -> bool:
        """P in push mode: blocks held for a decode engine to order written (the engine keeps stepping)."""
        return bool(self._held)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self._flags(request)[0]:
            try:  # claim remote tokens only for a request a worker can read (or fail) later
                recv = recv_from_params(params, (), report=False)
            except (ValueError, TypeError) as exc:
                logger.warning("nixlkv prefills %s locally: invalid kv_transfer_params: %s", request.request_id, exc)
                params["do_remote_prefill"] = False
                self._awaiting.pop(request.request_id, None)
                return 0, False
            key = (recv.remote_engine_id, recv.remote_request_id)
            reader = self._reader(key, request.request_id)
            if reader != request.request_id:
                if reader in self._loading:  # its blocks will be in D's prefix cache: ask again next step
                    return None, False
                if self._share_loads:
                    logger.info("nixlkv reads nothing for %s: its kv_transfer_params name prefill request %s of "
                                "engine %s, which request %s loaded (n > 1, or the params sent twice); D's prefix "
                                "cache gives it what it still holds", request.request_id, key[1], key[0], reader)
                else:
                    logger.warning("nixlkv computes %s's prompt here: its kv_transfer_params name prefill request %s "
                                   "of engine %s, which request %s reads (n > 1, or the params sent twice); a "
                                   "prefill request's blocks are read once", request.request_id, key[1], key[0], reader)
                params["do_remote_prefill"] = False  # nothing to read, and P is told by its reader
                self._awaiting.pop(request.request_id, None)
                return 0, False
            num_prompt = len(request.prompt_token_ids or ())
            target = tokens_to_load(num_prompt, self.recompute, recv.remote_num_tokens)
            if target is None:
                # Nothing P holds can be used; update_state_after_alloc (0 tokens) still tells P to free.
                log = logger.warning if num_prompt > self.recompute else logger.debug
                log("nixlkv computes %s's prompt here: it must compute the last %d of its %d tokens itself, but "
                    "the prefill engine holds %s tokens", request.request_id, self.recompute, num_prompt,
                    "an unknown number of" if recv.remote_num_tokens is None else recv.remote_num_tokens)
                return 0, False
            count = target - num_computed_tokens
            if count > 0:
                self._local_hit[request.request_id] = num_computed_tokens
                if self._share_loads:
                    self._loading.add(request.request_id)
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not self._flags(request)[0]:
            return
        # The blocks vLLM just allocated (those its prefix cache did not hold): the tail of the
        # request's list, after the local hit get_num_new_matched_tokens was given. The token count
        # the lists describe is that hit plus the claimed tokens; not request.num_computed_tokens,
        # which vLLM sets only after this call, or before it where it defers the load.
        hit = self._local_hit.pop(request.request_id, 0)
        local = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else ()
        if num_external_tokens <= 0:
            self._awaiting.pop(request.request_id, None)
            self._loading.discard(request.request_id)
        awaiting = self._awaiting.get(request.request_id)
        try:
            # A full local prefix hit (nothing to read) still notifies P so it frees its blocks.
            recv = recv_from_params(
                params, local, report=num_external_tokens > 0, arrived=awaiting[1] if awaiting else None,
                num_tokens=hit + num_external_tokens, now=time.monotonic(),
            )
            self._recv[request.request_id] = recv
        except (ValueError, TypeError) as exc:
            logger.warning("nixlkv ignores invalid kv_transfer_params of %s: %s", request.request_id, exc)
        else:
            if self._damage:
                try:
                    recv.damage = damage.requested(params)
                except ValueError as exc:  # a test's typo: the control is not applied, and its check fails
                    logger.warning("nixlkv applies no control to %s: %s", request.request_id, exc)
            if num_external_tokens > 0 and self.config.dump_kv_dir:
                self._expect_dump(request.request_id, recv.remote_request_id, blocks, hit + num_external_tokens, hit)
        params["do_remote_prefill"] = False  # one transfer per request

    # ------------------------------------------------------------------ both
    def _expect_dump(self, rid: str, prefill_rid: str, blocks: Any, num_tokens: int, hit: int) -> None:
        """D with dump_kv_dir: a claimed load, noted for the judge, and its dump ordered: the request's
        whole block table as vLLM's KV manager holds it (``blocks.get_block_ids()``, prefix hit
        included; never the connector's own ids), written by each worker when its READs complete,
        before any forward pass of the request."""
        self._dump[rid] = DumpOrder("decode", prefill_rid, tuple(list(g) for g in blocks.get_block_ids()),
                                    num_tokens, local_hit=hit)
        try:
            write_expectation(self.config.dump_kv_dir, prefill_rid, self.engine_id, rid, self.tp_size)
        except OSError as exc:
            logger.warning("nixlkv could not note the load of req=%s in %s: %s", rid, self.config.dump_kv_dir, exc)

    def build_connector_meta(self, scheduler_output: Any) -> NixlkvMetadata:
        meta = NixlkvMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send, reqs_to_dump=self._dump,
                              heartbeats=self._due_heartbeats())
        self._recv, self._send, self._dump = {}, {}, {}
        return meta

    def _due_heartbeats(self) -> dict[RemoteKey, dict[str, LeaseView | None]]:
        interval = self.config.heartbeat_interval_s
        if not interval or not self._awaiting:
            return {}
        # A P whose lease is shorter than the interval would free the blocks between heartbeats:
        # beat at least three times per the shortest lease D waits under.
        leases = [r.lease_s for r, _ in self._awaiting.values() if r.lease_s is not None]
        if leases:
            interval = min(interval, min(leases) / 3)
        now = time.monotonic()
        if now - self._last_heartbeat < interval:
            return {}
        self._last_heartbeat = now
        wall_now = time.time()
        out: dict[RemoteKey, dict[str, LeaseView | None]] = {}
        for r, arrived in self._awaiting.values():
            out.setdefault((r.engine_id, r.host, r.port), {})[r.request_id] = lease_view(
                r.lease_s, arrived, now, r.held_until, wall_now)
        return out

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        prefill, decode = self._flags(request)
        self._invalid.discard(rid)
        self._awaiting.pop(rid, None)
        self._short.discard(rid)
        self._local_hit.pop(rid, None)
        self._loading.discard(rid)
        if not (prefill or decode):
            return False, None
        if prefill:
            # D: finished (aborted) before allocation; tell P to free its blocks, read nothing, unless
            # another request reads them (P frees them on that one's notification, not before).
            try:
                recv = recv_from_params(params, (), report=False)
                if self._reader((recv.remote_engine_id, recv.remote_request_id), rid) == rid:
                    self._recv[rid] = recv
            except (ValueError, TypeError):
                pass
            params["do_remote_prefill"] = False
            return False, None
        if not decode:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: blocks free now, nothing published
        groups = [list(g) for g in block_id_groups(block_ids)]
        hold = any(len(g) for g in groups)
        if hold:
            self._send[rid] = self.config.lease_s
            if self.config.transfer_mode == "push":
                self._held.add(rid)
            if self.config.dump_kv_dir:
                self._dump[rid] = DumpOrder("prefill", rid, tuple(groups), int(request.num_computed_tokens))
        return hold, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": self.tp_size,
            "remote_num_tokens": int(request.num_computed_tokens),
            LEASE_KEY: self.config.lease_s,
            # the hold starts when a worker is handed the request (the next step): it ends later
            HELD_UNTIL_KEY: time.time() + self.config.lease_s,
            **({GENERATION_KEY: self.generation} if self.generation else {}),
        }

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


