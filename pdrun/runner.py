"""A worker process from start to end: join the group, build its stage, train, validate, report.

``worker_entry`` is what the launcher starts on every rank (and what runs directly under
torchrun). Every rank builds the model from the plan's spec with the same seed, traces
it, keeps only its stage, and finds the shapes of the values it will receive from one
forward of a sample batch; then it runs the schedule's program one segment (an epoch,
or the whole run) at a time, and rank 0 gathers what every rank measured.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdrun import checkpoint, peak
from pdrun.config import RunConfig
from pdrun.data import Units, datasets, to_device
from pdrun.env import DistEnv
from pdrun.faults import Fault
from pdrun.interleaved import chunk_chain, train_interleaved
from pdrun.orphan import die_with
from pdrun.partition import Partition, partition
from pdrun.stage import build_stage, sample_run
from pdrun.tied import find_ties, tied_gradients
from pdrun.transport import Transport, node_tag, open_transport, remove_leftovers
from pdrun.values import ValueSpec, spec_of, with_channels_last
from pdrun.weights import TwoWeightVersions, WeightVersions
from pdrun.worker import Peers, Worker
from shared.errors import PDError, RunError, UserError
from shared.host import send_thread_pays
from shared.layout import module_to_channels_last, use_channels_last
from shared.malloc import steady_malloc
from shared.plan import Plan
from shared.resolve import resolve_loss, resolve_model
from shared.schedule import GENERATORS, Pipeline, in_flight_bounds, make_pipeline, worker_program
from shared.schedule_check import validate_run
from shared.tracer import trace


@dataclass
class WorkerResult:
    """What one rank reports to rank 0 at the end (plain data, so it pickles)."""

    rank: int
    stage: int
    replica: int
    steps: int  # the run's optimizer steps (runner.units_per_step units each), the same on every rank
    units: int
    wall_s: float
    rows: list[dict[str, Any]]
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
    updates: int = 0  # this rank's own optimizer updates (1f1b: a replica of r updates once per r units)


@dataclass(frozen=True)
class Segments:
    """How the run is cut: units per program, and whether an epoch ends after each."""

    lengths: tuple[int, ...]
    epochs: bool
    units_per_step: int


def effective_plan(plan: Plan, cfg: RunConfig) -> Plan:
    """The plan with the command line's overrides applied (schedule, microbatches, vertical sync)."""
    update: dict[str, Any] = {}
    if cfg.schedule is not None:
        update["schedule"] = cfg.schedule
    if cfg.microbatches is not None:
        update["microbatches"] = cfg.microbatches
    if cfg.vertical_sync is not None:
        update["vertical_sync"] = cfg.vertical_sync
    return plan.model_copy(update=update) if update else plan


def units_per_step(plan: Plan) -> int:
    """Units in one optimizer step of the run (what ``--steps`` counts).

    Flushing schedules: the plan's ``microbatches``. ``1f1b``: one unit per step when no
    stage is replicated (PipeDream: every minibatch is an update at every stage). A stage
    of r replicas all-reduces once per r units, one from each replica, so its weights are
    updated once per r units; a step is then one round of ``lcm(replicas)`` units, after
    which every replica of every stage has made a whole number of identical updates
    (``lcm / r``; one for the most replicated stages, more for stages with fewer replicas).
    It is what data parallelism calls a step: one update of a global batch, r units wide.
    """
    if plan.schedule != "1f1b":
        return plan.microbatches
    return math.lcm(*(s.replicas for s in plan.stages))


def segments(plan: Plan, cfg: RunConfig, per_epoch: int) -> Segments:
    """Cut the run into programs; raises ``UserError`` when nothing would run."""
    ups = units_per_step(plan)
    if cfg.steps is not None:
        return Segments((cfg.steps * ups,), False, ups)
    epochs = cfg.epochs or 1
    units = per_epoch - per_epoch % ups
    if units < 1:
        raise UserError(
            f"dataset: one epoch holds {per_epoch} units of {plan.batch_size} samples, fewer than one step "
            f"({ups} units); use --steps or a smaller --microbatches"
        )
    return Segments((units,) * epochs, True, ups)


