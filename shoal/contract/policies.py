"""The routing policies a router runs: ``shoal route --policy`` and an InferenceService's
``spec.router.policy`` take the same names."""

from __future__ import annotations

ROUTING_POLICIES = ("cache-affinity", "least-load", "round-robin")
DEFAULT_ROUTING_POLICY = "cache-affinity"
