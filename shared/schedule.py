"""Schedules as data: typed instructions and one lazy generator per schedule, with no torch in them.

A *worker* is ``(stage, replica)``; unit ``u`` (a minibatch in 1F1B, a microbatch in
the flushing schedules) goes to replica ``u % replicas[stage]`` of every stage. Each
schedule is a generator of one worker's instructions for a range of units, computed
from a few integers (:class:`Pipeline`): a pdrun rank runs its own stream through a
dispatch table as it is generated; the planner's simulator and ``pdrun schedule`` run
the same generators for every worker (:func:`build_program`) with profiled or unit costs.
Validation is in ``shared.schedule_check`` and the grid drawing in ``shared.schedule_grid``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from shared.errors import UserError


class Kind(str, Enum):
    """What one instruction does."""

    FORWARD = "F"  # run the stage forward on unit
    BACKWARD = "B"  # run the stage backward on unit (input and weight gradients, or input only if W follows)
    WEIGHT = "W"  # the weight gradients of unit whose B computed only the input gradients (zero bubble)
    SEND_ACT = "SA"  # send unit's activations to peer (a later stage)
    RECV_ACT = "RA"  # receive unit's activations from peer (an earlier stage)
    SEND_GRAD = "SG"  # send unit's input gradients to peer (an earlier stage)
    RECV_GRAD = "RG"  # receive unit's output gradients from peer (a later stage)
    ALLREDUCE = "AR"  # all-reduce gradients among the stage's replicas (unit: the step's last unit)
    STEP = "S"  # optimizer step (unit: the step's last unit)


Worker = tuple[int, int]  # (stage, replica)


class Instr(NamedTuple):
    """One instruction; ``peer`` is the other worker of a send or receive; ``chunk`` a virtual stage.

    ``chunk`` is which of its worker's model chunks a compute op runs (interleaved
    schedules; 0 otherwise); on a send or receive it is the chunk of the *sender's* op,
    so both ends of a message name it alike (see [Note: chunks] in ``shared.schedule_more``).

    A named tuple (immutable, hashable, ordered field by field) rather than a frozen
    dataclass, which takes three times as long to make: the planner's schedule search
    generates tens of thousands of instructions per plan (AlexNet on 4 workers: 24,000).
    """

    kind: Kind
    unit: int
    peer: Worker | None = None
    chunk: int = 0

    def __str__(self) -> str:
        # Compact, round-trippable: F3, B3, SA3>1.0, RG3<2.0, AR7, S7; chunk 1: F3.1, SA3.1>1.0
        head = f"{self.kind.value}{self.unit}" + (f".{self.chunk}" if self.chunk else "")
        if self.peer is None:
            return head
        arrow = ">" if self.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else "<"
        return f"{head}{arrow}{self.peer[0]}.{self.peer[1]}"


Program = dict[Worker, list[Instr]]  # the whole schedule: each worker's instructions in order

COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT})
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})


class ScheduleError(UserError):
    """A schedule that cannot run: bad arguments, or a program that fails validation.

    ``grid`` holds the drawn program with the failing step marked (empty when the
    arguments were wrong before any program existed); ``worker`` and ``index`` point
    at the failing instruction when there is one.
    """

    def __init__(
        self, message: str, grid: str = "", worker: Worker | None = None, index: int | None = None
    ) -> None:
        super().__init__(message)
        self.grid = grid
        self.worker = worker
        self.index = index


# ---------------------------------------------------------------------------- workers


def stage_workers(replicas: Sequence[int]) -> list[Worker]:
    """Every worker in rank order: stage by stage, replica by replica."""
    return [(s, r) for s, n in enumerate(replicas) for r in range(n)]


def worker_of_unit(stage: int, unit: int, replicas: Sequence[int]) -> Worker:
    """The worker that runs ``unit`` at ``stage``: round-robin over the stage's replicas (PipeDream)."""
    return (stage, unit % replicas[stage])


def check_whole_steps(schedule: str, units: int, m: int) -> None:
    """Refuse a run of ``units`` that is not a whole number of steps of ``m`` units (a flushing step)."""
    if units < 1:
        raise ScheduleError(f"units: {units} must be at least 1")
    if units % m:
        raise ScheduleError(
            f"units: {units} is not a multiple of microbatches={m} "
            f"({schedule} steps once per {m} units); use {units - units % m or m}"
        )


