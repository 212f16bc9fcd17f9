"""The vLLM KV connector (``NixlkvConnector``) — not implemented yet.

It will be a ``KVConnectorBase_V1`` for vLLM 0.33 running nixlkv's TransferPlan over NIXL:
side-channel handshake carrying each rank's ``RankGeometry``, per-request ``TransferPlan.resolve``
and READs through ``nixlkv.transfer.NixlRank``, notifications freeing P's blocks. Until then it
refuses loudly instead of pretending: use vLLM's own NixlConnector for serving and
``nixlkv explain`` / ``nixlkv rehearse`` to check a P/D pairing.
"""

from __future__ import annotations

from typing import Any

REASON = (
    "nixlkv's vLLM connector is not implemented yet (tracked by the connector issue). "
    "Use vLLM's NixlConnector for serving; `nixlkv explain` and `nixlkv rehearse` check a P/D pairing."
)


class NixlkvConnector:
    """Placeholder so a kv-transfer-config naming it fails at start-up with the reason."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(REASON)
