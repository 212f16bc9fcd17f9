"""The NIXL transport: the only code that talks to NIXL.

- :mod:`.agents`: builds NIXL agents (with the progress-thread pause NIXL's Python wrapper lacks).
- :mod:`.nixl_rank`: :class:`~.nixl_rank.NixlRank` registers a rank's memory, prepares a plan's
  descriptor lists once and posts each request's READs and notifications.
- :mod:`.reader`: :class:`~.reader.Reader` posts a request in a descriptor mode (direct, staged
  through a buffer it owns, or auto); the staged layout itself is :mod:`nixlkv.core.staging`.

It stands above :mod:`nixlkv.core` and below :mod:`nixlkv.vllm` (the connector's worker) and the
test kit's rehearsal. NIXL and torch are imported here, never in the core.
"""
