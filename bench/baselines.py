"""The alternatives pdrun is measured against: single-process, DDP and torch.distributed.pipelining.

Every system trains the same model (same spec, arguments and seed) on the same data, one
thread per process, gloo on 127.0.0.1, and one optimizer step covers the same global batch
of ``microbatches x batch_size`` samples:

- ``single``: one process, the whole model, the step's microbatches one after the other with
  their gradients accumulated (the loss is their mean: the flush schedules' arithmetic);
- ``ddp``: ``world`` processes, each the whole model on its share of the step's microbatches,
  gradients accumulated locally and all-reduced once per step by ``DistributedDataParallel``;
- ``pipe-1f1b`` / ``pipe-gpipe``: one process per stage of the plan's split (the same
  ``nn.Module`` cut as pdrun's, see ``bench.stage_split``), ``Schedule1F1B`` or
  ``ScheduleGPipe`` over ``microbatches`` microbatches of ``batch_size``;
- ``pipe-interleaved-1f1b`` / ``pipe-zb``: ``ScheduleInterleaved1F1B`` or
  ``ScheduleInterleavedZeroBubble`` (ZB1P, Qi et al.), the split's stages dealt out as
  pdrun deals an interleaved plan's chunks: with ``chunks`` V, rank ``r`` of ``world`` holds
  one ``PipelineStage`` per chunk ``c``, stage index ``c * world + r``. Both run with V = 1 too
  (one stage a rank);
- ``pipe-zbv``: ``ScheduleZBVZeroBubble`` (ZB-V, Qi et al.), two stages a rank placed in a V
  as pdrun places a zb-v plan's chunks: rank ``r`` holds stages ``r`` and ``2 world - 1 - r``.

Each worker times its steps after ``warmup`` untimed ones and splits its time into
compute (forward, backward, loss), optimizer and the rest (communication, waiting and
framework overhead), so a result says where the time goes.
"""

from __future__ import annotations

import contextlib
import math
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pdrun.preload import preload_forkserver
from shared.errors import RunError, UserError
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.schedule import chunk_virtual
from shared.spec import TraceOptions

# torch.distributed.pipelining's schedule class behind each "pipe-" system.
PIPE_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
# The schedules that take a list of stages (PipelineScheduleMulti): several chunks a rank.
MULTI_STAGE = ("interleaved-1f1b", "zb", "zbv")
SYSTEMS = ("single", "ddp", *(f"pipe-{name}" for name in PIPE_SCHEDULES))


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration, identical for every system it is run on."""

    model: str = "zoo:mnist_cnn"
    model_args: dict[str, Any] = field(default_factory=dict)
    data: str = "zoo:mnist5k"
    data_args: dict[str, Any] = field(default_factory=lambda: {"split": "train"})
    loss: str = "cross_entropy"
    trace: TraceOptions = field(default_factory=TraceOptions)
    batch_size: int = 64  # samples per microbatch (the plan's unit)
    microbatches: int = 4  # microbatches per optimizer step
    stage_of: dict[str, int] = field(default_factory=dict)  # the plan's split: layer -> stage
    chunks: int = 1  # pipelining's stages per rank (interleaved: rank r holds stages c * world + r)
    steps: int = 20  # timed steps
    warmup: int = 3  # untimed steps before them
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    optimizer: str = "sgd"  # or "adam" (torch's defaults beside lr), as pdrun's --optimizer
    bandwidth: float | None = None  # emulated link between workers, bytes/s (bench.slow_link)
    eval_data_args: dict[str, Any] | None = None  # e.g. {"split": "val"}: evaluate after every epoch
    timeout_s: float = 300.0
    channels_last: bool = (
        False  # pipelining: the stages' weights and the input batch in NHWC, as pdrun's auto
    )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.microbatches


@dataclass
class RankTimes:
    """Where one rank's timed seconds went."""

    rank: int
    total_s: float
    compute_s: float
    optimizer_s: float
    comm_s: float = math.nan  # in communication calls and waiting on them (pipelining only)
    # pipelining: forward_s, backward_s, loss_s (their sum is compute_s), send_s (posting its batched
    # sends and receives) and recv_wait_s (waiting on them; their sum is comm_s)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        comm = 0.0 if math.isnan(self.comm_s) else self.comm_s
        return max(0.0, self.total_s - self.compute_s - self.optimizer_s - comm)


