"""A worker's result: what one rank reports to rank 0 at the end of the run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class WorkerResult:
    """What one rank reports to rank 0 at the end (plain data, so it pickles).

    ``steps`` and ``units`` are positions in the whole training, as the metrics' ``step``
    column is: after a resume they count from the start, the checkpoint's steps included
    (``resumed_from`` says where this invocation began).
    """

    rank: int
    stage: int
    replica: int
    steps: int  # the run's optimizer steps (pdrun.shape.units_per_step units each), the same on every rank
    units: int
    wall_s: float
    rows: Sequence[dict[str, Any]]  # pdrun.step_rows.StepRows from a worker
    events: list[dict[str, Any]]
    validation: list[dict[str, Any]] = field(default_factory=list)  # per epoch: loss_sum, correct, count
    versions: list[dict[str, Any]] = field(
        default_factory=list
    )  # testing: per unit, forward/backward version
    max_versions: int = 0
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # testing: final weights (CPU)
    checkpoints: list[int] = field(default_factory=list)  # steps whose checkpoint this rank helped write
    resumed_from: int | None = None  # the step of the checkpoint this run started from
    send_thread: bool = False  # its sends went through the helper thread (--send-thread)
    links: dict[int, str] = field(default_factory=dict)  # per peer it messaged: "shm" or "gloo" carried them
    replica_sum: str | None = None  # a replicated stage: what summed its gradients ("shm" or "gloo")
    tie_sum: str | None = None  # a stage holding a tied parameter: what summed its gradient ("shm" or "gloo")
    updates: int = 0  # this rank's own optimizer updates (1f1b: a replica of r updates once per r units)
