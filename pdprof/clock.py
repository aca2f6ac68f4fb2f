"""The clocks that time layers: ``perf_counter`` on CPU, CUDA events on a GPU.

Both hand out opaque marks; ``ms(a, b)`` is only valid after ``settle()``, which on
CUDA waits for the device, so that every mark recorded on the stream has happened.
The profiler is written once against this interface; the CUDA branch is this file.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """A source of time marks for one device."""

    def mark(self) -> Any: ...

    def settle(self) -> None: ...

    def ms(self, start: Any, end: Any) -> float: ...


class CpuClock:
    """Wall time with ``time.perf_counter``: CPU work is synchronous, a mark is a float."""

    def mark(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        return None

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1000.0


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
