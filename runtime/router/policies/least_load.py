"""Least-load: the replica with the fewest requests in flight (this router's count plus the
replica's scraped waiting queue), then the emptiest KV cache; ties rotate so an idle fleet
is still used evenly."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.runtime.router.policies.base import Decision, ReplicaSnapshot, require_replicas
from shoal.runtime.router.policies.request_keys import RequestKeys


def pick_least_loaded(replicas: Sequence[ReplicaSnapshot], rotation: int) -> str:
    ordered = sorted(replicas, key=lambda r: r.url)
    n = len(ordered)
    best = min(range(n), key=lambda i: (ordered[i].in_flight + ordered[i].num_waiting,
                                        ordered[i].kv_usage, (i - rotation) % n))
    return ordered[best].url


class LeastLoadPolicy:
    name = "least-load"
    uses_prefix = False

    def __init__(self) -> None:
        self._rotation = 0

    def choose(self, keys: RequestKeys | None, replicas: Sequence[ReplicaSnapshot],
               now: float) -> Decision:
        require_replicas(replicas)
        url = pick_least_loaded(replicas, self._rotation)
        self._rotation += 1
        return Decision(url)

    def routed(self, url: str, keys: RequestKeys | None, now: float) -> None:
        return None

    def sync(self, urls: Iterable[str]) -> None:
        return None
