"""``shoal fleet``: N engines and one router on loopback, for demos and benchmarks.

Engine i listens on 127.0.0.(2+i):ENGINE_PORT (every engine its own address, so one port
and one KV-events port serve them all); the router listens on 127.0.0.1:PORT. Each child
runs in its own process group (killed as a group, so an engine's own helper processes go
too) and has the parent-death signal set, so nothing outlives the fleet even if the fleet
process itself is killed. Ctrl-C (or SIGTERM) stops the router, then the engines.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

PR_SET_PDEATHSIG = 1
READY_POLL_S = 0.25


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def engine_host(index: int) -> str:
    if not 0 <= index < 250:
        raise ValueError("a loopback fleet holds at most 250 engines")
    return f"127.0.0.{index + 2}"


@dataclass
class FleetConfig:
    replicas: int = 2
    model: str | None = None  # None: shoal serve's embedded default model
    host: str = "127.0.0.1"
    port: int = 8000
    engine_port: int = 8001
    engine_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)  # --policy ... (shoal route flags)
    kv_events: bool = False
    kv_events_port: int = 5557
    ready_timeout: float = 600.0
    log_dir: Path | None = None  # None: children inherit stdout/stderr
    engine_command: list[str] = field(
        default_factory=lambda: [sys.executable, "-m", "shoal.cli", "serve"])

    def engine_urls(self) -> list[str]:
        return [f"http://{engine_host(i)}:{self.engine_port}" for i in range(self.replicas)]

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def engine_argv(config: FleetConfig, index: int) -> list[str]:
    argv = [*config.engine_command, "--host", engine_host(index),
            "--port", str(config.engine_port)]
    if config.model:
        argv += ["--model", config.model]
    if config.kv_events:
        argv += ["--kv-events-endpoint", f"tcp://{engine_host(index)}:{config.kv_events_port}"]
    return argv + list(config.engine_args)


def router_argv(config: FleetConfig, backends: list[str] | None = None) -> list[str]:
    argv = [sys.executable, "-m", "shoal.runtime.router.cli", "--host", config.host,
            "--port", str(config.port)]
    for url in backends if backends is not None else config.engine_urls():
        argv += ["--backend", url]
    if config.kv_events:
        argv += ["--kv-events", "--kv-events-port", str(config.kv_events_port)]
    return argv + list(config.router_args)


class LocalFleet:
    def __init__(self, config: FleetConfig) -> None:
        if config.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        self.config = config
        self.engines: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.extra_routers: list[subprocess.Popen[bytes]] = []
        self.names: dict[int, str] = {}  # pid -> engine-0 / router / ...

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.config.log_dir is None:
            proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent,
                                    env=env)
        else:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.config.log_dir / f"{name}.log", "ab") as log:  # the child keeps a copy
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_die_with_parent,
                                        env=env)
        self.names[proc.pid] = name
        return proc

    def start(self) -> None:
        try:
            for i in range(self.config.replicas):
                self.engines.append(self._spawn(engine_argv(self.config, i), f"engine-{i}"))
            self._wait_ready(self.config.engine_urls(), self.engines)
            self.router = self._spawn(router_argv(self.config), "router")
            self._wait_ready([self.config.router_url], [self.router])
        except BaseException:
            self.stop()
            raise

    def add_router(self, port: int, router_args: list[str], kv_events: bool = False,
                   backends: list[str] | None = None) -> str:
        """Another router over the same engines (or ``backends`` of them): benchmarks
        compare policies side by side."""
        config = replace(self.config, port=port, router_args=router_args, kv_events=kv_events)
        proc = self._spawn(router_argv(config, backends), f"router-{port}")
        self.extra_routers.append(proc)
        self._wait_ready([config.router_url], [proc])
        return config.router_url

    def _wait_ready(self, urls: list[str], procs: list[subprocess.Popen[bytes]]) -> None:
        import httpx

        deadline = time.monotonic() + self.config.ready_timeout
        pending = dict(zip(urls, procs, strict=True))
        while pending:
            for url, proc in list(pending.items()):
                if proc.poll() is not None:
                    raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                        del pending[url]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {self.config.ready_timeout}s: "
                                   f"{', '.join(pending)}")
            if pending:
                time.sleep(READY_POLL_S)

    def children(self) -> list[subprocess.Popen[bytes]]:
        return ([self.router] if self.router else []) + self.extra_routers + self.engines

    def first_exit(self) -> subprocess.Popen[bytes] | None:
        return next((p for p in self.children() if p.poll() is not None), None)

    def stop(self, grace_s: float = 15.0) -> None:
        """Router first (no new traffic), then engines; SIGKILL whatever outlives the grace."""
        routers = ([self.router] if self.router else []) + self.extra_routers
        for group in (routers, self.engines):
            for proc in group:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                # the engine's own helpers (engine core, workers) share its process group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def register(subparsers: argparse._SubParsersAction) -> None:
    from shoal.runtime.router.cli import add_router_flags

    parser = subparsers.add_parser(
        "fleet", help="N engines + one router on loopback (demos, benchmarks)",
        description="Start N `shoal serve` engines on 127.0.0.2.. and a `shoal route` router "
                    "on 127.0.0.1; Ctrl-C stops them all.")
    parser.add_argument("--replicas", type=int, default=2, help="number of engines (default 2)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="model dir for every engine (default: shoal serve's default)")
    parser.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    parser.add_argument("--engine-port", type=int, default=8001,
                        help="port of every engine, each on its own 127.0.0.x (default 8001)")
    parser.add_argument("--engine-args", default="",
                        help="extra `shoal serve` flags for every engine, one quoted string")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for engines to become ready (default 600)")
    parser.add_argument("--engine-command", default=None,
                        help="command that starts one engine (default: this Python's "
                             "`-m shoal.cli serve`); --host/--port/--model are appended")
    parser.add_argument("--log-dir", default=None,
                        help="write each child's output to DIR/<name>.log instead of the terminal")
    add_router_flags(parser)
    parser.set_defaults(func=_main)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    router_args = ["--policy", args.policy, "--block-size", str(args.block_size),
                   "--chars-per-block", str(args.chars_per_block),
                   "--scrape-interval", str(args.scrape_interval),
                   "--health-interval", str(args.health_interval),
                   "--load-factor", str(args.load_factor),
                   "--max-attempts", str(args.max_attempts),
                   "--approx-capacity", str(args.approx_capacity)]
    if args.model_revision:
        router_args += ["--model-revision", args.model_revision]
    tokenizer = args.tokenizer or (args.model if args.kv_events else None)
    if tokenizer:
        router_args += ["--tokenizer", tokenizer]
    return FleetConfig(
        replicas=args.replicas, model=args.model, host=args.host, port=args.port,
        engine_port=args.engine_port, engine_args=shlex.split(args.engine_args),
        router_args=router_args, kv_events=args.kv_events, kv_events_port=args.kv_events_port,
        ready_timeout=args.ready_timeout,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        **({"engine_command": shlex.split(args.engine_command)} if args.engine_command else {}))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _main(args: argparse.Namespace) -> int:
    fleet = LocalFleet(config_from_args(args))
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        fleet.start()  # Ctrl-C or SIGTERM while starting: KeyboardInterrupt, stop() below
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        print(f"fleet ready: router {fleet.config.router_url} -> "
              f"{', '.join(fleet.config.engine_urls())} (Ctrl-C stops all)", flush=True)
        while not stopping:
            exited = fleet.first_exit()
            if exited is not None:
                name = fleet.names.get(exited.pid, str(exited.pid))
                print(f"fleet: {name} exited with {exited.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"shoal fleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m shoal.runtime.router.fleet``: the same as ``shoal fleet``."""
    parser = argparse.ArgumentParser(prog="shoal")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["fleet", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
