"""What both generation endpoints share: ordered validation, admission, and running a
``Generation`` as a JSON response or as server-sent events with disconnect handling.

Validation has one path: pydantic checks the JSON types, ``SamplingParams.validate`` and
``validate_request`` (shared with the engine core) check every range against
``state.request_limits``, for every engine request before the first is admitted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from shoal.runtime.engine.validation import validate_request
from shoal.runtime.frontend.engine_client import (
    EngineDeadError,
    EngineRequestError,
    EngineRequestFailed,
)
from shoal.runtime.http_listener import abort_connection
from shoal.runtime.kv.block_hash import effective_cache_salt
from shoal.runtime.kv_transfer.params import KVTransferParams, parse_request_params
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams
from shoal.runtime.structured.spec import GrammarSpec

from .admission import kv_blocks_estimate
from .body import decode_json, read_body
from .errors import APIError, bad_request, engine_died, engine_unavailable, internal_error
from .generation import ChoiceDelta, Generation, PromptInput
from .protocol import EmbeddingRequest, SamplingFields
from .sampling_defaults import default_of
from .state import ServerState

Body = TypeVar("Body", bound=BaseModel)
logger = logging.getLogger("shoal.api")


async def parse_body(request: Request, state: ServerState, model: type[Body]) -> Body:
    """auth (done by the route dependency) -> availability -> body size and JSON depth
    (while reading) -> model name -> field types (pydantic)."""
    state.check_available()
    raw = await read_body(request, state.settings.max_request_body_bytes)
    data = decode_json(raw, state.settings.max_json_depth)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    model_name = data.get("model")
    state.check_model(model_name if isinstance(model_name, str) else None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not _is_union_member(p)) or None
    if first["type"] == "extra_forbidden":
        unknown = sorted({str(e["loc"][-1]) for e in exc.errors()
                          if e["type"] == "extra_forbidden"})
        return bad_request(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    return bad_request(f"invalid value for {param}: {first['msg']}", param)


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "none"})


def _is_union_member(loc: int | str) -> bool:
    """pydantic puts the union member tried into the location (``prompt.str``,
    ``prompt.list[int]``); the client's field path is the rest."""
    return isinstance(loc, str) and (loc in _TYPE_LABELS or "[" in loc)


_logged_ignored: set[str] = set()


def check_fields(body: SamplingFields) -> None:
    """A 400 naming a field whose value would silently change the result; fields that
    cannot change it are accepted, and logged the first time each is seen."""
    refused = body.refused_fields()
    if refused:
        raise bad_request(f"{refused[0]} is not supported with this value by this server "
                          "(see docs/api-fields.md)", refused[0])
    for name in body.ignored_fields():
        if name not in _logged_ignored:
            _logged_ignored.add(name)
            logger.info("the request field %r is accepted and ignored (logged once)", name)


def logit_bias_of(body: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias: JSON object keys are token ids as strings."""
    if not body.logit_bias:
        return None
    try:
        return {int(k): float(v) for k, v in body.logit_bias.items()}
    except ValueError as exc:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from exc


def truncated(prompt: PromptInput, keep: int | None, state: ServerState) -> PromptInput:
    """vLLM's truncate_prompt_tokens: keep the prompt's last ``keep`` tokens (-1: as many
    as max_model_len allows)."""
    if keep is None:
        return prompt
    if keep == -1:
        keep = state.max_model_len
    if keep < 1:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1",
                          "truncate_prompt_tokens")
    if len(prompt.token_ids) <= keep:
        return prompt
    return PromptInput(prompt.token_ids[-keep:])


def sampling_params(body: SamplingFields, state: ServerState, max_tokens: int | None,
                    logprobs: int | None, structured: GrammarSpec | None = None) -> SamplingParams:
    check_fields(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    defaults = state.settings.sampling_defaults  # generation_config.json's
    params = SamplingParams(
        n=body.n,
        temperature=default_of(defaults, "temperature", body.temperature),
        top_p=default_of(defaults, "top_p", body.top_p),
        top_k=default_of(defaults, "top_k", body.top_k),
        min_p=default_of(defaults, "min_p", body.min_p),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=default_of(defaults, "repetition_penalty", body.repetition_penalty),
        seed=body.seed, max_tokens=default_of(defaults, "max_tokens", max_tokens),
        min_tokens=body.min_tokens, stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
        logit_bias=logit_bias_of(body), skip_special_tokens=body.skip_special_tokens,
        structured=structured)
    try:
        params.validate(state.request_limits)
    except InvalidParameter as exc:
        raise bad_request(exc.message, exc.param) from exc
    return params


def check_prompt_text(state: ServerState, text: str, param: str) -> None:
    """Before tokenizing: a text of B bytes has at least B / max_token_bytes tokens, so one
    whose lower bound already reaches max_model_len is refused without the tokenizer's work."""
    limit = state.max_model_len
    num_bytes = len(text.encode("utf-8"))  # valid: the JSON decoder refused lone surrogates
    if limit and num_bytes // state.max_token_bytes >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the "
                          f"{param} has {num_bytes} bytes, so at least "
                          f"{num_bytes // state.max_token_bytes} tokens", param)


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def text_byte_limit(state: ServerState) -> int | None:
    """Bytes of text that surely make max_model_len tokens or more (see check_prompt_text)."""
    return state.max_model_len * state.max_token_bytes if state.max_model_len else None


