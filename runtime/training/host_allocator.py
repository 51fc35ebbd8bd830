"""Steady host allocations: glibc's malloc with fixed thresholds, so that an iteration's tensors reuse its heap.

glibc serves an allocation above its mmap threshold (128 KiB at a process's start) with a fresh mapping and unmaps
it when it is freed, so each of a CPU iteration's activations and gradients is page-faulted and zeroed anew. The
threshold is dynamic: freeing a larger mapped block raises it to that block's size, and allocations of up to that
size come from the heap from then on. Left dynamic, a worker runs at one speed until something frees a big buffer
(the bytes of its first checkpoint) and markedly faster after it, so a job's speed would depend on whether it has
saved yet. Fixing the thresholds where the dynamic ones end up (glibc's ceiling of 32 MiB, and a trim threshold of
twice that, as glibc would set it) at the start of every process that computes (each worker, and the profiler
before it times layers) makes every iteration run at the fast speed, and the profile time what the workers run.

Other C libraries (macOS, musl) have no such thresholds; there this does nothing.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ceiling for the dynamic mmap threshold on 64-bit machines (``DEFAULT_MMAP_THRESHOLD_MAX``): mallopt
refuses a larger one."""


def steady_allocations() -> bool:
    """Fix this process's malloc thresholds; False where the C library has none to fix (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 on success and 0 when it refuses a value.
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mapped and mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES))
