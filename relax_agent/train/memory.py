"""Return the C heap's free memory to the operating system after a training step.

A training step allocates and frees several GB of activations; glibc's allocator keeps freed
heap pages mapped for reuse, in one arena per thread. When the trainer and an in-process
rollout engine run in different threads, each arena can keep its own peak, so the process may
hold the sum of the two although they never need them at the same time. Measured on
SmolLM2-135M fp32 (forward+backward of micro-batches of 384-1,800 tokens): 4.25 GB resident
after the passes without a trim, 1.50 GB with one. ``malloc_trim(0)`` hands every arena's free
pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (``malloc_trim(0)``: every arena).

    Returns:
        True when the C library has ``malloc_trim`` (glibc) and it ran; False elsewhere (a no-op).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_gb() -> float:
    """This process's resident set size now, in GB (from ``/proc/self/statm``; 0.0 without /proc)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9
