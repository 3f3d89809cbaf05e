"""Wiring for ``shoal route --epp``: discovery -> replica pool -> the proxy's policy -> picker
-> gRPC server, in one asyncio loop until SIGTERM/SIGINT.

The same RouterConfig as the proxy (so every routing flag means the same in both modes);
the proxy-only parts (retries over HTTP, the ASGI app) are not built.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from shoal.runtime.router.discovery import KubernetesDiscovery, StaticDiscovery
from shoal.runtime.router.epp_picker import EndpointPicker
from shoal.runtime.router.epp_protocol import PROTOCOL_VERSION
from shoal.runtime.router.epp_server import EppServer
from shoal.runtime.router.policy import make_policy
from shoal.runtime.router.replica_pool import ReplicaPool
from shoal.runtime.router.request_keys import KeyConfig, PromptTokenizer
from shoal.runtime.router.router_app import RouterConfig

log = logging.getLogger("shoal.router.epp")


def build_picker(config: RouterConfig, shed_limit: int | None) -> tuple[
        EndpointPicker, StaticDiscovery | KubernetesDiscovery]:
    config.validate()
    if config.kv_events:
        raise ValueError("--kv-events is not supported with --epp yet (approximate or "
                         "--tokenizer affinity only)")
    tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
    policy = make_policy(config.policy, load_factor=config.load_factor,
                         approx_capacity=config.approx_capacity)
    pool = ReplicaPool(config.health_interval, config.scrape_interval)
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


async def serve_epp(config: RouterConfig, address: str, shed_limit: int | None) -> None:
    picker, discovery = build_picker(config, shed_limit)
    server = EppServer(picker, address)
    pool = picker.pool
    await server.start()
    log.info("endpoint picker (ext_proc, protocol %s) on %s", PROTOCOL_VERSION, address)
    discover = asyncio.create_task(discovery.run(pool.sync), name="discovery")
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
        discover.cancel()
        await asyncio.gather(discover, return_exceptions=True)
        await server.stop()
        await pool.stop()
