"""A local fleet: N engines and one router on loopback (``shoal fleet``, benchmarks, tests).

Engine i listens on 127.0.0.(2+i):ENGINE_PORT (every engine its own address, so one port
and one KV-events port serve them all); the router listens on 127.0.0.1:PORT. Each child
runs in its own process group (killed as a group, so an engine's own helper processes go
too) and has the parent-death signal set, so nothing outlives the fleet even if the fleet
process itself is killed. ``stop()`` ends the routers first, then the engines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from shoal.runtime.distributed.lifeline import set_parent_death_signal

READY_POLL_S = 0.25
# `shoal route` flags that say where things are in a cluster (each takes a value); a loopback
# fleet supplies its own (--host/--port, --backend per engine, its --kv-events-port)
DEPLOYMENT_FLAGS = frozenset({"--host", "--port", "--discovery", "--namespace", "--service",
                              "--engine-port", "--kube-api", "--kv-events-port",
                              "--capacity-request"})


def _die_with_parent() -> None:  # runs in the child between fork and exec
    set_parent_death_signal(signal.SIGTERM)  # SIGTERM: an engine drains and ends its own ranks


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


def loopback_router_args(rendered: list[str]) -> tuple[list[str], bool]:
    """The router args a cluster deployment renders (``route ...``) as the same routing
    over a loopback fleet: (the routing flags, whether the router follows KV events). So
    benchmarks and tests run exactly the flags the operator deploys."""
    args = rendered[1:] if rendered[:1] == ["route"] else list(rendered)
    kept: list[str] = []
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in DEPLOYMENT_FLAGS:
            i += 1 if "=" in args[i] else 2
            continue
        kept.append(args[i])
        i += 1
    kv_events = "--kv-events" in kept
    return [a for a in kept if a != "--kv-events"], kv_events


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
