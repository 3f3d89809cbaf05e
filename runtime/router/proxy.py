"""The router's HTTP face: an ASGI app that picks a replica and streams its answer through.

Per request: read the body, compute its prefix keys (when the policy uses them), ask the
policy for a replica among the ready ones, and forward. Until the replica's response
headers arrive nothing has been sent to the client, so a refused connection, a reset, or a
429/502/503 from that replica moves the request to another one; after that the bytes are
relayed as they arrive (no re-encoding, no buffering), so SSE streams pass
through byte for byte. A client disconnect, noticed by a watcher on the ASGI ``receive``
channel, cancels the relay, which closes the upstream connection: the engine sees the
disconnect and aborts the request, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict
from shoal.runtime.router.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    error_response,
    read_body,
    respond,
    wait_disconnect,
)
from shoal.runtime.router.hold_queue import CapacityHold
from shoal.runtime.router.policy import RoutingPolicy
from shoal.runtime.router.replica_pool import ReplicaPool
from shoal.runtime.router.request_keys import (
    KeyConfig,
    PromptTokenizer,
    RequestKeyError,
    RequestKeys,
    request_keys,
)
from shoal.runtime.router.router_metrics import RouterMetrics

log = logging.getLogger("shoal.router.proxy")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
RETRY_STATUSES = frozenset({429, 502, 503})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer",
                        "upgrade", "proxy-authenticate", "proxy-authorization"})
# the client library sets these for the upstream request itself
REQUEST_HEADERS_DROPPED = HOP_BY_HOP | {"host", "content-length"}


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3  # replicas tried per request before the first byte
    key_config: KeyConfig = KeyConfig()


def make_upstream_session() -> aiohttp.ClientSession:
    """The proxy's client. aiohttp, not httpx: its C parser costs the router about a third
    of the CPU per request (measured: ~0.5 vs ~1.5 ms on this machine's cores)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),  # < uvicorn's 5 s
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        auto_decompress=False,  # relay the replica's bytes as they are
        skip_auto_headers=("User-Agent", "Accept-Encoding"))


