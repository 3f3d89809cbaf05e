"""A process with a lifeline dies with its parent, through the kernel's parent-death signal
or, without it, through the watcher thread alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

# parent: starts a child that installs its lifeline, prints the child's pid, then sleeps
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(__import__("os").getpid()),
                              sys.argv[2]])
    print(child.pid, flush=True)
    time.sleep(600)
""")
CHILD = textwrap.dedent("""
    import sys, time
    from shoal.runtime.distributed.lifeline import install_lifeline
    install_lifeline(int(sys.argv[1]), sys.argv[2] == "1")
    time.sleep(600)
""")


@pytest.mark.parametrize("death_signal", ["1", "0"], ids=["pdeathsig", "watcher-only"])
def test_a_child_with_a_lifeline_dies_with_its_parent(death_signal, alive_after):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, death_signal],
                              stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        assert alive_after([child_pid], 5) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child_pid is not None:  # whatever happened, leave nothing behind
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
