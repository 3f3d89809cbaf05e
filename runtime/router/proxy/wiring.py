"""Wiring of the proxy mode: the fleet view and policy (fleet_view.py) -> the proxy app, with
the P/D prefill pool (or, as --pd-sidecar, the picker's header) and the hold queue when the
flags ask."""

from __future__ import annotations

import asyncio
import logging

from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.fleet_view import FleetView, policy_of, prefill_discovery
from shoal.runtime.router.policies.request_keys import KeyConfig, PromptTokenizer
from shoal.runtime.router.proxy.app import ProxySettings, RouterApp
from shoal.runtime.router.proxy.hold_queue import CapacityHold, HoldSettings
from shoal.runtime.router.proxy.pd import HeaderPrefill, PrefillStage
from shoal.runtime.router.replicas.capacity_request import (
    PREFILL_CAPACITY_ANNOTATION,
    CapacityAsker,
    CapacityRequester,
)
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery
from shoal.runtime.router.replicas.pool import ReplicaPool

log = logging.getLogger("shoal.router")


def build_router(config: RouterConfig) -> RouterApp:
    config.validate()
    tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
    if config.kv_events and tokenizer is None and not config.tokenizer_from_engine:
        log.warning("--kv-events without --tokenizer or --tokenizer-from-engine: only "
                    "token-id prompts can match the engines' block hashes")
    policy = policy_of(config)
    auth = config.edge_auth()

    def engine_pool() -> ReplicaPool:
        return ReplicaPool(config.health_interval, config.scrape_interval,
                           scrape_headers=auth.scrape_headers(),
                           metrics_port=config.engine_metrics_port)

    fleet = FleetView(config, policy, engine_pool())
    pool = fleet.pool
    prefills = prefill_discovery(config)
    prefill = PrefillStage(engine_pool(), config.pd_threshold) \
        if prefills is not None and not config.pd_sidecar else None
    # a sidecar's prefill replica is the picker's choice: no pool of its own to watch, only
    # the addresses the picker may name
    sidecar = HeaderPrefill(config.prefill_backends) if config.pd_sidecar else None
    tasks: list[asyncio.Task[None]] = []

    def install(fetched: PromptTokenizer) -> None:
        app.tokenizer = fetched

    async def startup() -> None:
        fleet.start(install if app.tokenizer is None else None)
        if fleet.subscriber is not None:
            app.metrics.watch_kv_events(fleet.subscriber.states)
        if prefill is not None and prefills is not None:
            tasks.append(asyncio.create_task(prefills.run(prefill.pool.sync),
                                             name="prefill discovery"))
            prefill.pool.start()
            await prefill.pool.wait_first_check(timeout=config.health_interval * 2)
        if sidecar is not None and prefills is not None and prefills.service is not None:
            tasks.append(asyncio.create_task(prefills.service.run(sidecar.allow_peers),
                                             name="prefill peers"))
        await pool.wait_first_check(timeout=config.health_interval * 2)

    async def shutdown() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.stop()
        if prefill is not None:
            await prefill.pool.stop()

    settings = ProxySettings(
        max_attempts=config.max_attempts,
        key_config=KeyConfig(config.block_size, config.chars_per_block, config.model_revision,
                             per_tenant_cache=config.cache_sharing == "tenant"),
        auth=auth, debug_endpoints=config.enable_debug, connect_timeout=config.connect_timeout,
        first_byte_timeout=config.first_byte_timeout, idle_timeout=config.idle_timeout,
        stream_stall_timeout=config.stream_stall_timeout,
        quarantine_window=config.quarantine_window)
    discovery = fleet.discovery
    ask = None
    if config.capacity_request and isinstance(discovery, KubernetesDiscovery):
        ask = CapacityRequester(discovery, config.capacity_request)  # held requests' (decode)
        if prefill is not None:  # a prompt that found no prefill replica (prefill at zero)
            prefill.asker = CapacityAsker(CapacityRequester(
                discovery, config.capacity_request, annotation=PREFILL_CAPACITY_ANNOTATION))
    hold = CapacityHold(pool, HoldSettings(config.hold_timeout, config.hold_queue,
                                           config.hold_queue_bytes), ask)
    app = RouterApp(pool, policy, settings, tokenizer, startup, shutdown, hold=hold,
                    prefill=sidecar or prefill)
    return app
