"""Round-robin: each request to the next available replica, ignoring prefixes and load."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.runtime.router.policies.base import Decision, ReplicaSnapshot, require_replicas
from shoal.runtime.router.policies.request_keys import RequestKeys


def pick_round_robin(urls: Sequence[str], counter: int) -> str:
    return sorted(urls)[counter % len(urls)]


class RoundRobinPolicy:
    name = "round-robin"
    uses_prefix = False

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, keys: RequestKeys | None, replicas: Sequence[ReplicaSnapshot],
               now: float) -> Decision:
        require_replicas(replicas)
        url = pick_round_robin([r.url for r in replicas], self._counter)
        self._counter += 1
        return Decision(url)

    def routed(self, url: str, keys: RequestKeys | None, now: float) -> None:
        return None

    def sync(self, urls: Iterable[str]) -> None:
        return None
