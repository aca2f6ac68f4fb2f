"""How to run a plan: the training options of ``pdrun``, parsed once into a frozen config."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from shared.schedule import default_microbatches

if TYPE_CHECKING:
    from shared.layout import MemoryFormat  # a Literal; the module imports torch
    from shared.plan import Plan

Optimizer = Literal["sgd", "adam"]
SendThread = Literal["auto", "on", "off"]
Transport = Literal["auto", "gloo"]
Device = Literal["cpu", "cuda"]
Backend = Literal["gloo", "nccl"]
Dtype = Literal["float32", "float64"]
LrSchedule = Literal["constant", "cosine"]


@dataclass(frozen=True)
class RunConfig:
    """Everything a worker needs besides the plan; picklable, so it travels to spawned workers."""

    steps: int | None = None  # optimizer steps; None: run `epochs` epochs
    epochs: int | None = None
    seed: int = 0
    optimizer: Optimizer = "sgd"
    lr: float = 0.01
    lr_schedule: LrSchedule = "constant"  # cosine: lr * (1 + cos(pi * step / steps)) / 2
    # Optimizer steps over which the learning rate ramps up linearly to its schedule (Goyal et al., 2017,
    # "gradual warmup"): the first steps' large gradients otherwise throw a stale pipeline stage off.
    warmup_steps: int = 0
    momentum: float = 0.0
    weight_decay: float = 0.0
    schedule: str | None = None  # overrides the plan's
    microbatches: int | None = None  # overrides the plan's
    vertical_sync: bool | None = None  # overrides the plan's
    device: Device = "cpu"
    backend: Backend | None = None  # default: nccl on CUDA, gloo on CPU
    timeout_s: float = 120.0
    threads: int = 1  # torch threads per CPU worker
    validate: bool = True  # validation pass at the end of each epoch (or of the run, with --steps)
    metrics: str | None = None  # Parquet path
    trace: str | None = None  # Chrome trace path
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps between checkpoints (besides the end of each epoch)
    keep: int = 2  # complete checkpoints kept (0: all)
    resume: bool = False
    resume_from: str | None = None  # the verified checkpoint directory --resume starts from (set by launch)
    dtype: Dtype = "float32"
    # 4-d activations channels-last (shared.layout); auto: float32 CNNs on CPU.
    memory_format: MemoryFormat = "auto"
    # Sends posted by a helper thread; auto: when the host has a core to spare for it (shared.host.send_thread_pays).
    send_thread: SendThread = "auto"
    # Messages between ranks and replicas' gradient sums: auto: shared memory between ranks of one node on
    # an x86 CPU, gloo across nodes (pdrun/transport/choose.py); gloo: gloo for all.
    transport: Transport = "auto"
    # Testing only: run 1f1b without weight stashing (the backward recomputes with the latest weights).
    stash: bool = True
    # Testing only: keep per-unit version records and the final parameters in each worker's result.
    record: bool = False
    progress: bool = False  # rich progress bar on stderr (rank 0 of the last stage)
    launcher_pid: int | None = None  # set by the launcher: workers stop when this process is gone

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of optimizer step ``step`` (from 0) out of ``total``."""
        lr = self.lr
        if self.lr_schedule == "cosine" and total > 0:
            lr *= 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
        if step < self.warmup_steps:
            lr *= (step + 1) / self.warmup_steps
        return lr


def article(word: str) -> str:
    """ "a" or "an" before ``word`` as it is read ("an interleaved-1f1b", "a 1f1b": one)."""
    return "an" if word[:1] in "aeiou" else "a"


def vertical_sync_note(plan: Plan, cfg: RunConfig) -> str | None:
    """``--vertical-sync`` asked of a run whose schedule is not 1f1b: it has nothing to do there (the flush
    schedules keep one weight version; 2BW its two), so it is said rather than dropped unseen."""
    schedule = cfg.schedule or plan.schedule
    if not cfg.vertical_sync or schedule == "1f1b":
        return None
    return (
        f"--vertical-sync is not used: it applies to 1f1b's stashed weight versions, and {schedule} keeps "
        f"{'two versions, one step apart' if schedule == '2bw' else 'one version'} on every stage"
    )


def resolve_units_per_step(plan: Plan, cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """``cfg`` with the units per optimizer step settled, and a line saying what was chosen, if anything was.

    1F1B (PipeDream's asynchronous schedule) steps after every unit, so ``--microbatches``
    cannot apply to it: dropped, and said; asked of a plan of several microbatches per step, that a
    step is then one unit is said too. A flush schedule asked of a 1F1B plan would inherit that
    plan's one unit per step, with nothing to pipeline (the replicas of a stage taking turns);
    it gets the planner's default instead (``default_microbatches``: the units that fill its
    pipeline, every replica working), unless ``--microbatches`` says otherwise.
    """
    schedule = cfg.schedule or plan.schedule
    if schedule == "1f1b":
        if cfg.microbatches is not None and cfg.microbatches != 1:
            # Said, not refused: scripts (our benchmarks among them) pass one --microbatches to every schedule.
            return replace(cfg, microbatches=None), (
                f"--microbatches {cfg.microbatches} is not used: 1f1b takes an optimizer step after every unit "
                "(--schedule 1f1b-flush or gpipe accumulates several units per step)"
            )
        if cfg.microbatches is None and plan.schedule != "1f1b" and plan.microbatches > 1:
            # The plan's microbatches do not carry over either: --steps N now trains N units, not N x M.
            return cfg, (
                f"--schedule 1f1b on {article(plan.schedule)} {plan.schedule} plan of {plan.microbatches} "
                "microbatches per step: 1f1b "
                "takes an optimizer step after every unit, so a step is one unit here (--steps counts units)"
            )
        return cfg, None
    if cfg.microbatches is not None or plan.schedule != "1f1b":
        return cfg, None
    chosen = default_microbatches([s.replicas for s in plan.stages])
    note = (
        f"--schedule {schedule} on a 1f1b plan: {chosen} microbatches per step (one per stage at least, "
        "a multiple of each stage's replicas, to fill its pipeline); --microbatches M to choose"
    )
    return replace(cfg, microbatches=chosen), note
