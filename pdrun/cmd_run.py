"""``pdrun PLAN``: train with a stage plan and print a JSON summary on stdout."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

import click

from pdrun.config import (
    Backend,
    Device,
    Dtype,
    LrSchedule,
    Optimizer,
    RunConfig,
    SendThread,
    Transport,
    resolve_units_per_step,
    vertical_sync_note,
)
from shared.cli import console
from shared.errors import UserError
from shared.io import display_name
from shared.plan import SCHEDULES, Plan, load_plan

if TYPE_CHECKING:
    from collections.abc import Callable

    from pdrun.result import WorkerResult
    from pdrun.stopped import Stopped
    from shared.layout import MemoryFormat


@click.command("run")
@click.argument("plan", default="-")
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    help="Optimizer steps to run (default: --epochs 1). A step is --microbatches units (flush schedules); "
    "with 1f1b one unit, or one round of lcm(replicas) units when a stage is replicated (docs/pdrun.md).",
)
@click.option(
    "--epochs", type=click.IntRange(min=1), help="Epochs over the training set; validation after each."
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the weights and the data order."
)
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True)
@click.option("--lr", type=float, default=0.01, show_default=True, help="Learning rate.")
@click.option(
    "--lr-schedule",
    type=click.Choice(["constant", "cosine"]),
    default="constant",
    show_default=True,
    help="cosine: decay the learning rate to 0 over the run.",
)
@click.option(
    "--warmup-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Ramp the learning rate up linearly over the first N optimizer steps.",
)
@click.option("--momentum", type=float, default=0.0, show_default=True, help="SGD momentum.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--schedule", type=click.Choice(list(SCHEDULES)), help="Override the plan's schedule.")
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    help="Override the plan's units per step (flush schedules; 1f1b steps after every unit). "
    "Default: the plan's; a 1f1b plan run with a flush --schedule gets its units in flight (NOAM).",
)
@click.option(
    "--vertical-sync/--no-vertical-sync",
    default=None,
    help="1f1b: run each unit on one weight version at every stage.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="gloo on CPU, NCCL on CUDA.",
)
@click.option(
    "--backend",
    type=click.Choice(["gloo", "nccl"]),
    help="Override the backend (gloo carries CUDA tensors through host memory, e.g. several ranks on one GPU).",
)
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option(
    "--memory-format",
    type=click.Choice(["auto", "contiguous", "channels-last"]),
    default="auto",
    show_default=True,
    help="Layout of 4-d activations; auto: channels-last for float32 CNNs on CPU (faster kernels; values equal up to float rounding).",
)
@click.option(
    "--send-thread",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Post sends from a helper thread; auto: when the host has a core to spare for it (a GPU, or more cores than workers x --threads).",
)
@click.option(
    "--transport",
    type=click.Choice(["auto", "gloo"]),
    default="auto",
    show_default=True,
    help="How stages pass activations and gradients, and replicas sum gradients; auto: through shared memory when every rank runs on this host's x86 CPU, else gloo.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    help="Seconds a worker waits for a peer before the run fails.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch threads per CPU worker.",
)
@click.option("--no-val", is_flag=True, help="Skip validation.")
@click.option(
    "--metrics", "metrics_path", type=click.Path(dir_okay=False), help="Write run metrics (Parquet)."
)
@click.option(
    "--trace", "trace_path", type=click.Path(dir_okay=False), help="Write a Chrome-trace timeline (JSON)."
)
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Write per-stage checkpoints here.")
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    help="Also checkpoint every N steps (the pipeline drains there); default: at the end of each epoch/run.",
)
@click.option(
    "--keep",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Complete checkpoints kept in --checkpoint-dir (0: all).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Start from the last complete checkpoint in --checkpoint-dir and run --steps more from its step; "
    "the summary counts this run's steps (resumed_from_step: the checkpoint's), the metrics' step goes on from it.",
)
@click.option(
    "--nnodes", type=click.IntRange(min=1), default=1, show_default=True, help="Machines in the job."
)
@click.option("--node-rank", type=click.IntRange(min=0), help="This machine's index (static rendezvous).")
@click.option("--rdzv-endpoint", help="HOST:PORT where the machines meet (with --nnodes > 1).")
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    help="Workers on this machine (default: world size / nnodes).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def run(
    plan: str,
    steps: int | None,
    epochs: int | None,
    seed: int,
    optimizer: Optimizer,
    lr: float,
    lr_schedule: LrSchedule,
    warmup_steps: int,
    momentum: float,
    weight_decay: float,
    schedule: str | None,
    microbatches: int | None,
    vertical_sync: bool | None,
    device: Device,
    backend: Backend | None,
    dtype: Dtype,
    memory_format: MemoryFormat,
    send_thread: SendThread,
    transport: Transport,
    timeout_s: float,
    threads: int,
    no_val: bool,
    metrics_path: str | None,
    trace_path: str | None,
    checkpoint_dir: str | None,
    checkpoint_every: int | None,
    keep: int,
    resume: bool,
    nnodes: int,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    nproc_per_node: int | None,
    quiet: bool,
) -> None:
    """Train with PLAN (a path or - for stdin): one worker per rank, the plan's schedule, a JSON summary on stdout."""
    if steps is not None and epochs is not None:
        raise click.UsageError("give --steps or --epochs, not both")
    if resume and not checkpoint_dir:
        raise click.UsageError("--resume needs --checkpoint-dir")
    if checkpoint_every and not checkpoint_dir:
        raise click.UsageError("--checkpoint-every needs --checkpoint-dir")
    p = load_plan(plan)
    cfg = RunConfig(
        steps=steps,
        epochs=epochs,
        seed=seed,
        optimizer=optimizer,
        lr=lr,
        momentum=momentum,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        schedule=schedule,
        microbatches=microbatches,
        vertical_sync=vertical_sync,
        device=device,
        backend=backend,
        dtype=dtype,
        memory_format=memory_format,
        send_thread=send_thread,
        transport=transport,
        timeout_s=timeout_s,
        threads=threads,
        validate=not no_val,
        metrics=metrics_path,
        trace=trace_path,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        keep=keep,
        resume=resume,
        progress=not quiet,
    )
    cfg, note = resolve_units_per_step(p, cfg)
    if nnodes > 1:
        # Before torch loads: a node that waits for a missing peer has torch's C++ store log each retry with
        # a 60-frame stack dump on stderr; pdrun says it in one line (launch._not_joined). Set the variable
        # to see them.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    # Here, not at the top: torch and the runtime load for a run, not for `pdrun run --help`.
    from pdrun.launch import Nodes, check_schedule_runs, launch
    from pdrun.shape import effective_plan
    from pdrun.stopped import Stopped

    # A schedule the plan cannot run is refused before any note on how it would have run.
    check_schedule_runs(effective_plan(p, cfg), display_name(plan))
    for line in (note, vertical_sync_note(p, cfg)):
        if line:
            console.print(f"pdrun: {line}", markup=False)
    if resume and checkpoint_dir:
        cfg = _resume_from(p, cfg, checkpoint_dir, quiet)
    try:
        results = launch(
            p, cfg, Nodes(nnodes, node_rank, rdzv_endpoint, nproc_per_node), source=display_name(plan)
        )
    except Stopped as exc:
        # What the workers trained before the signal: written as a finished run's, then the signal's exit.
        if any(len(r.rows) for r in exc.results):  # a step every worker finished: else nothing to write
            _report(exc.results, p, cfg, quiet, stopped_by=exc)
        if exc.signum == signal.SIGINT:
            raise KeyboardInterrupt from None  # "pdrun: aborted", 130, as Ctrl-C anywhere else
        raise
    if results is None:
        return  # a worker other than rank 0 under torchrun: rank 0 reports
    _report(results, p, cfg, quiet)


