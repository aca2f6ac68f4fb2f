"""A worker's peak memory: its stage's parameters plus the high-water rise above them, per process.

Every rank builds the whole model and then keeps only its stage (``pdrun.build_worker``), so the
process's lifetime high-water mark says little about the stage. :func:`start` is called
once the stage is built and the rest dropped: on CPU it resets the kernel's high-water RSS
(``/proc/self/clear_refs``, "5" resets ``VmHWM``) and notes the RSS then; on CUDA it resets
``torch.cuda``'s peak statistics and notes the bytes allocated. :func:`peak_bytes` is the
stage's parameter bytes (counted from its tensors, as the planner's memory model counts
them) plus the rise of the high-water mark above that start: gradients, optimizer state,
stashed weight versions, saved activations, messages and the allocator's slack.

One tracker per process (a worker is a process), so the worker's builder starts it and the worker
reads it at every step without threading it through their constructors.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

import torch
from torch import nn

_state: dict[str, object] = {}


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
    """Hand the heap's free memory back to the kernel (glibc's ``malloc_trim``), where there is glibc.

    The rest of the model was just dropped: left in the heap, its memory stays resident, the
    stage's gradients and activations reuse it without raising the high-water mark, and the
    measured rise reads low (a VGG's first stage measured a third of its prediction).
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: measured as it was
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def start(device: torch.device, module: nn.Module) -> None:
    """Begin tracking: the stage ``module`` is built on ``device``; what comes after is its run."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    _state.clear()
    _state["params"] = params
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _state.update(device=device, base=torch.cuda.memory_allocated(device))
        return
    gc.collect()  # the dropped model may sit in reference cycles (fx graphs): free it before the trim
    _trim()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # then VmHWM may still hold the model's build: the rise reads low until the run exceeds it
    rss = _status_kb("VmRSS")
    _state["base"] = None if rss is None else rss * 1024


def peak_bytes() -> float:
    """The stage's parameters plus the high-water rise since :func:`start` (NaN when not measurable)."""
    base = _state.get("base")
    params = _state.get("params", 0)
    assert isinstance(params, int)
    if base is None:
        return float("nan")
    assert isinstance(base, int)
    device = _state.get("device")
    if isinstance(device, torch.device):
        return float(params + max(0, torch.cuda.max_memory_allocated(device) - base))
    hwm = _status_kb("VmHWM")
    return float("nan") if hwm is None else float(params + max(0, hwm * 1024 - base))
