"""One worker process per tensor-parallel rank, run in lockstep, and fatal when one fails.

Each step the executor encodes the plan once and writes the same bytes to every rank's
socket; every rank answers (rank 0 with its sampled tokens, the others with "done"), so
the executor sees each rank finish each step. A rank that exits or crashes is seen at once
(its socket reaches EOF, or it sends its error); a rank that makes no progress for
``rank_timeout`` seconds is declared hung (on CPU: the ranks used no CPU for that long, so a
long step on busy cores is not a hang; on GPU: the step took that long, progress.py). Either way the executor kills every rank and
raises ``RankFailure`` from then on: the engine core treats that as fatal.

A step that raises on every rank (the ranks live on and report STEP_FAILED) is not a rank
failure: ``execute`` raises ``StepFailed`` and the engine core isolates the request behind
it (engine/isolation.py), as with one rank in process. Ranks that disagree about a step (one
failed, another finished it or stays silent) are a RankFailure.

Startup is fail-fast: all ranks start together, and the first one to report an error (or
to exit) fails the startup with that rank's own message.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import NoReturn, cast

import psutil
from shoal.runtime.config import EngineConfig
from shoal.runtime.distributed.shardability import check_shardable
from shoal.runtime.executor.base import Executor
from shoal.runtime.executor.grammar_shipping import ShippedGrammars, with_compiled_grammars
from shoal.runtime.executor.preflight import check_gpus_for_ranks
from shoal.runtime.executor.progress import cpu_seconds, made_progress
from shoal.runtime.model.config import ModelConfig, load_model_config
from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.wire.plan import StepPlan, StepResult
from shoal.runtime.wire.plan_codec import PlanEncoder
from shoal.runtime.wire.result_codec import decode_result
from shoal.runtime.worker import worker_proc as wp

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # loading a large checkpoint may take long; errors still fail fast
STOP_GRACE_S = 5.0
# once one rank reports that a step failed, how long the others get to report the same
# (ranks run the same plan on the same inputs: a request's content fails them all at one
# point, at most seconds apart on a loaded machine); a rank still silent after it is stuck
# in a collective its failed peer left, and the engine is failed
STEP_FAILURE_GRACE_S = 10.0
# how often a step's wait samples the ranks' CPU time (at most; a quarter of rank_timeout
# when that is shorter)
PROGRESS_POLL_S = 1.0


class RankFailure(RuntimeError):
    """A rank died, hung or raised: the engine cannot continue."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"tensor-parallel rank {rank}: {message}")
        self.rank = rank


def _exit_description(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "closed its connection but is still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _kill_ranks(ranks: list[_Rank], rendezvous_dir: str) -> None:
    """SIGKILL every rank still running, reap them, drop the rendezvous directory. Holds no
    reference to the executor, so it can run as the executor's finalizer."""
    for r in ranks:
        if r.proc.poll() is None:
            try:
                r.proc.kill()
            except ProcessLookupError:
                pass
    for r in ranks:
        try:
            r.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.error("rank %d (pid %d) did not exit after SIGKILL", r.rank, r.proc.pid)
        r.conn.close()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)


def _stopped_rank(ranks: list[_Rank]) -> int | None:
    """The first rank whose process is stopped (SIGSTOP, traced) or already gone."""
    for r in ranks:
        try:
            if psutil.Process(r.proc.pid).status() in (psutil.STATUS_STOPPED,
                                                       psutil.STATUS_TRACING_STOP):
                return r.rank
        except psutil.NoSuchProcess:
            return r.rank
    return None


def _likely_culprit(stalled: list[_Rank]) -> int:
    """Of ranks that all stopped answering, the one to blame: a stopped (SIGSTOP, traced)
    process over ranks that merely wait for it inside a collective."""
    stopped = _stopped_rank(stalled)
    return stalled[0].rank if stopped is None else stopped


def _resolved_device(name: str) -> str:
    from shoal.runtime.worker.worker import resolve_device

    return str(resolve_device(name))


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


class StepFailed(RuntimeError):
    """Every rank raised on the same step and lives on: the step failed, not the engine."""


