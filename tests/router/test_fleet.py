"""`shoal fleet` process management, with fake engines standing in for `shoal serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
from shoal.runtime.router.local.fleet import FleetConfig, LocalFleet, engine_argv, router_argv

FAKE_ENGINE = [sys.executable, str(Path(__file__).parent / "fake_engine.py")]


def test_argv_puts_each_engine_on_its_own_loopback_address():
    config = FleetConfig(replicas=3, model="/m", engine_port=9000, kv_events=True,
                         kv_events_port=6000, engine_args=["--num-kv-blocks", "64"])
    assert engine_argv(config, 2)[-9:] == [
        "--host", "127.0.0.4", "--port", "9000", "--model", "/m",
        "--kv-events-endpoint", "tcp://127.0.0.4:6000", "--num-kv-blocks", "64"][-9:]
    argv = router_argv(config)
    assert argv.count("--backend") == 3 and "http://127.0.0.3:9000" in argv
    assert argv[argv.index("--kv-events-port") + 1] == "6000"


def test_local_fleet_routes_and_stops_everything(free_port):
    config = FleetConfig(replicas=2, port=free_port("127.0.0.1"),
                         engine_port=free_port("127.0.0.2"), engine_command=FAKE_ENGINE,
                         router_args=["--health-interval", "0.2"], ready_timeout=60)
    with LocalFleet(config) as fleet:
        pids = [p.pid for p in fleet.children()]
        r = httpx.post(f"{config.router_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 200
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)


def test_shoal_fleet_stops_all_children_on_ctrl_c(free_port, wait_for, spawn):
    port, engine_port = free_port("127.0.0.1"), free_port("127.0.0.2")
    proc = spawn([sys.executable, "-m", "shoal.runtime.router.local.cli", "--replicas", "2",
                  "--port", str(port), "--engine-port", str(engine_port),
                  "--engine-command", " ".join(FAKE_ENGINE), "--health-interval", "0.2"],
                 stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "fleet ready" in line
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 3
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    wait_for(lambda: not any(c.is_running() and c.status() != "zombie" for c in children),
             timeout=10, what="children gone")


def test_children_die_with_a_killed_fleet(free_port, wait_for, spawn):
    port, engine_port = free_port("127.0.0.1"), free_port("127.0.0.2")
    proc = spawn([sys.executable, "-m", "shoal.runtime.router.local.cli", "--replicas", "1",
                  "--port", str(port), "--engine-port", str(engine_port),
                  "--engine-command", " ".join(FAKE_ENGINE), "--health-interval", "0.2"],
                 stdout=subprocess.PIPE, text=True)
    assert "fleet ready" in proc.stdout.readline()
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: the parent-death signal must
    proc.wait(timeout=10)
    wait_for(lambda: not any(c.is_running() and c.status() != "zombie" for c in children),
             timeout=15, what="orphans gone")
