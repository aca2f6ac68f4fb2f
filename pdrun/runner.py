"""A worker process from start to end: join the group, build its stage, train, validate, report.

``worker_entry`` is what the launcher starts on every rank (and what runs directly under
torchrun). Every rank joins the process group, builds its worker (``pdrun/build_worker.py``:
the model from the plan's spec with the same seed, traced, of which it keeps its stage),
then runs the schedule's program one segment (an epoch, or the whole run; ``pdrun/shape.py``)
at a time, validating and checkpointing between them, and rank 0 gathers what every rank
measured. A failure is recorded for the launcher on its way out (``pdrun/failures.py``).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from pdrun import peak, run_checkpoint, stopped, validation
from pdrun.build_worker import build_model, build_worker
from pdrun.config import RunConfig
from pdrun.data import Units
from pdrun.env import DistEnv
from pdrun.failures import PEER_LOST_GRACE_S, joining_failed, peer_lost, record_failure
from pdrun.interleaved import train_interleaved
from pdrun.orphan import die_with
from pdrun.progress import Progress
from pdrun.result import WorkerResult
from pdrun.shape import chunks, effective_plan, pipeline_of, segments
from pdrun.transport import Transport, node_tag, open_transport, remove_leftovers
from pdrun.worker import Worker
from shared.host import send_thread_pays
from shared.malloc import building_malloc
from shared.plan import Plan
from shared.schedule import GENERATORS, Pipeline, worker_program
from shared.schedule_check import validate_run


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
        # Until the stage is built, big blocks are mapped and unmapped, so the build leaves no holes in
        # the heap for the run's tensors to fill unseen by the memory count; pdrun.peak then fixes the
        # steady thresholds pdprof profiles with (shared.malloc).
        building_malloc()
    backend = cfg.backend or ("nccl" if cfg.device == "cuda" else "gloo")
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    try:
        dist.init_process_group(
            backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=cfg.timeout_s)
        )
    except dist.DistError as exc:
        failure = joining_failed(env.rank, cfg.timeout_s, exc)
        record_failure(errdir, env.rank, failure)
        raise failure from exc
    transport = rank_transport(env, cfg, device)
    try:
        run = train_interleaved if plan.virtual_stages > 1 else _train  # several chunks per rank
        out = run(env, plan, cfg, stage_index, replica, device, dtype, t_start, transport)
        dist.barrier()  # leave together: no rank tears its connections down while a peer still uses them
        return out
    except dist.DistStoreError as exc:
        failure = joining_failed(env.rank, cfg.timeout_s, exc)
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


def rank_transport(env: DistEnv, cfg: RunConfig, device: torch.device) -> Transport:
    """This rank's transport (pdrun/transport): per pair of ranks, shared memory or the backend."""
    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")  # where messages travel from
    send_thread = cfg.send_thread == "on" or (
        cfg.send_thread == "auto" and send_thread_pays(device.type, env.local_world_size, cfg.threads)
    )
    return open_transport(env, cfg, device, wire, send_thread)


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
    """Build this rank's worker, run the run's programs (validating and checkpointing between them), report."""
    model = build_model(plan, cfg, device, dtype)
    segs = segments(plan, cfg, model.units.per_epoch, run_checkpoint.resume_point(cfg)[0])
    show = s == model.part.last and replica == 0  # one worker of the last stage draws the bar
    progress = Progress(cfg, show, segs.steps, replicas=plan.stages[s].replicas)
    worker = build_worker(env, plan, cfg, model, (s, replica), transport, dtype, on_step=progress.step)
    stage, part = worker.config.stage, worker.config.part
    val_set = model.val_set
    per_epoch = model.units.per_epoch
    del model  # what is left of it: this rank keeps its stage
    base, resumed = run_checkpoint.resume_point(cfg)
    val_units = validation.units(val_set, plan, cfg)
    passes: list[dict[str, Any]] = []
    written: list[int] = []
    pipe = pipeline_of(plan, part)
    schedule = GENERATORS[plan.schedule]
    checked: set[int] = set()  # the windows validated so far (shared.schedule_check: window validation)

    def save_checkpoint() -> None:
        assert cfg.checkpoint_dir is not None
        step = base // segs.units_per_step  # the run's step (a replica's own count can be lower)
        held = [(s, stage.module, worker.config.optimizer)]
        run_checkpoint.write(env, cfg, plan, held, replica, step, base, worker.steps, device)
        written.append(step)

    def report() -> WorkerResult:
        """What this rank measured: at the end, or so far when the run is stopped (pdrun.stopped)."""
        return WorkerResult(
            rank=env.rank,
            stage=s,
            replica=replica,
            steps=worker.run_steps,
            units=base,
            updates=worker.steps,
            wall_s=time.perf_counter() - t_start,
            rows=worker.step_rows,
            events=worker.events if cfg.trace else [],
            validation=passes,
            versions=worker.version_log,
            max_versions=worker.config.versions.max_held,
            params={n: p.detach().cpu().clone() for n, p in stage.module.named_parameters()}
            if cfg.record
            else {},
            checkpoints=written,
            resumed_from=resumed,
            send_thread=transport.poster is not None,
            links=dict(transport.used),
            replica_sum=transport.summed,
            tie_sum=transport.tie_summed,
        )

    progress.start()
    try:
        for epoch, length in enumerate(segs.lengths):
            segment_end = base + length
            for chunk in chunks(length, base, segs.units_per_step * (cfg.checkpoint_every or 0)):
                if schedule.window(pipe, chunk) not in checked:
                    # Every send has its receive, no deadlock: before any of it runs, on a bounded window.
                    validate_run(schedule, pipe, [chunk])
                    checked.add(schedule.window(pipe, chunk))
                # This rank's own instructions, generated as they run.
                worker.run(worker_program(schedule, pipe, (s, replica), chunk), base)
                peak.settle(worker.step_rows)  # before checkpointing and validation, as each step's row was
                base += chunk
                every = segs.units_per_step * (cfg.checkpoint_every or 0)
                # The segment's end checkpoints after validation, below.
                if cfg.checkpoint_dir and every and base % every == 0 and base < segment_end:
                    save_checkpoint()
            last = epoch == len(segs.lengths) - 1
            if val_units is not None and (segs.epochs or last):
                entry = _validate(worker, val_units, pipe, segs.epoch_at(base, per_epoch))
                passes.append(entry)
                progress.validated(entry)
            if cfg.checkpoint_dir:
                save_checkpoint()
    except BaseException:
        # The steps so far, for the launcher to write if the run was stopped (pdrun.stopped): not only on
        # the signal's own exception, since a rank blocked in a receive unwinds by its peer's going first.
        stopped.keep(report())
        raise
    finally:
        progress.close()
    result = report()
    gathered: list[Any] = [None] * env.world_size if env.rank == 0 else []
    dist.gather_object(result, gathered if env.rank == 0 else None, dst=0)
    return [r for r in gathered if isinstance(r, WorkerResult)] if env.rank == 0 else None


