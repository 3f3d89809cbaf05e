"""The FastAPI application: routes, the API-key guard on /v1/*, /tokenize and /detokenize,
probes and metrics. Any exception a handler did not turn into an ``APIError`` is a generic
500 carrying a request id; its traceback is logged once, rate-limited per cause."""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from shoal.runtime.log_limits import RateLimitedLog

from shoal import __version__
from shoal.contract.response_ids import READY_INSTANCE_FIELD

from .auth import Authenticator
from .errors import APIError, bad_request, internal_error, is_anthropic_path, public_reason
from .lora_adapters import load_lora_adapter, model_cards, unload_lora_adapter
from .openapi import REQUEST_BODIES, document_request_bodies
from .protocol import DetokenizeRequest, TokenizeRequest
from .responses_store import ResponseStore
from .serving_chat import chat_prompt, create_chat_completion, render_chat
from .serving_common import check_prompt_text, parse_body
from .serving_completion import create_completion
from .serving_embeddings import create_embedding
from .serving_messages import count_tokens, create_message
from .serving_responses import create_response
from .state import ServerState

logger = logging.getLogger("shoal.api")


def failure_cause(exc: BaseException) -> str:
    """A rate-limit key: the exception type and the innermost frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__name__}@{where}"


class InternalErrors:
    """ASGI middleware: an unhandled exception becomes a generic 500 with a request id (or,
    once a response has started, ends it); logged here, rate-limited, and not re-raised, so
    Starlette and uvicorn do not log it again."""

    def __init__(self, app, log: RateLimitedLog, on_error) -> None:
        self.app = app
        self.log = log
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            request_id = f"req-{uuid.uuid4().hex}"
            self.log.log(logging.ERROR, failure_cause(exc), "internal error in %s %s (%s)",
                         scope.get("method"), scope.get("path"), request_id, exc_info=exc)
            self.on_error(500)
            if not started:
                await internal_error(request_id).response(
                    is_anthropic_path(scope.get("path", "")))(scope, receive, send)


def _post_endpoint(state: ServerState, handle: Callable[[Request], Awaitable[Any]],
                   generates: bool) -> Callable[[Request], Awaitable[Any]]:
    async def endpoint(request: Request) -> Any:
        if generates:
            state.check_generates()
        return await handle(request)

    return endpoint


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="shoal", version=__version__, redoc_url=None)
    app.state.shoal = state
    settings = getattr(state, "settings", None)  # None: only the routes are wanted (docs)
    auth = Authenticator(tuple(k.encode() for k in settings.api_keys), settings.tenant_header,
                         settings.cache_sharing == "tenant") if settings else Authenticator(())
    errors_log = RateLimitedLog(logger)
    document_request_bodies(app, REQUEST_BODIES)

    def require_api_key(request: Request) -> None:
        try:
            identity = auth.authenticate(request)
        except APIError:
            state.metrics.observe_rejected(401)
            raise
        request.state.tenant = identity  # owns what it stores (the Responses store)
        request.state.cache_tenant = auth.cache_tenant(identity)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status != 401:
            state.metrics.observe_rejected(exc.status)
        return exc.response(is_anthropic_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(str(exc.errors()[0].get("msg", exc))).response(
            is_anthropic_path(request.url.path))

    guarded = [Depends(require_api_key)]
    app.add_middleware(InternalErrors, log=errors_log,
                       on_error=lambda status: state.metrics.observe_rejected(status))

    responses = ResponseStore()
    # the POST routes whose handlers read the request themselves; True: it generates text,
    # which a pooling server refuses
    handlers: dict[str, tuple[Callable[[Request], Awaitable[Any]], bool]] = {
        "/v1/completions": (lambda r: create_completion(r, state), True),
        "/v1/chat/completions": (lambda r: create_chat_completion(r, state), True),
        "/v1/messages": (lambda r: create_message(r, state), True),
        "/v1/messages/count_tokens": (lambda r: count_tokens(r, state), False),
        "/v1/embeddings": (lambda r: create_embedding(r, state), False),
        "/v1/responses": (lambda r: create_response(r, state, responses), True),
        "/v1/load_lora_adapter": (lambda r: load_lora_adapter(r, state), False),
        "/v1/unload_lora_adapter": (lambda r: unload_lora_adapter(r, state), False),
    }
    for path, (handle, generates) in handlers.items():
        app.add_api_route(path, _post_endpoint(state, handle, generates), methods=["POST"],
                          dependencies=guarded, response_model=None)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": model_cards(state)}

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict:
        """Exactly the ids a completion (``prompt``) or a chat (``messages``) would run."""
        body = await parse_body(request, state, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = (await render_chat(state, chat_prompt(
                body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                add_special_tokens=bool(body.add_special_tokens),
                allow_special_tokens_in_content=body.allow_special_tokens_in_content))
                      ).token_ids
        else:
            check_prompt_text(state, body.prompt or "", "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = (await asyncio.to_thread(state.renderer.encode_text, body.prompt or "",
                                              add)).token_ids
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, state, DetokenizeRequest)
        vocab = state.tokenizer.vocab_size
        if len(body.tokens) > state.max_model_len:
            raise bad_request(f"at most max_model_len ({state.max_model_len}) tokens",
                              "tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    tokenizer_body: list[bytes] = []  # built on first use, then the same bytes every time

    @app.get("/tokenizer")
    async def tokenizer() -> Response:
        """The tokenizer and chat template this engine encodes with, for a router in
        token-precise mode (`shoal route --tokenizer-from-engine`). Open like /metrics (a
        router may hold no key): it takes no input and reveals the vocabulary and template
        only, never weights, requests or tenants."""
        if not tokenizer_body:
            tokenizer_body.append(json.dumps(state.tokenizer.to_wire()).encode())
        return Response(tokenizer_body[0], media_type="application/json")

    @app.get("/version")
    async def version() -> dict:
        """As vLLM's: the server's version (open, like the probes)."""
        return {"version": __version__}

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the engine process answers heartbeats (checked in the background)."""
        if state.client.is_dead:
            return JSONResponse({"status": "dead",
                                 "reason": public_reason(state.client.dead_reason or "")},
                                status_code=503)
        return JSONResponse({"status": "ok", "phase": state.phase})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 only once warmup is done and while not draining."""
        phase = state.phase
        body = {"status": readiness_status(phase), "phase": phase,
                "phase_durations": state.client.phase_durations,
                READY_INSTANCE_FIELD: responses.instance}  # routers send follow-ups by it
        return JSONResponse(body, status_code=200 if phase == "ready" else 503)

    def require_metrics_key(request: Request) -> None:
        """--metrics-auth: prefix-cache counters are a cross-tenant oracle, so /metrics here
        needs the API key (the router scrapes with its --upstream-api-key; Prometheus uses
        --metrics-port)."""
        if state.settings.metrics_auth:
            require_api_key(request)

    @app.get("/metrics", dependencies=[Depends(require_metrics_key)])
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
