"""One tensor-parallel rank as its own process: join the group, load the shard, run plans.

Started by the multiprocess executor as
``python -m shoal.runtime.worker.worker_proc FD PARENT_PID PDEATHSIG rank=R`` where FD is
this rank's end of a socket pair (``rank=R`` only names the rank for ``ps``; SETUP is what
configures it). Messages are length-framed (multiprocessing
``Connection``) and start with one kind byte:

    parent -> rank   SETUP  pickled RankSetup            (first message, once)
                     PLAN   encoded step plan            (hot path, msgpack, see wire/plan_codec)
                     CALL   pickled (method, args)       (control: init_kv_cache, warmup, ...)
                     PING                                 (health check between steps)
                     STOP
    rank -> parent   READY / REPLY pickled value, RESULT encoded StepResult (rank 0),
                     DONE step id (other ranks), STEP_FAILED text (the step raised; the
                     rank lives on), PONG, ERROR text of the exception that ends the rank

Every rank decodes and runs every plan (the collectives need all of them); only rank 0
sends its sampled tokens back, the others report that the step finished, which is what
lets the executor see a rank that stopped making progress.

A step that raises does not end the rank: the error goes back as STEP_FAILED and the rank
waits for the next plan. Every rank runs the same plan on the same replicated inputs, so a
request whose content trips the step trips it on every rank at the same point; the executor
then fails the step alone and the engine core isolates the request, as with one rank in
process (engine/isolation.py). Ranks that disagree (one fails, another finishes or stays
stuck in a collective) are a failed engine: the executor decides that (executor/multiproc.py).
Engine faults (out of memory) and anything outside the step (decoding the plan, replying)
still end the rank.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from shoal.runtime import debug_plugins
from shoal.runtime.config import EngineConfig

SETUP, PLAN, CALL, PING, STOP = b"S", b"P", b"C", b"H", b"Q"
READY, REPLY, RESULT, DONE, PONG, ERROR = b"r", b"y", b"s", b"d", b"h", b"e"
STEP_FAILED = b"f"

CALLABLE = frozenset({"init_kv_cache", "warmup", "kv_bytes_per_block", "profile_num_kv_blocks",
                      "state_bytes_per_request"})


@dataclass
class RankSetup:
    config: EngineConfig
    rank: int
    world_size: int
    rendezvous_file: str
    collective_timeout_s: float


def _ends_the_rank(exc: Exception) -> bool:
    """Out of memory is the device's fault, not the request's: the rank ends (and with it
    the engine, as the engine core decides for one rank in process)."""
    return isinstance(exc, MemoryError) or any(
        cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)


def _send(conn: Connection, kind: bytes, payload: bytes = b"") -> None:
    conn.send_bytes(kind + payload)


def _rank_device(config: EngineConfig, rank: int) -> str:
    from shoal.runtime.worker.worker import resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        import torch

        return f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return str(device)


def _start(setup: RankSetup):  # -> Worker
    import torch
    from shoal.runtime.distributed.process_group import init_tensor_parallel
    from shoal.runtime.worker.worker import Worker

    config = setup.config.replace(device=_rank_device(setup.config, setup.rank))
    device = torch.device(config.device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # ranks share the cores instead of each taking all of them (unless told otherwise)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // setup.world_size))
    parallel = init_tensor_parallel(setup.rank, setup.world_size, setup.rendezvous_file,
                                    device, setup.collective_timeout_s)
    debug_plugins.load_plugins()
    for hook in debug_plugins.hooks():
        hook.rank_started(setup.rank)
    worker = Worker(config, setup.rank, setup.world_size, parallel=parallel)
    worker.load_model()
    return worker


def serve(conn: Connection, setup: RankSetup) -> None:
    from shoal.runtime.wire.plan_codec import PlanDecoder
    from shoal.runtime.wire.result_codec import encode_result

    worker = _start(setup)
    _send(conn, READY, pickle.dumps(worker.kv_bytes_per_block()))
    decoder = PlanDecoder(setup.config.block_size)
    hooks = debug_plugins.hooks()
    while True:
        message = conn.recv_bytes()
        kind, payload = message[:1], message[1:]
        if kind == PLAN:
            plan = decoder.decode(payload)
            try:
                for hook in hooks:
                    hook.before_rank_step(setup.rank, plan)
                result = worker.execute(plan)
            except Exception as exc:
                if _ends_the_rank(exc):
                    raise
                text = f"rank {setup.rank}: {type(exc).__name__}: {exc}"
                print(f"{text}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                _send(conn, STEP_FAILED, text.encode())
                continue
            if setup.rank == 0:
                _send(conn, RESULT, encode_result(result, plan))
            else:
                _send(conn, DONE, plan.step_id.to_bytes(8, "little", signed=True))
        elif kind == CALL:
            method, args = pickle.loads(payload)
            if method not in CALLABLE:
                raise ValueError(f"rank {setup.rank}: unknown call {method!r}")
            _send(conn, REPLY, pickle.dumps(getattr(worker, method)(*args)))
        elif kind == PING:
            _send(conn, PONG)
        elif kind == STOP:
            return
        else:
            raise ValueError(f"rank {setup.rank}: unknown message kind {kind!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m shoal.runtime.worker.worker_proc FD PARENT_PID PDEATHSIG(0|1) "
              "rank=R", file=sys.stderr)
        return 2
    from shoal.runtime.distributed.lifeline import install_lifeline

    # first thing, before the slow imports: a rank never outlives its executor
    install_lifeline(int(argv[1]), argv[2] == "1")
    # Ctrl-C or a SIGTERM to the whole group reaches us too; the parent decides (STOP)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    rank = -1
    try:
        message = conn.recv_bytes()
        if message[:1] != SETUP:
            raise ValueError(f"first message must be SETUP, got {message[:1]!r}")
        setup: RankSetup = pickle.loads(message[1:])
        rank = setup.rank
        serve(conn, setup)
    except EOFError:  # the executor closed its end: nothing left to report to
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        text = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            _send(conn, ERROR, text.encode())
        except OSError:
            pass
        print(text, file=sys.stderr, flush=True)
        os._exit(1)  # no interpreter teardown: peers may be stuck in a collective with us
    from shoal.runtime.distributed.process_group import destroy_tensor_parallel

    destroy_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