def _report(
    results: list[WorkerResult], p: Plan, cfg: RunConfig, quiet: bool, stopped_by: Stopped | None = None
) -> None:
    """Write the run's metrics and trace, say how it went on stderr and print its summary on stdout."""
    from pdrun import metrics, timeline
    from pdrun.failures import signal_name
    from pdrun.shape import effective_plan

    used = effective_plan(p, cfg)
    summary = metrics.summary(results, used, p)
    # A file that cannot be written (a full disk, after hours of training) still leaves the summary on
    # stdout and the other file written; its one line comes last, with the write's exit status.
    unwritten: list[UserError] = []
    artifacts: dict[str, str | None] = {"metrics": cfg.metrics, "trace": cfg.trace}
    writers: dict[str, Callable[[str], None]] = {
        "metrics": lambda path: metrics.save(results, path, used, asdict(cfg)),
        "trace": lambda path: timeline.save(results, path),
    }
    for name, write in writers.items():
        path = artifacts[name]
        if path:
            try:
                write(path)
            except UserError as exc:
                unwritten.append(exc)
                artifacts[name] = None
    summary["artifacts"] = {**artifacts, "checkpoints": cfg.checkpoint_dir}
    rank0 = min(results, key=lambda r: r.rank)
    summary["checkpoint_steps"] = rank0.checkpoints  # complete checkpoints this run wrote
    summary["resumed_from_step"] = rank0.resumed_from
    # A stopped run's figures are those of the steps every worker finished; null for a finished run.
    summary["stopped_by"] = signal_name(stopped_by.signum) if stopped_by is not None else None
    summary["ranks_reported"] = sorted(r.rank for r in results)
    for note in (metrics.over_limit_note(summary), metrics.short_step_note(summary, used.batch_size)):
        if note:
            console.print(f"pdrun: {note}", markup=False)
    if stopped_by is not None:
        outputs = (("metrics", cfg.metrics), ("trace", cfg.trace))
        kept = ", ".join(f"{what} in {path}" for what, path in outputs if path)
        missing = len(results) < used.world_size
        console.print(
            f"pdrun: stopped by {signal_name(stopped_by.signum)} after {summary['steps']} steps"
            + (f"; their {kept}" if kept else "")
            + (f" (ranks {summary['ranks_reported']} of {used.world_size} reported)" if missing else ""),
            markup=False,
        )
    elif not quiet:
        acc = summary.get("val_accuracy")
        n = summary["steps"]
        line = f"pdrun: {n} step{'s' if n != 1 else ''} of {used.schedule} on {used.world_size} workers"
        if rank0.resumed_from is not None:
            line += f" (resumed from step {rank0.resumed_from})"  # the steps are this run's, after those
        line += f", final loss {summary['final_loss']}, {summary['samples_per_s'] or 0:.0f} samples/s"
        skipped = metrics.warmup_steps(summary["steps"])
        if skipped:
            line += f" ({summary['steady_samples_per_s'] or 0:.0f} after the first {skipped})"
        predicted = summary["predicted_samples_per_s"]
        if predicted:
            measured = summary["steady_samples_per_s"] or summary["samples_per_s"] or 0.0
            line += f", the plan predicted {predicted:.0f} (measured / predicted {measured / predicted:.2f})"
        console.print(line + (f", val accuracy {acc:.2%}" if acc is not None else ""))
    click.echo(json.dumps(summary, indent=2, default=str))
    if unwritten:
        raise unwritten[0]


def _resume_from(plan: Plan, cfg: RunConfig, directory: str, quiet: bool) -> RunConfig:
    """Pick the checkpoint to resume from here, to say which one and which newer ones were skipped."""
    from pdrun.checkpoint import resume_point
    from pdrun.shape import effective_plan

    used = effective_plan(plan, cfg)
    ck, skipped = resume_point(directory, used.graph_hash, len(used.stages), used.world_size, cfg.optimizer)
    if not quiet or skipped:
        for why in skipped:
            console.print(f"pdrun: skipping incomplete checkpoint {why}")
        console.print(f"pdrun: resuming from {ck.path} (step {ck.step})")
    return replace(cfg, resume_from=str(ck.path))
