"""Building a worker: from the plan and the command line to a :class:`pdrun.worker.Worker` of one stage.

Every rank builds the model from the plan's spec with the same seed, traces it and
partitions it (:func:`build_model`, once per rank); then each stage (or interleaved chunk)
it runs gets its module, process groups, weight versions and optimizer, restored from a
checkpoint on ``--resume``, as one :class:`pdrun.worker_config.WorkerConfig`
(:func:`build_worker`). The transport is given (``pdrun.runner``): a rank's chunks share one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdrun import checkpoint, peak, run_checkpoint
from pdrun.config import RunConfig
from pdrun.data import Units, datasets, to_device
from pdrun.env import DistEnv
from pdrun.partition import Partition, partition
from pdrun.shape import needs_stash, segments, updates_per_step
from pdrun.stage import build_stage, sample_run
from pdrun.tied import find_ties, tied_gradients
from pdrun.transport import Transport
from pdrun.values import ValueSpec, spec_of, with_channels_last
from pdrun.weights import TwoWeightVersions, WeightVersions
from pdrun.worker import Worker
from pdrun.worker_config import Peers, WorkerConfig
from shared.errors import UserError
from shared.layout import module_to_channels_last, use_channels_last
from shared.plan import Plan
from shared.resolve import resolve_loss, resolve_model
from shared.schedule import SPLIT_BACKWARD
from shared.tracer import place, trace


@dataclass
class Model:
    """The model as every rank builds it: traced, partitioned, with its data and the crossing values' specs."""

    traced: Any  # the whole model; build_worker drops it on a rank of one stage
    part: Partition
    units: Units
    val_set: Any
    specs: dict[str, ValueSpec]
    channels_last: bool


