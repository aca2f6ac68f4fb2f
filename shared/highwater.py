"""A process's memory high-water mark, from a mark onwards: what a stretch of training costs.

On CPU the figure is the resident set (``VmHWM`` in ``/proc/self/status``): tensors, but also
the library code the run pages in, oneDNN's kernel caches and the allocator's slack, which is
what a host's memory limit meets. :func:`mark` first hands the heap's free memory back
(``gc.collect``, glibc's ``malloc_trim``: memory freed before the mark would otherwise be
reused unseen and the rise read low) and resets the kernel's high-water mark
(``/proc/self/clear_refs``, "5"). On CUDA the figure is ``torch.cuda``'s peak of allocated
bytes, reset at the mark.

pdprof marks before its first training steps (the graph's ``memory_rise_bytes``) and pdrun's
workers once their stage is built (``pdrun.peak``): the same measure on both sides, so the
planner's prediction and the run's record compare like with like.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mark:
    """Where the count starts: the device and its bytes then (None when not measurable)."""

    device: torch.device
    base: int | None


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: measured as it was
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def mark(device: torch.device) -> Mark:
    """Start counting on ``device`` from now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return Mark(device, torch.cuda.memory_allocated(device))
    gc.collect()  # what was just dropped may sit in reference cycles (fx graphs): free it before the trim
    _trim()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # then VmHWM may still hold what came before: the rise reads low until the run exceeds it
    rss = _status_kb("VmRSS")
    return Mark(device, None if rss is None else rss * 1024)


def rise(since: Mark) -> float:
    """Bytes the high-water mark rose above ``since`` (NaN when not measurable)."""
    if since.base is None:
        return float("nan")
    if since.device.type == "cuda":
        return float(max(0, torch.cuda.max_memory_allocated(since.device) - since.base))
    hwm = _status_kb("VmHWM")
    return float("nan") if hwm is None else float(max(0, hwm * 1024 - since.base))
