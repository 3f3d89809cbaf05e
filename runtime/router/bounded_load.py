"""Bounded load: no replica takes a request while its in-flight count is above
``factor`` x the mean, unless every replica is (then all are candidates).

With factor 1.25 (KubeAI's and the consistent-hashing-with-bounded-loads paper's choice),
a hot prefix spills from its home replica to the next ones on the ring instead of piling
up there; the least-loaded replica is always at or below the mean, so it always qualifies.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_LOAD_FACTOR = 1.25


def load_cap(loads: Mapping[str, int], factor: float = DEFAULT_LOAD_FACTOR) -> float:
    if not loads:
        return 0.0
    return factor * sum(loads.values()) / len(loads)


def within_bound(loads: Mapping[str, int], factor: float = DEFAULT_LOAD_FACTOR) -> set[str]:
    """Replicas allowed to take the next request."""
    if factor < 1.0:
        raise ValueError(f"load factor must be >= 1.0, got {factor}")
    cap = load_cap(loads, factor)
    allowed = {url for url, load in loads.items() if load <= cap}
    return allowed or set(loads)
