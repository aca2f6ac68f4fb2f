"""Schedules as data: per-worker lists of typed instructions, with no torch in them.

A *worker* is ``(stage, replica)``; unit ``u`` (a minibatch in 1F1B, a microbatch in
the flushing schedules) goes to replica ``u % replicas[stage]`` of every stage. The
runtime (pdrun) executes each worker's list through a dispatch table; the planner's
simulator executes the same lists with profiled costs. The generators live beside these
types; validation is in ``shared.schedule_check`` and the grid drawing in ``shared.schedule_grid``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from shared.errors import UserError


class Kind(str, Enum):
    """What one instruction does."""

    FORWARD = "F"  # run the stage forward on unit
    BACKWARD = "B"  # run the stage backward on unit
    SEND_ACT = "SA"  # send unit's activations to peer (a later stage)
    RECV_ACT = "RA"  # receive unit's activations from peer (an earlier stage)
    SEND_GRAD = "SG"  # send unit's input gradients to peer (an earlier stage)
    RECV_GRAD = "RG"  # receive unit's output gradients from peer (a later stage)
    ALLREDUCE = "AR"  # all-reduce gradients among the stage's replicas (unit: the step's last unit)
    STEP = "S"  # optimizer step (unit: the step's last unit)


Worker = tuple[int, int]  # (stage, replica)


@dataclass(frozen=True, order=True)
class Instr:
    """One instruction; ``peer`` is the other worker of a send or receive."""

    kind: Kind
    unit: int
    peer: Worker | None = None

    def __str__(self) -> str:
        # Compact, round-trippable: F3, B3, SA3>1.0, RG3<2.0, AR7, S7
        if self.peer is None:
            return f"{self.kind.value}{self.unit}"
        arrow = ">" if self.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else "<"
        return f"{self.kind.value}{self.unit}{arrow}{self.peer[0]}.{self.peer[1]}"


Program = dict[Worker, list[Instr]]  # the whole schedule: each worker's instructions in order

SCHEDULES = ("1f1b", "1f1b-flush", "gpipe")
COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD})
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


_INSTR = re.compile(r"^(F|B|SA|RA|SG|RG|AR|S)(\d+)(?:([<>])(\d+)\.(\d+))?$")


def parse_instr(text: str) -> Instr:
    """The inverse of ``str(Instr)``: ``"RA3<0.1"`` -> ``Instr(RECV_ACT, 3, (0, 1))``."""
    m = _INSTR.match(text.strip())
    if m is None:
        raise ScheduleError(f"{text!r}: not an instruction (expected e.g. F3, B3, SA3>1.0, RG3<2.0, AR7, S7)")
    kind = Kind(m.group(1))
    peer = (int(m.group(4)), int(m.group(5))) if m.group(3) else None
    if (peer is None) != (kind not in SENDS | RECVS):
        raise ScheduleError(f"{text!r}: {kind.name} {'needs' if peer is None else 'takes no'} peer")
    if peer is not None and (m.group(3) == ">") != (kind in SENDS):
        raise ScheduleError(f"{text!r}: sends point '>' at their peer, receives '<'")
    return Instr(kind, int(m.group(2)), peer)


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


# ---------------------------------------------------------------------------- compute orders
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

Order = list[tuple[Kind, int]]


def one_f_one_b_order(units: Sequence[int], warmup: int) -> Order:
    """Warm-up forwards, then backward/forward pairs, then drain: PipeDream's 1F1B for one worker."""
    k = min(warmup, len(units))
    order: Order = [(Kind.FORWARD, u) for u in units[:k]]
    for i in range(len(units) - k):
        order += [(Kind.BACKWARD, units[i]), (Kind.FORWARD, units[i + k])]
    order += [(Kind.BACKWARD, u) for u in units[len(units) - k :]]
    return order


def gpipe_order(units: Sequence[int]) -> Order:
    """All forwards in order, then all backwards in reverse order."""
    return [(Kind.FORWARD, u) for u in units] + [(Kind.BACKWARD, u) for u in reversed(units)]


