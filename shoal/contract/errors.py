"""The OpenAI-style error body every Shoal HTTP server answers with (engine, router, the
listener below both, the endpoint picker's immediate responses):
``{"error": {"message", "type", "param", "code"}}``, its ``type`` from the status."""

from __future__ import annotations

import json

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, code: str | int | None = None,
               param: str | None = None) -> dict:
    """The body as a dict; ``code`` defaults to the status, as OpenAI's server errors have."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"),
                      "param": param, "code": status if code is None else code}}


def error_json(status: int, message: str, code: str | int | None = None,
               param: str | None = None) -> bytes:
    """The body serialized, for servers that write bytes (ASGI, ext_proc)."""
    return json.dumps(error_body(status, message, code, param)).encode()
