"""The FastAPI application: routes, the API-key guard on /v1/*, probes and metrics."""

from __future__ import annotations

import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .errors import APIError, bad_request
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving_chat import create_chat_completion, render_chat
from .serving_common import parse_body
from .serving_completion import create_completion
from .state import ServerState


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="shoal", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.shoal = state

    def require_api_key(request: Request) -> None:
        expected = state.settings.api_key
        if expected is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), expected.encode()):
            state.metrics.observe_rejected(401)
            raise APIError(401, "invalid or missing API key", None, "invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status != 401:
            state.metrics.observe_rejected(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(str(exc.errors()[0].get("msg", exc))).response()

    guarded = [Depends(require_api_key)]

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "shoal",
             "root": state.settings.model_dir, "max_model_len": state.max_model_len}
            for name in state.settings.served_model_names]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body, _ = await parse_body(request, state, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = render_chat(state, body.messages, body.add_generation_prompt).token_ids
        else:
            tokens = state.tokenizer.encode(body.prompt or "", body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body, _ = await parse_body(request, state, DetokenizeRequest)
        vocab = state.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the engine process answers heartbeats (checked in the background)."""
        if state.client.is_dead:
            return JSONResponse({"status": "dead", "reason": state.client.dead_reason},
                                status_code=503)
        return JSONResponse({"status": "ok", "phase": state.phase})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 only once warmup is done and while not draining."""
        phase = state.phase
        body = {"status": readiness_status(phase), "phase": phase,
                "phase_durations": state.client.phase_durations}
        return JSONResponse(body, status_code=200 if phase == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def readiness_status(phase: str) -> str:
    """The coarse state a probe reader wants: ready, starting, draining or failed."""
    if phase in ("ready", "draining"):
        return phase
    if phase in ("dead", "failed"):
        return "failed"
    return "starting"
