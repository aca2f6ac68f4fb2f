"""Starting the workers: locally through torch's elastic launcher, or as one worker under torchrun.

``pdrun plan.json`` checks the plan against the traced model in this process (so a bad
plan is one line and exit 2 before any worker starts), then starts the plan's world size
of workers with ``torch.distributed.launcher.api.elastic_launch`` and a c10d rendezvous on
a free port. Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) this process is
one worker. The first worker failure is reported with its rank.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from pdrun import checkpoint, named_sems, run_checkpoint, stopped
from pdrun.config import RunConfig, resolve_units_per_step
from pdrun.data import Units, datasets
from pdrun.datacheck import check_data
from pdrun.env import DistEnv, under_torchrun
from pdrun.failures import first_failure
from pdrun.notes import cluster_note, edited_note, two_bw_momentum_note, validation_note
from pdrun.outputs import check_outputs
from pdrun.partition import check_ranks, partition
from pdrun.preload import defining_modules, preload_forkserver, start_forkserver
from pdrun.result import WorkerResult
from pdrun.shape import chunk_lengths, effective_plan, overrides, pipeline_of, segments, units_per_step
from pdrun.stopped import Stopped
from pdrun.tied import check_ties, find_ties
from pdrun.transport import launcher_tag, remove_leftovers
from shared.artifact import validation_error
from shared.blame import naming_source
from shared.cli import say
from shared.errors import RunError, UserError
from shared.plan import Plan
from shared.resolve import resolve_loss, resolve_model
from shared.schedule import SCHEDULES
from shared.schedule_check import validate_run
from shared.tracer import trace


@dataclass(frozen=True)
class Nodes:
    """Where the workers run: this machine alone, or one of ``nnodes`` meeting at ``rdzv_endpoint``."""

    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    nproc_per_node: int | None = None


# The schedules this runtime runs; pdplan plans and pdrun schedule draws more.
RUNS = (*SCHEDULES, "2bw", "zb-h1", "interleaved-1f1b", "zb-v")


def check_schedule_runs(plan: Plan, source: str = "plan") -> None:
    """UserError for a schedule that pdplan plans and ``pdrun schedule`` draws but this runtime does not run
    yet, or that the plan's model chunks per worker (``virtual_stages``) do not fit, named by the plan's field."""
    if plan.schedule not in RUNS:
        raise UserError(
            f"{source}: schedule: pdrun does not run {plan.schedule} yet (it runs {', '.join(RUNS)}); "
            f"`pdrun schedule --schedule {plan.schedule}` draws it, pdplan predicts it; use --schedule 1f1b-flush"
        )
    v = plan.virtual_stages
    if not {"interleaved-1f1b": v >= 2, "zb-v": v == 2}.get(plan.schedule, v == 1):
        wants = {"interleaved-1f1b": "2 or more", "zb-v": "2"}.get(plan.schedule, "1")
        again = f"plan again with pdplan --schedule {plan.schedule}" + (
            " --virtual-stages 2" if wants != "1" else ""
        )
        raise UserError(
            f"{source}: virtual_stages: {plan.schedule} runs {wants} model chunk{'s' if wants != '1' else ''} "
            f"per worker, the plan has {v} ({len(plan.stages)} stages as chunks of {len(plan.stages) // v} "
            f"workers); {again}, as a plan's stages are its chunks"
        )
    # The plan was validated for its own schedule; where --schedule changed it, again: interleaved-1f1b
    # and zb-v place the same chunks on other ranks, and running one's plan as the other deadlocked
    # (each rank waiting for activations its peer never sends) until the peer timeout.
    try:
        Plan.model_validate(plan.model_dump())
    except ValidationError as exc:
        raise validation_error(f"{source} (run as {plan.schedule})", exc) from None


def check(
    plan: Plan, cfg: RunConfig, world_size: int, source: str = "plan", warm: bool = False
) -> tuple[str, ...]:
    """Everything that can be checked before a worker starts: model, trace, partition, ranks, schedule.

    Returns the modules that building the model and its dataset imported (``pdrun.preload``).
    With ``warm``, the forkserver starts importing them as soon as they are known, while the
    trace and the data check run here (for a Hugging Face model, seconds of each).
    """
    edited = edited_note(plan, source)  # of the plan as written: the options' overrides are said apart
    plan = effective_plan(plan, cfg)
    check_schedule_runs(plan, source)
    with naming_source(overrides(cfg), source):
        pipeline_of(plan, None)  # microbatches and replicas against the schedule, before the model is built
    check_ranks(plan, world_size, source)
    if plan.spec.model is None:
        raise UserError(f"{source}: spec.model: the plan names no model; make it with pdprof --model SPEC")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible here; use --device cpu")
    torch.manual_seed(cfg.seed)
    model = resolve_model(plan.spec.model, plan.spec.model_args)
    resolve_loss(plan.spec.loss)
    train_set, val_set = datasets(plan.spec)
    if os.environ.get("RANK", "0") == "0":
        notes = (
            validation_note(plan, cfg, val_set is not None),
            two_bw_momentum_note(plan, cfg),
            cluster_note(plan, source),
            edited,
        )
        for note in notes:
            if note:
                say(note)
    modules = defining_modules(model, train_set)
    if warm:
        start_forkserver(modules)
    traced = trace(model, plan.spec.trace)
    part = partition(traced, plan, source)
    check_ties(plan, find_ties(traced, part), source)
    units = Units(train_set, plan.batch_size, cfg.seed, name=f"dataset {plan.spec.data}")
    check_data(traced, units, plan.spec.loss)  # one batch through the whole model, before any worker
    start = run_checkpoint.resume_point(cfg)[0]
    segs = segments(plan, cfg, units.per_epoch, start)
    # Every program of the run (its segments cut at checkpoints), each on a bounded window.
    with naming_source(overrides(cfg), source):
        validate_run(plan.schedule, pipeline_of(plan, part), sorted(chunk_lengths(segs, cfg, start)))
    return modules


def launch(
    plan: Plan, cfg: RunConfig, nodes: Nodes = Nodes(), source: str = "plan"
) -> list[WorkerResult] | None:
    """Run ``plan``; returns every rank's result (None on ranks other than 0 under torchrun)."""
    # First, and cheap: a run that cannot write its results must not train for them.
    check_outputs(cfg.metrics, cfg.trace, cfg.checkpoint_dir, plan=source, resume=cfg.resume)
    cfg, _ = resolve_units_per_step(plan, cfg)  # cmd_run has said what it chose
    if under_torchrun():
        env = DistEnv.from_environ()
        check(plan, cfg, env.world_size, source)
        from pdrun.runner import worker_entry  # this process is the worker

        return worker_entry(plan.model_dump_json(), resume_config(plan, cfg), None)
    nproc = nodes.nproc_per_node or -(-plan.world_size // nodes.nnodes)
    with _checking(cfg.progress, source):
        modules = check(plan, cfg, nproc * nodes.nnodes, source, warm=_start_method(cfg) == "forkserver")
    return _elastic(plan, resume_config(plan, cfg), nodes, nproc, modules)


@contextmanager
def _checking(show: bool, source: str) -> Iterator[None]:
    """A spinner on a terminal while the launcher checks the run: building and tracing a Hugging Face
    model and sending a batch through it takes seconds before any worker starts (a new user saw none)."""
    if not show:
        yield
        return
    from shared.cli import rich_console

    with rich_console().status(f"pdrun: checking {source}: the model, its trace, a batch of the data"):
        yield


def resume_config(plan: Plan, cfg: RunConfig) -> RunConfig:
    """``cfg`` with the verified checkpoint ``--resume`` starts from; UserError when there is none."""
    if not cfg.resume or cfg.resume_from is not None:
        return cfg
    if not cfg.checkpoint_dir:
        raise UserError("--resume needs --checkpoint-dir")
    ck, _ = checkpoint.resume_point(
        cfg.checkpoint_dir, plan.graph_hash, len(plan.stages), plan.world_size, cfg.optimizer
    )
    return replace(cfg, resume_from=str(ck.path))


def _elastic(
    plan: Plan, cfg: RunConfig, nodes: Nodes, nproc: int, modules: tuple[str, ...] = ()
) -> list[WorkerResult] | None:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nodes.nnodes > 1 and not nodes.rdzv_endpoint:
        raise UserError("--nnodes: several machines need --rdzv-endpoint HOST:PORT to meet at")
    if nodes.node_rank is not None:
        backend, configs = "static", {"rank": nodes.node_rank}
    else:
        backend, configs = "c10d", {}
    # The launcher's log folders (empty: the workers' output is not redirected) go in a folder removed
    # when the launch ends: by default every run left a /tmp/torchelastic_* folder (3,755 on this host).
    logdir = tempfile.TemporaryDirectory(prefix="pdrun-logs-")
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=logdir.name),
        min_nodes=nodes.nnodes,
        max_nodes=nodes.nnodes,
        nproc_per_node=nproc,
        run_id=f"pdrun-{uuid.uuid4().hex[:8]}" if nodes.nnodes == 1 else "pdrun",
        rdzv_backend=backend,
        rdzv_endpoint=nodes.rdzv_endpoint or "127.0.0.1:0",  # port 0: the store picks a free one
        # static reads "timeout"; c10d "join_timeout" (600 s by default: a missing node was a silent
        # 10-minute wait whatever --timeout said).
        rdzv_configs={
            **configs,
            "timeout": _join_timeout(cfg, static=True),
            "join_timeout": _join_timeout(cfg, static=False),
        },
        max_restarts=0,
        monitor_interval=0.05,
        # [Note: start method] Not fork: the launcher holds threads (the c10d store, rendezvous
        # keep-alive), and a child forked while one of them holds a lock can hang at start (seen
        # under load). A forkserver is one clean, single-threaded process that imports torch once
        # and forks every worker of every launch from there: fork's speed without its hazards.
        # CUDA needs spawn (a CUDA context cannot cross a fork).
        start_method=_start_method(cfg),
    )
    if config.start_method == "forkserver":
        preload_forkserver(modules)
    named_sems.no_named_locks()
    with (
        logdir,
        tempfile.TemporaryDirectory(prefix="pdrun-err-") as errdir,
        _quiet_launcher(),
        _transport_swept(config.run_id, launcher_tag(os.getpid())),
        named_sems.unlinked_once_started(errdir, nproc),
    ):
        try:
            run = replace(cfg, launcher_pid=os.getpid())
            out: dict[int, Any] = elastic_launch(config, named_sems.entry)(
                plan.model_dump_json(), run, errdir
            )
        except ChildFailedError as exc:
            raise first_failure(Path(errdir), exc) from None
        except (RendezvousError, DistError) as exc:
            if nodes.nnodes == 1:
                raise
            raise _not_joined(nodes, cfg, exc) from None
        except SignalException as exc:
            # pdrun was told to stop (Ctrl-C, a scheduler's SIGTERM): the launcher has stopped the workers,
            # and each left what it trained (pdrun.stopped), for cmd_run to write.
            ups = units_per_step(effective_plan(plan, cfg))
            raise Stopped(exc.sigval, stopped.kept(errdir, ups)) from None
    result = out.get(0)
    return list(result) if result is not None else None


