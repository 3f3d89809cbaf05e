"""Request bodies a router held go back to the operating system once they are freed.

glibc's malloc keeps freed memory for reuse: a block over its mmap threshold (128 KiB at
start) is mapped and unmapped on its own, but each time one is freed the threshold rises to
that block's size (up to 32 MiB), so the next bodies of that size come from the heap; and
gRPC's threads each allocate from an arena of their own, which keeps its free pages. Chunks
of cancelled streams and requests also wait in reference cycles for a garbage collection.
In the endpoint picker, three bursts of 40 ext_proc streams sending 15 MiB each (the third
red team's attack, issue 36; 23 of each 40 refused by the 256 MiB body budget) left the
process at ~600 MiB after every stream had ended (~90 MiB before); in the proxy, 50 requests
of 12 MiB held at zero replicas (the hold queue's attack) left it at 676 MiB (66 before).

So ``shoal route`` holds the threshold where it starts (``keep_large_blocks_mapped``), and
counts the body bytes it holds (``BurstTrimmer``): once none are held after a burst and
nothing has been released for a second, a full garbage collection and ``malloc_trim`` give
the pages back. The picker's bursts end at 82-87 MiB (start 83; collecting and trimming
without the fixed threshold: 104 -> 113-124).

Elsewhere (musl, macOS) the libc calls do not exist and only the collection runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own starting value, kept from rising

_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_MALLOPT = getattr(_LIBC, "mallopt", None)
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)


def keep_large_blocks_mapped() -> bool:
    """Blocks of 128 KiB and more are mapped on their own from now on and unmapped when
    freed (fixing the threshold also stops its rise). False where unsupported."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim() -> bool:
    """Give the free pages of every malloc arena back to the OS (a walk over the arenas:
    milliseconds; call it when a burst has ended, not per request)."""
    if _MALLOC_TRIM is None:
        return False
    return bool(_MALLOC_TRIM(0))


BURST_BYTES = 32 << 20  # held since the last trim, before the next is worth it
QUIET_S = 1.0  # gRPC and the ASGI server free a request's buffers after its handler returns


class BurstTrimmer:
    """Body bytes held now, and a trim once a burst of them has drained and gone quiet.
    ``held``/``released`` as bodies come and go, ``touch`` when a request ends without
    releasing anything; both from the event loop."""

    def __init__(self, burst_bytes: int = BURST_BYTES, quiet_s: float = QUIET_S) -> None:
        self.burst_bytes = burst_bytes
        self.quiet_s = quiet_s
        self.used = 0
        self.since_trim = 0
        self.trims = 0
        self._last_activity = 0.0
        self._scheduled = False

    def held(self, size: int) -> None:
        self.used += size
        self.since_trim += size

    def released(self, size: int) -> None:
        self.used -= size
        self.touch()

    def drained_after_burst(self) -> bool:
        return self.used <= 0 and self.since_trim >= self.burst_bytes

    def touch(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator finalized outside the loop (shutdown)
            return
        self._last_activity = loop.time()
        if self.drained_after_burst() and not self._scheduled:
            self._scheduled = True
            loop.call_later(self.quiet_s, self._trim)

    def _trim(self) -> None:
        loop = asyncio.get_running_loop()
        quiet_for = loop.time() - self._last_activity
        if self.drained_after_burst() and quiet_for < self.quiet_s:
            loop.call_later(self.quiet_s - quiet_for, self._trim)
            return
        self._scheduled = False
        if not self.drained_after_burst():
            return  # a new burst is held: its own drain schedules the next
        self.since_trim = 0
        # a full pass: a request open for long may have aged past the young generations
        # (once per drained burst, not per request)
        gc.collect()
        trim()
        self.trims += 1
