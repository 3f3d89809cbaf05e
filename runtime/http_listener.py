"""The HTTP listener both public servers run (``shoal serve`` and ``shoal route``), and the
parts of their HTTP contract the router relies on.

uvicorn with the limits a port exposed to many clients needs, enforced while reading:
- headers: a request whose head passes ``max_header_bytes`` before it is complete gets a
  431 and the connection is closed (counted as the bytes reach httptools' parser; uvicorn's
  only built-in limit is h11's, and h11 costs the router twice the CPU per request and
  ~10x the latency here: 0.90 vs 0.46 ms CPU, 12.4 vs 1.3 ms wall, sequential requests);
- bodies: ``BodyLimit`` answers 413 from Content-Length, or as soon as the bytes read pass
  the limit, before the application sees any of it;
- connections: past ``max_connections`` a new connection gets one clean 503 (Connection:
  close) for anything but the probes, which still answer: at the cap a kubelet or the
  router must see the replica as alive and ready, not dead;
- the kernel's send buffer per connection is fixed (``send_buffer_bytes``), so a client
  that stops reading blocks our writes after a bounded amount, and the stream's stall
  clock starts (``shoal serve --stream-stall-timeout``);
- idle connections that never send a complete request head are closed after
  ``first_request_timeout`` (uvicorn's keep-alive timer only starts after a first response);
- log lines are rate-limited per message (``RateLimitedLog``), so 20k bad connections make a
  handful of lines, not 20k.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from shoal.runtime.log_limits import RateLimitedLog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shoal.contract.errors import error_json
from shoal.contract.headers import ENGINE_DIED_CODE, RETRY_SAFE_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The HTTP contract between engines and the router (RETRY_SAFE_HEADER, ENGINE_DIED_CODE) is
# shoal.contract.headers; re-exported here for the servers that import the listener.
__all__ = ["ENGINE_DIED_CODE", "RETRY_SAFE_HEADER"]

PROBE_PATHS = frozenset({"/health", "/ready"})
OVER_CAP_FIRST_REQUEST_TIMEOUT_S = 1.0


def default_max_connections() -> int:
    """80% of the process's open-file limit: past the cap there must still be descriptors
    to accept with, answer 503 and close."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, int(soft * 0.8)) if soft != resource.RLIM_INFINITY else 16_384


@dataclass(frozen=True)
class ListenerLimits:
    max_connections: int = 0  # 0: default_max_connections()
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 8 * 1024 * 1024  # 0: none here (shoal serve bounds it in the app)
    first_request_timeout: float = 10.0
    keep_alive_timeout: int = 5
    # per connection, fixed (no autotuning to megabytes): what a client that stops reading
    # can leave queued in the kernel before our writes block and the stall clock starts
    send_buffer_bytes: int = 256 * 1024

    def validate(self, flag_prefix: str = "--") -> None:
        for flag, value in (("max-connections", self.max_connections),
                            ("max-header-bytes", self.max_header_bytes - 1),
                            ("max-request-body-bytes", self.max_body_bytes),
                            ("first-request-timeout", self.first_request_timeout)):
            if value < 0:
                raise ValueError(f"{flag_prefix}{flag} is out of range")

    @property
    def connection_cap(self) -> int:
        return self.max_connections or default_max_connections()


def add_listener_flags(parser: argparse.ArgumentParser) -> None:
    """The connection limits, the same flags and defaults in front of both servers."""
    parser.add_argument("--max-connections", type=int, default=ListenerLimits.max_connections,
                        help="open connections past which new ones get a 503 (the probes "
                             "still answer); 0: 80%% of the open-file limit")
    parser.add_argument("--max-header-bytes", type=int, default=ListenerLimits.max_header_bytes,
                        help="largest request head (line + headers); larger ones are refused "
                             "while reading")


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets a 413 before the app reads
    any of it (by Content-Length at once, else as soon as the running count passes it)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large(send, int(length))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        message = f"the request body has at least {size} bytes; the limit is {self.limit}"
        await send_json(send, 413, error_json(413, message, "request_too_large"),
                        [(b"connection", b"close")])


ABORT_EXTENSION = "shoal.abort_connection"


