"""A validation pass's record: the last stage's sums (over its replicas), with the epoch and step it followed.

Both runners write it, the one-chunk runner (``pdrun.runner``) and the interleaved one
(``pdrun.interleaved``); the summary (``pdrun.metrics``) turns the last stage's into loss and accuracy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pdrun.config import RunConfig
from pdrun.data import Units
from pdrun.worker import Worker
from shared.plan import Plan


def units(val_set: Any, plan: Plan, cfg: RunConfig) -> Units | None:
    """The validation split in the plan's batches, unshuffled, a last partial batch padded; None without one."""
    if val_set is None or not cfg.validate:
        return None
    name = f"validation set of {plan.spec.data}"
    return Units(val_set, plan.batch_size, cfg.seed, shuffle=False, name=name, pad=True)


def entry(worker: Worker, sums: tuple[float, int, int, int], epoch: int) -> dict[str, Any]:
    """``sums`` (loss sum, correct, samples, scored) of ``worker``'s pass, summed over its stage's replicas."""
    loss_sum, correct, count, scored = sums
    if worker.config.stage.has_output and worker.config.group is not None:
        t = torch.tensor([loss_sum, correct, count, scored], dtype=torch.float64, device=worker.comm.wire)
        dist.all_reduce(t, group=worker.config.group)
        loss_sum, correct, count, scored = float(t[0]), int(t[1]), int(t[2]), int(t[3])
    return {
        "epoch": epoch,
        "step": worker.run_steps,
        "loss_sum": loss_sum,
        "correct": correct,
        "count": count,
        "scored": scored,
    }
