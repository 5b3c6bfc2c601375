"""Giving the C heap's free pages back to the system.

glibc's malloc raises its mmap threshold each time a large block is freed, so the large temporaries of a training
step (TQC's pairwise quantile differences are 15 MB at batch 256) come from the heap once the first few are freed. A
few small allocations made between steps (an evaluation, a log write) then sit above the free space and keep glibc
from shrinking the heap: the process's resident memory grows with free pages while what it uses stays flat. Only
``malloc_trim`` hands free pages in the middle of the heap back; it costs milliseconds, so a training calls it every
half-minute or so, between steps (``sb3_gpu.runs.callbacks.ReturnFreeMemory``).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols, libc's among them; glibc's only: musl has none
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def can_return_free_memory() -> bool:
    """Whether this process's C library can give free heap pages back (glibc)."""
    return _malloc_trim() is not None


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the system; True where some were given back, False where none were or the C
    library cannot (anything but glibc)."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1