@dataclass
class Result:
    """What a run measured: throughput over the timed steps, losses and the per-rank split."""

    system: str
    world: int
    steps: int
    samples: int
    seconds: float
    losses: list[float]
    ranks: list[RankTimes]
    step_end_s: list[float] = field(default_factory=list)  # training time at the end of each step
    evals: list[tuple[float, int, float]] = field(default_factory=list)  # (train time, step, val accuracy)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.nan

    @property
    def time_per_step_s(self) -> float:
        return self.seconds / self.steps if self.steps else math.nan

    @property
    def step_s(self) -> list[float]:
        """Each timed step's duration on the reporting rank."""
        ends = self.step_end_s
        return [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]

    @property
    def steady_samples_per_s(self) -> float:
        """Samples per step over the median step time: robust to another job's burst on a shared machine."""
        from bench.measure import steady

        return steady(self.samples / self.steps if self.steps else math.nan, self.step_s)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["samples_per_s"] = self.samples_per_s
        out["time_per_step_s"] = self.time_per_step_s
        out["steady_samples_per_s"] = self.steady_samples_per_s
        return out


def load_tensors(spec: str, args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset as two stacked tensors: batches are slices, so no loader costs time."""
    data = resolve_dataset(spec, args)
    xs, ys = zip(*(data[i] for i in range(len(data))), strict=True)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.stack([torch.as_tensor(y) for y in ys])


class UnitOrder:
    """pdrun's order of units: unit ``u`` is batch ``u mod B`` of epoch ``u div B`` (``B`` full batches
    per epoch), each epoch a permutation seeded with ``seed + epoch``; so every system sees the same data."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.per_epoch = n // batch_size
        if self.per_epoch < 1:
            raise UserError(f"dataset: {n} samples, fewer than one batch of {batch_size}")
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, unit: int) -> torch.Tensor:
        epoch, b = divmod(unit, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        return self._perm[1][b * self.batch_size : (b + 1) * self.batch_size]


def batch_at(
    x: torch.Tensor, y: torch.Tensor, order: UnitOrder, step: int, units: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of step ``step``: its ``units`` consecutive units, concatenated."""
    idx = torch.cat([order.indices(step * units + u) for u in range(units)])
    return x[idx], y[idx]


def build_model(s: Settings) -> nn.Module:
    torch.manual_seed(s.seed)
    model: nn.Module = resolve_model(s.model, s.model_args)
    return model


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 500) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    right = 0
    with torch.no_grad():
        for i in range(0, x.shape[0], chunk):
            out = model(x[i : i + chunk])
            out = out[0] if isinstance(out, (tuple, list)) else out
            right += int((out.argmax(dim=-1) == y[i : i + chunk]).sum())
    model.train()
    return right / x.shape[0]


class _Clock:
    """Training time only: evaluation happens between laps and is not counted."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start: float | None = None

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self.total += time.perf_counter() - self._start
            self._start = None

    def now(self) -> float:
        extra = time.perf_counter() - self._start if self._start is not None else 0.0
        return self.total + extra


def _timed(fn: Callable[..., Any], *into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            for acc in into:
                acc[0] += dt

    return wrapper


def _train_loop(
    s: Settings,
    rank: int,
    world: int,
    step_fn: Callable[[int], float | None],
    optimizer: torch.optim.Optimizer,
    compute: list[float],
    eval_model: nn.Module | None,
    epoch_steps: int,
    comm: list[float] | None = None,
    parts: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """Run warm-up and timed steps; the rank with ``eval_model`` evaluates after each epoch."""
    val = load_tensors(s.data, s.eval_data_args) if s.eval_data_args is not None and eval_model else None
    for step in range(s.warmup):
        step_fn(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    compute[0] = 0.0
    if comm is not None:
        comm[0] = 0.0
    for acc in (parts or {}).values():
        acc[0] = 0.0
    optimizer_s = 0.0
    losses: list[float] = []
    ends: list[float] = []
    evals: list[tuple[float, int, float]] = []
    clock = _Clock()
    if world > 1:
        dist.barrier()
    clock.start()
    for i in range(s.steps):
        loss = step_fn(s.warmup + i)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_s += time.perf_counter() - t0
        if loss is not None:
            losses.append(loss)
        ends.append(clock.now())
        if s.eval_data_args is not None and (i + 1) % epoch_steps == 0:
            clock.stop()
            if world > 1:
                dist.barrier()
            if val is not None and eval_model is not None:
                evals.append((clock.total, i + 1, accuracy(eval_model, *val)))
            if world > 1:
                dist.barrier()
            clock.start()
    if world > 1:
        dist.barrier()
    clock.stop()
    return {
        "rank": rank,
        "total_s": clock.total,
        "compute_s": compute[0],
        "optimizer_s": optimizer_s,
        "comm_s": comm[0] if comm is not None else math.nan,
        "parts": {name: acc[0] for name, acc in (parts or {}).items()},
        "losses": losses,
        "ends": ends,
        "evals": evals,
    }


def make_optimizer(params: list[torch.nn.Parameter], s: Settings) -> torch.optim.Optimizer:
    """The optimizer pdrun builds for ``--optimizer``, ``--lr`` and ``--momentum`` (pdrun.build_worker)."""
    if s.optimizer == "adam":
        return torch.optim.Adam(params, lr=s.lr)
    return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum)


def _run_single(s: Settings, rank: int, world: int) -> dict[str, Any]:
    model = build_model(s)
    x, y = load_tensors(s.data, s.data_args)
    order = UnitOrder(x.shape[0], s.batch_size, s.seed)
    loss_fn = resolve_loss(s.loss)
    opt = make_optimizer(list(model.parameters()), s)
    compute = [0.0]

    def step(i: int) -> float:
        # The same microbatches as the pipelines, their gradients accumulated: the loss is their mean.
        t0 = time.perf_counter()
        xb, yb = batch_at(x, y, order, i, s.microbatches)
        total = 0.0
        for xm, ym in zip(torch.split(xb, s.batch_size), torch.split(yb, s.batch_size), strict=True):
            loss = loss_fn(model(xm), ym) / s.microbatches
            loss.backward()
            total += float(loss.detach())
        compute[0] += time.perf_counter() - t0
        return total

    return _train_loop(s, rank, world, step, opt, compute, model, max(1, order.per_epoch // s.microbatches))


def _run_ddp(s: Settings, rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from bench.slow_link import ddp_hook

    model = build_model(s)
    ddp = DistributedDataParallel(model)
    if s.bandwidth:
        ddp.register_comm_hook(None, ddp_hook(s.bandwidth, world))
    x, y = load_tensors(s.data, s.data_args)
    order = UnitOrder(x.shape[0], s.batch_size, s.seed)
    loss_fn = resolve_loss(s.loss)
    opt = make_optimizer(list(ddp.parameters()), s)
    if s.microbatches % world:
        raise UserError(f"ddp: {s.microbatches} microbatches do not divide among {world} workers")
    share = s.microbatches // world
    compute = [0.0]

    def step(i: int) -> float:
        # This rank's microbatches of the step, gradients accumulated locally and all-reduced once,
        # with the last one. Compute here includes the all-reduce DDP overlaps with that backward.
        t0 = time.perf_counter()
        xb, yb = batch_at(x, y, order, i, s.microbatches)
        mine = range(rank * share, (rank + 1) * share)
        total = 0.0
        for j in mine:
            xm, ym = (
                xb[j * s.batch_size : (j + 1) * s.batch_size],
                yb[j * s.batch_size : (j + 1) * s.batch_size],
            )
            sync = ddp.no_sync() if j != mine[-1] else contextlib.nullcontext()
            with sync:
                loss = loss_fn(ddp(xm), ym) / share
                loss.backward()
            total += float(loss.detach())
        compute[0] += time.perf_counter() - t0
        return total

    epoch = max(1, order.per_epoch // s.microbatches)
    return _train_loop(s, rank, world, step, opt, compute, model if rank == 0 else None, epoch)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands the gradient on in the default (contiguous) layout."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _Contiguous(nn.Module):
    """A stage whose outputs, and its inputs' gradients, leave in the default (contiguous) layout,
    whatever layout it computes in: gloo sends nothing else. A stage that opens with a convolution on
    NHWC weights (a cut after a pooling layer) computes its input's gradient channels-last."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        args = tuple(
            _ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a  # type: ignore[no-untyped-call]
            for a in args
        )
        out = self.inner(*args)
        if isinstance(out, tuple):
            return tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


def _run_pipe(s: Settings, rank: int, world: int, schedule_name: str) -> dict[str, Any]:
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage, schedules

    from bench.slow_link import patch_pipelining
    from bench.stage_split import split_stages
    from shared.tracer import trace

    model = build_model(s)
    stages = split_stages(trace(model, s.trace), s.stage_of)
    n = len(stages.modules)
    if n != world * s.chunks:
        raise UserError(f"pipelining: the split has {n} stages, {world} workers x {s.chunks} chunks expected")
    if s.chunks > 1 and schedule_name not in MULTI_STAGE:
        raise UserError(f"pipelining: {PIPE_SCHEDULES[schedule_name]} runs one stage a rank, not {s.chunks}")
    patch_pipelining(s.bandwidth)
    # pdrun's chunk order: chunk c of worker w, round-robin, or in a V for ZB-V (shared.schedule.chunk_virtual).
    mine = [chunk_virtual(world, rank, c, schedule_name == "zbv") for c in range(s.chunks)]
    modules: list[nn.Module] = []
    for index in mine:
        module: nn.Module = stages.modules[index]
        if s.channels_last:
            from shared.layout import module_to_channels_last

            module_to_channels_last(module)
            # gloo sends only contiguous tensors: a user's stage hands its NHWC output on as NCHW (a copy).
            module = _Contiguous(module)
        modules.append(module)
    built = [PipelineStage(m, i, n, torch.device("cpu")) for m, i in zip(modules, mine, strict=True)]
    loss_fn = resolve_loss(s.loss)
    cls = getattr(pipelining, PIPE_SCHEDULES[schedule_name])
    schedule = cls(built if schedule_name in MULTI_STAGE else built[0], s.microbatches, loss_fn=loss_fn)
    compute = [0.0]
    parts = {name: [0.0] for name in ("forward_s", "backward_s", "loss_s", "send_s", "recv_wait_s")}
    for stage in built:
        stage.forward_one_chunk = _timed(stage.forward_one_chunk, compute, parts["forward_s"])  # type: ignore[method-assign]
        stage.backward_one_chunk = _timed(stage.backward_one_chunk, compute, parts["backward_s"])  # type: ignore[method-assign]
        # Zero bubble's W (the weight gradients), counted as backward as pdrun's metrics count it.
        stage.backward_weight_one_chunk = _timed(  # type: ignore[method-assign]
            stage.backward_weight_one_chunk, compute, parts["backward_s"]
        )
    schedule._compute_loss = _timed(schedule._compute_loss, compute, parts["loss_s"])
    # Posting sends/receives and waiting for them (with the emulated link's sleep, when set).
    comm = [0.0]
    schedules._batch_p2p = _timed(schedules._batch_p2p, comm, parts["send_s"])
    schedules._wait_batch_p2p = _timed(schedules._wait_batch_p2p, comm, parts["recv_wait_s"])
    x, y = load_tensors(s.data, s.data_args)
    order = UnitOrder(x.shape[0], s.batch_size, s.seed)
    params = [p for m in modules for p in m.parameters()]
    opt = make_optimizer(params, s)
    first, last = (
        0 in mine,
        n - 1 in mine,
    )  # rank 0 holds stage 0; stage n - 1 is the last rank's, or rank 0's in a V

    def step(i: int) -> float | None:
        xb, yb = batch_at(x, y, order, i, s.microbatches)
        if s.channels_last and xb.dim() == 4:
            xb = xb.contiguous(memory_format=torch.channels_last)
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(xb, target=yb, losses=losses)
        elif first:
            schedule.step(xb)
        elif last:
            schedule.step(target=yb, losses=losses)
        else:
            schedule.step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    epoch = max(1, order.per_epoch // s.microbatches)
    return _train_loop(s, rank, world, step, opt, compute, None, epoch, comm, parts)


def _worker(rank: int, world: int, port: int, system: str, s: Settings, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=s.timeout_s),
            )
        if system == "single":
            out = _run_single(s, rank, world)
        elif system == "ddp":
            out = _run_ddp(s, rank, world)
        else:
            out = _run_pipe(s, rank, world, system.removeprefix("pipe-"))
        results.put(("ok", rank, out))
    except BaseException as exc:  # reported to the parent with the rank
        results.put(("error", rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(system: str, s: Settings, world: int | None = None) -> Result:
    """Run ``system`` on ``s`` in fresh processes and return what it measured."""
    if system not in SYSTEMS:
        raise UserError(f"system {system!r}: expected one of {', '.join(SYSTEMS)}")
    if world is None:
        stages = max(s.stage_of.values()) + 1 if s.stage_of else 2
        world = 1 if system == "single" else max(1, stages // s.chunks)
    # Fresh processes forked from a forkserver that has imported torch and this module once, as
    # pdrun's workers are (pdrun.preload): neither side pays a torch import per worker.
    preload_forkserver(("torch.distributed.pipelining", "bench.baselines"))
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, system, s, results)) for r in range(world)]
    for p in procs:
        p.start()
    outs: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + s.timeout_s
    try:
        while len(outs) < world:
            try:
                status, rank, payload = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = (
                        f"exit status {dead[0].exitcode}" if dead else f"no result after {s.timeout_s:.0f} s"
                    )
                    raise RunError(f"{system}: a worker failed ({why})") from None
                continue
            if status != "ok":
                raise RunError(f"{system}: rank {rank} failed: {payload}")
            outs[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return _combine(system, world, s, outs)


def _combine(system: str, world: int, s: Settings, outs: dict[int, dict[str, Any]]) -> Result:
    ranks = [
        RankTimes(r, o["total_s"], o["compute_s"], o["optimizer_s"], o["comm_s"], o.get("parts", {}))
        for r, o in sorted(outs.items())
    ]
    # Losses come from the rank that computes them (the last stage, or rank 0 of DDP).
    reporter = max((r for r, o in outs.items() if o["losses"]), default=0)
    evals = [tuple(e) for o in outs.values() for e in o["evals"]]
    return Result(
        system=system,
        world=world,
        steps=s.steps,
        samples=s.steps * s.global_batch,
        seconds=max(o["total_s"] for o in outs.values()),
        losses=list(outs[reporter]["losses"]),
        ranks=ranks,
        step_end_s=list(outs[reporter]["ends"]),
        evals=[(float(e[0]), int(e[1]), float(e[2])) for e in evals],
    )


def even_split(s: Settings, stages: int) -> dict[str, int]:
    """A split of the traced layers into ``stages`` runs of about equal parameter bytes (no planner needed)."""
    from shared.tracer import parameter_bytes, trace

    traced = trace(build_model(s), s.trace)
    sizes = [parameter_bytes(traced, layer) + 1 for layer in traced.layers]
    total = sum(sizes)
    out: dict[str, int] = {}
    acc = 0
    for layer, size in zip(traced.layers, sizes, strict=True):
        out[layer.name] = min(stages - 1, int(acc * stages / total))
        acc += size
    return out
