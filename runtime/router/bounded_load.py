"""Bounded load: no replica takes a request that would put it above the load cap, unless
every replica is there (then all are candidates).

The cap counts the request being placed (as consistent hashing with bounded loads does) and
is the larger of a relative and an absolute bound over the mean:

    cap = max(factor x mean_after, mean_after + headroom),  mean_after = (in flight + 1) / N

The relative bound (factor 1.25, KubeAI's and the paper's choice) alone throws affinity
away at moderate concurrency: with 3 replicas and loads [1, 0, 0] the cap is 0.83, so any
replica already running one request is refused while another is idle, and a follow-up turn
or a shared system prompt is sent where it is not cached. An engine batches; one or two
requests above the mean are no imbalance worth a full prefill elsewhere. So a replica may
always hold ``headroom`` requests above the mean; above a mean of headroom / (factor - 1)
(8 requests at the defaults) the relative bound is the larger one and takes over. A hot
prefix still spills from its home to the next replicas once the home is past the cap. The
least-loaded replica is always within the cap (headroom >= 1), so someone always qualifies.
"""

from __future__ import annotations

from collections.abc import Mapping

DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_LOAD_HEADROOM = 2.0


def load_cap(loads: Mapping[str, int], factor: float = DEFAULT_LOAD_FACTOR,
             headroom: float = DEFAULT_LOAD_HEADROOM) -> float:
    """The most requests a replica may hold once the next request is placed."""
    if not loads:
        return 0.0
    mean_after = (sum(loads.values()) + 1) / len(loads)
    return max(factor * mean_after, mean_after + headroom)


def within_bound(loads: Mapping[str, int], factor: float = DEFAULT_LOAD_FACTOR,
                 headroom: float = DEFAULT_LOAD_HEADROOM) -> set[str]:
    """Replicas allowed to take the next request."""
    if factor < 1.0:
        raise ValueError(f"load factor must be >= 1.0, got {factor}")
    if headroom < 1.0:
        raise ValueError(f"load headroom must be >= 1, got {headroom}")
    cap = load_cap(loads, factor, headroom)
    allowed = {url for url, load in loads.items() if load + 1 <= cap}
    return allowed or set(loads)
