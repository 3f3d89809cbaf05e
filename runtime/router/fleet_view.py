"""What both modes (the proxy and the Endpoint Picker) run from one ``RouterConfig``: the
routing policy, and the view of the fleet that feeds it: discovery -> replica pool, plus,
as the flags ask, the engines' KV events into the policy's block indexes and the tokenizer
fetched from a ready engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.policies.base import RoutingPolicy, make_policy
from shoal.runtime.router.policies.request_keys import PromptTokenizer
from shoal.runtime.router.replicas.discovery import (
    KubernetesDiscovery,
    PrefillDiscovery,
    StaticDiscovery,
)
from shoal.runtime.router.replicas.pool import ReplicaPool

if TYPE_CHECKING:
    from shoal.runtime.router.replicas.kv_events import KVEventsSubscriber


def policy_of(config: RouterConfig) -> RoutingPolicy:
    return make_policy(config.policy, precise=config.kv_events, load_factor=config.load_factor,
                       approx_capacity=config.approx_capacity,
                       load_headroom=config.load_headroom)


def prefill_discovery(config: RouterConfig) -> PrefillDiscovery | None:
    """P/D's prefill replicas (None: no P/D). The Service's endpoints are found on its port
    named ``http``: --engine-port is the decode side's (a sidecar's, through a gateway)."""
    if not config.pd:
        return None
    service = KubernetesDiscovery(config.namespace, config.prefill_service, None,
                                  api_url=config.kube_api) if config.prefill_service else None
    return PrefillDiscovery(config.prefill_backends, service)


class FleetView:
    def __init__(self, config: RouterConfig, policy: RoutingPolicy, pool: ReplicaPool) -> None:
        self.config, self.policy, self.pool = config, policy, pool
        self.discovery: StaticDiscovery | KubernetesDiscovery
        if config.discovery == "static":
            self.discovery = StaticDiscovery(config.backends)
        else:
            self.discovery = KubernetesDiscovery(config.namespace, config.service,
                                                 config.engine_port, api_url=config.kube_api)
        self.subscriber: KVEventsSubscriber | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, install_tokenizer: Callable[[PromptTokenizer], None] | None) -> None:
        """Start following the fleet; ``install_tokenizer`` gets the engines' tokenizer once
        one hands it over (None: the router has its own, or needs none)."""
        config, pool = self.config, self.pool
        if config.kv_events:  # precise mode: the engines' own KV events
            from shoal.runtime.router.replicas.kv_events import KVEventsSubscriber

            indexes = self.policy.indexes  # type: ignore[attr-defined]
            self.subscriber = KVEventsSubscriber(config.kv_events_port, indexes.get)
            pool.on_change.append(self.subscriber.sync)
            self.subscriber.sync(set(pool.replicas))
        self._tasks.append(asyncio.create_task(self.discovery.run(pool.sync), name="discovery"))
        if install_tokenizer is not None and config.tokenizer_from_engine:
            from shoal.runtime.router.replicas.engine_tokenizer import load_from_engines

            self._tasks.append(asyncio.create_task(load_from_engines(
                pool, install_tokenizer, config.health_interval), name="tokenizer"))
        pool.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.stop()
        if self.subscriber is not None:
            await self.subscriber.close()
