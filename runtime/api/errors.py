"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status;
on the Anthropic routes the same error in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}`` (``anthropic_body``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from shoal.contract.errors import error_body
from shoal.contract.headers import ENGINE_DIED_CODE, RETRY_SAFE_HEADER

# Anthropic's error types by status (its API reference, "Errors")
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code or self.status, self.param)

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(self.status, "api_error"),
            "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.anthropic_body() if anthropic else self.body(),
                            status_code=self.status, headers=self.headers)


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_request_error")


def internal_error(request_id: str) -> APIError:
    """What a client sees of a server fault: nothing but a request id to quote."""
    return APIError(500, f"internal server error (request id {request_id}); the details "
                    "are in the server log", None, "internal_error")


def engine_unavailable(message: str) -> APIError:
    """503 before any work was done for the request (not ready, draining, already dead):
    marked so the router may send it to another replica."""
    return APIError(503, public_reason(message), None, "engine_unavailable",
                    {RETRY_SAFE_HEADER: "1"})


def engine_died(message: str) -> APIError:
    """503 for a request that was running when the engine died: it may be what killed the
    engine, so the router returns it to its client instead of replaying it elsewhere."""
    return APIError(503, public_reason(message), None, ENGINE_DIED_CODE)


def public_reason(reason: str) -> str:
    """What a client may read of an engine failure: its first line. A core that crashed
    reports its traceback (server paths, code) after it; that stays in the server log."""
    first, _, rest = reason.partition("\n")
    return first.rstrip(":") + " (details in the server log)" if rest.strip() else first
