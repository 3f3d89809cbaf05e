"""Bounded load: no replica takes a request that would put it above the load cap, unless
every replica is there (then all are candidates).

The cap counts the request being placed (as consistent hashing with bounded loads does) and
is the larger of a relative bound and what chance alone puts on one replica:

    cap = max(factor x mean_after, mean_after + max(headroom, 3 x sigma_after))
    mean_after = n / N,  sigma_after = sqrt(n x (1/N) x (1 - 1/N)),  n = in flight + 1

sigma_after is the spread of one replica's count when n requests land on N replicas
independently and evenly: a perfectly balanced fleet still sees it, and a policy that
follows caches adds to it whatever the prefixes' popularity adds. Only a load beyond that
is a hot spot worth a full prefill elsewhere.

Why not the relative bound alone (factor 1.25, KubeAI's and the paper's choice): it throws
affinity away at moderate concurrency. With 3 replicas and loads [1, 0, 0] it refuses the
replica already running one request while another is idle. An earlier fix allowed a fixed
2 requests above the mean; with 8 in flight on 4 replicas that cap (4.25) refuses a
replica holding 4 of the other 7, which chance alone does to a balanced fleet 7% of the
time (binomial 7, 1/4): bench/routing.py counted 17 spills in 192 requests, 8k prompt
tokens prefilled again. Three sigmas leave chance a small tail (the same case: 5 of the
other 7, 1.3%; 6 in flight on 3 replicas: all 5 others on one, 0.4%; small counts have the
fattest tails, 2.1% with 12 in flight on 6 replicas). Above
~300 requests in flight (N = 3; ~430 for N = 4) the relative bound is the larger one
and rules. ``headroom`` stays as the floor (a replica may always hold that many above the
mean), so the least-loaded replica is always within the cap and someone qualifies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_LOAD_HEADROOM = 2.0
CHANCE_SIGMAS = 3.0


def chance_spread(requests: int, replicas: int) -> float:
    """Standard deviation of one replica's share of ``requests`` spread evenly at random."""
    if replicas < 2:
        return 0.0
    share = 1.0 / replicas
    return math.sqrt(requests * share * (1.0 - share))


def load_cap(loads: Mapping[str, int], factor: float = DEFAULT_LOAD_FACTOR,
             headroom: float = DEFAULT_LOAD_HEADROOM) -> float:
    """The most requests a replica may hold once the next request is placed."""
    if not loads:
        return 0.0
    requests = sum(loads.values()) + 1
    mean_after = requests / len(loads)
    chance = CHANCE_SIGMAS * chance_spread(requests, len(loads))
    return max(factor * mean_after, mean_after + max(headroom, chance))


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
