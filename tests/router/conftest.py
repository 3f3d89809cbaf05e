"""Router test helpers: free loopback ports, processes that are always stopped, fake engines
and a router process in front of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ..processes import free_port as _free_port
from ..processes import wait_until

HERE = Path(__file__).parent


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def free_port():
    """free_port(host="127.0.0.1") -> a TCP port nobody listens on right now."""
    return _free_port


@pytest.fixture
def spawn():
    """spawn(argv) -> Popen, in its own process group; every one is stopped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], **kwargs) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kwargs)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Fleet:
    router: str
    engines: list[str]
    procs: dict[str, subprocess.Popen]

    def admin(self, engine: str, **update) -> dict:
        if update:
            return httpx.post(f"{engine}/admin", json=update, timeout=5).json()
        return httpx.get(f"{engine}/admin", timeout=5).json()


@pytest.fixture
def fake_fleet(spawn, free_port):
    """fake_fleet(n, *router_flags) -> Fleet of n fake engines behind a real router process."""

    def build(n: int, *router_flags: str) -> Fleet:
        engines, procs = [], {}
        for i in range(n):
            host = f"127.0.0.{i + 2}"
            port = free_port(host)
            url = f"http://{host}:{port}"
            procs[url] = spawn([sys.executable, str(HERE / "fake_engine.py"),
                                "--host", host, "--port", str(port)])
            engines.append(url)
        for url in engines:
            wait_until(lambda u=url: http_ok(f"{u}/ready"), what=f"{url} ready")
        port = free_port("127.0.0.1")
        router = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "shoal.runtime.router.cli", "--host", "127.0.0.1",
                "--port", str(port), "--health-interval", "0.2", "--scrape-interval", "0.2",
                *router_flags]
        for url in engines:
            argv += ["--backend", url]
        procs[router] = spawn(argv)
        wait_until(lambda: http_ok(f"{router}/ready"), what="router ready")
        return Fleet(router, engines, procs)

    return build


@pytest.fixture
def wait_for():
    """wait_for(predicate, timeout=30, what="") -> the first truthy value, or AssertionError."""
    return wait_until


@pytest.fixture(scope="module")
def engine_fleet_factory(tiny_qwen3, tmp_path_factory):
    """engine_fleet_factory(replicas, engine_args, kv_events, router_flags=None, model=None)
    -> a started LocalFleet of real `shoal serve` engines (tiny qwen3, or ``model``) and a
    router (``router_flags`` verbatim when given); all stopped when the module ends."""
    from shoal.runtime.router.local.fleet import FleetConfig, LocalFleet

    fleets: list[LocalFleet] = []

    def build(replicas: int = 2, engine_args: list[str] | None = None,
              kv_events: bool = False, router_flags: list[str] | None = None,
              model: Path | None = None) -> LocalFleet:
        if router_flags is not None:
            router_args = list(router_flags)
        else:
            router_args = ["--health-interval", "0.2", "--scrape-interval", "0.2"]
            if kv_events:  # the tests compare the router's block view with the engines'
                router_args += ["--tokenizer", str(tiny_qwen3), "--enable-debug"]
        config = FleetConfig(replicas=replicas, model=str(model or tiny_qwen3),
                             port=_free_port("127.0.0.1"), engine_port=_free_port("127.0.0.2"),
                             engine_args=engine_args or [], router_args=router_args,
                             kv_events=kv_events, kv_events_port=_free_port("127.0.0.2"),
                             ready_timeout=180, log_dir=tmp_path_factory.mktemp("fleet"))
        fleet = LocalFleet(config)
        fleets.append(fleet)
        fleet.start()
        return fleet

    yield build
    for fleet in fleets:
        fleet.stop()


ALTERNATION_CHECK = (  # the classic check of Llama-2 / Mistral templates
    "{% for message in messages | rejectattr('role', 'equalto', 'system') %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def alternating_qwen3(tiny_qwen3, tmp_path_factory) -> Path:
    """tiny qwen3 whose chat template raises unless user and assistant turns alternate."""
    import json

    root = tmp_path_factory.mktemp("alternating-qwen3")
    for item in tiny_qwen3.iterdir():
        (root / item.name).symlink_to(item)
    (root / "tokenizer_config.json").unlink()
    config = json.loads((tiny_qwen3 / "tokenizer_config.json").read_text())
    templates = config["chat_template"]  # a string, or the named-templates list
    if isinstance(templates, str):
        config["chat_template"] = ALTERNATION_CHECK + templates
    else:
        for named in templates:
            named["template"] = ALTERNATION_CHECK + named["template"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root
