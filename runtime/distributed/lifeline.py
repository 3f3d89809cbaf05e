"""A child process never outlives the process that started it: the one parent-death mechanism
of every spawner (the engine core under the API, the worker ranks under the executor, the
engines and routers of ``shoal fleet``).

Two independent guards, because either alone has a gap: the kernel's parent-death signal
(PR_SET_PDEATHSIG, Linux) fires even while the rank is stuck inside a collective, and a
watcher thread that polls the parent pid covers platforms without prctl and the window
before prctl ran.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
# resolved at import, so set_parent_death_signal is safe as a Popen preexec_fn (between fork
# and exec nothing is loaded); dlopen(NULL) sees the libc the interpreter runs on
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` when the parent dies. False where unsupported."""
    if _LIBC is None:
        return False
    return _LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def parent_is_gone(parent_pid: int) -> bool:
    # re-parenting (to init or a subreaper) changes getppid(); the original pid may be reused
    return os.getppid() != parent_pid


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Exit this process at once (no cleanup: the parent is gone) when the parent dies."""

    def run() -> None:
        while True:
            if parent_is_gone(parent_pid):
                os._exit(70)
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="shoal-parent-watch", daemon=True)
    thread.start()
    return thread


def install_lifeline(parent_pid: int, parent_death_signal: bool = True) -> None:
    """``parent_death_signal`` only where the parent's starting thread lives as long as the
    parent process: the kernel signals when that thread exits, not the process."""
    if parent_death_signal:
        set_parent_death_signal()
    if parent_is_gone(parent_pid):  # the parent died before prctl took effect
        os._exit(70)
    watch_parent(parent_pid)
