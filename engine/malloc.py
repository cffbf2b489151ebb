"""glibc malloc settings for the engine process (``tune_heap``).

Each forward allocates and frees the same activations step after step. With glibc's
defaults the freed top of the heap is returned to the kernel once it exceeds the trim
threshold (twice the mmap threshold, which adapts up to 32 MiB) and blocks above the mmap
threshold are mapped and unmapped per allocation, so the next step faults the pages in and
the kernel zeroes them again: a 2,048-token prefill step of the tiny benchmark model spent
~12-16% of its time there. Keeping freed memory in the heap (as tcmalloc or jemalloc would)
removes that; the cost is that the process keeps its peak heap. Only glibc has ``mallopt``;
elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("epdserve.core")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: bigger blocks are mapped (the KV cache, weights)
TRIM_THRESHOLD = 1 << 30  # free heap kept before any is returned
TOP_PAD = 64 << 20  # grow the heap in large steps


def tune_heap() -> bool:
    """Set the thresholds above in this process; True when glibc took them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        log.debug("mallopt refused the heap settings")
    return ok
