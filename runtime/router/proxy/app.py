"""The router's HTTP face: an ASGI app that picks a replica and streams its answer through.

Per request: authenticate at the edge (``edge_auth``), read the body, compute its prefix
keys (when the policy uses them), ask the policy for a replica among the ready ones, and
forward with the router's own credential and the tenant header. A request moves to another
replica only when the first did no work for it: the connection could not be made, or the
engine answered 429/503 marked ``x-shoal-retry-safe`` (not ready, draining, queue full,
connection cap). Anything else (an engine that died while serving it, an unmarked 5xx, a
broken connection, a timeout) goes back to this client alone, and the request's
fingerprint is pinned to that replica for a while (``poison``), so neither this router nor
the client's own retries carry a poison request across the fleet.

Once the replica's response headers arrive the bytes are relayed as they come (no
re-encoding, no buffering), so SSE streams pass through byte for byte. Timeouts per
upstream: connect, first byte (response headers) and idle (between chunks); a client that
stops reading for the stall window has its connection dropped. A client disconnect,
noticed by a watcher on the ASGI ``receive`` channel, cancels the relay, which closes the
upstream connection: the engine sees the disconnect and aborts the request.
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
from shoal.runtime.heap import BurstTrimmer
from shoal.runtime.http_listener import abort_connection
from shoal.runtime.router.edge_auth import EdgeAuth
from shoal.runtime.router.policies.base import SPILL_LOAD_CAP, Decision, RoutingPolicy
from shoal.runtime.router.policies.lora_affinity import adapter_for_keys, model_of, prefer_adapter
from shoal.runtime.router.policies.pd_decider import pd_choice
from shoal.runtime.router.policies.request_keys import (
    KeyConfig,
    PromptTokenizer,
    RequestKeys,
    keys_or_none,
)
from shoal.runtime.router.proxy.asgi import (
    ClientGone,
    Receive,
    Scope,
    Send,
    error_response,
    read_body,
    respond,
    wait_disconnect,
)
from shoal.runtime.router.proxy.hold_queue import CapacityHold
from shoal.runtime.router.proxy.metrics import RouterMetrics
from shoal.runtime.router.proxy.pd import HeaderPrefill, PrefillStage
from shoal.runtime.router.proxy.poison import FailedRequests, fingerprint
from shoal.runtime.router.replicas.pool import ReplicaPool
from shoal.runtime.router.replicas.response_home import HomeGone, response_home

from shoal.contract.errors import error_json
from shoal.contract.headers import ENGINE_DIED_CODE, PREFILLER_HEADER, RETRY_SAFE_HEADER

log = logging.getLogger("shoal.router.proxy")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")  # placed by their prompt's prefix
# also forwarded, placed by load alone (a Responses follow-up: where its conversation is)
FORWARDED_PATHS = ROUTED_PATHS + ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                                  "/tokenize", "/detokenize")
RETRY_STATUSES = frozenset({429, 503})  # and only with the retry-safe mark
FINGERPRINT_INLINE_BYTES = 64 * 1024  # larger bodies are fingerprinted on a thread
ENGINE_DIED_EVENT = b'"code":"' + ENGINE_DIED_CODE.encode() + b'"'  # in a stream's last event
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer",
                        "upgrade", "proxy-authenticate", "proxy-authorization"})
# the client library sets these for the upstream request itself
REQUEST_HEADERS_DROPPED = HOP_BY_HOP | {"host", "content-length"}


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3  # replicas tried per request before the first byte
    key_config: KeyConfig = KeyConfig()
    auth: EdgeAuth = EdgeAuth()
    debug_endpoints: bool = False
    connect_timeout: float = 5.0
    first_byte_timeout: float = 300.0  # a non-streaming answer's headers come at its end
    idle_timeout: float = 60.0  # between two chunks of an answer
    stream_stall_timeout: float = 30.0  # a client that reads nothing this long is dropped
    quarantine_window: float = 60.0


class UpstreamFailed(Exception):
    """The replica took the request and then failed it: not to be replayed elsewhere."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def make_upstream_session(connect_timeout: float = 5.0) -> aiohttp.ClientSession:
    """The proxy's client. aiohttp, not httpx: its C parser costs the router about a third
    of the CPU per request (measured: ~0.5 vs ~1.5 ms on this machine's cores)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),  # < uvicorn's 5 s
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        auto_decompress=False,  # relay the replica's bytes as they are
        skip_auto_headers=("User-Agent", "Accept-Encoding"))


class RouterApp:
    def __init__(self, pool: ReplicaPool, policy: RoutingPolicy,
                 settings: ProxySettings = ProxySettings(),
                 tokenizer: PromptTokenizer | None = None,
                 on_startup: Callable[[], Awaitable[None]] | None = None,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None,
                 hold: CapacityHold | None = None,
                 prefill: PrefillStage | HeaderPrefill | None = None) -> None:
        self.pool = pool
        self.prefill = prefill  # P/D: prefill replicas, used when the prompt is worth it
        # --pd-sidecar: it stands where a picker expects the engine, so a picker taking the
        # tokenizer from its endpoints (--tokenizer-from-engine) gets the engine's
        self._sidecar = isinstance(prefill, HeaderPrefill)
        self.hold = hold  # scale from zero: wait for a replica instead of a 503
        self.bodies = BurstTrimmer()  # request bodies' memory back to the OS after a burst
        self.policy = policy
        self.session: aiohttp.ClientSession | None = None  # made on startup, inside the loop
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics(pool)
        if prefill is not None:  # a sidecar decodes; a proxy's prefill pool is watched too
            self.metrics.watch_prefill_pool(
                prefill.pool if isinstance(prefill, PrefillStage) else None)
        self.failed = FailedRequests(settings.quarantine_window)
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
        elif (path in FORWARDED_PATHS and method == "POST") or \
                (path == "/v1/models" and method == "GET") or \
                (path == "/tokenizer" and method == "GET" and self._sidecar):
            allowed, tenant = self._authenticate(scope)
            if allowed:
                await self._proxy(scope, receive, send, tenant)
            else:
                await self._unauthorized(send)
        elif path == "/debug/blocks" and method == "GET" and self.settings.debug_endpoints:
            if self._authenticate(scope)[0]:
                await self._blocks(send)
            else:
                await self._unauthorized(send)
        else:
            await error_response(send, 404, f"no route for {method} {path}")

    def _authenticate(self, scope: Scope) -> tuple[bool, str | None]:
        """(allowed, tenant); no keys configured: allowed, no tenant."""
        auth = self.settings.auth
        if not auth.enabled:
            return True, None
        headers = dict(scope["headers"])
        given, x_api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        tenant = auth.tenant(given.decode("latin-1") if given is not None else None,
                             x_api_key.decode("latin-1") if x_api_key is not None else None)
        return tenant is not None, tenant

    async def _unauthorized(self, send: Send) -> None:
        self.metrics.unauthorized.inc()
        body = error_json(401, "invalid or missing API key", "invalid_api_key")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = make_upstream_session(self.settings.connect_timeout)
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
    async def _proxy(self, scope: Scope, receive: Receive, send: Send,
                     tenant: str | None) -> None:
        received_at = time.perf_counter()
        try:
            body = await read_body(receive)
        except ClientGone:
            self.bodies.touch()
            return
        self.bodies.held(len(body))
        relay = asyncio.create_task(self._forward(scope, body, send, received_at, tenant))
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
            self.bodies.released(len(body))
        if relay.done() and not relay.cancelled() and relay.result() is ClientStalled:
            await abort_connection(scope)

    async def _keys(self, path: str, body: bytes, tenant: str | None) -> RequestKeys | None:
        if not self.policy.uses_prefix or path not in ROUTED_PATHS:
            return None
        # never raises: a body the router cannot key is routed by load, and the engine
        # answers it (a malformed one with its own 400)
        adapter = adapter_for_keys(model_of(body), (r.lora for r in self.pool.replicas.values()))
        if self.tokenizer is not None:  # tokenizing is CPU work: off the event loop
            return await asyncio.to_thread(keys_or_none, path, body, self.settings.key_config,
                                           self.tokenizer, tenant, adapter)
        return keys_or_none(path, body, self.settings.key_config, None, tenant, adapter)

    async def _forward(self, scope: Scope, body: bytes, send: Send, received_at: float,
                       tenant: str | None) -> object:
        path = scope["path"]
        keys = await self._keys(path, body, tenant)
        client_headers = [(k.decode("latin-1"), v.decode("latin-1"))
                          for k, v in scope["headers"]
                          if k.decode("latin-1").lower() not in REQUEST_HEADERS_DROPPED]
        headers = CIMultiDict(self.settings.auth.upstream_headers(client_headers, tenant))
        if self.session is None:
            raise RuntimeError("the ASGI lifespan must run before requests")
        query = scope.get("query_string", b"").decode("latin-1")
        if self.hold is not None and self.hold.enabled:
            refused = await self.hold.wait_for_replica(len(body))
            if refused is not None:
                self.metrics.no_replica.inc()
                await error_response(send, 503, refused.message, refused.retry_after_s)
                return None
        home = response_home(path, body, self.pool.replicas)
        if isinstance(home, HomeGone):
            retry = [(b"retry-after", str(home.retry_after_s).encode())] \
                if home.retry_after_s else None
            await respond(send, home.status, home.body(),
                          extra_headers=retry)
            return None
        # a parse and a re-serialisation of the body: only while something is quarantined
        # (else when this request fails), and off the event loop when the body is large
        request_key = await self._fingerprint(tenant, path, body) if len(self.failed) else None
        quarantine = (self.failed.lookup(request_key, time.monotonic())
                      if request_key is not None else None)
        tried: set[str] = set()
        if quarantine is not None:  # only the replica it already failed on may see it again
            tried = {url for url in self.pool.replicas if url != quarantine.replica}
        if home is not None:  # a Responses follow-up: only where its conversation is stored
            tried |= {url for url in self.pool.replicas if url != home}
        last_error = "no ready replica"
        sent_body: bytes | None = None  # P/D: decided once, at the first decode replica
        for attempt in range(self.settings.max_attempts):
            candidates = self.pool.available(exclude=tried)
            if not candidates:
                break
            now = time.monotonic()
            snapshots = [r.snapshot() for r in candidates]
            if any(s.lora is not None for s in snapshots):  # some replica serves adapters
                snapshots = prefer_adapter(model_of(body), snapshots)
            decision = self.policy.choose(keys, snapshots, now)
            replica = self.pool.replicas[decision.url]
            tried.add(replica.url)
            # recorded now, not when the answer starts: a non-streaming answer starts only
            # when it is done, and same-prefix requests arriving meanwhile must follow this one
            self.policy.routed(replica.url, keys, now)
            if attempt:
                self.metrics.retries.inc()
            if sent_body is None:
                sent_body = await self._maybe_prefill(path, body, headers, keys, decision)
            url = f"{replica.url}{path}" + (f"?{query}" if query else "")
            replica.in_flight += 1
            upstream: aiohttp.ClientResponse | None = None
            try:
                self.metrics.decision_seconds.observe(time.perf_counter() - received_at)
                try:
                    async with asyncio.timeout(self.settings.first_byte_timeout):
                        upstream = await self.session.request(
                            scope["method"], url, data=sent_body, headers=headers,
                            allow_redirects=False)
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                    # never connected, nothing sent: another replica may take it; out of
                    # rotation until /ready says otherwise
                    last_error = f"{replica.url}: {type(exc).__name__}"
                    self.pool.eject(replica.url, f"connect failed: {exc!r}")
                    continue
                except TimeoutError as exc:
                    raise UpstreamFailed(504, f"the replica sent no answer within "
                                              f"{self.settings.first_byte_timeout:g} s") from exc
                except aiohttp.ClientError as exc:
                    raise UpstreamFailed(502, f"the replica failed the request "
                                              f"({type(exc).__name__})") from exc
                if upstream.status in RETRY_STATUSES and RETRY_SAFE_HEADER in upstream.headers \
                        and attempt + 1 < self.settings.max_attempts:
                    last_error = f"{replica.url} answered {upstream.status}"
                    continue
                self.metrics.first_byte_seconds.observe(time.perf_counter() - received_at)
                replica.requests += 1
                if decision.matched_blocks:
                    replica.affinity_hits += 1
                if decision.spilled_blocks:
                    reason = decision.spill_reason or SPILL_LOAD_CAP
                    self.metrics.affinity_spills.labels(reason).inc()
                    self.metrics.affinity_spilled_blocks.labels(reason).inc(
                        decision.spilled_blocks)
                failed = upstream.status >= 500 and RETRY_SAFE_HEADER not in upstream.headers
                outcome = await self._relay(upstream, send)
                if outcome is ClientStalled:
                    return outcome
                if failed or outcome is not None:
                    request_key = request_key or await self._fingerprint(tenant, path, body)
                    self._failed(request_key, replica.url, str(outcome or "5xx"))
                return outcome
            except UpstreamFailed as exc:
                request_key = request_key or await self._fingerprint(tenant, path, body)
                self._failed(request_key, replica.url, "timeout" if exc.status == 504
                             else "connection")
                await error_response(send, exc.status, str(exc))
                return None
            finally:
                replica.in_flight -= 1
                if upstream is not None:
                    if upstream.content.at_eof():
                        upstream.release()  # keep the connection for the next request
                    else:
                        upstream.close()  # unfinished (client left): the engine must see it
        if quarantine is not None and quarantine.replica not in tried:
            self.metrics.quarantined.inc()
            retry_in = max(1, int(quarantine.until - time.monotonic()))
            await error_response(send, 503, "this request failed on a replica that is out of "
                                 f"rotation; it is not sent to others (retry in {retry_in} s)")
            return None
        self.metrics.no_replica.inc()
        await error_response(send, 503, f"no replica could take the request ({last_error})")
        return None

    async def _maybe_prefill(self, path: str, body: bytes, headers: CIMultiDict,
                             keys: RequestKeys | None, decision: Decision) -> bytes:
        """P/D: the body the decode replica gets (``pd.py``): as it came, or with the
        kv_transfer_params of a prefill replica that computed the prompt."""
        # the picker's header is for this hop only: neither engine is to see it
        named = headers.popall(PREFILLER_HEADER, [])
        if self.prefill is None or path not in ROUTED_PATHS:
            return body
        assert self.session is not None
        if isinstance(self.prefill, HeaderPrefill):  # a sidecar: the picker has decided
            outcome = await self.prefill.run(self.session, path, body, headers, named,
                                             self.settings.first_byte_timeout)
        else:
            choice = pd_choice(keys, decision, self.settings.key_config, self.prefill.threshold)
            if not choice.remote:
                self.metrics.pd_decisions.labels("local", choice.reason).inc()
                return body
            outcome = await self.prefill.run(self.session, path, body, headers,
                                             self.settings.first_byte_timeout, choice.reason)
        self.metrics.pd_decisions.labels(outcome.decision, outcome.reason).inc()
        return outcome.body

    @staticmethod
    async def _fingerprint(tenant: str | None, path: str, body: bytes) -> bytes:
        if len(body) > FINGERPRINT_INLINE_BYTES:
            return await asyncio.to_thread(fingerprint, tenant, path, body)
        return fingerprint(tenant, path, body)

    def _failed(self, request_key: bytes, replica: str, reason: str) -> None:
        self.metrics.upstream_failures.labels(reason).inc()
        self.failed.record(request_key, replica, time.monotonic())
        log.warning("a request failed on %s (%s): not replayed, held to that replica for "
                    "%.0f s", replica, reason, self.settings.quarantine_window)

    async def _relay(self, upstream: aiohttp.ClientResponse, send: Send) -> object:
        """Relay the answer; returns None when it ended well, else why it did not (a
        reason string, or ``ClientStalled`` when the client stopped reading)."""
        headers = [(k, v) for k, v in upstream.raw_headers
                   if k.decode("latin-1").lower() not in HOP_BY_HOP]
        stall = self.settings.stream_stall_timeout or None
        outcome: object = None
        try:
            async with asyncio.timeout(stall):
                await send({"type": "http.response.start", "status": upstream.status,
                            "headers": headers})
            while True:
                try:
                    async with asyncio.timeout(self.settings.idle_timeout):
                        chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:  # replica died or hung
                    log.warning("upstream broke mid-response: %r", exc)
                    outcome = "idle timeout" if isinstance(exc, TimeoutError) else "broken"
                    break
                if not chunk:
                    break
                if ENGINE_DIED_EVENT in chunk:
                    outcome = "engine died"
                async with asyncio.timeout(stall):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            async with asyncio.timeout(stall):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:  # only the sends are left: the client stopped reading
            self.metrics.client_stalls.inc()
            return ClientStalled
        return outcome


class ClientStalled:
    """Marker: the client read nothing for the stall window; its connection is dropped."""
