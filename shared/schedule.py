"""Schedules as data: per-worker lists of typed instructions, with no torch in them.

A *worker* is ``(stage, replica)``; unit ``u`` (a minibatch in 1F1B, a microbatch in
the flushing schedules) goes to replica ``u % replicas[stage]`` of every stage. The
runtime (pdrun) executes each worker's list through a dispatch table; the planner's
simulator executes the same lists with profiled costs. Generators, validation and the
grid drawing live beside these types.
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


# ---------------------------------------------------------------------------- validation


def validate_program(program: Program) -> None:
    """Raise :class:`ScheduleError` (one line, with ``.grid``) unless ``program`` can run to the end.

    Checks, in order: every peer is a worker of the program and in the right direction;
    each worker forwards and backwards each of its units exactly once, forward first;
    every send has its receive and every receive its send, in the same order between
    the same two workers (messages between two ranks arrive in the order sent); every
    replica of a stage joins the same number of all-reduces; and the whole program runs
    to the end with blocking receives and non-blocking sends (no deadlock).
    """
    for w, instrs in program.items():
        _check_worker(program, w, instrs)
    _check_messages(program)
    _check_allreduces(program)
    from shared.simulate import Costs, run_timeline

    stages = 1 + max((s for s, _ in program), default=0)
    timeline = run_timeline(program, Costs.uniform(stages))
    if timeline.deadlocked:
        stuck = ", ".join(f"{worker_name(w)} at {program[w][i]}" for w, i in timeline.blocked.items())
        marks = list(timeline.blocked.items())
        raise ScheduleError(
            f"the program deadlocks: {stuck} wait forever (receives block, sends do not)",
            draw_grid(program, marks=marks),
            *marks[0],
        )


def _fail(program: Program, message: str, worker: Worker, index: int) -> ScheduleError:
    return ScheduleError(message, draw_grid(program, marks=[(worker, index)]), worker, index)


def _check_worker(program: Program, w: Worker, instrs: Sequence[Instr]) -> None:
    name = worker_name(w)
    forwarded: set[int] = set()
    backwarded: set[int] = set()
    for i, ins in enumerate(instrs):
        if ins.kind in SENDS | RECVS:
            if ins.peer is None or ins.peer not in program:
                raise _fail(program, f"{name} {ins}: its peer is not a worker of the program", w, i)
            later = ins.kind in (Kind.SEND_ACT, Kind.RECV_GRAD)
            if (ins.peer[0] > w[0]) != later:
                side = "a later" if later else "an earlier"
                raise _fail(program, f"{name} {ins}: the peer must be at {side} stage than {w[0]}", w, i)
        elif ins.peer is not None:
            raise _fail(program, f"{name} {ins}: {ins.kind.name} takes no peer", w, i)
        if ins.kind is Kind.FORWARD:
            if ins.unit in forwarded:
                raise _fail(program, f"{name} F{ins.unit}: unit {ins.unit} is forwarded twice", w, i)
            forwarded.add(ins.unit)
        elif ins.kind is Kind.BACKWARD:
            if ins.unit in backwarded:
                raise _fail(program, f"{name} B{ins.unit}: unit {ins.unit} is backwarded twice", w, i)
            if ins.unit not in forwarded:
                raise _fail(
                    program, f"{name} B{ins.unit}: backward of unit {ins.unit} before its forward", w, i
                )
            backwarded.add(ins.unit)
    for u in sorted(forwarded - backwarded):
        i = next(j for j, ins in enumerate(instrs) if ins.kind is Kind.FORWARD and ins.unit == u)
        raise _fail(program, f"{name} F{u}: unit {u} is forwarded but never backwarded", w, i)


def _check_messages(program: Program) -> None:
    # channel (kind of message, sender, receiver) -> [(unit, worker, index)] in program order
    sent: dict[tuple[str, Worker, Worker], list[tuple[int, int]]] = {}
    received: dict[tuple[str, Worker, Worker], list[tuple[int, int]]] = {}
    for w, instrs in program.items():
        for i, ins in enumerate(instrs):
            if ins.peer is None:
                continue
            if ins.kind in SENDS:
                sent.setdefault((ins.kind.value[1], w, ins.peer), []).append((ins.unit, i))
            elif ins.kind in RECVS:
                received.setdefault((ins.kind.value[1], ins.peer, w), []).append((ins.unit, i))
    what = {"A": ("SA", "RA", "activations"), "G": ("SG", "RG", "gradients")}
    for chan in sorted(set(sent) | set(received)):
        kind, src, dst = chan
        send_code, recv_code, noun = what[kind]
        outs, gets = sent.get(chan, []), received.get(chan, [])
        recv_units = [u for u, _ in gets]
        send_units = [u for u, _ in outs]
        for u, i in outs:
            send_text = f"{worker_name(src)} {send_code}{u}>{_peer_text(dst)}"
            recv_text = f"{recv_code}{u}<{_peer_text(src)}"
            if send_units.count(u) > 1:
                raise _fail(program, f"{send_text}: sent {send_units.count(u)} times", src, i)
            if recv_units.count(u) == 0:
                raise _fail(program, f"{send_text}: no matching {recv_text} on {worker_name(dst)}", src, i)
            if recv_units.count(u) > 1:
                j = [k for uu, k in gets if uu == u][1]
                raise _fail(program, f"{worker_name(dst)} {recv_text}: received twice", dst, j)
        for u, i in gets:
            if u not in send_units:
                raise _fail(
                    program,
                    f"{worker_name(dst)} {recv_code}{u}<{_peer_text(src)}: no matching "
                    f"{send_code}{u}>{_peer_text(dst)} on {worker_name(src)}",
                    dst,
                    i,
                )
        if send_units != recv_units:
            j = next(k for k, (a, b) in enumerate(zip(send_units, recv_units, strict=True)) if a != b)
            raise _fail(
                program,
                f"{worker_name(src)} sends {noun} to {worker_name(dst)} in the order {send_units} but "
                f"{worker_name(dst)} receives them in the order {recv_units} (messages arrive in send order)",
                dst,
                gets[j][1],
            )


def _peer_text(w: Worker) -> str:
    """A worker as a peer is written in instructions: ``1.0``."""
    return f"{w[0]}.{w[1]}"


def _check_allreduces(program: Program) -> None:
    counts: dict[int, dict[Worker, int]] = {}
    for w, instrs in program.items():
        counts.setdefault(w[0], {})[w] = sum(ins.kind is Kind.ALLREDUCE for ins in instrs)
    for stage, per in sorted(counts.items()):
        if len(set(per.values())) > 1:
            most = max(per, key=lambda w: per[w])
            index = [i for i, ins in enumerate(program[most]) if ins.kind is Kind.ALLREDUCE][-1]
            got = ", ".join(f"{worker_name(w)}: {n}" for w, n in sorted(per.items()))
            raise _fail(
                program,
                f"stage {stage}'s replicas join different numbers of all-reduces ({got}); each is a collective",
                most,
                index,
            )


# ---------------------------------------------------------------------------- grid


def draw_grid(program: Program, *, detail: bool = False, marks: Sequence[tuple[Worker, int]] = ()) -> str:
    """A step-by-worker grid of a unit-time run (forward = backward = 1, messages instant).

    Rows are workers, columns time slots, cells the compute op run there (``F3``, ``B3``)
    or ``.``. With ``detail`` a cell holds all the instructions around its compute op:
    the receives before it, the sends, all-reduce and step after it. ``marks`` point at
    instructions (worker, index) to flag with ``!``; one that never ran is drawn in the
    slot after its worker's last op.
    """
    from shared.simulate import Costs, run_timeline

    stages = 1 + max((s for s, _ in program), default=0)
    timeline = run_timeline(program, Costs.uniform(stages))
    slot_of = {(op.worker, op.index): int(op.start) for op in timeline.ops if op.instr.kind in COMPUTE}
    marked = set(marks)
    rows: dict[Worker, dict[int, list[str]]] = {w: {} for w in program}
    for w, instrs in program.items():
        last = max((slot for (ww, _), slot in slot_of.items() if ww == w), default=-1)
        for group in _groups(instrs):
            compute = next((i for i in group if instrs[i].kind in COMPUTE), None)
            slot = slot_of.get((w, compute)) if compute is not None else None
            flagged = [i for i in group if (w, i) in marked]
            if slot is None:
                if not flagged:
                    continue
                last += 1
                slot = last
            shown = [i for i in group if detail or i == compute or i in flagged]
            rows[w].setdefault(slot, []).extend(("!" if i in flagged else "") + str(instrs[i]) for i in shown)
    width = 1 + max((s for cells in rows.values() for s in cells), default=-1)
    cols = [[" ".join(rows[w].get(c, ["."])) for c in range(width)] for w in sorted(program)]
    col_w = [max([len(str(c))] + [len(r[c]) for r in cols]) for c in range(width)]
    names = [worker_name(w) for w in sorted(program)]
    name_w = max([len(n) for n in names] + [4])
    sep = " | " if detail else " "  # detailed cells hold spaces themselves
    lines = [sep.join([" " * name_w] + [str(c).rjust(col_w[c]) for c in range(width)]).rstrip()]
    for name, row in zip(names, cols, strict=True):
        lines.append(sep.join([name.ljust(name_w)] + [row[c].rjust(col_w[c]) for c in range(width)]).rstrip())
    if marked:
        lines.append("(! marks the failing instruction)")
    return "\n".join(lines)


def _groups(instrs: Sequence[Instr]) -> list[list[int]]:
    """Indices grouped around compute ops: receives before one, sends/all-reduce/step after it."""
    groups: list[list[int]] = [[]]
    has_compute = False
    for i, ins in enumerate(instrs):
        if ins.kind in RECVS and has_compute:
            groups.append([])
            has_compute = False
        elif ins.kind in COMPUTE:
            if has_compute:
                groups.append([])
            has_compute = True
        groups[-1].append(i)
    return [g for g in groups if g]
