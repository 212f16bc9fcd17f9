"""One exception hierarchy. Every message names the offending field and says what would work."""

from __future__ import annotations


class NixlkvError(Exception):
    """Base of every error nixlkv raises on purpose."""


class RegistryError(NixlkvError):
    """Strategy registration or lookup failed (conflicts, unknown names, missing strategies)."""


class StrategyConflict(RegistryError):
    """Two strategies claim the same spec type and neither declares that it overrides the other."""


class NoStrategyError(RegistryError):
    """A spec type has no strategy along its MRO."""


class PlanError(NixlkvError):
    """A transfer plan cannot be built for this pair of engines; nothing was transferred."""


class IncompatibleTopology(PlanError):
    """The TP sizes / head counts of the two sides cannot be paired."""


class IncompatibleGeometry(PlanError):
    """The two sides describe the same KV cache differently (layout, dtype, head size, kind...)."""


class PlanValidationError(PlanError):
    """A strategy produced segments that leave registered memory or write the same bytes twice."""


class RequestError(NixlkvError):
    """One request's block IDs cannot be resolved; only that request fails."""


class HandshakeError(NixlkvError):
    """A remote engine's advertised geometry is malformed or incompatible."""


class MalformedRemoteFact(HandshakeError, IncompatibleGeometry):
    """A remote region's fact decodes but is of another kind than the strategy writes (1.5 tokens
    per block, a string for a count): a malformed handshake, and a plan that cannot be built."""
