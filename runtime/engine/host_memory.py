"""The memory a CPU engine may use: the machine's, or its container's limit when lower.

In a pod, ``/proc/meminfo`` (what ``psutil.virtual_memory`` reads) is the node's memory, not
the pod's: a KV cache sized from it can exceed the container's limit and be OOM-killed, and
since a CPU cache's pages are only touched as blocks fill (``model_runner.zeroed``) that
happens under load, not at start. So the default budget is a share of the lower of the two,
and an explicit budget that cannot fit is refused at start, naming the flag.
"""

from __future__ import annotations

from pathlib import Path

# cgroup v2 (a pod's own, as the container sees it), then cgroup v1
LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"),
               Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
NO_LIMIT_ABOVE = 1 << 60


def parse_limit(text: str) -> int | None:
    """A cgroup memory limit file's bytes; None for no limit ("max", v1's huge number) or
    text that is not a number."""
    value = text.strip()
    if not value.isdigit():
        return None
    limit = int(value)
    return None if limit >= NO_LIMIT_ABOVE else limit


def container_limit() -> int | None:
    """This process's container memory limit in bytes, None where there is none."""
    for path in LIMIT_FILES:
        try:
            return parse_limit(path.read_text())
        except OSError:
            continue
    return None


def usable_memory() -> int:
    """Bytes of memory this machine (or container) has for the engine's process tree."""
    import psutil

    total = psutil.virtual_memory().total
    limit = container_limit()
    return total if limit is None else min(total, limit)


def describe(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