def _join_timeout(cfg: RunConfig, static: bool) -> int:
    """Seconds the nodes have to meet: --timeout, at least 30 under a static rendezvous (--node-rank), whose
    store torch gives that long, and 5 under c10d."""
    return int(max(cfg.timeout_s, 30 if static else 5))


def _not_joined(nodes: Nodes, cfg: RunConfig, exc: BaseException) -> RunError:
    """One line for a multi-node run whose nodes did not all meet (torch says it in a C++ stack dump, or
    with an empty reason)."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    said = type(exc).__name__ + (f": {first}" if first and first != type(exc).__name__ else "")
    return RunError(
        f"--nnodes {nodes.nnodes}: the nodes did not all join at {nodes.rdzv_endpoint} within about "
        f"{_join_timeout(cfg, static=nodes.node_rank is not None):g}s ({said}); start pdrun with the same plan and "
        "--rdzv-endpoint on every node (--node-rank 0 first with --node-rank), or raise --timeout"
    )


def _start_method(cfg: RunConfig) -> str:
    """How the launcher starts its workers (see [Note: start method])."""
    return "spawn" if cfg.device == "cuda" else "forkserver"


@contextmanager
def _transport_swept(run_id: str, node: str) -> Iterator[None]:
    """Remove what a killed worker of this launch left of the transport (files of its node's links).

    ``node`` names this launcher's workers' files only: another node of the run may share the host.
    """
    try:
        yield
    finally:
        remove_leftovers(run_id, node)


@contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The launcher logs each failure as a traceback; we report it as one line (tracebacks under --debug)."""
    if os.environ.get("PIPEDREAM_DEBUG") == "1":
        yield
        return
    # Their child loggers too: torch gives some of them a level of their own.
    names = [
        name
        for name in list(logging.root.manager.loggerDict)
        if any(name == p or name.startswith(p + ".") for p in _LAUNCHER_LOGGERS)
    ]
    loggers = [logging.getLogger(name) for name in {*_LAUNCHER_LOGGERS, *names}]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
