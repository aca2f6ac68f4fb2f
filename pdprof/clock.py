"""The clocks that time layers: ``perf_counter`` on CPU, CUDA events on a GPU.

Both hand out opaque marks; ``ms(a, b)`` is only valid after ``settle()``, which on
CUDA waits for the device, so that every mark recorded on the stream has happened.
The profiler is written once against this interface; the CUDA branch is this file.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """A source of time marks for one device."""

    def mark(self) -> Any: ...

    def settle(self) -> None: ...

    def ms(self, start: Any, end: Any) -> float: ...


class CpuClock:
    """Wall time with ``time.perf_counter``, less the time the thread sat runnable waiting for a CPU.

    On a shared machine another process can take our core in the middle of a layer; the
    kernel counts that wait (``run_delay`` in ``/proc/thread-self/schedstat``), and we take
    it out, so a figure is what the work costs, not how busy the neighbours were. Where the
    file is missing (not Linux) the clock is plain ``perf_counter``.

    A mark is ``(t_before, wait_ns, t_after)``: reading the wait costs a few microseconds,
    and an interval runs from one mark's ``t_after`` to the next one's ``t_before``, so that
    reading is never charged to the work being timed.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            return
        weakref.finalize(self, os.close, self._fd)

    @property
    def corrects_waits(self) -> bool:
        return self._fd is not None

    def _wait_ns(self) -> int:
        if self._fd is None:
            return 0
        # "<ns on cpu> <ns waiting on a run queue> <timeslices>"
        return int(os.pread(self._fd, 128, 0).split()[1])

    def mark(self) -> tuple[float, int, float]:
        before = time.perf_counter()
        wait = self._wait_ns()
        return before, wait, time.perf_counter()

    def settle(self) -> None:
        return None

    def ms(self, start: tuple[float, int, float], end: tuple[float, int, float]) -> float:
        return max(0.0, (end[0] - start[2]) * 1000.0 - (end[1] - start[1]) / 1e6)


class CudaClock:
    """CUDA events on the current stream: a mark is recorded where the stream has got to."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    def ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on ``device``."""
    if device.type == "cuda":
        return CudaClock(device)
    return CpuClock()
