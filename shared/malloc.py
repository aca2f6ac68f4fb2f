"""Keeping glibc's malloc steady while profiling, so a layer's time does not depend on luck.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves big blocks with a
fresh ``mmap`` (whose pages the kernel must zero on first touch, i.e. page faults on every
use) or from its heap, and moves the boundary between the two as the program frees memory
(the "dynamic mmap threshold"), while also handing the heap's top back to the system when
more than a threshold is free. For a ResNet-50 at batch 8 on CPU the 25 MB activation
gradients of the first stage land on one side or the other from one run to the next, and
a BatchNorm backward takes 4 ms in one run and 12 ms in the next.

Fixing both thresholds (``mallopt``) makes the choice the same in every round and every
run: blocks up to 32 MiB are reused from the heap, which is never trimmed, larger ones are
mapped afresh each time. The whole-step timing runs under the same setting, so the ratio
of the two stays a fair check. Without glibc (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_NEVER = 2**31 - 1  # mallopt takes an int

_done = False


def steady_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when it took effect."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_NEVER)
    )
    return _done


def malloc_is_steady() -> bool:
    """Whether ``steady_malloc`` has taken effect in this process."""
    return _done