class _Rank:
    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.process = psutil.Process(proc.pid)  # for its CPU time (progress.py)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S
                 ) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.rank_timeout = float(config.rank_timeout)
        self._model_config = load_model_config(config.model, config.hf_overrides)
        check_shardable(self._model_config, self.world_size)  # before any process starts
        device = _resolved_device(config.device)
        check_gpus_for_ranks(self.world_size, device, _visible_gpus())
        # a step is stuck when its ranks stop using CPU, not when it runs long (progress.py);
        # on a GPU a waiting rank may spin, so there the step's deadline is wall time
        self._steps_on_cpu = device.startswith("cpu")
        self._encoder = PlanEncoder(config.block_size)
        self._grammars: GrammarBackend | None = None
        self._shipped = ShippedGrammars()
        self._failure: RankFailure | None = None
        self._closed = False
        self._ranks: list[_Rank] = []
        self._rendezvous_dir = tempfile.mkdtemp(prefix="shoal-tp-")
        # ranks die with the executor: on failure, shutdown(), garbage collection (say, an
        # EngineCore whose constructor raised after starting us) or interpreter exit
        self._reaper = weakref.finalize(self, _kill_ranks, self._ranks, self._rendezvous_dir)
        try:
            self._spawn_ranks()
            setup_deadline = time.monotonic() + startup_timeout_s
            replies = self._collect(wp.READY, setup_deadline, "load its shard",
                                    f"did not start within {startup_timeout_s:g} s")
            self._kv_bytes_per_block = pickle.loads(replies[0])
        except BaseException:
            self._kill_all()
            raise

    # -- processes ------------------------------------------------------------------------
    def _spawn_ranks(self) -> None:
        pdeathsig = "1" if threading.current_thread() is threading.main_thread() else "0"
        rendezvous = os.path.join(self._rendezvous_dir, "rendezvous")
        for rank in range(self.world_size):
            ours, theirs = socket.socketpair()
            # a rank that stops reading must not block the executor forever on a full socket
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", int(self.rank_timeout),
                                        int(self.rank_timeout % 1 * 1e6)))
            proc = subprocess.Popen(
                [sys.executable, "-m", "shoal.runtime.worker.worker_proc",
                 str(theirs.fileno()), str(os.getpid()), pdeathsig, f"rank={rank}"],
                pass_fds=(theirs.fileno(),), start_new_session=False)
            theirs.close()  # only the rank holds its end: EOF here means the rank is gone
            conn = Connection(ours.detach())
            self._ranks.append(_Rank(rank, proc, conn))
            setup = wp.RankSetup(self.config, rank, self.world_size, rendezvous,
                                 collective_timeout_s=max(1800.0, 4 * self.rank_timeout))
            self._send(self._ranks[-1], wp.SETUP + pickle.dumps(setup))
        logger.info("started %d tensor-parallel ranks: pids %s", self.world_size,
                    [r.proc.pid for r in self._ranks])

    def _kill_all(self) -> None:
        self._reaper()  # idempotent: a finalizer runs at most once

    def _fail(self, rank: int, message: str) -> RankFailure:
        failure = RankFailure(rank, message)
        if self._failure is None:
            self._failure = failure
            logger.error("%s; stopping all ranks", failure)
        self._kill_all()
        return self._failure

    # -- messaging ------------------------------------------------------------------------
    def _send(self, r: _Rank, message: bytes) -> None:
        try:
            r.conn.send_bytes(message)
        except BlockingIOError:
            raise self._fail(r.rank, f"made no progress for {self.rank_timeout:g} s "
                             "(stopped reading its messages)") from None
        except OSError:
            raise self._fail(r.rank, _exit_description(r.proc)) from None

    def _broadcast(self, message: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("the executor is shut down")
        for r in self._ranks:
            self._send(r, message)

    def _collect(self, expected: bytes | list[bytes], deadline: float, doing: str,
                 timeout_message: str | None = None,
                 step_failures: dict[int, str] | None = None,
                 stall_s: float | None = None) -> dict[int, bytes]:
        """Wait for one message from every rank (``expected``: its kind, one for all or one
        per rank); payloads by rank. Any other outcome is a RankFailure, except a STEP_FAILED
        when ``step_failures`` is given: recorded there (rank -> message), and the ranks
        still running get ``STEP_FAILURE_GRACE_S`` more to report theirs. With ``stall_s``
        the deadline moves: it is ``stall_s`` after the ranks last used CPU (progress.py),
        sampled a few times per ``stall_s``."""
        kinds = expected if isinstance(expected, list) else [expected] * len(self._ranks)
        waited_s = deadline - time.monotonic() if stall_s is None else stall_s
        poll_s = None if stall_s is None else min(PROGRESS_POLL_S, stall_s / 4)
        sampled = (time.monotonic(), self.workers_cpu_seconds())
        pending = {id(r.conn): r for r in self._ranks}
        replies: dict[int, bytes] = {}
        while pending:
            remaining = deadline - time.monotonic()
            conns = [r.conn for r in pending.values()]
            timeout = remaining if poll_s is None else min(remaining, poll_s)
            ready = wait(conns, timeout=timeout) if remaining > 0 else []
            if not ready and stall_s is not None and not step_failures:
                now, cpu = time.monotonic(), self.workers_cpu_seconds()
                if made_progress(cpu - sampled[1], now - sampled[0]):
                    deadline = max(deadline, now + stall_s)
                sampled = (now, cpu)
            if not ready and time.monotonic() < deadline:
                continue
            if not ready and step_failures:
                stalled = sorted(r.rank for r in pending.values())
                failed = min(step_failures)
                raise self._fail(failed, f"{step_failures[failed]}; ranks {stalled} did not "
                                 f"{doing} (a rank that fails alone leaves its peers in a "
                                 "collective)")
            if not ready:
                stalled = sorted(r.rank for r in pending.values())
                culprit = _likely_culprit([self._ranks[i] for i in stalled])
                others = f"; ranks {stalled} all stalled" if len(stalled) > 1 else ""
                raise self._fail(culprit, timeout_message or
                                 f"made no progress for {waited_s:.3g} s "
                                 f"(while waiting for it to {doing}{others})")
            for conn in ready:
                r = pending.pop(id(conn))
                try:
                    message = r.conn.recv_bytes()
                except (EOFError, OSError):
                    raise self._fail(r.rank, f"{_exit_description(r.proc)} "
                                     f"(while waiting for it to {doing})") from None
                kind, payload = message[:1], message[1:]
                if kind == wp.STEP_FAILED and step_failures is not None:
                    step_failures[r.rank] = payload.decode(errors="replace")
                    deadline = min(deadline, time.monotonic()
                                   + min(STEP_FAILURE_GRACE_S, self.rank_timeout))
                    continue
                if kind == wp.ERROR:
                    text = payload.decode(errors="replace")
                    cause = self._dead_peer(r.rank, doing)
                    if cause is not None:  # this rank's error may only echo a peer's death
                        peer, story = cause
                        raise self._fail(peer, f"{story}; rank {r.rank} then failed: "
                                         f"{text.splitlines()[0]}")
                    raise self._fail(r.rank, f"failed to {doing}: {text}")
                if kind != kinds[r.rank]:
                    raise self._fail(r.rank, f"sent {kind!r} while {kinds[r.rank]!r} was "
                                     f"expected (while waiting for it to {doing})")
                replies[r.rank] = payload
        return replies

    def _dead_peer(self, reporter: int, doing: str, wait_s: float = 0.5
                   ) -> tuple[int, str] | None:
        """When a rank reports an error, a peer that has exited is the likelier root cause
        (a broken collective fails every survivor). The peer's own error if it sent one,
        else how it exited; None when every other rank is still running."""
        deadline = time.monotonic() + wait_s
        while True:
            for r in self._ranks:
                if r.rank == reporter or r.proc.poll() is None:
                    continue
                try:
                    if r.conn.poll(0):
                        message = r.conn.recv_bytes()
                        if message[:1] == wp.ERROR:
                            return r.rank, (f"failed to {doing}: "
                                            f"{message[1:].decode(errors='replace')}")
                except (EOFError, OSError):
                    pass
                return r.rank, f"{_exit_description(r.proc)} (while waiting for it to {doing})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _call_all(self, method: str, *args: object) -> list[object]:
        """Run a Worker method on every rank; the return values in rank order."""
        self._broadcast(wp.CALL + pickle.dumps((method, args)))
        # warmup and KV allocation may compile or capture graphs: give them the startup budget
        replies = self._collect(wp.REPLY, time.monotonic() + max(STARTUP_TIMEOUT_S / 6,
                                                                  self.rank_timeout), method)
        return [pickle.loads(replies[rank]) for rank in range(self.world_size)]

    # -- Executor -------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    def kv_bytes_per_block(self) -> int:
        return self._kv_bytes_per_block

    def state_bytes_per_request(self) -> int:
        return cast(int, self._call_all("state_bytes_per_request")[0])

    def profile_num_kv_blocks(self) -> int | None:
        """Each rank profiles its own device; the cache is what the tightest rank holds
        (allocation must succeed on every rank). None when the ranks run on CPU."""
        counts = [cast(int, c) for c in self._call_all("profile_num_kv_blocks")
                  if c is not None]
        return min(counts) if counts else None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("init_kv_cache", num_blocks)
        self._call_all("warmup")
        self.grammar_backend().prepare()  # before ready, as each rank's (Worker.warmup)

    def grammar_backend(self) -> GrammarBackend:
        """The engine core compiles grammars here, off its loop and within its budget, as
        with one rank; each plan then carries a new request's grammar serialized, and the
        ranks read it back instead of compiling on the step (grammar_shipping.py)."""
        if self._grammars is None:
            mc = self._model_config
            self._grammars = GrammarBackend(self.config.model, mc.vocab_size, mc.eos_token_ids,
                                            serialize_on_compile=True)
        return self._grammars

    def execute(self, plan: StepPlan) -> StepResult:
        if self._grammars is not None:
            plan = with_compiled_grammars(plan, self._grammars, self._shipped)
        self._broadcast(wp.PLAN + self._encoder.encode(plan))
        kinds = [wp.RESULT] + [wp.DONE] * (self.world_size - 1)  # only rank 0 reports tokens
        failures: dict[int, str] = {}
        doing = f"step {plan.step_id}"
        replies = self._collect(kinds, time.monotonic() + self.rank_timeout, f"finish {doing}",
                                step_failures=failures,
                                stall_s=self.rank_timeout if self._steps_on_cpu else None)
        if failures:
            self._step_failed(doing, failures, finished=sorted(replies))
        return decode_result(replies[0], plan)

    def _step_failed(self, doing: str, failures: dict[int, str], finished: list[int]
                     ) -> NoReturn:
        """Every rank failed the step: the step failed, not the engine (the core isolates
        the request behind it). Some ranks finished it: their state moved on while the
        others' did not (a sampler's random stream, say), so the engine cannot go on."""
        first = min(failures)
        if finished:
            raise self._fail(first, f"{failures[first]}; ranks {finished} finished {doing}: "
                             "the ranks disagree")
        raise StepFailed(f"{doing} failed on every rank: {failures[first]}")

    def check_health(self, timeout_s: float | None = None) -> None:
        """Raise RankFailure if a rank has exited, is stopped (SIGSTOP, traced), or does not
        answer a ping within ``timeout_s`` (default ``rank_timeout``). The engine loop calls
        this while idle, so a rank that dies between requests is fatal at once, not at the
        next step."""
        if self._failure is not None:
            raise self._failure
        for r in self._ranks:
            if r.proc.poll() is not None:
                raise self._fail(r.rank, _exit_description(r.proc))
        stopped = _stopped_rank(self._ranks)
        if stopped is not None:  # it would never answer: no need to wait for the timeout
            raise self._fail(stopped, "is stopped (SIGSTOP or traced) and cannot make progress")
        limit = self.rank_timeout if timeout_s is None else min(timeout_s, self.rank_timeout)
        self._broadcast(wp.PING)
        self._collect(wp.PONG, time.monotonic() + limit, "answer a health check")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            for r in self._ranks:
                try:
                    r.conn.send_bytes(wp.STOP)
                except OSError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            for r in self._ranks:
                try:
                    r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._kill_all()

    def workers_cpu_seconds(self) -> float:
        return cpu_seconds([r.process for r in self._ranks])

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]