def chunk_lengths(segs: Segments, cfg: RunConfig, base: int = 0) -> set[int]:
    """The distinct lengths of the run's programs (its segments cut at every ``--checkpoint-every``).

    Computed per segment, not per program: a million steps checkpointed every step are one length.
    """
    every = segs.units_per_step * (cfg.checkpoint_every or 0)
    out: set[int] = set()
    for length in segs.lengths:
        if every <= 0:
            out.add(length)
        else:
            head = min(length, (every - base % every) % every or every)  # up to the next multiple
            out.add(head)
            rest = length - head
            if rest >= every:
                out.add(every)
            if rest % every:
                out.add(rest % every)
        base += length
    return out


def pipeline_of(plan: Plan, part: Partition) -> Pipeline:
    """The few integers the plan's schedule generator is computed from."""
    workers = len(plan.stages) // plan.virtual_stages  # interleaved: the stages are the chunks
    chunk_chain(plan, sorted(part.edges()))
    return make_pipeline(
        plan.schedule,
        [s.replicas for s in plan.stages[:workers]],
        microbatches=plan.microbatches,
        stage_edges=sorted(part.edges()) if plan.virtual_stages == 1 else None,
        in_flight=plan.in_flight if plan.schedule == "1f1b" else None,
        chunks=plan.virtual_stages,
    )


def value_specs(
    plan: Plan, cfg: RunConfig, part: Partition, traced: Any, sample: tuple[Any, ...]
) -> dict[str, ValueSpec]:
    """Specs of every value that crosses a stage boundary, from one forward of ``sample``."""
    buffers = {n: b.clone() for n, b in traced.module.named_buffers()}
    values, written = sample_run(traced, sample)
    with torch.no_grad():  # the sample pass must not move BatchNorm statistics
        for n, b in traced.module.named_buffers():
            b.copy_(buffers[n])
    crossing = {n for names in part.sends.values() for n in names}
    return {n: replace(spec_of(values[n]), written=n in written) for n in crossing}


def train(env: DistEnv, plan: Plan, cfg: RunConfig, errdir: str | None = None) -> list[WorkerResult] | None:
    """The whole life of one worker; returns every rank's result on rank 0, None elsewhere."""
    t_start = time.perf_counter()
    plan = effective_plan(plan, cfg)
    stage_index, replica = plan.rank_stage(env.rank)
    if cfg.device == "cuda":
        # One GPU per local rank; with fewer GPUs than ranks, ranks share them round-robin.
        device = torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cfg.threads)
        # As pdprof profiles: without fixed thresholds glibc maps large activation buffers afresh and
        # every first touch page-faults (zoo:mnist_cnn: ~13 ms a step instead of ~9.5 ms).
        steady_malloc()
    backend = cfg.backend or ("nccl" if cfg.device == "cuda" else "gloo")
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    try:
        dist.init_process_group(
            backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=cfg.timeout_s)
        )
    except dist.DistError as exc:
        failure = _joining_failed(env, cfg, exc)
        record_failure(errdir, env.rank, failure)
        raise failure from exc
    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")  # where messages travel from
    send_thread = cfg.send_thread == "on" or (
        cfg.send_thread == "auto" and send_thread_pays(device.type, env.local_world_size, cfg.threads)
    )
    transport = open_transport(env, cfg, device, wire, send_thread)
    try:
        run = train_interleaved if plan.virtual_stages > 1 else _train  # several chunks per rank
        out = run(env, plan, cfg, stage_index, replica, device, dtype, t_start, transport)
        dist.barrier()  # leave together: no rank tears its connections down while a peer still uses them
        return out
    except dist.DistStoreError as exc:
        failure = _joining_failed(env, cfg, exc)
        record_failure(errdir, env.rank, failure)
        raise failure from exc
    except BaseException as exc:
        # Record before tearing down: once our peers see the group close, the launcher kills us.
        record_failure(errdir, env.rank, exc)
        if errdir is not None and peer_lost(exc):
            # A peer vanished (killed, out of memory): give the launcher a moment to see that death
            # first, so that it, not this consequence, is what the run reports. It stops us meanwhile.
            time.sleep(PEER_LOST_GRACE_S)
        raise
    finally:
        transport.close()
        dist.destroy_process_group()


