"""A worker's configuration: everything a worker is built from except its transport.

:func:`pdrun.build_worker.build_worker` makes one per stage (or chunk) a rank runs; the
worker (``pdrun/worker.py``) takes it whole, with the transport beside it, and changes
nothing in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdrun.data import Units
from pdrun.partition import Partition
from pdrun.stage import StageModule
from pdrun.tied import TiedGradients
from pdrun.values import ValueSpec
from pdrun.weights import WeightVersions


@dataclass(frozen=True)
class Peers:
    """How a worker finds ranks: (stage, replica) -> rank."""

    ranks: tuple[tuple[int, ...], ...]

    def rank(self, worker: tuple[int, int]) -> int:
        return self.ranks[worker[0]][worker[1]]

    def of_unit(self, stage: int, unit: int) -> int:
        replicas = self.ranks[stage]
        return replicas[unit % len(replicas)]


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker is made of: its stage and data, its optimizer and weight versions, how it steps."""

    rank: int
    stage: StageModule
    replica: int
    part: Partition
    specs: dict[str, ValueSpec]  # every value that crosses a stage boundary
    peers: Peers
    units: Units
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: torch.optim.Optimizer | None  # None: a stage with nothing to update
    versions: WeightVersions
    group: Any  # the stage's replicas' process group, None when it has one replica
    device: torch.device
    dtype: torch.dtype
    loss_scale: float  # 1/M under a flushing schedule: the step's gradient is the mean of its units'
    average_replicas: bool
    vertical_sync: bool
    record: bool  # testing: log weight versions per unit
    # Optimizer updates this worker makes in one step of the run (pdrun.shape.updates_per_step).
    updates_per_step: int = 1
    recompute: bool = False  # testing: no stash, the backward recomputes on the latest weights
    trace: bool = False  # keep one timeline event per instruction
    channels_last: bool = False  # 4-d batch inputs go channels-last (shared.layout)
    split_backward: bool = False  # zero bubble: B takes the input gradients, W the weight gradients
    next_token: bool = False  # the loss scores logits at t against labels at t + 1 (causal_lm)
    lr_at: Callable[[int], float] | None = None  # the learning rate of the run's step
    on_step: Callable[[dict[str, Any]], None] | None = None  # called with each step's metrics row
    tied: TiedGradients | None = None  # parameters other stages hold too (pdrun/tied.py)
    steps: int = 0  # own optimizer updates already made (a resumed run: the checkpoint's)
