"""A process's memory high-water mark, from a mark onwards: what a stretch of training costs.

On CPU the figure is the resident set's high-water rise (``VmHWM`` in ``/proc/self/status``) less
the file-backed pages mapped since the mark (``RssFile``): tensors, oneDNN's kernel caches, the
allocator's slack and shared memory (pdrun's transport slots), not the library code the run pages
in. How many of a library's pages a fault maps depends on which of the file's pages the host's
page cache holds (the kernel maps a faulting page's cached neighbours with it), not on the model,
and it drifts as the cache ages: three ``make bench`` runs in one install (issue 19, runs A to C)
read BERT's second stage at 0.58, 0.70 and 0.94 of its prediction while its measured peak held
at 13-15 MB: the prediction moved with pdprof's probe, whose rise held the library code the
whole model's first steps paged in. Library code is shared by every process on the host and
stays in the page cache either way; what a worker adds is its anonymous and shared memory. File
pages stay mapped once touched and are mostly touched in the first steps, so the growth read
beside the high-water mark stands for the growth at the peak. :func:`mark` first hands the
heap's free memory back
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
    file: int = 0  # CPU: file-backed resident bytes (library code) then, not counted in the rise


def _status_kb(resident: str) -> tuple[int | None, int]:
    """``resident`` (VmRSS or VmHWM) and RssFile in KiB, from one read of ``/proc/self/status``
    (pdrun reads it every step): None and 0 where the kernel does not say."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in (resident, "RssFile"):
                    fields[name] = int(rest.split()[0])
    except OSError:
        pass
    return fields.get(resident), fields.get("RssFile", 0)


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
    rss, file = _status_kb("VmRSS")
    return Mark(device, None if rss is None else rss * 1024, file * 1024)


def rise(since: Mark) -> float:
    """Bytes the high-water mark rose above ``since`` (NaN when not measurable)."""
    if since.base is None:
        return float("nan")
    if since.device.type == "cuda":
        return float(max(0, torch.cuda.max_memory_allocated(since.device) - since.base))
    hwm, file = _status_kb("VmHWM")
    if hwm is None:
        return float("nan")
    paged_in = max(0, file * 1024 - since.file)  # library code mapped since the mark
    return float(max(0, hwm * 1024 - since.base - paged_in))