def needs_stash(plan: Plan, part: Partition, s: int) -> bool:
    """Whether stage ``s`` of an asynchronous 1F1B plan must stash weight versions.

    A stage that forwards one unit before each backward (warm-up bound 1: the last stage of a
    straight pipeline, a lone or purely replicated stage) steps only after the backward of the
    unit it forwarded last, so its backward sees the forward's weights without a stash, and runs
    the stage's module directly instead of ``functional_call`` over a version (about 7% of its
    compute). Vertical sync still needs the versions: a unit runs on the input stage's.
    """
    if plan.vertical_sync:
        return True
    replicas = [st.replicas for st in plan.stages]
    return in_flight_bounds(replicas, sorted(part.edges()), plan.in_flight)[s] > 1


def _chunks(length: int, base: int, every: int) -> Iterator[int]:
    """Cut a segment of ``length`` units starting at global unit ``base`` at multiples of ``every`` (0: not)."""
    if every <= 0:
        yield length
        return
    while length > 0:
        n = min(length, every - base % every)
        yield n
        length -= n
        base += n


def _checkpoint(
    env: DistEnv,
    cfg: RunConfig,
    plan: Plan,
    s: int,
    replica: int,
    step: int,
    units: int,
    own_steps: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> None:
    """Every rank writes its files; rank 0 commits the manifest once all have (the pipeline is drained)."""
    assert cfg.checkpoint_dir is not None
    files = []
    if replica == 0:  # replicas are identical: one copy per stage
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
        )


def _joining_failed(env: DistEnv, cfg: RunConfig, exc: BaseException) -> RunError:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RunError(
        f"rank {env.rank}: a peer did not join the process group within {cfg.timeout_s:g}s "
        f"({type(exc).__name__}: {first})"
    )


