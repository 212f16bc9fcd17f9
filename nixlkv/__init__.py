"""nixlkv: KV-cache transfer plans for disaggregated vLLM serving over NIXL.

One strategy plugin per KV-cache spec type answers geometry questions; the engine-agnostic
core (:mod:`nixlkv.core`) merges the answers into one validated :class:`TransferPlan` per
(local rank, remote engine); the connector and the rehearsal execute it with NIXL.
"""

__version__ = "0.1.0"
