"""Process helpers every serving test area uses: a free loopback port, polling for a
condition, and killing a process with all it started."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05,
               what: str = "condition") -> object:
    """``predicate()``'s first truthy value, polled every ``interval`` seconds; an
    AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and its descendants whatever state they are in (a stopped one is
    continued first, so that it dies at once), then reap ``proc``."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        try:
            child.send_signal(signal.SIGCONT)
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
