"""The engine-core process: a ZeroMQ loop around ``EngineCore``.

Started by the API process (``AsyncEngineClient``) as ``python -m`` of this module. It
reports its startup phases, then loops: take every waiting input without blocking while
there is work (block briefly when idle), run one step, send that step's outputs. Heartbeats
are answered between steps, so a busy engine still proves it is alive and a hung one
(stopped, deadlocked) is noticed by the API. While idle, the loop probes every
tensor-parallel rank each second, so a rank that dies or stops between requests is fatal
within about a second, not at the next step. A request's own failure (rejected on arrival,
or isolated by the core after a step raised) is sent as a ``RequestError`` for that request
alone; any other exception is fatal: it is reported on the output socket and the process
exits non-zero. It never outlives the API process, and only that process stops it (a ``shutdown`` message;
SIGTERM and SIGINT are ignored, so a signal to the whole process group lets the API drain).

Heartbeats are answered by a thread on their own socket, with how long the current step has
gone without progress (CPU used): the API tells a slow step (a prefill on busy cores) from a
stuck one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import freeze_gc_after_startup
from shoal.runtime.engine.kv_events_topic import kv_events_topic
from shoal.runtime.executor.progress import made_progress
from shoal.runtime.log_limits import RateLimitedLog
from shoal.runtime.wire.core_frames import (
    CoreMessageType,
    FatalError,
    Heartbeat,
    RequestError,
    StartupPhase,
    UtilityCall,
    UtilityReply,
)
from shoal.runtime.wire.messages import EngineCoreOutputs, EngineCoreRequest, RequestType

logger = logging.getLogger("shoal.engine.core_proc")
IDLE_POLL_MS = 100
STATS_INTERVAL_S = 0.1
# While idle, every rank is probed this often (a dead or stopped rank would otherwise go
# unnoticed until the next request's step); a healthy idle rank answers a ping in
# milliseconds, the timeout only bounds a rank that is alive but hung.
RANK_PROBE_INTERVAL_S = 1.0
RANK_PROBE_TIMEOUT_S = 3.0


class _Startup:
    """Times the startup phases and reports each one as it begins."""

    def __init__(self, send) -> None:
        self._send = send
        self.durations: dict[str, float] = {}
        self._phase = ""
        self._since = time.monotonic()

    def begin(self, phase: str, **ready_info: object) -> None:
        now = time.monotonic()
        if self._phase:
            self.durations[self._phase] = round(now - self._since, 4)
        self._phase, self._since = phase, now
        self._send(CoreMessageType.STARTUP,
                   StartupPhase(phase=phase, durations=dict(self.durations), **ready_info))


def _phase_reporting(executor, startup: _Startup):
    """Wraps an executor so the core's KV allocation and warmup show as their own phase."""
    from shoal.runtime.executor.base import Executor

    class PhaseReportingExecutor(Executor):
        @property
        def model_config(self):
            return executor.model_config

        def kv_bytes_per_block(self) -> int:
            return executor.kv_bytes_per_block()

        def profile_num_kv_blocks(self) -> int | None:  # GPU KV sizing (phase "profiling")
            return executor.profile_num_kv_blocks()

        def initialize_kv_cache(self, num_blocks: int) -> None:
            startup.begin("capturing")
            executor.initialize_kv_cache(num_blocks)

        def grammar_backend(self):
            return executor.grammar_backend()

        def execute(self, plan):
            return executor.execute(plan)

        def add_lora(self, name: str, path: str) -> None:
            executor.add_lora(name, path)

        def remove_lora(self, name: str) -> None:
            executor.remove_lora(name)

        def kv_block_io(self):
            return executor.kv_block_io()

        def check_health(self, timeout_s: float | None = None) -> None:
            executor.check_health(timeout_s)

        def shutdown(self) -> None:
            executor.shutdown()

    return PhaseReportingExecutor()


