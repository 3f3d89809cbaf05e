"""The routing-policy interface and what a policy sees of each replica.

A policy is a small object around pure decision functions: ``choose`` picks one replica
from those that may take the request now (ready, not already tried for this request),
``routed`` tells it where the request went (affinity remembers it), ``sync`` gives it the
full discovered replica set when that changes. Policies never do I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shoal.runtime.router.policies.request_keys import RequestKeys

from shoal.contract.metrics import LoraInfo
from shoal.contract.policies import ROUTING_POLICIES as POLICY_NAMES

SPILL_LOAD_CAP = "load_cap"  # the best-matching replica was over the load cap
SPILL_ENGINE_QUEUE = "engine_queue"  # its engine reported a waiting queue


@dataclass(frozen=True)
class ReplicaSnapshot:
    url: str
    in_flight: int = 0  # requests this router has open on the replica
    num_waiting: int = 0  # scraped from the replica's /metrics
    num_running: int = 0
    kv_usage: float = 0.0  # 0..1
    lora: LoraInfo | None = None  # its adapter slots (lora_requests_info); None: LoRA off

    @property
    def pressure(self) -> float:
        """Tie-breaker between equally good replicas: queue first, then KV fullness."""
        return self.in_flight + self.num_waiting + self.kv_usage


@dataclass(frozen=True)
class Decision:
    url: str
    matched_blocks: int = 0  # prefix blocks the replica was believed to hold
    total_blocks: int = 0
    # the most any replica was believed to hold, when enough to follow (more: a spill)
    best_blocks: int = 0
    spill_reason: str = ""  # why not that replica: SPILL_LOAD_CAP or SPILL_ENGINE_QUEUE

    @property
    def spilled_blocks(self) -> int:
        """Blocks believed cached elsewhere that this placement gives up."""
        return max(self.best_blocks - self.matched_blocks, 0)


class RoutingPolicy(Protocol):
    name: str
    uses_prefix: bool  # whether the proxy should compute request keys for it

    def choose(self, keys: RequestKeys | None, replicas: Sequence[ReplicaSnapshot],
               now: float) -> Decision: ...

    def routed(self, url: str, keys: RequestKeys | None, now: float) -> None: ...

    def sync(self, urls: Iterable[str]) -> None: ...


def make_policy(name: str, *, precise: bool = False, load_factor: float = 1.25,
                approx_capacity: int | None = None, load_headroom: float = 2.0
                ) -> RoutingPolicy:
    if name == "cache-affinity":
        from shoal.runtime.router.policies.cache_affinity import CacheAffinityPolicy

        return CacheAffinityPolicy(precise=precise, load_factor=load_factor,
                                   approx_capacity=approx_capacity,
                                   load_headroom=load_headroom)
    if name == "least-load":
        from shoal.runtime.router.policies.least_load import LeastLoadPolicy

        return LeastLoadPolicy()
    if name == "round-robin":
        from shoal.runtime.router.policies.round_robin import RoundRobinPolicy

        return RoundRobinPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def require_replicas(replicas: Sequence[ReplicaSnapshot]) -> None:
    if not replicas:
        raise ValueError("no replica available")
