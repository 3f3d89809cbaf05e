"""The API process's side of the engine: an asyncio client over ZeroMQ.

It starts the engine-core process, follows its startup phases, sends requests and aborts,
and routes each step's outputs to per-request queues. Outputs for requests it no longer
tracks (aborted, finished) or for an older version of a request are stale and dropped. A
heartbeat runs every ``heartbeat_interval`` seconds; if the process exits, a heartbeat is
not answered within ``heartbeat_timeout``, or one step has made no progress (used no CPU)
for the config's ``rank_timeout``, the engine is dead: every live request gets an
``EngineDeadError`` and ``on_dead`` is called (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from shoal.runtime.config import EngineConfig
from shoal.runtime.wire.core_frames import (
    CoreMessageType,
    FatalError,
    Heartbeat,
    RequestError,
    StartupPhase,
    UtilityCall,
    UtilityReply,
)
from shoal.runtime.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    SchedulerStats,
)

logger = logging.getLogger("shoal.engine.client")


class EngineDeadError(RuntimeError):
    """The engine-core process died or stopped answering; no request can complete."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed before it was ready."""


class EngineRequestError(ValueError):
    """The engine core rejected a request (the front end's checks should catch these)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class EngineRequestFailed(RuntimeError):
    """The engine failed this one request (its own fault, isolated); the engine lives on."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} failed in the engine")
        self.request_id = request_id