def build_engine_core(config: EngineConfig, startup: _Startup):
    startup.begin("loading")  # imports (torch) count as loading
    from shoal.runtime.engine.core import EngineCore

    if config.tensor_parallel_size == 1:
        from shoal.runtime.executor.uniproc import UniProcExecutor

        executor = _phase_reporting(UniProcExecutor(config), startup)
        startup.begin("profiling")
        return EngineCore(config, executor)
    return EngineCore(config)  # the core picks the multiprocess executor for TP > 1


class LoopProgress:
    """How long the loop's current step has gone without computing, for the heartbeat
    thread (executor/progress.py: stuck means no progress, not a long step). The CPU time
    of this process (every thread's) and of the executor's worker processes, if it has any
    (tensor-parallel ranks: the core waits on them without CPU while they compute), is read
    at each heartbeat, and the step counts as stalled since the last beat at which it had
    advanced (or since it began). A step that waits on something that does not compute (a
    stopped or deadlocked rank, a lock, a blocking read) stalls from its start. The step's
    start is one tuple, replaced whole (atomic under the GIL)."""

    def __init__(self, clock=time.monotonic, cpu_clock=time.process_time) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self._worker_cpu: Callable[[], float] = lambda: 0.0
        # the workers' CPU as the heartbeat last read it: a step's start takes this one, so
        # the engine loop reads no /proc files (a step's first beat may then count some of
        # the workers' CPU from before the step: only ever more lenient)
        self._workers_read = 0.0
        self.step: tuple[float, float] | None = None  # (wall, CPU) when it began
        # the step the last beat saw, that beat's (wall, CPU), when it last progressed
        self._seen: tuple[tuple[float, float] | None, float, float, float] = (None, 0, 0, 0)

    def count_workers(self, worker_cpu: Callable[[], float]) -> None:
        """Count the CPU seconds ``worker_cpu`` reports (the executor's worker processes)
        as the step's progress too."""
        self._worker_cpu = worker_cpu

    def begin_step(self) -> None:
        self.step = (self._clock(), self._cpu_clock() + self._workers_read)

    def end_step(self) -> None:
        self.step = None

    def step_stalled_s(self) -> float:
        """Seconds since the current step last made progress (0 between steps); called by
        the heartbeat thread only."""
        step = self.step
        if step is None:
            return 0.0
        self._workers_read = self._worker_cpu()
        now, cpu = self._clock(), self._cpu_clock() + self._workers_read
        seen_step, then, then_cpu, progressed_at = self._seen
        if seen_step is not step:  # the first beat of this step: since its start
            then, then_cpu, progressed_at = step[0], step[1], step[0]
        if made_progress(cpu - then_cpu, now - then):
            progressed_at = now
        self._seen = (step, now, cpu, progressed_at)
        return now - progressed_at


