"""Lifecycle of ``shoal serve``: start the engine process and uvicorn, drain on SIGTERM,
exit non-zero when the engine dies or fails to start.

The HTTP port opens at once, before the engine is ready, so probes can tell "loading" from
"dead": /ready answers 503 with the startup phase until warmup is done. SIGTERM (or Ctrl-C)
starts a drain: readiness goes 503, new requests get 503, in-flight requests have
``shutdown_timeout`` seconds to finish, the rest are aborted, then the server exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator

import uvicorn
from shoal.runtime.config import EngineConfig
from shoal.runtime.frontend.engine_client import AsyncEngineClient, EngineStartupError
from shoal.runtime.frontend.prompts import PromptRenderer
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.http_listener import (
    PROBE_PATHS,
    ASGIApp,
    ListenerLimits,
    Receive,
    Scope,
    Send,
    send_json,
    uvicorn_config,
)

from shoal.contract.errors import error_json

from .app import build_app
from .lora_adapters import ADMIN_PATHS as LORA_ADMIN_PATHS
from .metrics import ServerMetrics
from .state import ServerSettings, ServerState

logger = logging.getLogger("shoal.serve")
DEAD_EXIT_DELAY_S = 0.5  # lets error events reach the live streams before the exit
ABORTED_STREAMS_GRACE_S = 2.0


class ShoalServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting our drain instead of closing the port."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.shoal = state
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain_task is None:
            logger.info("signal %s: draining (up to %.0f s)", signal.Signals(sig).name,
                        self.shoal.settings.shutdown_timeout)
            self._drain_task = asyncio.get_running_loop().create_task(self.drain())
        elif sig == signal.SIGINT:
            self.force_exit = True
            self.should_exit = True

    async def drain(self) -> None:
        state = self.shoal
        state.draining = True
        deadline = time.monotonic() + state.settings.shutdown_timeout
        while state.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.live:
            logger.warning("shutdown timeout: aborting %d request(s)", len(state.live))
            for generation in list(state.live):
                generation.abort(end_streams=True)
            grace = time.monotonic() + ABORTED_STREAMS_GRACE_S
            while state.live and time.monotonic() < grace:
                await asyncio.sleep(0.05)
        self.should_exit = True

    def engine_died(self, reason: str) -> None:
        self.shoal.exit_code = 1
        print(f"shoal serve: {reason}", file=sys.stderr, flush=True)
        asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY_S, self._exit_now)

    def _exit_now(self) -> None:
        self.should_exit = True


class SideListener(uvicorn.Server):
    """A second listener in the same loop (``--metrics-port``): the main server owns the
    signals, this one stops when the main one does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def metrics_app(app: ASGIApp, state: ServerState) -> ASGIApp:
    """What the metrics port serves: /metrics without the API key (for Prometheus inside
    the cluster), and the probes; of /v1 only the model list and the LoRA adapter
    endpoints, with --enable-lora (the operator's channel), served by the main app itself:
    the same API-key check and the same runtime-updating switch as on the main port."""

    admin = state.settings.enable_lora

    async def call(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if admin and scope["path"] in LORA_ADMIN_PATHS:
            await app(scope, receive, send)
        elif scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": state.metrics.render()})
        elif scope["path"] in PROBE_PATHS:
            await app(scope, receive, send)
        else:
            await send_json(send, 404, error_json(404, "only /metrics, /health and /ready here"))

    return call


async def serve(engine_config: EngineConfig, settings: ServerSettings, host: str, port: int,
                metrics_compat: list[str], log_level: str = "info",
                limits: ListenerLimits = ListenerLimits(), metrics_port: int | None = None) -> int:
    tokenizer = Tokenizer.from_dir(engine_config.model)
    renderer = PromptRenderer(tokenizer)
    metrics = ServerMetrics(settings.model_name, metrics_compat)
    if (transfer := engine_config.kv_transfer_config) is not None:
        metrics.set_kv_transfer_config(transfer.kv_connector, transfer.kv_role,
                                       transfer.engine_id)
    if engine_config.enable_lora:
        metrics.enable_lora(engine_config.max_loras)
    client = AsyncEngineClient(engine_config, on_stats=metrics.update_stats)
    state = ServerState(settings, client, tokenizer, metrics, renderer)
    _ = state.max_token_bytes  # one pass over the vocabulary now, not in the first request
    app = build_app(state)
    server = ShoalServer(uvicorn_config(app, host, port, limits, log_level, lifespan="off"),
                         state)
    side = None
    if metrics_port is not None:
        side = SideListener(uvicorn_config(metrics_app(app, state), host, metrics_port,
                                           limits, log_level, lifespan="off"))
    client.on_dead = server.engine_died

    async def follow_startup() -> None:
        try:
            info = await client.wait_ready()
        except EngineStartupError:
            return  # engine_died already reported it and set the exit code
        metrics.set_phase_durations(info.durations)
        metrics.set_cache_config(engine_config.block_size, info.num_kv_blocks,
                                 engine_config.kv_cache_dtype)
        metrics.set_model_config(info.quantization)
        logger.info("engine ready: %s (max_model_len %d, %d KV blocks)",
                    info.durations, info.max_model_len, info.num_kv_blocks)

    client.start()
    startup = asyncio.create_task(follow_startup())
    side_task = asyncio.create_task(side.serve()) if side is not None else None
    try:
        await server.serve()
    finally:
        startup.cancel()
        if side is not None and side_task is not None:
            side.should_exit = True
            await asyncio.gather(side_task, return_exceptions=True)
        await client.shutdown()
    return state.exit_code