def default_microbatches(replicas: Sequence[int]) -> int:
    """The units per step a flushing schedule takes unless told: enough to fill the pipeline.

    At least one unit per stage (each stage has work once the pipeline is full), rounded up to a
    multiple of every stage's replica count, so that each replica of a stage gets the same share of
    the step's units (units go round-robin); with fewer, replicas take turns instead of working
    at once (one stage of 2 replicas at M=1 simulated 11.78 ms against 5.89 ms at M=2).
    """
    whole = math.lcm(*replicas)
    return -(-len(replicas) // whole) * whole


def default_in_flight(replicas: Sequence[int]) -> int:
    """PipeDream's NOAM: ``ceil(workers / replicas of the input stage)`` units per input-stage worker.

    PipeDream (Narayanan et al., SOSP'19, 1F1B scheduling): in the startup state the input
    stage admits NOAM = ceil(# machines / # machines in the input stage) minibatches, just
    enough to keep every worker busy once the pipeline reaches its steady state.
    """
    return math.ceil(sum(replicas) / replicas[0])


def worker_name(worker: Worker) -> str:
    """``s1.r0``: how a worker is named in grids and messages."""
    return f"s{worker[0]}.r{worker[1]}"


_INSTR = re.compile(r"^(F|B|W|SA|RA|SG|RG|AR|S)(\d+)(?:\.(\d+))?(?:([<>])(\d+)\.(\d+))?$")


def parse_instr(text: str) -> Instr:
    """The inverse of ``str(Instr)``: ``"RA3<0.1"`` -> ``Instr(RECV_ACT, 3, (0, 1))``, ``"F3.1"`` chunk 1."""
    m = _INSTR.match(text.strip())
    if m is None:
        raise ScheduleError(
            f"{text!r}: not an instruction (expected e.g. F3, B3, W3, F3.1, SA3>1.0, RG3<2.0, AR7, S7)"
        )
    kind = Kind(m.group(1))
    peer = (int(m.group(5)), int(m.group(6))) if m.group(4) else None
    if (peer is None) != (kind not in SENDS | RECVS):
        raise ScheduleError(f"{text!r}: {kind.name} {'needs' if peer is None else 'takes no'} peer")
    if peer is not None and (m.group(4) == ">") != (kind in SENDS):
        raise ScheduleError(f"{text!r}: sends point '>' at their peer, receives '<'")
    chunk = int(m.group(3)) if m.group(3) is not None else 0
    if m.group(3) is not None and (chunk == 0 or kind in (Kind.ALLREDUCE, Kind.STEP)):
        raise ScheduleError(
            f"{text!r}: a chunk is written only when it is not 0, and only on compute or messages"
        )
    return Instr(kind, int(m.group(2)), peer, chunk)


def program_to_text(program: Program) -> dict[str, list[str]]:
    """The program in compact text form, keyed by worker name (``{"s0.r0": ["F0", "SA0>1.0", ...]}``)."""
    return {worker_name(w): [str(i) for i in program[w]] for w in sorted(program)}


def program_from_text(data: dict[str, list[str]]) -> Program:
    """The inverse of :func:`program_to_text`."""
    program: Program = {}
    for name, instrs in data.items():
        m = re.match(r"^s(\d+)\.r(\d+)$", name)
        if m is None:
            raise ScheduleError(f"{name!r}: not a worker name (expected e.g. s0.r1)")
        program[(int(m.group(1)), int(m.group(2)))] = [parse_instr(t) for t in instrs]
    return program


# ---------------------------------------------------------------------------- stage DAG


def _check_edges(stages: int, stage_edges: Sequence[tuple[int, int]] | None) -> list[tuple[int, int]]:
    if stage_edges is None:
        return [(s, s + 1) for s in range(stages - 1)]
    edges = sorted({(int(a), int(b)) for a, b in stage_edges})
    for a, b in edges:
        if not 0 <= a < b < stages:
            raise ScheduleError(
                f"stage_edges: ({a}, {b}) is not a pair of stages a < b among {stages} stages"
            )
    for s in range(1, stages):
        if not any(b == s for _, b in edges):
            raise ScheduleError(f"stage_edges: stage {s} has no producer (only stage 0 reads the data)")
    for s in range(stages - 1):
        if not any(a == s for a, _ in edges):
            raise ScheduleError(
                f"stage_edges: stage {s} has no consumer (only stage {stages - 1}, the last, computes the loss)"
            )
    return edges


def in_flight_bounds(
    replicas: Sequence[int], stage_edges: Sequence[tuple[int, int]], in_flight: int | None = None
) -> list[int]:
    """Per stage, how many of its own units one worker forwards before its first backward.

    PipeDream's runtime warms a stage up with "the total number of machines following the
    current stage, shared amongst all replicas in this stage" plus the unit it works on:
    ``ceil(later workers / replicas) + 1``, which is NOAM at the input stage and ``S - s``
    on a straight pipeline. ``in_flight`` overrides the input stage's bound.

    A consumer must not wait for a unit that its producer only admits after a backward
    the consumer itself still owes. Stage a's replicas (joined by their all-reduces)
    forward unit v only once every unit up to ``v - replicas[a] * (k[a] - 1) - 1`` came
    back, while stage b backwards unit x only after forwarding up to
    ``x + replicas[b] * (k[b] - 1)``; so every edge a -> b needs
    ``replicas[b] * (k[b] - 1) <= replicas[a] * (k[a] - 1)``. PipeDream's bounds meet it;
    a lowered ``in_flight`` lowers the bounds downstream to meet it.
    """
    bounds: list[int] = []
    for s, n in enumerate(replicas):
        later = sum(replicas[s + 1 :])
        k = math.ceil(later / n) + 1
        if s == 0 and in_flight is not None:
            k = in_flight
        for a, b in stage_edges:
            if b == s:
                k = min(k, replicas[a] * (bounds[a] - 1) // n + 1)
        bounds.append(max(1, k))
    return bounds


# ---------------------------------------------------------------------------- chunk placement

VSHAPED = frozenset({"zb-v"})  # the schedules whose chunks sit in a V rather than round-robin
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v"})  # the schedules whose backward is B, then W (zero bubble)


def chunk_virtual(stages: int, stage: int, chunk: int, vshape: bool = False) -> int:
    """The virtual stage (position in the chain of ``chunks x stages``) of chunk ``chunk`` of ``stage``.

    Round-robin (Narayanan et al., SC'21, Megatron-LM's interleaving): ``chunk * S + stage``,
    so the chain visits the workers 0 .. S-1 once per chunk. V-shaped (Qi et al., ICLR'24,
    ZB-V: "we split the model into 2p chunks and assign chunk i and 2p-1-i to worker i"): odd
    chunks run the workers backwards, ``chunk * S + S - 1 - stage``, so the chain goes
    down the workers and back up, the last worker runs two neighbouring chunks (a local
    hand-off, no message on a link) and the first worker holds the first and the last.
    """
    return chunk * stages + (stages - 1 - stage if vshape and chunk % 2 else stage)


def chunk_owner(stages: int, v: int, vshape: bool = False) -> tuple[int, int]:
    """(worker stage, chunk) of virtual stage ``v``: the inverse of :func:`chunk_virtual`."""
    chunk, k = divmod(v, stages)
    return (stages - 1 - k if vshape and chunk % 2 else k), chunk


# ---------------------------------------------------------------------------- the integers


@dataclass(frozen=True)
class Pipeline:
    """The few integers every schedule is computed from: replicas per stage, the stage DAG, and so on.

    ``bounds[s]`` is how many of its own units a worker of stage s forwards before its
    first backward (:func:`in_flight_bounds`); ``microbatches`` is the units per optimizer
    step of the flushing schedules. Make one with :func:`pipeline`, which checks them.
    """

    replicas: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    bounds: tuple[int, ...]
    microbatches: int = 1
    chunks: int = 1  # model chunks (virtual stages) per worker: the interleaved schedules' V
    vshape: bool = False  # chunks placed in a V (zb-v), not round-robin: see :func:`chunk_virtual`

    @property
    def stages(self) -> int:
        return len(self.replicas)

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage that chunk ``chunk`` of worker stage ``stage`` runs (:func:`chunk_virtual`)."""
        return chunk_virtual(self.stages, stage, chunk, self.vshape)

    def chunk_of(self, v: int) -> tuple[int, int]:
        """(worker stage, chunk) of virtual stage ``v`` (:func:`chunk_owner`)."""
        return chunk_owner(self.stages, v, self.vshape)

    def workers(self) -> list[Worker]:
        return stage_workers(self.replicas)

    def producers(self, stage: int) -> tuple[int, ...]:
        return tuple(a for a, b in self.edges if b == stage)

    def consumers(self, stage: int) -> tuple[int, ...]:
        return tuple(b for a, b in self.edges if a == stage)

    def owner(self, stage: int, unit: int) -> Worker:
        return (stage, unit % self.replicas[stage])


def pipeline(
    replicas: Sequence[int],
    *,
    microbatches: int = 1,
    stage_edges: Sequence[tuple[int, int]] | None = None,
    in_flight: int | None = None,
    chunks: int = 1,
    vshape: bool = False,
) -> Pipeline:
    """A checked :class:`Pipeline`; ``in_flight`` (1f1b's NOAM override) lowers the warm-up bounds."""
    reps = list(replicas)
    if not reps or any(int(n) != n or n < 1 for n in reps):
        raise ScheduleError(f"replicas: {reps} must be one positive count per stage")
    if microbatches < 1:
        raise ScheduleError(f"microbatches: {microbatches} must be at least 1")
    if in_flight is not None and in_flight < 1:
        raise ScheduleError(f"in_flight: {in_flight} must be at least 1")
    if chunks < 1:
        raise ScheduleError(f"chunks: {chunks} must be at least 1 (model chunks per worker)")
    edges = _check_edges(len(reps), stage_edges)
    bounds = in_flight_bounds(reps, edges, in_flight)
    return Pipeline(tuple(int(n) for n in reps), tuple(edges), tuple(bounds), microbatches, chunks, vshape)


# ---------------------------------------------------------------------------- lowering


def lower(pipe: Pipeline, stage: int, ops: Iterable[Instr]) -> Iterator[Instr]:
    """Add each compute op's receives before it and its sends after it (PyTorch's lowering pass).

    Lazy: one op in, its few instructions out. Instructions other than FORWARD and
    BACKWARD (all-reduce, step, and whatever later schedules add) pass through as they are.
    """
    producers, consumers = pipe.producers(stage), pipe.consumers(stage)
    for ins in ops:
        u = ins.unit
        if ins.kind is Kind.FORWARD:
            for a in producers:
                yield Instr(Kind.RECV_ACT, u, pipe.owner(a, u))
            yield ins
            for b in consumers:
                yield Instr(Kind.SEND_ACT, u, pipe.owner(b, u))
        elif ins.kind is Kind.BACKWARD:
            for b in consumers:
                yield Instr(Kind.RECV_GRAD, u, pipe.owner(b, u))
            yield ins
            for a in producers:
                yield Instr(Kind.SEND_GRAD, u, pipe.owner(a, u))
        else:
            yield ins


# ---------------------------------------------------------------------------- generators
#
# [Note: 1F1B order] Each worker runs its own units (u with u % replicas == replica) in
# increasing order: k forwards of warm-up, then one backward and one forward in turn,
# then the remaining backwards (drain). For 4 stages, units of time f = b = 1:
#
#        0  1  2  3  4  5  6  7  8  9 10 11
#   s0  F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2 ...
#   s1   . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 ...
#   s2   .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 ...
#   s3   .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 ...
#
# GPipe runs all the step's forwards, then all its backwards in reverse order (the last
# microbatch's activations are the freshest, as in GPipe's Figure 2).
#
# [Note: generators] A schedule is a class with one generator, ``compute``: given the
# pipeline's integers, one worker and a range of units [first, stop), it yields that
# worker's compute ops (F, B) and step ops (AR, S) in order, computed on the fly from a
# few integers (DeepSpeed's shape), so a rank holds nothing that grows with the run.
# ``program`` lowers them (adds the matched sends and receives). A range of units is a
# program that drains at its end: a run is a sequence of such programs, cut at epoch
# ends and checkpoints (``pdrun.runner``). ``units_per_step`` is what a program's length
# must be a multiple of; ``period`` the units after which the steady state repeats, and
# ``fill`` how many units warm-up plus drain take: window validation
# (``shared.schedule_check.validate_run``) checks a program of ``window(units)`` units,
# which has the same warm-up, drain and residue of ``period`` as the whole, and at least
# two steady periods between.


def _own_units(first: int, stop: int, n: int, replica: int) -> range:
    """The units u in [first, stop) with u % n == replica, as a range (nothing materialised)."""
    start = first + (replica - first) % n
    return range(start, max(start, stop), n)


def one_f_one_b_order(units: Sequence[int], warmup: int) -> Iterator[tuple[Kind, int]]:
    """Warm-up forwards, then backward/forward pairs, then drain: PipeDream's 1F1B for one worker."""
    k = min(warmup, len(units))
    for i in range(k):
        yield Kind.FORWARD, units[i]
    for i in range(len(units) - k):
        yield Kind.BACKWARD, units[i]
        yield Kind.FORWARD, units[i + k]
    for i in range(len(units) - k, len(units)):
        yield Kind.BACKWARD, units[i]


def gpipe_order(units: Sequence[int]) -> Iterator[tuple[Kind, int]]:
    """All forwards in order, then all backwards in reverse order."""
    for u in units:
        yield Kind.FORWARD, u
    for u in reversed(units):
        yield Kind.BACKWARD, u


class Schedule:
    """One schedule: a generator of one worker's instructions for a range of units (see [Note: generators])."""

    name = ""
    trains = True  # whether every forward has its backward (the validation pass has none)

    def units_per_step(self, pipe: Pipeline) -> int:
        """Units from one optimizer step of the whole pipeline to the next; a program's length is a multiple."""
        return math.lcm(*pipe.replicas)

    def period(self, pipe: Pipeline) -> int:
        """Units after which every worker's steady state repeats (unit numbers shifted)."""
        return math.lcm(self.units_per_step(pipe), *pipe.replicas)

    def fill(self, pipe: Pipeline) -> int:
        """Units that warm-up and drain take together, at most."""
        return 2 * max(n * k for n, k in zip(pipe.replicas, pipe.bounds, strict=True))

    def window(self, pipe: Pipeline, units: int) -> int:
        """The length of a program that stands for one of ``units`` units (see [Note: generators])."""
        p = self.period(pipe)
        least = p * (-(-self.fill(pipe) // p) + 2)  # warm-up + drain, and two steady periods
        return units if units <= least + p else least + (units - least) % p

    def check_pipeline(self, pipe: Pipeline) -> None:
        """Raise :class:`ScheduleError` unless this schedule runs on ``pipe`` (PipeDream's three run on any)."""
        if pipe.chunks != 1:
            raise ScheduleError(
                f"chunks: {self.name} runs one model chunk per worker, not {pipe.chunks} "
                "(interleaved-1f1b runs several)"
            )

    def check_units(self, pipe: Pipeline, units: int) -> None:
        """Raise :class:`ScheduleError` unless a program of ``units`` units can be made."""
        if units < 1:
            raise ScheduleError(f"units: {units} must be at least 1")
        step = self.units_per_step(pipe)
        if units % step:
            raise ScheduleError(
                f"units: {units} is not a multiple of {step}; use {units - units % step or step}"
            )

    def compute(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        """The worker's compute and step instructions for units [first, stop), in order."""
        raise NotImplementedError

    def program(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        """The worker's whole instruction stream for units [first, stop), communication lowered."""
        return lower(pipe, worker[0], self.compute(pipe, worker, first, stop))


class OneFOneB(Schedule):
    """``1f1b``: PipeDream, asynchronous; every unit is its own step, with weight stashing in the runtime.

    A worker runs [Note: 1F1B order] over its own units; ``B u`` is followed by ``AR u``
    on a replicated stage (the i-th all-reduce of each replica is one collective, so
    round i joins units ``i*r .. i*r + r - 1``) and ``S u``.
    """

    name = "1f1b"

    def check_units(self, pipe: Pipeline, units: int) -> None:
        if units < 1:
            raise ScheduleError(f"units: {units} must be at least 1")
        for s, n in enumerate(pipe.replicas):
            if n > 1 and units % n:
                raise ScheduleError(
                    f"units: {units} is not a multiple of stage {s}'s {n} replicas "
                    f"(1f1b all-reduces one unit per replica at a time); use {units - units % n or n}"
                )

    def compute(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        stage, replica = worker
        mine = _own_units(first, stop, pipe.replicas[stage], replica)
        for kind, u in one_f_one_b_order(mine, pipe.bounds[stage]):
            yield Instr(kind, u)
            if kind is Kind.BACKWARD:
                yield from end_step(pipe, stage, u)


def end_step(pipe: Pipeline, stage: int, last: int) -> Iterator[Instr]:
    """A worker's end of an optimizer step: AR among the stage's replicas (when it has several), then S.

    Both are labelled with ``last``, the step's last unit (one unit is a step in ``1f1b``).
    """
    if pipe.replicas[stage] > 1:
        yield Instr(Kind.ALLREDUCE, last)
    yield Instr(Kind.STEP, last)


class _Accumulating(Schedule):
    """A schedule that accumulates gradients over ``microbatches`` units per optimizer step."""

    def units_per_step(self, pipe: Pipeline) -> int:
        return pipe.microbatches

    def check_units(self, pipe: Pipeline, units: int) -> None:
        check_whole_steps(self.name, units, pipe.microbatches)


class _Flush(_Accumulating):
    """A flushing schedule: steps of ``microbatches`` units, each ending in AR (replicated) and S everywhere.

    Every replica of a stage joins the step's all-reduce and step, labelled with the
    step's last unit, even one with no unit in that step (it contributes no gradient),
    so that replicas stay identical.
    """

    def fill(self, pipe: Pipeline) -> int:
        return 2 * pipe.microbatches  # a step drains before the next: the first and the last step

    def order(self, pipe: Pipeline, stage: int, units: range) -> Iterator[tuple[Kind, int]]:
        raise NotImplementedError

    def compute(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        stage, replica = worker
        m = pipe.microbatches
        for start in range(first, stop, m):
            last = start + m - 1
            for kind, u in self.order(
                pipe, stage, _own_units(start, last + 1, pipe.replicas[stage], replica)
            ):
                yield Instr(kind, u)
            yield from end_step(pipe, stage, last)


class OneFOneBFlush(_Flush):
    """``1f1b-flush`` (PipeDream-Flush): within a step, [Note: 1F1B order] with the same warm-up bounds."""

    name = "1f1b-flush"

    def order(self, pipe: Pipeline, stage: int, units: range) -> Iterator[tuple[Kind, int]]:
        return one_f_one_b_order(units, pipe.bounds[stage])


class GPipe(_Flush):
    """``gpipe``: within a step, all forwards in order, then all backwards in reverse order."""

    name = "gpipe"

    def order(self, pipe: Pipeline, stage: int, units: range) -> Iterator[tuple[Kind, int]]:
        return gpipe_order(units)


class ForwardOnly(Schedule):
    """``forward``: the validation pass, one forward per unit through the pipeline, nothing to step."""

    name = "forward"
    trains = False

    def units_per_step(self, pipe: Pipeline) -> int:
        return 1

    def fill(self, pipe: Pipeline) -> int:
        return 2 * max(pipe.replicas)

    def compute(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        stage, replica = worker
        for u in _own_units(first, stop, pipe.replicas[stage], replica):
            yield Instr(Kind.FORWARD, u)


GENERATORS: dict[str, Schedule] = {g.name: g for g in (OneFOneB(), OneFOneBFlush(), GPipe(), ForwardOnly())}
SCHEDULES = ("1f1b", "1f1b-flush", "gpipe")  # PipeDream's; "forward" is the validation pass
MORE_SCHEDULES = ("interleaved-1f1b", "zb-h1", "2bw", "zb-v")  # the second wave, in shared.schedule_more
ALL_SCHEDULES = SCHEDULES + MORE_SCHEDULES  # what a plan may name


def get_schedule(name: str) -> Schedule:
    """The generator of schedule ``name``; ScheduleError naming the choices otherwise."""
    if name not in GENERATORS:
        raise ScheduleError(f"schedule: {name!r} is not one of {', '.join(ALL_SCHEDULES)}")
    return GENERATORS[name]


def make_pipeline(
    schedule: str,
    replicas: Sequence[int],
    *,
    microbatches: int = 1,
    stage_edges: Sequence[tuple[int, int]] | None = None,
    in_flight: int | None = None,
    chunks: int = 1,
) -> Pipeline:
    """The :class:`Pipeline` of a run of ``schedule``: ``in_flight`` applies to ``1f1b`` only."""
    gen = get_schedule(schedule)
    pipe = pipeline(
        replicas,
        microbatches=microbatches,
        stage_edges=stage_edges,
        in_flight=in_flight if schedule == "1f1b" else None,
        chunks=chunks,
        vshape=schedule in VSHAPED,
    )
    gen.check_pipeline(pipe)
    return pipe


def worker_program(schedule: str | Schedule, pipe: Pipeline, worker: Worker, units: int) -> Iterator[Instr]:
    """One worker's instructions for a program of ``units`` units, lazily (what each rank runs)."""
    gen = get_schedule(schedule) if isinstance(schedule, str) else schedule
    gen.check_units(pipe, units)
    return gen.program(pipe, worker, 0, units)


def build_program(
    schedule: str,
    replicas: Sequence[int],
    units: int,
    *,
    microbatches: int = 1,
    stage_edges: Sequence[tuple[int, int]] | None = None,
    in_flight: int | None = None,
    chunks: int = 1,
    messages: bool = True,
) -> Program:
    """Every worker's instructions for ``units`` units of ``schedule``, materialised (drawing, simulation).

    ``1f1b``: each unit is an optimizer step (BACKWARD u, ALLREDUCE u when the stage is
    replicated, STEP u); ``in_flight`` is NOAM, units admitted per input-stage worker
    before its first backward. ``1f1b-flush`` and ``gpipe``: ``units // microbatches``
    steps, each ending on every worker with ALLREDUCE (replicated stages) and STEP
    labelled with the step's last unit; a replica with no unit in a step still joins
    them (it contributes no gradient) so that replicas stay identical. ``forward``: the
    validation pass. The same generators as :func:`worker_program`, for every worker.
    ``messages=False``: the compute and step instructions alone, not lowered (what each
    worker holds and does, in its order: the memory model's reading).
    """
    gen = get_schedule(schedule)
    pipe = make_pipeline(
        schedule,
        replicas,
        microbatches=microbatches,
        stage_edges=stage_edges,
        in_flight=in_flight,
        chunks=chunks,
    )
    gen.check_units(pipe, units)
    make = gen.program if messages else gen.compute
    return {w: list(make(pipe, w, 0, units)) for w in pipe.workers()}


def max_in_flight(program: Program) -> dict[Worker, int]:
    """Per worker, the most units forwarded but not yet backwarded at once (activations / stashed weights)."""
    return {w: peak_held(instrs) for w, instrs in program.items()}


def peak_held(
    instrs: Iterable[Instr], until: Kind = Kind.BACKWARD, chunk: int | None = None, since: Kind = Kind.FORWARD
) -> int:
    """The most units a worker's list holds at once: past ``since`` (their forward) and not yet past ``until``
    (its backward, or under a split backward its W); of one ``chunk`` only when given."""
    live = peak = 0
    for ins in instrs:
        if chunk is not None and ins.chunk != chunk:
            continue
        if ins.kind is since:
            live += 1
            peak = max(peak, live)
        elif ins.kind is until:
            live -= 1
    return peak


def compute_units(instrs: Iterable[Instr], kind: Kind) -> list[int]:
    """The units of ``kind`` in a worker's list, in order."""
    return [i.unit for i in instrs if i.kind is kind]


# The second wave builds on this module's classes and adds itself to GENERATORS: imported last.
import shared.schedule_more  # noqa: E402, F401