def visible_bytes(value: object, stop_after: int) -> int:
    """UTF-8 bytes of every string in JSON-like data (keys too; any other scalar counts one
    byte, its shortest JSON form), walked without recursion; stops once past ``stop_after``.
    What a chat template can write into the prompt is at least this long when rendered."""
    total = 0
    stack = [value]
    while stack and total <= stop_after:
        item = stack.pop()
        if isinstance(item, str):
            total += utf8_len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif item is not None:
            total += 1
    return total


def check_template_inputs(state: ServerState, parts: dict[str, object]) -> None:
    """Before templating: everything a chat template can see (messages with every field,
    tool definitions, documents, template kwargs) counts toward the bound the rendered
    prompt must meet, so megabytes in a tool-call's arguments or a tool's description are
    refused before any rendering or tokenizing. ``parts``: request field -> its data."""
    limit = text_byte_limit(state)
    if limit is None:
        return
    total = 0
    for name, value in parts.items():
        total += visible_bytes(value, limit - total)
        if total >= limit:
            raise bad_request(
                f"This model's maximum context length is {state.max_model_len} tokens; the "
                f"text a chat template sees (messages, tools, documents, template kwargs) "
                f"reaches {limit} bytes at {name}, so at least that many tokens", name)


def streams_every_token(body: SamplingFields | EmbeddingRequest) -> bool:
    """A stream that asked for token ids or logprobs gets each step's tokens as they are
    made (vLLM's chunks), not held until they make text."""
    logprobs = getattr(body, "logprobs", None)
    return bool(getattr(body, "stream", False)) and (
        bool(getattr(body, "return_token_ids", False))
        or (logprobs is not None and logprobs is not False))


def start_generation(request: Request, state: ServerState, prefix: str,
                     prompts: list[PromptInput], params: SamplingParams,
                     body: SamplingFields | EmbeddingRequest) -> Generation:
    """Every engine request (n per prompt) is built and validated before the first is
    admitted; admission counts all of them; only then is anything sent."""
    cache_salt = effective_cache_salt(getattr(request.state, "cache_tenant", None),
                                      body.cache_salt)
    adapter = state.adapter_for(body.model)
    kv_transfer = kv_transfer_of(body, len(prompts) * params.n)
    generation = Generation(state.client, state.tokenizer, state.metrics,
                            f"{prefix}-{uuid.uuid4().hex}", prompts, params,
                            state.eos_token_ids, body.priority, cache_salt, adapter=adapter,
                            kv_transfer=kv_transfer, every_step=streams_every_token(body))
    limits = state.request_limits
    try:
        for engine_request in generation.engine_requests():
            validate_request(engine_request, limits)
    except InvalidParameter as exc:
        raise bad_request(exc.message, exc.param) from exc
    generation.kv_blocks = params.n * sum(
        kv_blocks_estimate(len(p.token_ids), params.max_tokens, state.max_model_len,
                           state.block_size) for p in prompts)
    state.admit(len(generation.requests), generation.kv_blocks)
    state.live.add(generation)  # counted before the first send: a failure below releases it
    if adapter is not None:
        state.metrics.observe_lora_request(adapter, len(generation.requests))
    try:
        generation.start()
    except EngineDeadError as exc:
        state.release(generation)
        generation.abort_unfinished()
        raise engine_unavailable(str(exc)) from exc
    except BaseException:
        state.release(generation)
        generation.abort_unfinished()
        raise
    return generation


def kv_transfer_of(body: SamplingFields | EmbeddingRequest,
                   num_engine_requests: int) -> KVTransferParams | None:
    """vLLM's ``kv_transfer_params``: one prompt, one sample (a transfer is per request)."""
    raw = getattr(body, "kv_transfer_params", None)
    try:
        params = parse_request_params(raw)
    except ValueError as exc:
        raise bad_request(str(exc), "kv_transfer_params") from exc
    if params is not None and num_engine_requests != 1:
        raise bad_request("kv_transfer_params needs one prompt and n = 1",
                          "kv_transfer_params")
    return params


