"""Interleaved 1F1B in the runtime: a rank holds V stage modules (its chunks) and runs its stream by chunk.

Narayanan et al. (SC'21, section 2.2): chunk c of worker w is virtual stage ``c * S + w``
of a pipeline of V x S stages (the plan lists them in that order, ``virtual_stages`` = V).
Each chunk is an ordinary :class:`pdrun.worker.Worker` of its virtual stage: its own
module, optimizer and partition of the values, its peers named by virtual stage. The rank's
one instruction stream (``shared.schedule_more.InterleavedOneFOneB``) names physical peers
and the sender's chunk ([Note: chunks]); :func:`virtual_instr` turns each instruction into
what its chunk's worker expects, and all chunks share the rank's one transport, so the
messages between two ranks keep the order the validator checked. A step steps every chunk.

With ``--trace`` each instruction is a box on its rank's row of the Chrome trace, in the
chunk's own thread (tid c), named as the rank's stream names it (``F3.1``: unit 3, chunk 1); a
step or an all-reduce, which every chunk runs, is a box in each chunk's thread.

The validation pass runs each unit through the rank's chunks in turn (:func:`forward_only_stream`).
A checkpoint holds each chunk as its virtual stage's file (``stage{v}.pt``), so ``--resume``
restores every chunk as the one-chunk runner restores its stage.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from pdrun import peak, run_checkpoint, stopped, validation
from pdrun.build_worker import build_model, build_worker, replica_groups
from pdrun.config import RunConfig
from pdrun.data import Units
from pdrun.env import DistEnv
from pdrun.progress import Progress
from pdrun.result import WorkerResult
from pdrun.shape import chunks as cut_at
from pdrun.shape import pipeline_of, segments
from pdrun.step_rows import StepRows
from pdrun.tied import TiedGradients, find_ties, tied_gradients
from pdrun.transport import Transport
from pdrun.transport.interface import PostedRecv, expect_unit
from pdrun.worker import PARTS, StepStats, Tally, Worker
from shared.plan import Plan
from shared.schedule import (
    GENERATORS,
    RECVS,
    SENDS,
    Instr,
    Kind,
    Pipeline,
    worker_program,
)
from shared.schedule_more import lower_chunked

ALL_CHUNKS = -1


class _UnitRelease:
    """The rank's transport as each chunk sees it: a unit's received values are freed after its last chunk,
    and a message from one of the rank's chunks to another stays in the process.

    ``Transport.release(unit)`` frees what a unit's received values occupy where the transport
    lent them in place (a shared-memory slot), and every chunk's backward calls it; the earlier
    chunks' backwards of that unit come later and still read theirs, so only the V-th release frees them.

    Under zb-v the last worker runs two neighbouring chunks (the V's turn): the program sends
    their values to the worker itself (``shared.schedule_more.lower_chunked``), and here such a
    message goes into a queue per tag, in the order sent, which the validator checked is the
    order received. The receiver gets copies: its layers may write in place, and the sender
    saved its own output for its backward.
    """

    def __init__(self, comm: Transport, chunks: int) -> None:
        self.comm = comm
        self.chunks = chunks
        self.released: Counter[int] = Counter()
        self.loop: dict[int, deque[list[torch.Tensor]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        if dst != self.comm.rank:
            self.comm.send(tensors, dst, tag)
            return
        self.loop.setdefault(tag, deque()).append([t.detach().clone() for t in tensors])

    def post(self, buffers: Sequence[torch.Tensor], src: int, tag: int, hold: bool = False) -> PostedRecv:
        if src != self.comm.rank:
            return self.comm.post(buffers, src, tag, hold)
        return PostedRecv(src, tag, list(buffers))

    def wait(self, posted: PostedRecv, unit: int, what: str) -> tuple[int, list[torch.Tensor]]:
        if posted.src != self.comm.rank:
            return self.comm.wait(posted, unit, what)
        header, *values = self.loop[posted.tag].popleft()
        expect_unit(self.comm.rank, int(header[0]), unit, what, posted.src)
        return int(header[1]), [t.to(self.comm.device) for t in values]

    def recv(
        self, buffers: Sequence[torch.Tensor], src: int, tag: int, unit: int, what: str
    ) -> tuple[int, list[torch.Tensor]]:
        return self.wait(self.post(buffers, src, tag), unit, what)

    def release(self, unit: int) -> None:
        self.released[unit] += 1
        if self.released[unit] == self.chunks:
            del self.released[unit]
            self.comm.release(unit)


def virtual_instr(ins: Instr, stage: int, pipe: Pipeline) -> tuple[int, Instr]:
    """(the local chunk that runs ``ins``, or ALL_CHUNKS; ``ins`` as that chunk's virtual-stage worker sees it).

    A compute op runs on its chunk. A send goes from the sender's chunk (its label) to the
    next (activations) or previous (gradients) virtual stage; a receive is labelled with the
    sender's chunk, so its own chunk is the virtual stage after (before) the sender's. The
    peer keeps its replica: a unit stays on one replica index through every chunk. Virtual
    stages are ``pipe``'s (``shared.schedule.chunk_virtual``): round-robin, or in a V (zb-v).
    """
    if ins.kind in SENDS:
        assert ins.peer is not None
        v = pipe.virtual(stage, ins.chunk)
        return ins.chunk, Instr(
            ins.kind, ins.unit, (v + 1 if ins.kind is Kind.SEND_ACT else v - 1, ins.peer[1])
        )
    if ins.kind in RECVS:
        assert ins.peer is not None
        sender = pipe.virtual(ins.peer[0], ins.chunk)
        v = sender + 1 if ins.kind is Kind.RECV_ACT else sender - 1
        return pipe.chunk_of(v)[1], Instr(ins.kind, ins.unit, (sender, ins.peer[1]))
    if ins.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT):
        return ins.chunk, Instr(ins.kind, ins.unit)
    return ALL_CHUNKS, ins


def run_chunks(
    chunks: list[Worker],
    comm: Transport,
    instrs: Any,
    stage: int,
    pipe: Pipeline,
    base: int,
    events: list[dict[str, Any]] | None = None,
    tied: TiedGradients | None = None,
) -> None:
    """Run one program's stream, each instruction on its chunk's worker (receives posted as they come).

    ``events``: where each instruction's trace box goes, in the order the rank ran them (``--trace``).
    ``tied``: the rank's tied gradients, summed before each step, once for all its chunks.
    """
    for w in chunks:
        w.base = base
        w.stats = StepStats(time.perf_counter())
    for i, ins in enumerate(instrs):
        c, vins = virtual_instr(ins, stage, pipe)
        if tied is not None and ins.kind is Kind.STEP:
            # Every chunk's backward of the step is done; each chunk's step then sees the summed gradient.
            # (Timed with the first chunk's step: a collective the rank waits in, as the one-chunk runner does.)
            t0 = time.perf_counter()
            tied.sum()
            dt = time.perf_counter() - t0
            first = chunks[0].stats
            first.by_kind[Kind.STEP] = first.by_kind.get(Kind.STEP, 0.0) + dt
            first.compute_s += dt
        for k, w in enumerate(chunks) if c == ALL_CHUNKS else [(c, chunks[c])]:
            w.at = i
            wall0 = time.time()
            t0 = time.perf_counter()
            if vins.kind in RECVS:
                w.posted[i] = w._post(vins)
            w.DISPATCH[vins.kind](vins)
            dt = time.perf_counter() - t0
            w.stats.by_kind[vins.kind] = w.stats.by_kind.get(vins.kind, 0.0) + dt
            if vins.kind in RECVS:
                w.stats.idle_s += dt
            elif vins.kind in SENDS:
                w.stats.comm_s += dt
            else:
                w.stats.compute_s += dt
            if events is not None:
                events.append(_box(ins, k, w, wall0, dt))
    comm.drain()


def _box(ins: Instr, chunk: int, w: Worker, wall0: float, dt: float) -> dict[str, Any]:
    """One instruction as a Chrome-trace box: the rank's stream's name for it, in its chunk's thread."""
    return {
        "name": str(ins),
        "cat": ins.kind.name.lower(),
        "ph": "X",
        "ts": wall0 * 1e6,
        "dur": dt * 1e6,
        "pid": w.config.rank,
        "tid": chunk,
        "args": {"unit": w.base + ins.unit, "stage": w.s, "chunk": chunk},
    }


def _thread_names(chunks: list[Worker], rank: int) -> list[dict[str, Any]]:
    """Chrome-trace metadata naming each chunk's thread of the rank's row."""
    return [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": rank,
            "tid": c,
            "args": {"name": f"chunk {c} (stage {w.s})"},
        }
        for c, w in enumerate(chunks)
    ]


def forward_only_stream(worker: tuple[int, int], pipe: Pipeline, units: int) -> Iterator[Instr]:
    """The validation pass of rank ``worker`` (stage, replica), as its training stream names instructions.

    Unit by unit, each of the rank's chunks in turn: the receive from the virtual stage before
    (labelled with the sender's chunk, [Note: chunks]), the forward, the send to the virtual
    stage after. A unit goes through all V x S virtual stages before the next starts, so the
    messages between two ranks come in the order both ends read them, whatever the chunk;
    unpipelined, as a pass once an epoch can be. With ``pipe``'s n replicas per stage, a replica
    runs the units it owns in training (``u % n``), its peers of the same replica.
    """
    stage, replica = worker
    for u in range(replica, units, pipe.replicas[stage]):
        yield from lower_chunked(pipe, worker, (Instr(Kind.FORWARD, u, None, c) for c in range(pipe.chunks)))


def validate_chunks(
    chunks: list[Worker],
    comm: Transport,
    units: Units,
    worker: tuple[int, int],
    pipe: Pipeline,
) -> tuple[float, int, int, int]:
    """:meth:`pdrun.worker.Worker.validate` for a rank's chunks: (loss sum, correct, samples, scored).

    The sums are this replica's; ``pdrun.validation.entry`` adds the other replicas'."""
    tally = Tally()
    stage = worker[0]
    for w in chunks:
        w.config.stage.module.eval()  # dropout off, BatchNorm on its running statistics
    for ins in forward_only_stream(worker, pipe, units.per_epoch):
        c, vins = virtual_instr(ins, stage, pipe)
        chunks[c].val_instr(vins, units, tally)
    comm.drain()
    for w in chunks:
        w.config.stage.module.train()
    return tally.loss_sum, tally.correct, tally.count, tally.scored


def rank_rows(chunks: list[Worker], shown: Worker) -> StepRows:
    """The rank's step rows: the shown chunk's, with the time of every chunk summed (the rank ran them all).

    Each chunk's worker times only its own instructions; a row with one chunk's would count the
    rank's other chunks as time in no instruction. Every chunk steps at every step, so the chunks'
    rows line up step by step."""
    if any(len(w.step_rows) != len(shown.step_rows) for w in chunks):
        return shown.step_rows
    timed = ("compute_s", "comm_s", "idle_s", *PARTS)
    rows = StepRows()
    for i, row in enumerate(shown.step_rows):
        rows.append({**row, **{col: sum(w.step_rows.columns[col][i] for w in chunks) for col in timed}})
    return rows


def train_interleaved(
    env: DistEnv,
    plan: Plan,
    cfg: RunConfig,
    s: int,
    replica: int,
    device: torch.device,
    dtype: torch.dtype,
    t_start: float,
    comm: Transport,
) -> Any:
    """``pdrun.runner._train`` for an interleaved plan: this rank's V chunk workers; every result on rank 0."""
    model = build_model(plan, cfg, device, dtype)
    part = model.part
    val_units = validation.units(model.val_set, plan, cfg)
    shared = cast(Transport, _UnitRelease(comm, plan.virtual_stages))
    per_epoch = model.units.per_epoch
    segs = segments(plan, cfg, per_epoch, run_checkpoint.resume_point(cfg)[0])
    # The bar is drawn by the rank of the last chunk (the loss), from that chunk's rows.
    last = len(plan.stages) - 1
    progress = Progress(
        cfg, plan.chunk_worker(last) == s and replica == 0, segs.steps, replicas=plan.stages[last].replicas
    )
    groups = replica_groups(plan)  # every chunk's, on every rank, before any chunk is built
    taken: set[int] = set()  # the parameters the chunks built so far step (build_worker: one optimizer each)
    chunks = [
        build_worker(
            env,
            plan,
            cfg,
            model,
            (v, replica),
            shared,
            dtype,
            on_step=progress.step if v == last else None,
            group=groups[v],
            taken=taken,
        )
        for v in plan.worker_chunks(s)
    ]
    # Tied parameters across chunks: the rank sums its chunks' copies, then with the other ranks'.
    tied = tied_gradients(
        plan, find_ties(model.traced, part), {w.s: w.config.stage.module for w in chunks}, comm
    )
    del model  # the whole model: this rank keeps its chunks
    # The run's memory from here: the rank's chunks', all in one process (pdrun/peak.py).
    peak.start(comm.device, torch.nn.ModuleList([w.config.stage.module for w in chunks]))
    pipe = pipeline_of(plan, part)
    schedule = GENERATORS[plan.schedule]
    c_shown = next(
        (c for c, w in enumerate(chunks) if w.config.stage.has_output), 0
    )  # the loss lives on the last chunk
    shown = chunks[c_shown]
    base, resumed = run_checkpoint.resume_point(cfg)
    events = _thread_names(chunks, env.rank) if cfg.trace else None
    done: list[dict[str, Any]] = []
    written: list[int] = []
    every = segs.units_per_step * (cfg.checkpoint_every or 0)

    def save() -> None:
        # Every chunk by its virtual stage; they all step together, so the shown one's count is the rank's.
        step = base // segs.units_per_step
        held = [(w.s, w.config.stage.module, w.config.optimizer) for w in chunks]
        run_checkpoint.write(env, cfg, plan, held, replica, step, base, shown.steps, comm.device)
        written.append(step)

    def report() -> WorkerResult:
        """What this rank measured: at the end, or so far when the run is stopped (pdrun.stopped)."""
        return WorkerResult(
            rank=env.rank,
            stage=plan.worker_chunks(s)[
                c_shown
            ],  # the shown chunk's stage: the summary takes the loss from the last stage
            replica=replica,
            steps=shown.run_steps,
            units=base,
            updates=shown.steps,
            wall_s=time.perf_counter() - t_start,
            rows=rank_rows(chunks, shown),
            events=events or [],
            validation=done,
            checkpoints=written,
            resumed_from=resumed,
            params={
                k: p.detach().cpu().clone()
                for w in chunks
                for k, p in w.config.stage.module.named_parameters()
            }
            if cfg.record
            else {},
            send_thread=comm.poster is not None,
            links=dict(comm.used),
            replica_sum=comm.summed,
            tie_sum=comm.tie_summed,
        )

    progress.start()
    try:
        for epoch, length in enumerate(segs.lengths):
            end = base + length
            for units in cut_at(length, base, every):
                program = worker_program(schedule, pipe, (s, replica), units)
                run_chunks(chunks, shared, program, s, pipe, base, events, tied)
                peak.settle(shown.step_rows)  # rank_rows takes the shown chunk's rows; before validation
                base += units
                if cfg.checkpoint_dir and every and base % every == 0 and base < end:
                    save()  # the segment's end checkpoints after validation, below
            if val_units is not None and (segs.epochs or epoch == len(segs.lengths) - 1):
                entry = validation.entry(
                    shown,
                    validate_chunks(chunks, shared, val_units, (s, replica), pipe),
                    segs.epoch_at(base, per_epoch),
                )
                done.append(entry)
                progress.validated(entry)
            if cfg.checkpoint_dir:
                save()
    except BaseException:
        stopped.keep(report())  # the steps so far, if the run was stopped (pdrun.runner._train says why)
        raise
    finally:
        progress.close()
    result = report()
    gathered: list[Any] = [None] * env.world_size if env.rank == 0 else []
    dist.gather_object(result, gathered if env.rank == 0 else None, dst=0)
    return [r for r in gathered if isinstance(r, WorkerResult)] if env.rank == 0 else None