def start_heartbeat_thread(context: zmq.Context, address: str,
                           progress: LoopProgress) -> threading.Thread:
    def answer() -> None:
        socket = context.socket(zmq.PAIR)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        decoder = msgspec.msgpack.Decoder(Heartbeat)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                call = decoder.decode(socket.recv())
                socket.send(encoder.encode(Heartbeat(call.call_id, progress.step_stalled_s())))
        except zmq.ContextTerminated:
            socket.close()

    thread = threading.Thread(target=answer, name="heartbeat", daemon=True)
    thread.start()
    return thread


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_pid: int, heartbeat_address: str | None = None) -> None:
    """Process entry point (spawned). Exits 0 on a clean shutdown, 1 on any error."""
    from shoal.runtime.distributed.lifeline import install_lifeline

    install_lifeline(parent_pid)
    # the API process drains, then stops us with a "shutdown" message: a SIGTERM or Ctrl-C
    # sent to the whole process group (systemd, kill -- -PGID) must not end the engine
    # under requests that are still draining (the lifeline ends us if the API dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()

    def send(kind: CoreMessageType, message: msgspec.Struct) -> None:
        outputs.send_multipart([kind.value, encoder.encode(message)], copy=False)

    progress = LoopProgress()
    if heartbeat_address:
        start_heartbeat_thread(context, heartbeat_address, progress)
    code = 0
    try:
        startup = _Startup(send)
        core = build_engine_core(config, startup)
        progress.count_workers(core.executor.workers_cpu_seconds)
        freeze_gc_after_startup()  # no full-GC pass over every KV block during serving
        startup.begin("ready", max_model_len=core.max_model_len,
                      num_kv_blocks=core.stats().num_kv_blocks,
                      kv_cache_groups=core.kv_groups.num_groups,
                      eos_token_ids=list(core.model_config.eos_token_ids),
                      vocab_size=core.model_config.vocab_size,
                      quantization=served_quantization(config, core.model_config))
        EngineLoop(core, inputs, send, config.kv_events_endpoint, progress,
                   kv_events_topic(config.kv_events_topic, config.served_model_name
                                   or config.model)).run()
    except SystemExit as exc:
        code = int(exc.code or 0)
    except BaseException:
        send(CoreMessageType.FATAL, FatalError(traceback.format_exc()))
        code = 1
    finally:
        outputs.close(linger=2000)
        inputs.close(linger=0)
        context.term()
    os._exit(code)


