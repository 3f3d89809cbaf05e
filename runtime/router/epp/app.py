"""Wiring for ``shoal route --epp``: the fleet view and the proxy's policy (fleet_view.py: discovery
-> replica pool, + KV events, + the tokenizer fetched from an engine) -> picker -> gRPC server,
in one asyncio loop until SIGTERM/SIGINT.

The same RouterConfig as the proxy (so every routing flag means the same in both modes);
the proxy-only parts (retries over HTTP, the ASGI app) are not built. ``--prefill-backend``
and ``--prefill-service`` give the prefill pool P/D picks from (health and load watched as
the proxy's is; the Service's pods by their own IPs, as llm-d's picker names them).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from prometheus_client import start_http_server
from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.epp.picker import EndpointPicker
from shoal.runtime.router.epp.protocol import PROTOCOL_VERSION
from shoal.runtime.router.epp.server import EppLimits, EppServer
from shoal.runtime.router.fleet_view import FleetView, policy_of, prefill_discovery
from shoal.runtime.router.policies.request_keys import KeyConfig, PromptTokenizer
from shoal.runtime.router.replicas.capacity_request import (
    PREFILL_CAPACITY_ANNOTATION,
    CapacityAsker,
    CapacityRequester,
)
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery
from shoal.runtime.router.replicas.pool import ReplicaPool

log = logging.getLogger("shoal.router.epp")


def build_picker(config: RouterConfig, shed_limit: int | None) -> tuple[EndpointPicker, FleetView]:
    config.validate()
    tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
    policy = policy_of(config)
    def engine_pool() -> ReplicaPool:
        return ReplicaPool(config.health_interval, config.scrape_interval,
                           metrics_port=config.engine_metrics_port)

    fleet = FleetView(config, policy, engine_pool())
    key_config = KeyConfig(config.block_size, config.chars_per_block, config.model_revision)
    prefill = engine_pool() if config.pd else None
    if prefill is not None:
        prefill.sync(set(config.prefill_backends))  # --prefill-service's pods: serve_epp
    picker = EndpointPicker(fleet.pool, policy, key_config, tokenizer,
                            endpoints_per_pick=config.max_attempts, shed_limit=shed_limit,
                            prefill_pool=prefill, pd_threshold=config.pd_threshold)
    discovery = fleet.discovery
    if prefill is not None and config.capacity_request and \
            isinstance(discovery, KubernetesDiscovery):  # a prefill pool that scales to zero
        picker.prefill_asker = CapacityAsker(CapacityRequester(
            discovery, config.capacity_request, annotation=PREFILL_CAPACITY_ANNOTATION))
    return picker, fleet


async def serve_epp(config: RouterConfig, address: str, shed_limit: int | None,
                    limits: EppLimits = EppLimits(), metrics_port: int | None = None) -> None:
    picker, fleet = build_picker(config, shed_limit)
    server = EppServer(picker, address, limits)
    await server.start()
    log.info("endpoint picker (ext_proc, protocol %s) on %s", PROTOCOL_VERSION, address)
    metrics = None
    if metrics_port is not None:  # scrapes read counters and the pools' last scrapes only
        host = address.rsplit(":", 1)[0].strip("[]")
        metrics, _ = start_http_server(metrics_port, addr=host, registry=picker.registry)
        log.info("endpoint picker metrics on http://%s:%d/metrics", host, metrics_port)

    def install(fetched: PromptTokenizer) -> None:
        picker.tokenizer = fetched

    fleet.start(install if picker.tokenizer is None else None)
    prefills = prefill_discovery(config)
    discovering: asyncio.Task[None] | None = None
    if picker.prefill_pool is not None and prefills is not None:
        discovering = asyncio.create_task(prefills.run(picker.prefill_pool.sync),
                                          name="prefill discovery")
        picker.prefill_pool.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await fleet.pool.wait_first_check(timeout=config.health_interval * 2 + 5)
        if picker.prefill_pool is not None:  # not a condition of readiness: no P/D is a
            # fallback (decode computes the prompt), not an outage
            await picker.prefill_pool.wait_first_check(timeout=config.health_interval * 2 + 5)
        await server.set_ready(True)
        await stop.wait()
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        await server.stop()
        if discovering is not None:
            discovering.cancel()
            await asyncio.gather(discovering, return_exceptions=True)
        await fleet.stop()
        if picker.prefill_pool is not None:
            await picker.prefill_pool.stop()
