"""Stuck means no progress, not a long step: the rule the engine's watchdogs share.

A step on a shared machine can run for minutes and still be working (a long prefill while
other processes hold the cores: over 30 s at load 10 on 2 cores, measured), so a watchdog that
declares a rank or an engine dead after ``rank_timeout`` of wall time kills working replicas
exactly when they are busiest. What a working step does that a stuck one does not is use CPU:
a stopped process (SIGSTOP, a debugger), a deadlock, a wait on a peer that is itself stuck
(a collective over gloo blocks without spinning) uses none. So each watchdog samples the CPU
time of the processes doing the step and counts the step as stalled only from the last sample
at which they had advanced by a share of a core.

Only where the work is CPU work: on a GPU a rank's host thread may spin while it waits in a
collective, so CPU time says nothing there, and the executor keeps the wall-clock deadline.
"""

from __future__ import annotations

import psutil

# the share of a core a step must use between two samples to count as progress: a
# computing step gets a tenth of a core or more even at load 10 on 2 cores; a heartbeat or
# ZeroMQ thread uses about a thousandth
MIN_PROGRESS_SHARE = 0.02


def made_progress(cpu_delta_s: float, wall_delta_s: float) -> bool:
    """Whether ``cpu_delta_s`` of CPU over ``wall_delta_s`` of wall time is progress."""
    return wall_delta_s > 0 and cpu_delta_s >= MIN_PROGRESS_SHARE * wall_delta_s


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of these processes (every thread's); one that has exited
    adds nothing (its death is seen elsewhere, through its socket)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total
