"""Request bodies the endpoint picker held go back to the operating system once freed.

glibc's malloc keeps freed memory for reuse: a block over its mmap threshold (128 KiB at
start) is mapped and unmapped on its own, but each time one is freed the threshold rises to
that block's size (up to 32 MiB), so the next bodies of that size come from the heap; and
gRPC's threads each allocate from an arena of their own, which keeps its free pages. In the
endpoint picker, three bursts of 40 ext_proc streams sending 15 MiB each (the third red
team's attack, issue 36; 23 of each 40 refused by the 256 MiB body budget) left the process
at ~600 MiB after every stream had ended (~90 MiB before). The picker now holds the
threshold where it starts (``keep_large_blocks_mapped``) and, once no body is buffered after
a burst, collects garbage (a cancelled stream's frames can hold its last chunk in a cycle)
and trims the heap (``trim``): the same bursts end back at the starting size (83 -> 82-87
MiB; collecting and trimming without the fixed threshold: 104 -> 113-124).

Elsewhere (musl, macOS) these calls do not exist and nothing changes.
"""

from __future__ import annotations

import ctypes
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