@dataclass
class RequestStream:
    """Outputs of one engine request, in order; an exception item ends it with an error."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    version: int = 0
    finished: bool = False

    async def get(self) -> EngineCoreOutput:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, heartbeat_interval: float = 0.5,
                 heartbeat_timeout: float = 3.0,
                 on_dead: Callable[[str], None] | None = None,
                 on_stats: Callable[[SchedulerStats], None] | None = None) -> None:
        self.config = config
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.on_dead = on_dead
        self.on_stats = on_stats
        self.phase = "starting"
        self.phase_durations: dict[str, float] = {}
        self.ready_info: StartupPhase | None = None
        self.stats = SchedulerStats()
        self.dead_reason: str | None = None
        self.streams: dict[str, RequestStream] = {}
        self._ipc_dir = tempfile.mkdtemp(prefix="shoal-ipc-")
        self._context = zmq.asyncio.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._output = self._context.socket(zmq.PULL)
        self._heartbeat = self._context.socket(zmq.PAIR)
        self._heartbeat.setsockopt(zmq.LINGER, 0)
        self._input.bind(f"ipc://{self._ipc_dir}/input")
        self._output.bind(f"ipc://{self._ipc_dir}/output")
        self._heartbeat.bind(f"ipc://{self._ipc_dir}/heartbeat")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {
            CoreMessageType.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
            CoreMessageType.UTILITY_REPLY: msgspec.msgpack.Decoder(UtilityReply),
            CoreMessageType.STARTUP: msgspec.msgpack.Decoder(StartupPhase),
            CoreMessageType.REQUEST_ERROR: msgspec.msgpack.Decoder(RequestError),
            CoreMessageType.FATAL: msgspec.msgpack.Decoder(FatalError),
        }
        self._heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._ready = asyncio.Event()
        self._startup_error: str | None = None
        self._tasks: list[asyncio.Task] = []
        self.process: subprocess.Popen | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        # a fresh interpreter (like multiprocessing's spawn) that does not re-import our
        # __main__, so any script or console entry point can start an engine
        self.process = subprocess.Popen([
            sys.executable, "-m", "shoal.runtime.engine.core_proc",
            "--input", f"ipc://{self._ipc_dir}/input",
            "--output", f"ipc://{self._ipc_dir}/output",
            "--heartbeat", f"ipc://{self._ipc_dir}/heartbeat",
            "--parent-pid", str(os.getpid()),
            "--config", msgspec.json.encode(self.config).decode()])
        self._tasks = [asyncio.create_task(self._read_outputs()),
                       asyncio.create_task(self._watch())]

    async def wait_ready(self) -> StartupPhase:
        """Returns the ready report; raises EngineStartupError if startup fails."""
        await self._ready.wait()
        if self._startup_error is not None:
            raise EngineStartupError(self._startup_error)
        assert self.ready_info is not None
        return self.ready_info

    @property
    def is_ready(self) -> bool:
        return self.ready_info is not None and self.dead_reason is None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def shutdown(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.process is not None and self.process.poll() is None:
            # a message, not SIGTERM: the core ignores SIGTERM, which a supervisor may send
            # to the whole process group while this process is still draining
            with contextlib.suppress(zmq.ZMQError):
                self._send(RequestType.UTILITY, UtilityCall(next(self._call_ids), "shutdown"))
            try:
                await asyncio.to_thread(self.process.wait, timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait, 5.0)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._heartbeat.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request.request_id in self.streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(request.request_id)
        self.streams[request.request_id] = stream
        self._send(RequestType.ADD, request)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Stop tracking the requests and tell the engine; a no-op for finished ones."""
        live = [rid for rid in request_ids if self.streams.pop(rid, None) is not None]
        if live and self.dead_reason is None:
            self._send(RequestType.ABORT, live)

    async def call_utility(self, method: str, timeout: float = 10.0,
                           args: list[str] | None = None) -> UtilityReply:
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        try:
            self._send(RequestType.UTILITY, UtilityCall(call_id, method, args or []))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending_calls.pop(call_id, None)

    def _send(self, kind: RequestType, message: object) -> None:
        # PUSH with an unbounded HWM never blocks here; frames queue until the core reads
        self._input.send_multipart([kind.value, self._encoder.encode(message)], copy=False)

    # -- background tasks -----------------------------------------------------------------
    async def _read_outputs(self) -> None:
        """A failure here has no per-request recovery: it fails every live request."""
        try:
            await self._read_outputs_forever()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine output handler failed")
            self._mark_dead(f"the engine output handler failed: {exc!r}")

    async def _read_outputs_forever(self) -> None:
        while True:
            kind, payload = await self._output.recv_multipart()
            message_type = CoreMessageType(kind)
            message = self._decoders[message_type].decode(payload)
            if message_type is CoreMessageType.OUTPUTS:
                self._route(message)
            elif message_type is CoreMessageType.UTILITY_REPLY:
                future = self._pending_calls.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result(message)
            elif message_type is CoreMessageType.STARTUP:
                self._on_startup(message)
            elif message_type is CoreMessageType.REQUEST_ERROR:
                stream = self.streams.pop(message.request_id, None)
                if stream is not None:
                    stream.queue.put_nowait(
                        EngineRequestFailed(message.request_id) if message.internal
                        else EngineRequestError(message.param, message.message))
            else:
                self._mark_dead(f"the engine core failed:\n{message.message}")

    def _route(self, batch: EngineCoreOutputs) -> None:
        for output in batch.outputs:
            stream = self.streams.get(output.request_id)
            if stream is None or output.version < stream.version:
                continue  # aborted/finished here already, or computed for a revoked version
            stream.version = output.version
            if output.finish_reason is not None:
                stream.finished = True
                del self.streams[output.request_id]
            stream.queue.put_nowait(output)
        if batch.stats is not None:
            self.stats = batch.stats
            if self.on_stats is not None:
                self.on_stats(batch.stats)

    def _on_startup(self, message: StartupPhase) -> None:
        self.phase = message.phase
        self.phase_durations = dict(message.durations)
        if message.phase == "ready":
            self.ready_info = message
            self._ready.set()

    async def _watch(self) -> None:
        """Process liveness always; heartbeats once the engine is ready."""
        assert self.process is not None
        while self.dead_reason is None:
            await asyncio.sleep(self.heartbeat_interval)
            if self.process.poll() is not None:
                await asyncio.sleep(0.2)  # let a FATAL report that is in flight arrive first
                self._mark_dead(f"the engine core process exited with code "
                                f"{self.process.returncode}")
                return
            if not self._ready.is_set():
                continue
            try:
                beat = await self._beat()
            except TimeoutError:
                self._mark_dead(f"the engine core did not answer a heartbeat within "
                                f"{self.heartbeat_timeout:.1f} s (stopped or hung)")
                return
            if beat.step_stalled_s > self.config.rank_timeout:
                self._mark_dead(f"the engine core has been stuck in one step for "
                                f"{beat.step_stalled_s:.1f} s without progress (limit "
                                f"{self.config.rank_timeout} s)")
                return

    async def _beat(self) -> Heartbeat:
        call_id = next(self._call_ids)
        try:
            await self._heartbeat.send(self._encoder.encode(Heartbeat(call_id)), zmq.NOBLOCK)
        except zmq.Again as exc:  # the core's end is gone or not reading
            raise TimeoutError from exc
        deadline = time.monotonic() + self.heartbeat_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self._heartbeat.poll(remaining * 1000):
                raise TimeoutError
            beat = self._heartbeat_decoder.decode(await self._heartbeat.recv())
            if beat.call_id == call_id:  # older replies arrived late: skip them
                return beat

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.phase = "dead"
        logger.error("engine dead: %s", reason)
        if not self._ready.is_set():
            self._startup_error = reason
            self._ready.set()
        error = EngineDeadError(reason)
        for stream in self.streams.values():
            stream.queue.put_nowait(error)
        self.streams.clear()
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # hung: make sure it is gone before we exit
        if self.on_dead is not None:
            self.on_dead(reason)
