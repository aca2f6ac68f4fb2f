"""A worker's peak memory: its stage's parameters plus the high-water rise above them, per process.

Every rank builds the whole model and then keeps only its stage (``pdrun.build_worker``), so the
process's lifetime high-water mark says little about the stage. :func:`start` is called once
the stage is built and the rest dropped, and marks the high-water count there
(``shared.highwater``: the resident set on CPU, ``torch.cuda``'s allocated peak on CUDA).
:func:`peak_bytes` is the stage's parameter bytes (counted from its tensors, as the planner's
memory model counts them) plus the rise above that mark: gradients, optimizer state, stashed
weight versions, saved activations, messages, and the process's own overhead (kernel caches,
the allocator's slack; not the library code, which ``shared.highwater`` leaves out), which pdprof
measured the same way.

One tracker per process (a worker is a process), so the worker's builder starts it and the worker
reads it at every step without threading it through their constructors. On CPU a read is a read of
``/proc/self/status`` (about 60 us): 12% of a small model's 0.5 ms steps, so a step within
:data:`READ_EVERY_S` of the last read shows that read's figure. The mark only rises, so a row lags at
most that long behind, and :func:`settle` reads the last row of each program afresh (before the
checkpoint and validation that may follow it, which no step row ever counted): the run's peak is exact.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from pdrun.step_rows import StepRows
from shared.highwater import Mark, mark, rise
from shared.malloc import steady_malloc

_state: dict[str, object] = {}
READ_EVERY_S = 0.02  # at most this often a fresh read (module doc)


def start(device: torch.device, module: nn.Module) -> None:
    """Begin tracking: the stage ``module`` is built on ``device``; what comes after is its run."""
    _state.clear()
    _state["params"] = sum(p.numel() * p.element_size() for p in module.parameters())
    if device.type == "cpu":
        # The build is over (pdrun.runner mapped its big blocks afresh): from here glibc's thresholds
        # are pdprof's, both for the step times and for the memory counted from the mark.
        steady_malloc()
    _state["mark"] = mark(device)


def peak_bytes(fresh: bool = False) -> float:
    """The stage's parameters plus the high-water rise since :func:`start` (NaN when not measurable): read
    afresh when ``fresh`` or :data:`READ_EVERY_S` has passed since the last read, else that read's."""
    since = _state.get("mark")
    params = _state.get("params", 0)
    assert isinstance(params, int)
    if not isinstance(since, Mark):
        return float("nan")
    now = time.monotonic()
    last = _state.get("read")
    if not fresh and isinstance(last, tuple) and now - last[0] < READ_EVERY_S:
        return float(last[1])
    value = float(params) + rise(since)
    _state["read"] = (now, value)
    return value


def settle(rows: StepRows) -> None:
    """Give the run's last step row a fresh read: the earlier ones may lag (module doc), the peak may not."""
    if len(rows) and "peak_memory_bytes" in rows.columns:
        value = peak_bytes(fresh=True)
        if not math.isnan(value):
            rows.columns["peak_memory_bytes"][-1] = value