def _validate(worker: Worker, units: Units, pipe: Pipeline, epoch: int) -> dict[str, Any]:
    """One validation pass; on the last stage its sums over the stage's replicas."""
    return validation.entry(worker, worker.validate(units, pipe), epoch)


def worker_entry(plan_json: str, cfg: RunConfig, errdir: str | None) -> list[WorkerResult] | None:
    """The launcher's entrypoint on every rank; a failure is written to ``errdir`` before it propagates."""
    env = DistEnv.from_environ()
    # The launcher stops its workers with the signal it got (torch elastic forwards SIGINT, then waits
    # 30 s before SIGKILL). A worker started from a script's background job inherits SIGINT ignored (the
    # shell ignores it there, and the forkserver keeps what it inherited), so `kill -INT` on pdrun took 20 s
    # to end the run where it takes 0.4 s with a handler in place.
    stopped.arm(errdir)  # SIGINT and SIGTERM unwind the worker, and what it trained is kept (pdrun.stopped)
    if cfg.launcher_pid is not None:
        # Killed with SIGKILL, the launcher cannot sweep what the transport left of its node: its orphans do.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        sweep = partial(remove_leftovers, run_id, node_tag(cfg, env)) if run_id else None
        die_with(cfg.launcher_pid, sweep)
    try:
        plan = Plan.model_validate_json(plan_json)
        return train(env, plan, replace(cfg), errdir)
    except stopped.STOPS as exc:
        # Stopped by the signal the launcher got: it says so in one line, so no traceback from every worker
        # (multiprocessing prints one for any exception but SystemExit); the shell's status for the signal.
        record_failure(errdir, env.rank, exc)
        raise SystemExit(128 + stopped.signal_of(exc)) from None
    except BaseException as exc:
        record_failure(errdir, env.rank, exc)
        raise
