"""What both generation endpoints share: ordered validation, admission, and running a
``Generation`` as a JSON response or as server-sent events with disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from shoal.runtime.engine.client import EngineDeadError, EngineRequestError
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams

from .admission import kv_blocks_estimate
from .errors import APIError, bad_request, engine_unavailable
from .generation import ChoiceDelta, Generation, PromptInput
from .protocol import SamplingFields
from .state import ServerState

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, state: ServerState, model: type[Body]) -> tuple[Body, int]:
    """auth (done by the route dependency) -> availability -> model name -> parameters.
    Returns the parsed body and its size in bytes (checked later, after the ranges)."""
    state.check_available()
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    model_name = data.get("model")
    state.check_model(model_name if isinstance(model_name, str) else None)
    try:
        return model.model_validate(data), len(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        unknown = sorted({str(e["loc"][-1]) for e in exc.errors()
                          if e["type"] == "extra_forbidden"})
        return bad_request(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    return bad_request(f"invalid value for {param}: {first['msg']}", param)


def sampling_params(body: SamplingFields, state: ServerState, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos, logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens)
    try:
        params.validate(state.settings.max_logprobs)
    except InvalidParameter as exc:
        raise bad_request(exc.message, exc.param) from exc
    return params


def check_size(state: ServerState, body_bytes: int) -> None:
    limit = state.settings.max_request_body_bytes
    if body_bytes > limit:
        raise APIError(413, f"the request body has {body_bytes} bytes; the limit is {limit}",
                       None, "request_too_large")


def check_lengths(state: ServerState, prompts: list[PromptInput], params: SamplingParams) -> None:
    limit = state.max_model_len
    vocab = state.client.ready_info.vocab_size if state.client.ready_info else 0
    for prompt in prompts:
        n = len(prompt.token_ids)
        if n == 0:
            raise bad_request("the prompt is empty", "prompt")
        if vocab and any(not 0 <= t < vocab for t in prompt.token_ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        if n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; the "
                              f"prompt has {n} tokens, which leaves no room to generate",
                              "prompt")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens; you "
                              f"requested {n + params.max_tokens} tokens ({n} in the prompt, "
                              f"{params.max_tokens} for the completion)", "max_tokens")


def start_generation(state: ServerState, prefix: str, prompts: list[PromptInput],
                     params: SamplingParams, body: SamplingFields) -> Generation:
    kv_blocks = params.n * sum(
        kv_blocks_estimate(len(p.token_ids), params.max_tokens, state.max_model_len,
                           state.block_size) for p in prompts)
    state.admit(len(prompts) * params.n, kv_blocks)
    generation = Generation(state.client, state.tokenizer, state.metrics,
                            f"{prefix}-{uuid.uuid4().hex}", prompts, params,
                            state.eos_token_ids, body.priority, body.cache_salt, kv_blocks)
    try:
        generation.start()
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from exc
    state.live.add(generation)
    return generation


def engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, EngineRequestError):
        return bad_request(exc.message, exc.param)
    return engine_unavailable(str(exc))


async def run_to_completion(request: Request, state: ServerState, generation: Generation,
                            respond: Callable[[Generation], dict]) -> Response:
    """Non-streaming: collect every choice; a client that hangs up aborts the request."""
    collect = asyncio.ensure_future(generation.collect())
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client is gone
            collect.cancel()
            generation.abort()
            return Response(status_code=499)
        try:
            collect.result()
        except (EngineDeadError, EngineRequestError) as exc:
            raise engine_error(exc) from exc
        return Response(msgspec.json.encode(respond(generation)),
                        media_type="application/json")
    finally:
        watch.cancel()
        generation.abort_unfinished()
        state.release(generation)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await collect
        await generation.close()


def stream_response(state: ServerState, generation: Generation,
                    chunks: Callable[[ChoiceDelta], list[dict]],
                    usage_chunk: Callable[[], dict] | None) -> StreamingResponse:
    """SSE: one event per delta. A disconnect makes Starlette cancel this generator (it
    listens for http.disconnect), and ``finally`` aborts the engine requests; an engine
    death ends the stream with an error event."""

    async def events() -> AsyncIterator[bytes]:
        try:
            try:
                async for delta in generation.deltas():
                    for chunk in chunks(delta):
                        yield _sse(chunk)
                if usage_chunk is not None:
                    yield _sse(usage_chunk())
            except (EngineDeadError, EngineRequestError) as exc:
                yield _sse(engine_error(exc).body())
            yield b"data: [DONE]\n\n"
        finally:
            # synchronous first: when the ASGI server cancels us on disconnect, awaits here
            # are cancelled too, but the abort has already been sent
            generation.abort_unfinished()
            state.release(generation)
            await generation.close()

    return GenerationStream(events(), state, generation)


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its generation however the response ends, including a
    disconnect before the body generator ever started (its ``finally`` would not run)."""

    def __init__(self, content: AsyncIterator[bytes], state: ServerState,
                 generation: Generation) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._state = state
        self._generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.abort_unfinished()
            self._state.release(self._generation)


def _sse(payload: dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def now_s() -> int:
    return int(time.time())
