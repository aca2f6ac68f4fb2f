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

Before that, while a process builds (loads, traces and partitions the model, runs a sample
batch), :func:`building_malloc` maps every block above 64 KiB afresh and unmaps it when freed.
The build's big temporaries (the whole model's parameters where a pdrun worker keeps one
stage, the sample batch's activations) then leave no free holes in the heap. Measured on the
zoo's MNIST CNN, two 1F1B stages: with steady thresholds from the start, 35 MB of the heap was
free at the memory mark, and training's short-lived tensors, placed in those holes, made each
worker's resident set rise 6 MB more than with the holes gone (0.6 MB free at the mark), so a
stage's measured memory (``shared.highwater``) depended on what the build left behind, not on
the stage.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_NEVER = 2**31 - 1  # mallopt takes an int
BUILD_MMAP_THRESHOLD = 64 * 1024  # a fixed value: glibc's dynamic threshold would climb back to 32 MiB
BUILD_TRIM_THRESHOLD = 128 * 1024  # glibc's default: the heap's free top goes back to the system

_done = False


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
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
    return all([bool(mallopt(option, value)) for option, value in settings])  # a list: every one is set


def building_malloc() -> bool:
    """Map big blocks afresh while the process builds, until :func:`steady_malloc` (module doc)."""
    global _done
    _done = False
    return _mallopt(((M_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, BUILD_TRIM_THRESHOLD)))


def steady_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when it took effect."""
    global _done
    if not _done:
        _done = _mallopt(((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_NEVER)))
    return _done


def malloc_is_steady() -> bool:
    """Whether ``steady_malloc`` has taken effect in this process."""
    return _done
