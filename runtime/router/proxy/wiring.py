"""Wiring of the proxy mode: discovery -> replica pool -> policy (+ KV-event subscriber) -> proxy
app."""

from __future__ import annotations

import asyncio
import logging

from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.policies.base import make_policy
from shoal.runtime.router.policies.request_keys import KeyConfig, PromptTokenizer
from shoal.runtime.router.proxy.app import ProxySettings, RouterApp
from shoal.runtime.router.proxy.hold_queue import CapacityHold, HoldSettings
from shoal.runtime.router.proxy.pd import PrefillStage
from shoal.runtime.router.replicas.capacity_request import CapacityRequester
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery, StaticDiscovery
from shoal.runtime.router.replicas.pool import ReplicaPool

log = logging.getLogger("shoal.router")


def build_router(config: RouterConfig) -> RouterApp:
    config.validate()
    tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
    if config.kv_events and tokenizer is None and not config.tokenizer_from_engine:
        log.warning("--kv-events without --tokenizer or --tokenizer-from-engine: only "
                    "token-id prompts can match the engines' block hashes")
    policy = make_policy(config.policy, precise=config.kv_events,
                         load_factor=config.load_factor,
                         approx_capacity=config.approx_capacity,
                         load_headroom=config.load_headroom)
    auth = config.edge_auth()
    pool = ReplicaPool(config.health_interval, config.scrape_interval,
                       scrape_headers=auth.scrape_headers(),
                       metrics_port=config.engine_metrics_port)
    discovery: StaticDiscovery | KubernetesDiscovery
    if config.discovery == "static":
        discovery = StaticDiscovery(config.backends)
    else:
        discovery = KubernetesDiscovery(config.namespace, config.service, config.engine_port,
                                        api_url=config.kube_api)
    background: list[asyncio.Task[None]] = []
    subscriber = None
    prefill: PrefillStage | None = None
    if config.prefill_backends:
        prefill = PrefillStage(ReplicaPool(config.health_interval, config.scrape_interval,
                                           scrape_headers=auth.scrape_headers(),
                                           metrics_port=config.engine_metrics_port),
                               config.pd_threshold)

    async def startup() -> None:
        nonlocal subscriber
        if config.kv_events:
            from shoal.runtime.router.replicas.kv_events import KVEventsSubscriber

            indexes = policy.indexes  # type: ignore[attr-defined]
            subscriber = KVEventsSubscriber(config.kv_events_port, indexes.get)
            pool.on_change.append(subscriber.sync)
            subscriber.sync(set(pool.replicas))
            app.metrics.watch_kv_events(subscriber.states)
        background.append(asyncio.create_task(discovery.run(pool.sync), name="discovery"))
        if config.tokenizer_from_engine and app.tokenizer is None:
            from shoal.runtime.router.replicas.engine_tokenizer import load_from_engines

            def install(fetched: PromptTokenizer) -> None:
                app.tokenizer = fetched

            background.append(asyncio.create_task(load_from_engines(
                pool, install, config.health_interval), name="tokenizer"))
        pool.start()
        if prefill is not None:
            prefill.pool.sync(set(config.prefill_backends))
            prefill.pool.start()
            await prefill.pool.wait_first_check(timeout=config.health_interval * 2)
        await pool.wait_first_check(timeout=config.health_interval * 2)

    async def shutdown() -> None:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await pool.stop()
        if prefill is not None:
            await prefill.pool.stop()
        if subscriber is not None:
            await subscriber.close()

    settings = ProxySettings(
        max_attempts=config.max_attempts,
        key_config=KeyConfig(config.block_size, config.chars_per_block, config.model_revision,
                             per_tenant_cache=config.cache_sharing == "tenant"),
        auth=auth, debug_endpoints=config.enable_debug, connect_timeout=config.connect_timeout,
        first_byte_timeout=config.first_byte_timeout, idle_timeout=config.idle_timeout,
        stream_stall_timeout=config.stream_stall_timeout,
        quarantine_window=config.quarantine_window)
    ask = (CapacityRequester(discovery, config.capacity_request)
           if config.capacity_request and isinstance(discovery, KubernetesDiscovery) else None)
    hold = CapacityHold(pool, HoldSettings(config.hold_timeout, config.hold_queue,
                                               config.hold_queue_bytes), ask)
    app = RouterApp(pool, policy, settings, tokenizer, startup, shutdown, hold=hold,
                    prefill=prefill)
    return app
