"""Wiring: discovery -> replica pool -> policy (+ KV-event subscriber) -> proxy app."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from shoal.runtime.router.capacity_request import CapacityRequester
from shoal.runtime.router.discovery import KubernetesDiscovery, StaticDiscovery
from shoal.runtime.router.edge_auth import EdgeAuth, read_key_file
from shoal.runtime.router.hold_queue import CapacityHold, HoldSettings
from shoal.runtime.router.pd import PrefillStage
from shoal.runtime.router.policy import make_policy
from shoal.runtime.router.proxy import ProxySettings, RouterApp
from shoal.runtime.router.replica_pool import ReplicaPool
from shoal.runtime.router.request_keys import KeyConfig, PromptTokenizer

from shoal.contract.kv import DEFAULT_BLOCK_SIZE

log = logging.getLogger("shoal.router")


@dataclass
class RouterConfig:
    policy: str = "cache-affinity"
    backends: list[str] = field(default_factory=list)
    discovery: str = "static"  # static | kubernetes
    namespace: str = "default"
    service: str = ""
    engine_port: int | None = None
    engine_metrics_port: int | None = None  # scrape engines' /metrics there (no key)
    kube_api: str | None = None  # out-of-cluster API server (tests, kubectl proxy)
    tokenizer: str | None = None
    tokenizer_from_engine: bool = False  # fetch the tokenizer from the first ready engine
    block_size: int = DEFAULT_BLOCK_SIZE
    model_revision: str = ""
    chars_per_block: int = 64
    cache_sharing: str = "tenant"  # the engines' --cache-sharing
    kv_events: bool = False
    kv_events_port: int = 5557
    health_interval: float = 1.0
    scrape_interval: float = 1.0
    load_factor: float = 1.25
    load_headroom: float = 2.0  # requests above the mean a replica may always hold
    approx_capacity: int = 50_000  # prefix blocks remembered per replica (approximate mode)
    max_attempts: int = 3
    hold_timeout: float = 0.0  # scale from zero: seconds a request waits for a ready replica
    hold_queue: int = 256
    hold_queue_bytes: int = 256 << 20
    capacity_request: str = ""  # InferenceService to annotate for capacity (kubernetes)
    api_keys: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    upstream_api_key: str | None = None
    upstream_api_key_file: str | None = None
    enable_debug: bool = False
    connect_timeout: float = 5.0
    first_byte_timeout: float = 300.0
    idle_timeout: float = 60.0
    stream_stall_timeout: float = 30.0
    quarantine_window: float = 60.0
    # P/D disaggregation (runtime/router/pd.py): prefill replicas, and the uncached prompt
    # tokens above which one computes the prompt before the decode replica
    prefill_backends: list[str] = field(default_factory=list)
    pd_threshold: int = 256

    def edge_auth(self) -> EdgeAuth:
        keys = list(self.api_keys)
        if self.api_key_file:
            keys += read_key_file(self.api_key_file)
        if any(not key for key in keys):
            raise ValueError("an --api-key is empty")
        upstream = self.upstream_api_key or None
        if self.upstream_api_key_file:
            if upstream is not None:
                raise ValueError("give --upstream-api-key or --upstream-api-key-file, not both")
            lines = read_key_file(self.upstream_api_key_file)
            if len(lines) != 1:
                raise ValueError("--upstream-api-key-file must hold exactly one key")
            upstream = lines[0]
        return EdgeAuth(tuple(keys), upstream)

    def validate(self) -> None:
        if self.discovery == "static" and not self.backends:
            raise ValueError("give at least one --backend URL, or --discovery kubernetes")
        if self.discovery == "kubernetes" and not self.service:
            raise ValueError("--discovery kubernetes needs --service")
        if self.discovery not in ("static", "kubernetes"):
            raise ValueError(f"unknown discovery {self.discovery!r}")
        if self.approx_capacity < 1:
            raise ValueError("--approx-capacity must be >= 1")
        if self.load_headroom < 1:
            raise ValueError("--load-headroom must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be >= 1")
        if self.capacity_request and self.discovery != "kubernetes":
            raise ValueError("--capacity-request needs --discovery kubernetes")
        if self.tokenizer and self.tokenizer_from_engine:
            raise ValueError("give --tokenizer DIR or --tokenizer-from-engine, not both")
        for flag, value in (("--connect-timeout", self.connect_timeout),
                            ("--first-byte-timeout", self.first_byte_timeout),
                            ("--idle-timeout", self.idle_timeout)):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0")
        if self.stream_stall_timeout < 0 or self.quarantine_window < 0:
            raise ValueError("--stream-stall-timeout and --quarantine-window must be >= 0")
        if self.prefill_backends and self.policy != "cache-affinity":
            raise ValueError("--prefill-backend needs --policy cache-affinity (the decode "
                             "replica's cached prefix decides)")
        if self.pd_threshold < 0:
            raise ValueError("--pd-threshold must be >= 0")
        if self.kv_events and self.policy != "cache-affinity":
            raise ValueError("--kv-events only applies to --policy cache-affinity")


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
            from shoal.runtime.router.kv_events_subscriber import KVEventsSubscriber

            indexes = policy.indexes  # type: ignore[attr-defined]
            subscriber = KVEventsSubscriber(config.kv_events_port, indexes.get)
            pool.on_change.append(subscriber.sync)
            subscriber.sync(set(pool.replicas))
            app.metrics.watch_kv_events(subscriber.states)
        background.append(asyncio.create_task(discovery.run(pool.sync), name="discovery"))
        if config.tokenizer_from_engine and app.tokenizer is None:
            from shoal.runtime.router.engine_tokenizer import load_from_engines

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
