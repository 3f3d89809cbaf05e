"""Reading a JSON request body within limits, before any of it is interpreted.

The size is enforced while reading (a declared Content-Length over the limit is refused
before a byte is read; a chunked body is cut off as soon as it passes the limit), so a
client cannot make the server buffer more than ``max_request_body_bytes``. msgspec decodes
(C, no NaN/Infinity, strict UTF-8: a lone surrogate escape such as ``"\\ud800"`` is an
error); nesting deeper than ``max_json_depth`` is refused before pydantic walks it.
"""

from __future__ import annotations

import json

import msgspec
from fastapi import Request

from .errors import APIError, bad_request


def too_large(size: int | str, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; the limit is {limit}", None,
                    "request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes, max_depth: int) -> object:
    try:
        data = msgspec.json.decode(raw)
    except RecursionError:
        raise bad_request(f"the request body is nested more than {max_depth} levels deep") \
            from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        where = _bad_string_path(raw)
        if where is not None:
            raise bad_request(f"{where} is not valid Unicode text (a lone surrogate)",
                              where) from None
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    depth = json_depth(data, max_depth)
    if depth > max_depth:
        raise bad_request(f"the request body is nested more than {max_depth} levels deep")
    return data


def json_depth(data: object, stop_after: int) -> int:
    """Nesting depth of containers (a scalar is 0), iteratively; stops past ``stop_after``."""
    deepest = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: object = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > stop_after:
                return deepest
        stack.extend((child, depth) for child in children)  # type: ignore[attr-defined]
    return deepest


def _bad_string_path(raw: bytes) -> str | None:
    """Where a lone surrogate is, as ``messages.0.content`` (the error path only: json
    accepts the escapes msgspec refuses, so it can point at the field)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
    return None
