"""Cache affinity: send a request where its prefix is cached, within a load bound.

Decision, in order:
1. bounded load: only replicas that stay within the load cap with this request qualify
   (``bounded_load.py``: 1.25 x the mean, but never less than the mean + 2 requests);
2. the qualifying replica believed to hold the longest leading run of the request's
   blocks wins;
3. ties, including "nobody holds any of it" for a new prefix, go to the lowest pressure
   (in-flight + waiting + KV usage), then to ring order from the request's first block.
So new prefixes spread over the least busy replicas (an idle fleet: their ring homes, which
every router agrees on), their followers find them there, and a hot prefix spills to the
next best replica, which then holds it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from shoal.runtime.router.block_index import DEFAULT_APPROX_CAPACITY, BlockIndex
from shoal.runtime.router.bounded_load import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_HEADROOM,
    within_bound,
)
from shoal.runtime.router.hash_ring import HashRing
from shoal.runtime.router.policy import Decision, ReplicaSnapshot, require_replicas
from shoal.runtime.router.request_keys import RequestKeys


def pick_by_affinity(ring_order: Sequence[str], allowed: set[str],
                     matched: Mapping[str, int], pressure: Mapping[str, float]) -> str:
    """``ring_order``: candidate replicas clockwise from the request's ring key."""
    candidates = [url for url in ring_order if url in allowed]
    if not candidates:
        raise ValueError("no candidate replica")
    rank = {url: i for i, url in enumerate(candidates)}
    return min(candidates, key=lambda url: (-matched.get(url, 0), pressure.get(url, 0.0),
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
        for url in wanted:
            self.index(url)

    def choose(self, keys: RequestKeys | None, replicas: Sequence[ReplicaSnapshot],
               now: float) -> Decision:
        require_replicas(replicas)
        for replica in replicas:
            self.index(replica.url)
        allowed = not_queueing(replicas, within_bound(
            {r.url: r.in_flight for r in replicas}, self.load_factor, self.load_headroom))
        pressure = {r.url: r.pressure for r in replicas}
        if keys is None:  # nothing to match on: least pressure among the allowed
            url = min(sorted(allowed), key=lambda u: pressure[u])
            return Decision(url)
        matched = {r.url: self.indexes[r.url].match_length(keys.block_keys, now)
                   for r in replicas}
        ring_order = list(self.ring.walk(keys.ring_key))
        url = pick_by_affinity(ring_order, allowed, matched, pressure)
        return Decision(url, matched[url], len(keys.block_keys), max(matched.values()))

    def routed(self, url: str, keys: RequestKeys | None, now: float) -> None:
        if keys is not None:
            self.index(url).record_routed(keys.block_keys, now)