def _train(
    env: DistEnv,
    plan: Plan,
    cfg: RunConfig,
    s: int,
    replica: int,
    device: torch.device,
    dtype: torch.dtype,
    t_start: float,
    transport: Transport,
) -> list[WorkerResult] | None:
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
    specs = value_specs(plan, cfg, part, traced, tuple(sample))
    # Every rank decides from the same model and options: both ends of a message agree on its layout.
    channels_last = use_channels_last(cfg.memory_format, model, device, dtype)
    if channels_last:
        specs = {n: with_channels_last(v) for n, v in specs.items()}
    stage = build_stage(traced, part, s, frozenset(n for n, v in specs.items() if v.written))
    ties = find_ties(traced, part)
    del model, traced
    stage.module.to(device)
    if channels_last:
        module_to_channels_last(stage.module)
    peak.start(device, stage.module)  # the run's memory from here: the stage's, not the whole model's
    # Groups are made by every rank in the same order, even those outside them.
    group = None
    for idx, st in enumerate(plan.stages):
        if st.replicas > 1:
            g = dist.new_group(st.ranks)
            if idx == s:
                group = g
    tied = tied_gradients(
        plan, ties, s, stage.module, transport.wire
    )  # after the replicas' groups, on every rank
    stash = plan.schedule == "1f1b" and cfg.stash and needs_stash(plan, part, s)
    versions = (
        TwoWeightVersions(stage.module, plan.microbatches)
        if plan.schedule == "2bw"
        else WeightVersions(stage.module, stash=stash, history=stash and plan.vertical_sync)
    )
    params = list(versions.live.values())
    optimizer: torch.optim.Optimizer | None
    if not params:
        optimizer = None  # a stage of pooling and activations: nothing to update
    elif cfg.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    segs = segments(plan, cfg, units.per_epoch)
    replica_count = plan.stages[s].replicas
    worker = Worker(
        rank=env.rank,
        stage=stage,
        replica=replica,
        part=part,
        specs=specs,
        peers=Peers(tuple(tuple(st.ranks) for st in plan.stages)),
        units=units,
        loss_fn=resolve_loss(spec.loss),
        next_token=spec.loss == "causal_lm",
        optimizer=optimizer,
        versions=versions,
        comm=transport,
        group=group,
        device=device,
        dtype=dtype,
        loss_scale=1.0 / plan.microbatches if plan.schedule != "1f1b" else 1.0,
        updates_per_step=segs.units_per_step // replica_count if plan.schedule == "1f1b" else 1,
        average_replicas=plan.schedule == "1f1b",
        vertical_sync=plan.vertical_sync,
        record=cfg.record,
        recompute=plan.schedule == "1f1b" and not cfg.stash,
        trace=cfg.trace is not None,
        channels_last=channels_last,
        split_backward=plan.schedule == "zb-h1",
    )
    base = 0
    resumed: int | None = None
    if cfg.resume_from is not None:
        ck = Path(cfg.resume_from)
        manifest = json.loads((ck / checkpoint.MANIFEST).read_text())
        checkpoint.load_stage(ck, s, stage.module, optimizer, device, plan.graph_hash)
        base, resumed = int(manifest["units"]), int(manifest["step"])
        # Last, after every random draw building the stage made: the generator continues where it stopped.
        # A replica of a stage steps once per round of units: its own step count comes back with it.
        worker.steps = checkpoint.load_rank(ck, env.rank, device)
        versions.latest = worker.steps
    total_steps = worker.run_steps + sum(segs.lengths) // segs.units_per_step
    worker.lr_at = lambda step: cfg.lr_at(step, total_steps)
    val_units = (
        Units(
            val_set, plan.batch_size, cfg.seed, shuffle=False, name=f"validation set of {spec.data}", pad=True
        )
        if val_set is not None and cfg.validate
        else None
    )
    progress = _Progress(cfg, stage.has_output and replica == 0, sum(segs.lengths) // segs.units_per_step)
    worker.on_step = progress.step
    worker.tied = tied
    validation: list[dict[str, Any]] = []
    written: list[int] = []
    pipe = pipeline_of(plan, part)
    schedule = GENERATORS[plan.schedule]
    checked: set[int] = set()  # the windows validated so far (shared.schedule_check: window validation)

    def save_checkpoint() -> None:
        assert cfg.checkpoint_dir is not None
        step = base // segs.units_per_step  # the run's step (a replica's own count can be lower)
        _checkpoint(env, cfg, plan, s, replica, step, base, worker.steps, stage.module, optimizer, device)
        written.append(step)

    try:
        for epoch, length in enumerate(segs.lengths):
            segment_end = base + length
            for chunk in _chunks(length, base, segs.units_per_step * (cfg.checkpoint_every or 0)):
                if schedule.window(pipe, chunk) not in checked:
                    # Every send has its receive, no deadlock: before any of it runs, on a bounded window.
                    validate_run(schedule, pipe, [chunk])
                    checked.add(schedule.window(pipe, chunk))
                # This rank's own instructions, generated as they run.
                worker.run(worker_program(schedule, pipe, (s, replica), chunk), base)
                base += chunk
                every = segs.units_per_step * (cfg.checkpoint_every or 0)
                # The segment's end checkpoints after validation, below.
                if cfg.checkpoint_dir and every and base % every == 0 and base < segment_end:
                    save_checkpoint()
            last = epoch == len(segs.lengths) - 1
            if val_units is not None and (segs.epochs or last):
                loss_sum, correct, count, scored = worker.validate(val_units, pipe)
                if stage.has_output and group is not None:
                    t = torch.tensor(
                        [loss_sum, correct, count, scored], dtype=torch.float64, device=worker.comm.wire
                    )
                    dist.all_reduce(t, group=group)
                    loss_sum, correct, count, scored = float(t[0]), int(t[1]), int(t[2]), int(t[3])
                entry = {
                    "epoch": epoch,
                    "step": worker.run_steps,
                    "loss_sum": loss_sum,
                    "correct": correct,
                    "count": count,
                    "scored": scored,
                }
                validation.append(entry)
                progress.validated(entry)
            if cfg.checkpoint_dir:
                save_checkpoint()
    finally:
        progress.close()
    result = WorkerResult(
        rank=env.rank,
        stage=s,
        replica=replica,
        steps=worker.run_steps,
        units=base,
        updates=worker.steps,
        wall_s=time.perf_counter() - t_start,
        rows=worker.step_rows,
        events=worker.events if cfg.trace else [],
        validation=validation,
        versions=worker.version_log,
        max_versions=versions.max_held,
        params={n: p.detach().cpu().clone() for n, p in stage.module.named_parameters()}
        if cfg.record
        else {},
        checkpoints=written,
        resumed_from=resumed,
        send_thread=transport.poster is not None,
        links=dict(transport.used),
        replica_sum=transport.summed,
    )
    gathered: list[Any] = [None] * env.world_size if env.rank == 0 else []
    dist.gather_object(result, gathered if env.rank == 0 else None, dst=0)
    return [r for r in gathered if isinstance(r, WorkerResult)] if env.rank == 0 else None


class _Progress:
    """A rich progress bar with loss and throughput, drawn by one worker of the last stage."""

    def __init__(self, cfg: RunConfig, show: bool, total: int) -> None:
        self.bar: Any = None
        self.task: Any = None
        if not (show and cfg.progress):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from shared.cli import rich_console

        self.bar = Progress(
            TextColumn("[bold]pdrun"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=rich_console(),
            transient=False,
        )
        self.task = self.bar.add_task("train", total=total, info="")
        self.bar.start()

    def step(self, row: dict[str, Any]) -> None:
        if self.bar is not None:
            info = f"loss {row['loss']:.4f}  {row['samples_per_s']:.0f} samples/s"
            self.bar.update(self.task, advance=1, info=info)

    def validated(self, entry: dict[str, Any]) -> None:
        if self.bar is not None and entry["count"]:
            acc = entry["correct"] / entry["scored"] if entry["scored"] else 0.0
            self.bar.console.print(
                f"epoch {entry['epoch']}: val loss {entry['loss_sum'] / entry['count']:.4f}, accuracy {acc:.2%}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def worker_entry(plan_json: str, cfg: RunConfig, errdir: str | None) -> list[WorkerResult] | None:
    """The launcher's entrypoint on every rank; a failure is written to ``errdir`` before it propagates."""
    env = DistEnv.from_environ()
    if cfg.launcher_pid is not None:
        # Killed with SIGKILL, the launcher cannot sweep what the transport left of its node: its orphans do.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        sweep = partial(remove_leftovers, run_id, node_tag(cfg, env)) if run_id else None
        die_with(cfg.launcher_pid, sweep)
    try:
        plan = Plan.model_validate_json(plan_json)
        return train(env, plan, replace(cfg), errdir)
    except BaseException as exc:
        record_failure(errdir, env.rank, exc)
        raise


PEER_LOST_GRACE_S = 3.0
_PEER_LOST = ("Connection reset", "Connection closed", "Broken pipe", "Connection refused", "lost rank")


def peer_lost(exc: BaseException) -> bool:
    """True when ``exc`` says a peer's connection broke: the peer's failure, seen from here."""
    text = str(exc)
    return any(marker in text for marker in _PEER_LOST)


def record_failure(errdir: str | None, rank: int, exc: BaseException) -> None:
    """Write this rank's first error where the launcher reads it (once: the first error is the cause)."""
    if errdir is None:
        return
    path = Path(errdir, f"rank{rank}.json")
    if path.exists():
        return
    first = str(exc).splitlines()[0] if str(exc) else ""
    record = {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": first,
        "user": isinstance(exc, UserError),
        "ours": isinstance(exc, PDError),
        "peer_lost": peer_lost(exc),
        "traceback": traceback.format_exc() if os.environ.get("PIPEDREAM_DEBUG") == "1" else "",
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