def build_model(plan: Plan, cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> Model:
    """Build, trace and partition the plan's model, and find the specs of the values that cross stages."""
    spec = plan.spec
    if spec.model is None:
        raise UserError("plan: spec.model: the plan names no model")
    torch.manual_seed(cfg.seed)  # every rank builds the same initial weights
    model = resolve_model(spec.model, spec.model_args).to(dtype)
    traced = trace(model, spec.trace)
    part = partition(traced, plan)
    train_set, val_set = datasets(spec)
    units = Units(train_set, plan.batch_size, cfg.seed, name=f"dataset {spec.data}")
    sample = to_device(units.batch(0)[0], torch.device("cpu"), dtype)
    specs = value_specs(part, traced, tuple(sample))
    # Every rank decides from the same model and options: both ends of a message agree on its layout.
    channels_last = use_channels_last(cfg.memory_format, model, device, dtype)
    if channels_last:
        specs = {n: with_channels_last(v) for n, v in specs.items()}
    return Model(traced, part, units, val_set, specs, channels_last)


def value_specs(part: Partition, traced: Any, sample: tuple[Any, ...]) -> dict[str, ValueSpec]:
    """Specs of every value that crosses a stage boundary, from one forward of ``sample``."""
    buffers = {n: b.clone() for n, b in traced.module.named_buffers()}
    values, written = sample_run(traced, sample)
    with torch.no_grad():  # the sample pass must not move BatchNorm statistics
        for n, b in traced.module.named_buffers():
            b.copy_(buffers[n])
    crossing = {n for names in part.sends.values() for n in names}
    return {n: replace(spec_of(values[n]), written=n in written) for n in crossing}


def make_optimizer(params: list[torch.Tensor], cfg: RunConfig) -> torch.optim.Optimizer | None:
    """The run's optimizer over ``params``; None for a stage of pooling and activations (nothing to update)."""
    if not params:
        return None
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def build_worker(
    env: DistEnv,
    plan: Plan,
    cfg: RunConfig,
    model: Model,
    where: tuple[int, int],
    comm: Transport,
    dtype: torch.dtype,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    group: Any = None,
    taken: set[int] | None = None,
) -> Worker:
    """The worker of stage ``where[0]``, replica ``where[1]``, on this rank (restored on ``--resume``).

    An interleaved chunk's stage is its virtual stage. ``on_step`` is called with each step's
    metrics row (the progress bar). A chunk (``plan.virtual_stages > 1``) is given its virtual
    stage's replicas' ``group``, made with every other stage's before any chunk is built; its
    rank sums tied gradients and tracks its memory once, for all of its chunks (``pdrun.interleaved``).
    ``taken``: the ids of the parameters the rank's chunks built before this one step; this chunk's
    optimizer steps the others, and adds theirs. The chunks are built from one traced model, so a
    parameter two of them read (GPT-2's token embedding and its output layer, which zb-v's V puts
    on rank 0's first and last chunk) is one tensor in both, its gradient accumulated from both
    chunks' backwards: one optimizer steps it, once (``pdrun.tied`` counts it once in the tie's sum).
    """
    s, replica = where
    device = comm.device
    chunked = plan.virtual_stages > 1
    stage = build_stage(
        model.traced, model.part, s, frozenset(n for n, v in model.specs.items() if v.written)
    )
    ties = find_ties(model.traced, model.part) if not chunked else []
    if not chunked:
        # The whole model: from here this rank holds only its stage, before its memory is tracked
        # (pdrun/peak.py). An interleaved rank builds its other chunks from it still.
        model.traced = None
    place(stage.module, device, plan.spec.trace)
    if model.channels_last:
        module_to_channels_last(stage.module)
    tied = None
    if not chunked:
        peak.start(device, stage.module)  # the run's memory from here: the stage's, not the whole model's
        group = replica_groups(plan)[s]
        tied = tied_gradients(
            plan, ties, {s: stage.module}, comm
        )  # after the replicas' groups, on every rank
    stash = plan.schedule == "1f1b" and cfg.stash and needs_stash(plan, model.part, s)
    versions = (
        TwoWeightVersions(stage.module, plan.microbatches)
        if plan.schedule == "2bw"
        else WeightVersions(stage.module, stash=stash, history=stash and plan.vertical_sync)
    )
    stepped: list[torch.Tensor] = [p for p in versions.live.values() if taken is None or id(p) not in taken]
    if taken is not None:
        taken.update(id(p) for p in stepped)
    optimizer = make_optimizer(stepped, cfg)
    steps = 0
    if cfg.resume_from is not None:
        ck = Path(cfg.resume_from)
        checkpoint.load_stage(ck, s, stage.module, optimizer, device, plan.graph_hash)
        # Last, after every random draw building the stage made: the generator continues where it stopped.
        # A replica of a stage steps once per round of units: its own step count comes back with it.
        steps = checkpoint.load_rank(ck, env.rank, device)
        versions.latest = steps
    per_step = updates_per_step(plan, s)
    total = (
        steps // per_step
        + segments(plan, cfg, model.units.per_epoch, run_checkpoint.resume_point(cfg)[0]).steps
    )
    config = WorkerConfig(
        rank=env.rank,
        stage=stage,
        replica=replica,
        part=model.part,
        specs=model.specs,
        peers=Peers(tuple(tuple(st.ranks) for st in plan.stages)),
        units=model.units,
        loss_fn=resolve_loss(plan.spec.loss),
        next_token=plan.spec.loss == "causal_lm",
        optimizer=optimizer,
        versions=versions,
        group=group,
        device=device,
        dtype=dtype,
        loss_scale=1.0 / plan.microbatches if plan.schedule != "1f1b" else 1.0,
        updates_per_step=per_step,
        average_replicas=plan.schedule == "1f1b",
        vertical_sync=plan.vertical_sync and not chunked,
        record=cfg.record,
        recompute=plan.schedule == "1f1b" and not cfg.stash,
        trace=cfg.trace is not None,
        channels_last=model.channels_last,
        split_backward=plan.schedule in SPLIT_BACKWARD,
        lr_at=lambda step: cfg.lr_at(step, total),
        on_step=on_step,
        tied=tied,
        steps=steps,
    )
    return Worker(config, comm)


def replica_groups(plan: Plan) -> list[Any]:
    """Each stage's process group of its replicas (None for one replica), by stage.

    Every rank makes every stage's group, in the same order, even those it is outside of
    (``dist.new_group`` is collective). An interleaved plan's chunks are stages: each gets a
    group of its own over its worker's ranks, so the chunks' all-reduces never share one.
    """
    return [dist.new_group(st.ranks) if st.replicas > 1 else None for st in plan.stages]
