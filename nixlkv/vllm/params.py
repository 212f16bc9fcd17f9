"""``kv_transfer_params``: the one place they are read and checked.

They arrive with each request from a client, a proxy or a router: any JSON. A malformed value
must never raise out of a scheduler hook, never be read as something else ("false" as true, a
string of digits as a list of block ids), and never make D read blocks it should not. Each value
is checked strictly here (msgspec, no coercion), and a request whose params do not pass is
served without a transfer (D computes its prompt; P frees its blocks as for a plain request),
with one log line naming the field.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from ..core.topology import MAX_TP_SIZE

# nixlkv's own keys beside vLLM NixlConnector's (optional; a proxy forwards kv_transfer_params whole).
GENERATION_KEY = "remote_generation"  # liveness.engine_generation of the P that prefilled
LEASE_KEY = "remote_lease_s"  # how long that P holds the blocks without news from D
# when that hold ends at the latest without news from D, in Unix seconds on P's clock: D's own
# count from its arrival cannot see a decode leg delayed on its way (a router queueing it)
HELD_UNTIL_KEY = "remote_held_until"
MAX_UNIX_S = 1e11  # a time after the year 5000 is no clock's reading
MAX_BLOCK_ID = 2**31 - 1
NULL_BLOCK_ID = 0  # vLLM's null block: the placeholder of a window's dropped blocks, repeated freely
MAX_LEASE_S = 86400.0  # a day: a lease is how long P holds blocks unread; an endless one leaks them
_PRINTABLE = r"^[^\s\x00-\x1f\x7f]+\Z"  # no whitespace, no control characters
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=1024, pattern=_PRINTABLE)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]


class ParamsError(ValueError):
    """kv_transfer_params that cannot be used; the message names the field."""


class _Flags(msgspec.Struct):
    do_remote_prefill: bool | None = None
    do_remote_decode: bool | None = None


class _Remote(msgspec.Struct):
    remote_engine_id: Id
    remote_request_id: Id
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    remote_block_ids: list[Any]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)] | None = None
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] | None = None
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_S)] | None = msgspec.field(default=None, name=LEASE_KEY)
    generation: Id | None = msgspec.field(default=None, name=GENERATION_KEY)
    held_until: Annotated[float, msgspec.Meta(gt=0, le=MAX_UNIX_S)] | None = msgspec.field(default=None, name=HELD_UNTIL_KEY)


@dataclass(frozen=True)
class RemoteParams:
    """What D needs to read a request from P, checked."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[list[int], ...]  # per KV group
    tp_size: int | None
    num_tokens: int | None
    lease_s: float | None
    generation: str | None
    held_until: float | None = None  # P's hold ends by then (Unix seconds, P's clock) without news from D


def _convert(value: Any, typ: Any, what: str) -> Any:
    try:
        return msgspec.convert(value, typ, strict=True)
    except msgspec.ValidationError as exc:
        raise ParamsError(f"kv_transfer_params{what}: {exc}") from None


def flags(params: Any) -> tuple[bool, bool]:
    """(do_remote_prefill, do_remote_decode); absent or null is False, anything but a bool refused."""
    if params is None:
        return False, False
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    f = _convert(params, _Flags, "")
    return bool(f.do_remote_prefill), bool(f.do_remote_decode)


def remote(params: Any) -> RemoteParams:
    """The remote fields D reads a request with (ParamsError naming the field)."""
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    r = _convert(params, _Remote, "")
    return RemoteParams(
        engine_id=r.remote_engine_id, request_id=r.remote_request_id, host=_host(r.remote_host),
        port=r.remote_port, block_ids=block_groups(r.remote_block_ids), tp_size=r.tp_size,
        num_tokens=r.remote_num_tokens, lease_s=r.lease_s, generation=r.generation, held_until=r.held_until,
    )


def _host(host: str) -> str:
    """A host name or an IP address, nothing else (no port, no spaces, no scheme)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return bare
    except ValueError:
        pass
    if _HOSTNAME.fullmatch(host):
        return host
    raise ParamsError(
        f"kv_transfer_params remote_host must be a host name or an IP address (no port, spaces or scheme), got {host!r}"
    )


def block_groups(ids: Any) -> tuple[list[int], ...]:
    """Block ids per KV group, from vLLM's per-group lists or its single-group flat list: ints
    only, none but the null block repeated within a group (D would fill several of its blocks
    from one of P's)."""
    if not isinstance(ids, (list, tuple)):
        raise ParamsError(f"kv_transfer_params remote_block_ids must be a list, got {type(ids).__name__}")
    nested = bool(ids) and isinstance(ids[0], (list, tuple))
    if nested:
        groups = _convert(ids, list[list[BlockId]], " remote_block_ids")
    else:
        groups = [_convert(ids, list[BlockId], " remote_block_ids")]
    for i, g in enumerate(groups):
        real = np.asarray(g, dtype=np.int64)
        real = real[real != NULL_BLOCK_ID]
        if np.unique(real).size != real.size:
            raise ParamsError(f"kv_transfer_params remote_block_ids: group {i} names a block twice")
    return tuple(groups)