def with_connection_abort(app: ASGIApp, transport: asyncio.Transport) -> ASGIApp:
    """Give the app a way to drop its connection at once (``scope["extensions"]``): a stream
    whose client stopped reading cannot be closed politely, its unsent bytes never drain."""

    async def call(scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("extensions", {})[ABORT_EXTENSION] = transport.abort
        await app(scope, receive, send)

    return call


async def abort_connection(scope: Scope) -> None:
    """Reset the client's connection (when the listener offers it) and let uvicorn see the
    loss before the app returns, so an unfinished response is not logged as an app error."""
    abort = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
    if abort is not None:
        abort()
        await asyncio.sleep(0)


def over_cap(app: ASGIApp) -> ASGIApp:
    """The app a connection accepted past the cap sees: probes pass, the rest a 503."""

    async def answer(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROBE_PATHS:
            await app(scope, receive, send)
            return
        body = error_json(503, "the server is at its connection limit; retry later",
                          "too_many_connections")
        await send_json(send, 503, body, [(b"connection", b"close"), (b"retry-after", b"1"),
                                          (RETRY_SAFE_HEADER.encode(), b"1")])

    return answer


class HeadTooLarge(Exception):
    """Raised from a parser callback: the request head passed ``max_header_bytes``."""


def limited_protocol(limits: ListenerLimits) -> type[HttpToolsProtocol]:
    cap = limits.connection_cap

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _first_request_timer: asyncio.TimerHandle | None = None
        _in_head = False  # between a request's first byte and the end of its headers
        _head_bytes = 0  # the head's parts the parser has handed over
        _pending_bytes = 0  # bytes received while the head was incomplete
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and limits.send_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
            self.app = with_connection_abort(self.app, transport)
            timeout = limits.first_request_timeout
            if len(self.connections) > cap:
                self.app = over_cap(self.app)
                timeout = min(timeout, OVER_CAP_FIRST_REQUEST_TIMEOUT_S)
            if timeout:
                self._first_request_timer = self.loop.call_later(timeout, self._idle_close)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._in_head and not self._refused:  # a head still incomplete: bound the
                self._pending_bytes += len(data)  # bytes the parser holds for it
                if self._pending_bytes > limits.max_header_bytes:
                    self._refused = True
                    self._send_431()
            if self.cycle is not None and self._first_request_timer is not None:
                self._first_request_timer.cancel()  # a request head arrived: uvicorn's now
                self._first_request_timer = None

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._pending_bytes = True, 0, 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count_head(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._count_head(len(name) + len(value) + 4)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _count_head(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > limits.max_header_bytes:
                self._refused = True
                raise HeadTooLarge()  # stops the parser; uvicorn answers via send_400_response

        def send_400_response(self, msg: str) -> None:
            if self._refused:
                self._send_431()
            else:
                super().send_400_response(msg)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._first_request_timer is not None:
                self._first_request_timer.cancel()
            super().connection_lost(exc)

        def _send_431(self) -> None:
            body = error_json(431, f"the request head is over {limits.max_header_bytes} "
                                   "bytes", "request_header_too_large")
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: "
                b"application/json\r\nconnection: close\r\ncontent-length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.transport.close()

        def _idle_close(self) -> None:
            self._first_request_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return LimitedHttpToolsProtocol


def install_log_limits() -> None:
    """Rate-limit every line the root handlers write (uvicorn's propagate there too)."""
    limiter = RateLimitedLog(window_s=10.0, max_causes=1024)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RateLimitedLog) for f in handler.filters):
            handler.addFilter(limiter)


def uvicorn_config(app: ASGIApp, host: str, port: int, limits: ListenerLimits,
                   log_level: str, lifespan: Literal["on", "off"]) -> uvicorn.Config:
    if limits.max_body_bytes:  # 0: the application bounds its bodies itself
        app = BodyLimit(app, limits.max_body_bytes)
    config = uvicorn.Config(
        app, host=host, port=port,
        http=limited_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout, log_level=log_level, log_config=None,
        access_log=False, lifespan=lifespan, timeout_graceful_shutdown=5)
    install_log_limits()
    return config