def kv_transfer_json(generation: Generation) -> dict | None:
    """The response's ``kv_transfer_params`` (a prefill for a remote decode), else None."""
    params = generation.choices[0].kv_transfer_params if generation.choices else None
    return params.to_json() if params is not None else None


def engine_error(exc: BaseException, request_id: str) -> APIError:
    if isinstance(exc, EngineRequestError):
        if exc.param == "model":  # its adapter was unloaded before the engine saw it
            return APIError(404, exc.message, "model", "model_not_found")
        return bad_request(exc.message, exc.param)
    if isinstance(exc, EngineRequestFailed):  # logged by the engine core
        return internal_error(request_id)
    return engine_died(str(exc))


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
        except (EngineDeadError, EngineRequestError, EngineRequestFailed) as exc:
            raise engine_error(exc, generation.request_id) from exc
        return Response(msgspec.json.encode(respond(generation)),
                        media_type="application/json")
    finally:
        watch.cancel()
        generation.abort_unfinished()
        state.release(generation)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await collect
        await generation.close()


async def first_delta(state: ServerState, generation: Generation) -> ChoiceDelta | None:
    """Wait for the first delta before the stream's headers go out, so a request the engine
    core rejects (an invalid grammar, which only it can check) is a 4xx, not an SSE error."""
    try:
        async for delta in generation.deltas():
            return delta
        return None
    except BaseException as exc:  # a rejection, an engine death, or the handler cancelled
        generation.abort_unfinished()
        state.release(generation)
        if isinstance(exc, (EngineDeadError, EngineRequestError, EngineRequestFailed)):
            await generation.close()
            raise engine_error(exc, generation.request_id) from exc
        raise


@dataclass(frozen=True)
class SseFraming:
    """How a protocol writes its events: OpenAI's bare ``data:`` lines closed by
    ``[DONE]``, or Anthropic's named events (``event: <type>``, no terminator) whose
    errors are an ``error`` event in its own shape."""

    named: bool = False
    done: bytes | None = b"data: [DONE]\n\n"

    def frame(self, payload: dict) -> bytes:
        data = b"data: " + msgspec.json.encode(payload) + b"\n\n"
        return b"event: " + payload["type"].encode() + b"\n" + data if self.named else data

    def error(self, exc: APIError) -> dict:
        return exc.anthropic_body() if self.named else exc.body()


OPENAI_SSE = SseFraming()
ANTHROPIC_SSE = SseFraming(named=True, done=None)


def stream_response(state: ServerState, generation: Generation,
                    chunks: Callable[[ChoiceDelta], list[dict]],
                    usage_chunk: Callable[[], dict] | None,
                    first: ChoiceDelta | None = None,
                    framing: SseFraming = OPENAI_SSE) -> StreamingResponse:
    """SSE: one event per delta. A disconnect makes Starlette cancel this generator (it
    listens for http.disconnect), and ``finally`` aborts the engine requests; an engine
    death ends the stream with an error event. ``first``: a delta already taken from the
    generation (``first_delta``), sent first."""

    async def all_deltas() -> AsyncIterator[ChoiceDelta]:
        if first is not None:
            yield first
        async for delta in generation.deltas():
            yield delta

    async def events() -> AsyncIterator[bytes]:
        try:
            try:
                async for delta in all_deltas():
                    for chunk in chunks(delta):
                        yield framing.frame(chunk)
                if usage_chunk is not None:
                    yield framing.frame(usage_chunk())
            except (EngineDeadError, EngineRequestError, EngineRequestFailed) as exc:
                yield framing.frame(framing.error(engine_error(exc, generation.request_id)))
            if framing.done is not None:
                yield framing.done
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
            await super().__call__(scope, receive, stalled_send_aborts(
                send, self._state.settings.stream_stall_timeout))
        except ClientStalled:
            logger.warning("request %s: the client read nothing for %.0f s; aborted",
                           self._generation.request_id, self._state.settings.stream_stall_timeout)
            self._generation.abort_unfinished()
            await abort_connection(scope)
        finally:
            self._generation.abort_unfinished()
            self._state.release(self._generation)


class ClientStalled(Exception):
    """A write to the client stayed blocked (its receive window full) past the stall limit."""


def stalled_send_aborts(send, stall_timeout: float):
    """``send`` that raises ``ClientStalled`` when one write blocks longer than the limit: the
    transport pauses us once the client stops reading, and without this the engine would
    keep generating into a buffer nobody drains (0 disables)."""
    if not stall_timeout:
        return send

    async def limited(message) -> None:
        try:
            async with asyncio.timeout(stall_timeout):
                await send(message)
        except TimeoutError:
            raise ClientStalled() from None

    return limited


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def now_s() -> int:
    return int(time.time())
