"""Cache affinity: send a request where its prefix is cached, within a load bound.

Decision, in order:
1. bounded load: only replicas that stay within the load cap with this request qualify
   (``bounded_load.py``: 1.25 x the mean, or the mean plus what chance alone puts on one
   replica, whichever is larger);
2. the request *follows* a cached prefix when some qualifying replica holds at least half
   of its blocks (``MIN_FOLLOW_FRACTION``): the one believed to hold the longest leading
   run wins, ties go to the lowest pressure (in-flight + waiting + KV usage);
3. otherwise it is a *new* prefix, and the short match counts for nothing: the replica
   with the least recent demand (prompt blocks routed to it lately, ``cache_demand.py``)
   wins, then the lowest pressure, then ring order from the request's first block.
So new prefixes spread over the replicas by what their caches are asked to hold (an idle
fresh fleet: their ring homes, which every router agrees on), their followers find them
there, and a hot prefix spills to the next best replica, which then holds it too.

Why a new prefix ignores short matches: prompts often share a short preamble (the chat
template's header, a company boilerplate line, the same first words of every system
prompt). Following the longest match would send every new system prompt to whichever
replica saw that preamble first, up to the load cap: one engine's cache then holds all the
prompts and thrashes while the others idle (bench/routing.py, 4 replicas, 12 prompts with
a common first block: 100% of the prompt tokens on one engine). A match of a few blocks
saves a few blocks; placing the rest of the prompt where its followers will find room
saves the whole prompt for each of them. SGLang's cache-aware router and Ray Serve's
prefix-aware router make the same split (follow only above a match-rate threshold).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from shoal.runtime.router.policies.base import (
    SPILL_ENGINE_QUEUE,
    SPILL_LOAD_CAP,
    Decision,
    ReplicaSnapshot,
    require_replicas,
)
from shoal.runtime.router.policies.block_index import DEFAULT_APPROX_CAPACITY, BlockIndex
from shoal.runtime.router.policies.bounded_load import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_HEADROOM,
    within_bound,
)
from shoal.runtime.router.policies.cache_demand import DecayedDemand
from shoal.runtime.router.policies.hash_ring import HashRing
from shoal.runtime.router.policies.request_keys import RequestKeys

MIN_FOLLOW_FRACTION = 0.5  # of the request's blocks, cached on a replica, to follow it there


def follow_threshold(total_blocks: int) -> int:
    """The fewest matched blocks that make a request follow a replica's cache."""
    return max(1, math.ceil(MIN_FOLLOW_FRACTION * total_blocks))


def pick_by_affinity(ring_order: Sequence[str], allowed: set[str],
                     matched: Mapping[str, int], pressure: Mapping[str, float],
                     follow_from: int = 1, demand: Mapping[str, float] | None = None) -> str:
    """``ring_order``: candidate replicas clockwise from the request's ring key;
    ``follow_from``: the fewest matched blocks that count as the request's prefix being
    cached there (fewer, everywhere allowed: a new prefix, placed by demand, then
    pressure); ``demand``: recent prompt blocks routed to each replica."""
    candidates = [url for url in ring_order if url in allowed]
    if not candidates:
        raise ValueError("no candidate replica")
    rank = {url: i for i, url in enumerate(candidates)}
    if max(matched.get(url, 0) for url in candidates) >= follow_from:
        return min(candidates, key=lambda url: (-matched.get(url, 0), pressure.get(url, 0.0),
                                                rank[url]))
    demand = demand or {}
    return min(candidates, key=lambda url: (demand.get(url, 0.0), pressure.get(url, 0.0),
                                            rank[url]))


def not_queueing(replicas: Sequence[ReplicaSnapshot], allowed: set[str]) -> set[str]:
    """Of the allowed, those whose engine admits requests at once (no scraped waiting queue:
    its KV cache or batch is full, so one more would wait or preempt), unless none does."""
    admitting = {r.url for r in replicas if r.url in allowed and r.num_waiting == 0}
    return admitting or allowed


class CacheAffinityPolicy:
    name = "cache-affinity"
    uses_prefix = True

    def __init__(self, precise: bool = False, load_factor: float = DEFAULT_LOAD_FACTOR,
                 approx_capacity: int | None = None,
                 load_headroom: float = DEFAULT_LOAD_HEADROOM) -> None:
        self.precise = precise
        self.load_factor = load_factor
        self.load_headroom = load_headroom
        self.approx_capacity = approx_capacity or DEFAULT_APPROX_CAPACITY
        self.ring = HashRing()
        self.indexes: dict[str, BlockIndex] = {}
        self.demand = DecayedDemand()

    def index(self, url: str) -> BlockIndex:
        if url not in self.indexes:
            self.indexes[url] = BlockIndex(self.precise, capacity=self.approx_capacity)
            self.ring.add(url)
        return self.indexes[url]

    def sync(self, urls: Iterable[str]) -> None:
        wanted = set(urls)
        self.ring.sync(wanted)
        for gone in set(self.indexes) - wanted:
            del self.indexes[gone]
            self.demand.forget(gone)
        for url in wanted:
            self.index(url)

    def choose(self, keys: RequestKeys | None, replicas: Sequence[ReplicaSnapshot],
               now: float) -> Decision:
        require_replicas(replicas)
        for replica in replicas:
            self.index(replica.url)
        bounded = within_bound({r.url: r.in_flight for r in replicas}, self.load_factor,
                               self.load_headroom)
        allowed = not_queueing(replicas, bounded)
        pressure = {r.url: r.pressure for r in replicas}
        if keys is None:  # nothing to match on: least pressure among the allowed
            url = min(sorted(allowed), key=lambda u: pressure[u])
            return Decision(url)
        matched = {r.url: self.indexes[r.url].match_length(keys.block_keys, now)
                   for r in replicas}
        ring_order = list(self.ring.walk(keys.ring_key))
        follow_from = follow_threshold(len(keys.block_keys))
        demand = {r.url: self.demand.value(r.url, now) for r in replicas}
        url = pick_by_affinity(ring_order, allowed, matched, pressure, follow_from, demand)
        best = max(matched.values())
        if best < follow_from:  # nobody holds the prefix: a new one, no spill
            return Decision(url, matched[url], len(keys.block_keys))
        decision = Decision(url, matched[url], len(keys.block_keys), best)
        if decision.spilled_blocks:
            home = next(u for u in ring_order if matched.get(u, 0) == best)
            decision = replace(decision, spill_reason=SPILL_LOAD_CAP if home not in bounded
                               else SPILL_ENGINE_QUEUE)
        return decision

    def routed(self, url: str, keys: RequestKeys | None, now: float) -> None:
        if keys is not None:
            self.index(url).record_routed(keys.block_keys, now)
            self.demand.add(url, len(keys.block_keys), now)
