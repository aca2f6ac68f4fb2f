"""Writing a run's checkpoint and finding where a resumed run starts, for both runners.

Every rank writes its files (``pdrun.checkpoint``): each stage it holds (replica 0 of a stage
only: replicas are identical; an interleaved rank, each of its chunks, by virtual stage) and its
own random state; rank 0 commits the manifest once every rank reported (the pipeline is drained).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdrun import checkpoint
from pdrun.config import RunConfig
from pdrun.env import DistEnv
from pdrun.faults import Fault
from shared.plan import Plan

# One stage a rank writes: its index (an interleaved chunk's virtual stage), module and optimizer.
Held = tuple[int, torch.nn.Module, torch.optim.Optimizer | None]


def resume_point(cfg: RunConfig) -> tuple[int, int | None]:
    """(units trained, the step resumed from) of ``--resume``'s checkpoint; (0, None) for a fresh run."""
    if cfg.resume_from is None:
        return 0, None
    manifest = json.loads((Path(cfg.resume_from) / checkpoint.MANIFEST).read_text())
    return int(manifest["units"]), int(manifest["step"])


def write(
    env: DistEnv,
    cfg: RunConfig,
    plan: Plan,
    held: Sequence[Held],
    replica: int,
    step: int,
    units: int,
    own_steps: int,
    device: torch.device,
) -> None:
    """Every rank writes its files; rank 0 commits the manifest once all have."""
    assert cfg.checkpoint_dir is not None
    files = []
    if replica == 0:  # replicas are identical: one copy per stage
        for s, module, optimizer in held:
            files.append(
                checkpoint.save_stage(cfg.checkpoint_dir, step, s, module, optimizer, units, plan.graph_hash)
            )
    files.append(checkpoint.save_rank(cfg.checkpoint_dir, step, env.rank, device, own_steps))
    fault = Fault.from_environ()
    if fault is not None:
        fault.at_checkpoint(env.rank, step)
    gathered: list[Any] = [None] * env.world_size if env.rank == 0 else []
    dist.gather_object(files, gathered if env.rank == 0 else None, dst=0)
    if env.rank == 0:
        checkpoint.commit(
            cfg.checkpoint_dir,
            step,
            units,
            plan.graph_hash,
            len(plan.stages),
            env.world_size,
            [w for got in gathered for w in got],
            cfg.keep,
            cfg.optimizer,
        )