class RouterApp:
    def __init__(self, pool: ReplicaPool, policy: RoutingPolicy,
                 settings: ProxySettings = ProxySettings(),
                 tokenizer: PromptTokenizer | None = None,
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None,
                 hold: CapacityHold | None = None) -> None:
        self.pool = pool
        self.hold = hold  # scale from zero: wait for a replica instead of a 503
        self.policy = policy
        self.session: aiohttp.ClientSession | None = None  # made on startup, inside the loop
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics(pool)
        self._on_startup = on_startup
        self._on_shutdown = on_shutdown
        pool.on_change.append(policy.sync)
        policy.sync(set(pool.replicas))

    # -- ASGI entry ---------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await respond(send, 200, b'{"status":"ok"}')
        elif path == "/ready" and method == "GET":
            ready = bool(self.pool.available())
            await respond(send, 200 if ready else 503,
                           b'{"status":"ready"}' if ready else b'{"status":"no ready replica"}')
        elif path == "/metrics" and method == "GET":
            await respond(send, 200, self.metrics.render(),
                           content_type=b"text/plain; version=0.0.4; charset=utf-8")
        elif path in ROUTED_PATHS and method == "POST":
            await self._proxy(scope, receive, send)
        elif path == "/v1/models" and method == "GET":
            await self._proxy(scope, receive, send)
        elif path == "/debug/blocks" and method == "GET":
            await self._blocks(send)
        else:
            await error_response(send, 404, f"no route for {method} {path}")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = make_upstream_session()
                if self._on_startup is not None:
                    await self._on_startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._on_shutdown is not None:
                    await self._on_shutdown()
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _blocks(self, send: Send) -> None:
        """The router's view: block keys it believes each replica holds (affinity only)."""
        indexes = getattr(self.policy, "indexes", None)
        if indexes is None:
            await error_response(send, 404, f"policy {self.policy.name} keeps no block view")
            return
        view = {"policy": self.policy.name, "precise": bool(getattr(self.policy, "precise", 0)),
                "replicas": {url: sorted(index.blocks()) for url, index in indexes.items()}}
        await respond(send, 200, json.dumps(view).encode())

    # -- proxying -------------------------------------------------------------------------
    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        received_at = time.perf_counter()
        try:
            body = await read_body(receive)
        except ClientGone:
            return
        except ValueError as exc:
            await error_response(send, 413, str(exc))
            return
        relay = asyncio.create_task(self._forward(scope, body, send, received_at))
        watcher = asyncio.create_task(wait_disconnect(receive))
        try:
            await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not relay.done():  # the client left first: cancel, which closes upstream
                self.metrics.client_disconnects.inc()
                relay.cancel()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, ClientGone):
                await relay
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _keys(self, path: str, body: bytes) -> RequestKeys | None:
        if not self.policy.uses_prefix or path not in ROUTED_PATHS:
            return None
        try:
            parsed = json.loads(body)
            if self.tokenizer is not None:  # tokenizing is CPU work: off the event loop
                return await asyncio.to_thread(request_keys, path, parsed,
                                               self.settings.key_config, self.tokenizer)
            return request_keys(path, parsed, self.settings.key_config)
        except (ValueError, RequestKeyError, TypeError):
            return None  # not ours to validate: the engine answers with a proper 400

    async def _forward(self, scope: Scope, body: bytes, send: Send, received_at: float) -> None:
        path = scope["path"]
        keys = await self._keys(path, body)
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1"))
                              for k, v in scope["headers"]
                              if k.decode("latin-1").lower() not in REQUEST_HEADERS_DROPPED)
        if self.session is None:
            raise RuntimeError("the ASGI lifespan must run before requests")
        query = scope.get("query_string", b"").decode("latin-1")
        if self.hold is not None and self.hold.enabled:
            refused = await self.hold.wait_for_replica()
            if refused is not None:
                self.metrics.no_replica.inc()
                await error_response(send, 503, refused.message, refused.retry_after_s)
                return
        tried: set[str] = set()
        last_error = "no ready replica"
        for attempt in range(self.settings.max_attempts):
            candidates = self.pool.available(exclude=tried)
            if not candidates:
                break
            now = time.monotonic()
            decision = self.policy.choose(keys, [r.snapshot() for r in candidates], now)
            replica = self.pool.replicas[decision.url]
            tried.add(replica.url)
            # recorded now, not when the answer starts: a non-streaming answer starts only
            # when it is done, and same-prefix requests arriving meanwhile must follow this one
            self.policy.routed(replica.url, keys, now)
            if attempt:
                self.metrics.retries.inc()
            url = f"{replica.url}{path}" + (f"?{query}" if query else "")
            replica.in_flight += 1
            try:
                self.metrics.decision_seconds.observe(time.perf_counter() - received_at)
                try:
                    upstream = await self.session.request(scope["method"], url, data=body,
                                                          headers=headers,
                                                          allow_redirects=False)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last_error = f"{replica.url}: {type(exc).__name__}"
                    if isinstance(exc, aiohttp.ClientConnectorError | TimeoutError):
                        # cannot connect: out of rotation until /ready says otherwise (a
                        # dropped keep-alive connection is no reason to eject)
                        self.pool.eject(replica.url, f"request failed: {exc!r}")
                    continue
                try:
                    if upstream.status in RETRY_STATUSES and \
                            attempt + 1 < self.settings.max_attempts:
                        last_error = f"{replica.url} answered {upstream.status}"
                        continue
                    self.metrics.first_byte_seconds.observe(time.perf_counter() - received_at)
                    replica.requests += 1
                    if decision.matched_blocks:
                        replica.affinity_hits += 1
                    await self._relay(upstream, send)
                    return
                finally:
                    if upstream.content.at_eof():
                        upstream.release()  # keep the connection for the next request
                    else:
                        upstream.close()  # unfinished (client left): the engine must see it
            finally:
                replica.in_flight -= 1
        self.metrics.no_replica.inc()
        await error_response(send, 503, f"no replica could take the request ({last_error})")

    async def _relay(self, upstream: aiohttp.ClientResponse, send: Send) -> None:
        headers = [(k, v) for k, v in upstream.raw_headers
                   if k.decode("latin-1").lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": upstream.status,
                    "headers": headers})
        try:
            async for chunk in upstream.content.iter_any():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:  # replica died mid-stream
            log.warning("upstream broke mid-response: %r", exc)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
