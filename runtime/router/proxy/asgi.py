"""Raw ASGI plumbing for the router: body reading, disconnect watching, small responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from shoal.contract.errors import error_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

class ClientGone(Exception):
    """The client disconnected while the request was being forwarded."""


async def read_body(receive: Receive) -> bytes:
    """The whole body (its size is bounded by the listener's ``BodyLimit`` before this)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def respond(send: Send, status: int, body: bytes,
                   content_type: bytes = b"application/json",
                   extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode()),
                            *(extra_headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def error_response(send: Send, status: int, message: str,
                         retry_after_s: int | None = None) -> None:
    extra = [(b"retry-after", str(retry_after_s).encode())] if retry_after_s else None
    await respond(send, status, error_json(status, message), extra_headers=extra)

