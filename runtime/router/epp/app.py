"""Wiring for ``shoal route --epp``: discovery -> replica pool -> the proxy's policy (+ KV-event
subscriber, + the tokenizer fetched from an engine) -> picker -> gRPC server, in one asyncio
loop until SIGTERM/SIGINT.

The same RouterConfig as the proxy (so every routing flag means the same in both modes);
the proxy-only parts (retries over HTTP, the ASGI app) are not built.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.epp.picker import EndpointPicker
from shoal.runtime.router.epp.protocol import PROTOCOL_VERSION
from shoal.runtime.router.epp.server import EppLimits, EppServer
from shoal.runtime.router.policies.base import make_policy
from shoal.runtime.router.policies.request_keys import KeyConfig, PromptTokenizer
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery, StaticDiscovery
from shoal.runtime.router.replicas.pool import ReplicaPool

log = logging.getLogger("shoal.router.epp")


def build_picker(config: RouterConfig, shed_limit: int | None) -> tuple[
        EndpointPicker, StaticDiscovery | KubernetesDiscovery]:
    config.validate()
    tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
    policy = make_policy(config.policy, precise=config.kv_events,
                         load_factor=config.load_factor,
                         approx_capacity=config.approx_capacity,
                         load_headroom=config.load_headroom)
    pool = ReplicaPool(config.health_interval, config.scrape_interval,
                       metrics_port=config.engine_metrics_port)
    discovery: StaticDiscovery | KubernetesDiscovery
    if config.discovery == "static":
        discovery = StaticDiscovery(config.backends)
    else:
        discovery = KubernetesDiscovery(config.namespace, config.service, config.engine_port,
                                        api_url=config.kube_api)
    key_config = KeyConfig(config.block_size, config.chars_per_block, config.model_revision)
    picker = EndpointPicker(pool, policy, key_config, tokenizer,
                            endpoints_per_pick=config.max_attempts, shed_limit=shed_limit)
    return picker, discovery


async def serve_epp(config: RouterConfig, address: str, shed_limit: int | None,
                    limits: EppLimits = EppLimits()) -> None:
    picker, discovery = build_picker(config, shed_limit)
    server = EppServer(picker, address, limits)
    pool = picker.pool
    await server.start()
    log.info("endpoint picker (ext_proc, protocol %s) on %s", PROTOCOL_VERSION, address)
    background = [asyncio.create_task(discovery.run(pool.sync), name="discovery")]
    subscriber = None
    if config.kv_events:  # precise mode, as the proxy runs it: the engines' KV events
        from shoal.runtime.router.replicas.kv_events import KVEventsSubscriber

        subscriber = KVEventsSubscriber(config.kv_events_port,
                                        picker.policy.indexes.get)  # type: ignore[attr-defined]
        pool.on_change.append(subscriber.sync)
        subscriber.sync(set(pool.replicas))
    if config.tokenizer_from_engine and picker.tokenizer is None:
        from shoal.runtime.router.replicas.engine_tokenizer import load_from_engines

        def install(fetched: PromptTokenizer) -> None:
            picker.tokenizer = fetched

        background.append(asyncio.create_task(load_from_engines(
            pool, install, config.health_interval), name="tokenizer"))
    pool.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await pool.wait_first_check(timeout=config.health_interval * 2 + 5)
        await server.set_ready(True)
        await stop.wait()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await server.stop()
        await pool.stop()
        if subscriber is not None:
            await subscriber.close()