class EngineLoop:
    def __init__(self, core, inputs: zmq.Socket, send, kv_events_endpoint: str | None,
                 progress: LoopProgress | None = None, topic: str = "kv-events") -> None:
        self.core = core
        self.progress = progress or LoopProgress()
        self.inputs = inputs
        self.send = send
        self.decoders = {
            RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            RequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
            RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
        }
        self.publisher = None
        if kv_events_endpoint:
            from shoal.runtime.engine.kv_events_publisher import KVEventsPublisher

            self.publisher = KVEventsPublisher(kv_events_endpoint, topic.encode())
        self._stats_dirty = True
        self._last_stats = 0.0
        self._arrival_log = RateLimitedLog(logger)
        self._last_rank_probe = time.monotonic()

    def run(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            if self.inputs.poll(0 if busy else IDLE_POLL_MS):
                self._take_inputs()
            if self.core.has_unfinished_requests():
                outputs = self._step()
            else:
                outputs = []
                self._probe_ranks_if_due()
                if self.core.poll_transfers():  # offered blocks pulled or expired
                    self._stats_dirty = True
            for failure in self.core.take_failures():
                self._stats_dirty = True
                self.send(CoreMessageType.REQUEST_ERROR, RequestError(
                    failure.request_id, failure.param or "request", failure.message,
                    internal=failure.param is None))
            if self.publisher is not None:
                self.publisher.publish(self.core.drain_kv_events())
            self._send_outputs(outputs)

    def _probe_ranks_if_due(self) -> None:
        """Idle liveness: a failed rank raises here, which is fatal like a failed step."""
        now = time.monotonic()
        if now - self._last_rank_probe < RANK_PROBE_INTERVAL_S:
            return
        self.core.executor.check_health(RANK_PROBE_TIMEOUT_S)
        self._last_rank_probe = time.monotonic()

    def _step(self) -> list:
        self.progress.begin_step()
        try:
            return self.core.step()
        finally:
            self.progress.end_step()

    def _take_inputs(self) -> None:
        while True:
            try:
                kind, payload = self.inputs.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                request_type = RequestType(kind)
                message = self.decoders[request_type].decode(payload)
            except (ValueError, msgspec.DecodeError):  # the API never sends these
                logger.exception("dropped an undecodable input frame")
                continue
            self._stats_dirty = True
            if request_type is RequestType.ADD:
                self._add(message)
            elif request_type is RequestType.ABORT:
                self.core.abort_requests(message)
            else:
                self._utility(message)

    def _add(self, request: EngineCoreRequest) -> None:
        from shoal.runtime.sampling_params import InvalidParameter

        try:
            self.core.add_request(request)
        except InvalidParameter as exc:
            self.send(CoreMessageType.REQUEST_ERROR,
                      RequestError(request.request_id, exc.param, exc.message))
        except ValueError as exc:
            self.send(CoreMessageType.REQUEST_ERROR,
                      RequestError(request.request_id, "request", str(exc)))
        except Exception:  # a request's data must never end the loop: its content is the
            # cause, so a 4xx (an SDK would retry a 5xx, through a router on another replica)
            self._arrival_log.log(logging.ERROR, "arrival", "request %s failed on arrival",
                                  request.request_id, exc_info=sys.exc_info()[1])
            self.send(CoreMessageType.REQUEST_ERROR, RequestError(
                request.request_id, "request", f"the engine could not accept request "
                f"{request.request_id}; the details are in the server log"))

    def _utility(self, call: UtilityCall) -> None:
        if call.method == "shutdown":  # the API process has drained: exit 0
            raise SystemExit(0)
        if call.method == "heartbeat":
            self.core.executor.check_health()  # a dead rank raises: fatal
            reply = UtilityReply(call.call_id, True)
        elif call.method == "reset_prefix_cache":
            reply = UtilityReply(call.call_id, bool(self.core.reset_prefix_cache()))
        elif call.method == "check_invariants":
            try:
                self.core.check_invariants()
                reply = UtilityReply(call.call_id, True)
            except Exception as exc:  # the checker reports what is inconsistent
                reply = UtilityReply(call.call_id, False, str(exc))
        elif call.method in ("add_lora", "remove_lora"):
            reply = self._lora_call(call)
        else:
            reply = UtilityReply(call.call_id, False, f"unknown utility {call.method!r}")
        self.send(CoreMessageType.UTILITY_REPLY, reply)

    def _lora_call(self, call: UtilityCall) -> UtilityReply:
        """A bad adapter, or one not loaded, answers ok=False and the reason; the engine
        goes on serving."""
        try:
            if call.method == "add_lora":
                name, path = call.args
                self.core.add_lora(name, path)
            else:
                (name,) = call.args
                self.core.remove_lora(name)
        except KeyError:
            return UtilityReply(call.call_id, False, "not found")
        except Exception as exc:  # a bad adapter's files must never end the loop
            return UtilityReply(call.call_id, False, str(exc) or type(exc).__name__)
        self._stats_dirty = True
        return UtilityReply(call.call_id, True)

    def _send_outputs(self, outputs: list) -> None:
        now = time.monotonic()
        if outputs:
            self._stats_dirty = True
        idle = not self.core.has_unfinished_requests()
        stats_due = self._stats_dirty and (idle or now - self._last_stats >= STATS_INTERVAL_S)
        if not outputs and not stats_due:
            return
        stats = self.core.stats() if stats_due else None
        if stats_due:
            self._last_stats, self._stats_dirty = now, False
        self.send(CoreMessageType.OUTPUTS,
                  EngineCoreOutputs(outputs=outputs, stats=stats, timestamp=time.time()))


def served_quantization(config: EngineConfig, model_config: object) -> str:
    """What /v1/models and the metrics report: the checkpoint's method, or ``gguf`` for a
    GGUF file (vLLM's name for them, whether its blocks stay quantized here or not)."""
    from shoal.runtime.model_source import gguf_file

    name = getattr(getattr(model_config, "quantization", None), "name", "")
    return name or ("gguf" if gguf_file(config.model) is not None else "")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="shoal-engine-core")
    parser.add_argument("--input", required=True, help="zmq address to pull requests from")
    parser.add_argument("--output", required=True, help="zmq address to push outputs to")
    parser.add_argument("--heartbeat", default=None, help="zmq PAIR address for heartbeats")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config, type=EngineConfig)
    run_engine_core(config, args.input, args.output, args.parent_pid, args.heartbeat)


if __name__ == "__main__":
    main()
