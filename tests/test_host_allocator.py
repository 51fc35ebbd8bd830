"""Fixed malloc thresholds (``runtime.training.host_allocator``): an iteration's tensors come from the heap, not fresh maps."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

try:
    _MALLINFO2 = ctypes.CDLL("libc.so.6").mallinfo2
except (OSError, AttributeError):
    _MALLINFO2 = None

# In a fresh process, whose thresholds are glibc's defaults: how many blocks are mapped while one allocation of
# 1 MiB (an activation's size) is held, against none held; before and after steady_allocations.
PROBE = textwrap.dedent("""
    import ctypes
    from ftlab.runtime.training.host_allocator import steady_allocations

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)

    def mapped_for_one_mib():
        before = libc.mallinfo2().hblks
        block = libc.malloc(1 << 20)
        held = libc.mallinfo2().hblks
        libc.free(block)
        return held - before

    default = mapped_for_one_mib()
    fixed = steady_allocations()
    print(default, fixed, mapped_for_one_mib())
""")


@pytest.mark.skipif(_MALLINFO2 is None, reason="glibc's malloc only: other C libraries have no such thresholds")
def test_after_steady_allocations_a_mebibyte_comes_from_the_heap_not_a_fresh_map() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    default, fixed, steady = int(out[0]), out[1] == "True", int(out[2])
    assert default == 1, "glibc's default threshold (128 KiB) maps a mebibyte of its own"
    assert fixed
    assert steady == 0

