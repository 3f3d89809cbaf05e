"""One API request in flight: its engine requests (prompts x n) and their streamed choices.

Each engine request is followed by a task that feeds its outputs to the output processor
(frontend/output_processor.py, the offline ``LLM``'s too) and puts the ``ChoiceDelta``s it
makes on one queue, so both endpoints, streaming or not, consume the same sequence. A stop
string found there ends the choice and aborts the engine request. ``abort`` (client disconnect, drain timeout) stops every unfinished engine request;
an engine death surfaces as ``EngineDeadError`` from ``deltas()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shoal.runtime.frontend.engine_client import AsyncEngineClient, RequestStream
from shoal.runtime.frontend.output_processor import (
    Choice,
    ChoiceDelta,
    OutputProcessor,
    PromptInput,
    fan_out,
)
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.kv_transfer.params import KVTransferParams
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreOutput, EngineCoreRequest, FinishReason

from .metrics import ServerMetrics, request_phases

_ABORTED = object()  # queued by abort(): deltas() ends


@dataclass
class _EngineRequest:
    choice: Choice
    stream: RequestStream | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    queued_at: float = 0.0  # engine-side stamps from the first output (0: none yet)
    scheduled_at: float = 0.0
    done: bool = False


class Generation:
    def __init__(self, client: AsyncEngineClient, tokenizer: Tokenizer, metrics: ServerMetrics,
                 request_id: str, prompts: list[PromptInput], params: SamplingParams,
                 eos_token_ids: list[int], priority: int = 0,
                 cache_salt: str | None = None, kv_blocks: int = 0,
                 adapter: str | None = None,
                 kv_transfer: KVTransferParams | None = None, every_step: bool = False) -> None:
        self.client = client
        self.every_step = every_step  # OutputProcessor's: a delta for every step's tokens
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.cache_salt = cache_salt
        self.adapter = adapter  # the LoRA adapter's name; None: the base model
        self.kv_transfer = kv_transfer  # vLLM's kv_transfer_params (one engine request)
        self.kv_blocks = kv_blocks  # worst-case KV footprint of all its engine requests
        self.arrival = time.monotonic()
        self.requests = [_EngineRequest(c) for c in fan_out(
            request_id, prompts, [params] * len(prompts))]
        self._deltas: asyncio.Queue = asyncio.Queue()
        self._unfinished = len(self.requests)  # choices whose last delta deltas() has not given
        self._tasks: list[asyncio.Task] = []

    @property
    def choices(self) -> list[Choice]:
        return [r.choice for r in self.requests]

    def engine_requests(self) -> list[EngineCoreRequest]:
        """What ``start`` sends, one per choice (validated by the caller before it)."""
        now = time.time()
        return [EngineCoreRequest(
            request_id=req.choice.request_id, prompt_token_ids=req.choice.prompt.token_ids,
            sampling_params=req.choice.params, eos_token_ids=self.eos_token_ids, arrival_time=now,
            priority=self.priority, cache_salt=self.cache_salt, adapter_id=self.adapter,
            kv_transfer=self.kv_transfer)
            for req in self.requests]

    def start(self) -> None:
        for req, engine_request in zip(self.requests, self.engine_requests(), strict=True):
            req.stream = self.client.add_request(engine_request)
            self._tasks.append(asyncio.create_task(self._follow(req)))

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas, interleaved, until all choices finish (or an abort). May be
        iterated again after a break: it resumes where the last iteration stopped."""
        while self._unfinished:
            item = await self._deltas.get()
            if item is _ABORTED:
                return
            if isinstance(item, BaseException):
                self.abort()
                raise item
            if item.finish_reason is not None:
                self._unfinished -= 1
            yield item

    async def collect(self) -> list[Choice]:
        async for _ in self.deltas():
            pass
        return self.choices

    def abort(self, end_streams: bool = False) -> None:
        """Abort unfinished engine requests. ``end_streams``: finish their choices with
        reason "abort" (drain) instead of just stopping (client gone)."""
        live = [r for r in self.requests if not r.done]
        self.client.abort([r.choice.request_id for r in live])
        for req in live:
            if end_streams and req.stream is not None:
                req.stream.queue.put_nowait(EngineCoreOutput(
                    request_id=req.choice.request_id, version=req.stream.version, new_token_ids=[],
                    finish_reason=FinishReason.ABORT))
            elif not end_streams:
                req.done = True
                self.metrics.observe_finished("abort", time.monotonic() - self.arrival)
        if not end_streams:
            for task in self._tasks:
                task.cancel()
            self._deltas.put_nowait(_ABORTED)

    def abort_unfinished(self) -> None:
        if any(not r.done for r in self.requests):
            self.abort()

    async def close(self) -> None:
        """Abort whatever is still running and wait for the follower tasks to end."""
        self.abort_unfinished()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, req: _EngineRequest) -> None:
        assert req.stream is not None
        processor = OutputProcessor(self.tokenizer, req.choice, self.every_step)
        try:
            while True:
                output = await req.stream.get()
                self._observe_timing(req, len(output.new_token_ids))
                if output.scheduled_time:
                    req.queued_at, req.scheduled_at = output.queued_time, output.scheduled_time
                delta = processor.add(output)
                if processor.abort_engine:
                    self.client.abort([req.choice.request_id])  # the engine does not know
                if delta is None:
                    continue
                self._deltas.put_nowait(delta)
                if delta.finish_reason is not None:
                    req.done = True
                    self.metrics.observe_finished(delta.finish_reason,
                                                  time.monotonic() - self.arrival)
                    self._observe_phases(req)
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # engine death or a rejection: the whole request fails
            req.done = True
            self._deltas.put_nowait(exc)

    def _observe_timing(self, req: _EngineRequest, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.observe_first_token(now - self.arrival)
            if num_tokens > 1:
                self.metrics.observe_inter_token(0.0, num_tokens - 1)
        else:
            self.metrics.observe_inter_token((now - req.last_token_at) / num_tokens, num_tokens)
        req.last_token_at = now

    def _observe_phases(self, req: _EngineRequest) -> None:
        """Only requests that produced a token have an engine timeline to split."""
        if req.first_token_at is None or not req.scheduled_at:
            return
        self.metrics.observe_phases(request_phases(
            req.queued_at, req.scheduled_at, req.first_token_at, req.last_token_at,
            len(req.choice.token_ids)))