def _lower(
    orders: dict[Worker, list[Instr]], replicas: Sequence[int], edges: Sequence[tuple[int, int]]
) -> Program:
    """Add each compute op's receives before it and its sends after it (PyTorch's lowering pass)."""
    producers = {s: [a for a, b in edges if b == s] for s in range(len(replicas))}
    consumers = {s: [b for a, b in edges if a == s] for s in range(len(replicas))}
    program: Program = {}
    for (stage, replica), instrs in orders.items():
        out: list[Instr] = []
        for ins in instrs:
            u = ins.unit
            if ins.kind is Kind.FORWARD:
                out += [Instr(Kind.RECV_ACT, u, worker_of_unit(a, u, replicas)) for a in producers[stage]]
                out.append(ins)
                out += [Instr(Kind.SEND_ACT, u, worker_of_unit(b, u, replicas)) for b in consumers[stage]]
            elif ins.kind is Kind.BACKWARD:
                out += [Instr(Kind.RECV_GRAD, u, worker_of_unit(b, u, replicas)) for b in consumers[stage]]
                out.append(ins)
                out += [Instr(Kind.SEND_GRAD, u, worker_of_unit(a, u, replicas)) for a in producers[stage]]
            else:
                out.append(ins)
        program[(stage, replica)] = out
    return program


def build_program(
    schedule: str,
    replicas: Sequence[int],
    units: int,
    *,
    microbatches: int = 1,
    stage_edges: Sequence[tuple[int, int]] | None = None,
    in_flight: int | None = None,
) -> Program:
    """Every worker's instructions for ``units`` units of ``schedule``, communication lowered.

    ``1f1b``: each unit is an optimizer step (BACKWARD u, ALLREDUCE u when the stage is
    replicated, STEP u); ``in_flight`` is NOAM, units admitted per input-stage worker
    before its first backward. ``1f1b-flush`` and ``gpipe``: ``units // microbatches``
    steps, each ending on every worker with ALLREDUCE (replicated stages) and STEP
    labelled with the step's last unit; a replica with no unit in a step still joins
    them (it contributes no gradient) so that replicas stay identical.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    replicas = list(replicas)
    if not replicas or any(int(n) != n or n < 1 for n in replicas):
        raise ScheduleError(f"replicas: {replicas} must be one positive count per stage")
    if units < 1:
        raise ScheduleError(f"units: {units} must be at least 1")
    if microbatches < 1:
        raise ScheduleError(f"microbatches: {microbatches} must be at least 1")
    if in_flight is not None and in_flight < 1:
        raise ScheduleError(f"in_flight: {in_flight} must be at least 1")
    edges = _check_edges(len(replicas), stage_edges)
    bounds = in_flight_bounds(replicas, edges, in_flight if schedule == "1f1b" else None)
    workers = stage_workers(replicas)
    orders: dict[Worker, list[Instr]] = {w: [] for w in workers}

    if schedule == "1f1b":
        for s, n in enumerate(replicas):
            if n > 1 and units % n:
                raise ScheduleError(
                    f"units: {units} is not a multiple of stage {s}'s {n} replicas "
                    f"(1f1b all-reduces one unit per replica at a time); use {units - units % n or n}"
                )
        for stage, replica in workers:
            mine = list(range(replica, units, replicas[stage]))
            for kind, u in one_f_one_b_order(mine, bounds[stage]):
                orders[(stage, replica)].append(Instr(kind, u))
                if kind is Kind.BACKWARD:
                    if replicas[stage] > 1:
                        orders[(stage, replica)].append(Instr(Kind.ALLREDUCE, u))
                    orders[(stage, replica)].append(Instr(Kind.STEP, u))
        return _lower(orders, replicas, edges)

    if units % microbatches:
        raise ScheduleError(
            f"units: {units} is not a multiple of microbatches={microbatches} "
            f"({schedule} steps once per {microbatches} units); use {units - units % microbatches or microbatches}"
        )
    for first in range(0, units, microbatches):
        last = first + microbatches - 1
        for stage, replica in workers:
            n = replicas[stage]
            mine = [u for u in range(first, last + 1) if u % n == replica]
            order = one_f_one_b_order(mine, bounds[stage]) if schedule == "1f1b-flush" else gpipe_order(mine)
            orders[(stage, replica)] += [Instr(kind, u) for kind, u in order]
            if n > 1:
                orders[(stage, replica)].append(Instr(Kind.ALLREDUCE, last))
            orders[(stage, replica)].append(Instr(Kind.STEP, last))
    return _lower(orders, replicas, edges)


def max_in_flight(program: Program) -> dict[Worker, int]:
    """Per worker, the most units forwarded but not yet backwarded at once (activations / stashed weights)."""
    peaks: dict[Worker, int] = {}
    for w, instrs in program.items():
        live = peak = 0
        for ins in instrs:
            if ins.kind is Kind.FORWARD:
                live += 1
                peak = max(peak, live)
            elif ins.kind is Kind.BACKWARD:
                live -= 1
        peaks[w] = peak
    return peaks


def compute_units(instrs: Iterable[Instr], kind: Kind) -> list[int]:
    """The units of ``kind`` in a worker's list, in order."""
    return [i.unit for i in instrs if i.kind is kind]
