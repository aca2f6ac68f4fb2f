"""Validating a program before any of it runs: one line naming the worker and the instruction.

pdrun validates every program of a run, each on a bounded window that stands for it
(:func:`validate_run`), and ``pdrun schedule`` every program it draws, so that a schedule
that cannot run fails before training, with the grid of the failing program
(``shared.schedule_grid``) and the failing instruction marked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from shared.schedule import (
    RECVS,
    SENDS,
    Instr,
    Kind,
    Pipeline,
    Program,
    Schedule,
    ScheduleError,
    Worker,
    get_schedule,
    worker_name,
)
from shared.schedule_grid import draw_grid
from shared.simulate import Costs, run_timeline


def validate_program(program: Program, *, trains: bool = True) -> None:
    """Raise :class:`ScheduleError` (one line, with ``.grid``) unless ``program`` can run to the end.

    Checks, in order: every peer is a worker of the program and in the right direction;
    each worker forwards and backwards each of its units exactly once, forward first
    (per chunk, on interleaved programs), and where it splits a backward (W, zero
    bubble) every backward has exactly one weight-gradient instruction after it; a
    worker sends a unit's values only after the compute op that makes them;
    every send has its receive and every receive its send, in the same order between
    the same two workers (messages between two ranks arrive in the order sent); every
    replica of a stage joins the same number of all-reduces; and the whole program runs
    to the end with blocking receives and non-blocking sends (no deadlock). Linear in the
    program's length but for the deadlock check's simulation (``shared.simulate``). With
    ``trains`` false (the forward-only validation pass) a forward needs no backward.
    """
    chunked = any(ins.chunk for instrs in program.values() for ins in instrs)
    for w, instrs in program.items():
        _check_worker(program, w, instrs, trains, chunked)
    _check_messages(program)
    _check_allreduces(program)
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


def window_program(schedule: Schedule, pipe: Pipeline, units: int) -> Program:
    """Every worker's program of ``schedule.window(pipe, units)`` units: what stands for one of ``units``."""
    schedule.check_units(pipe, units)
    length = schedule.window(pipe, units)
    return {w: list(schedule.program(pipe, w, 0, length)) for w in pipe.workers()}


def validate_run(schedule: str | Schedule, pipe: Pipeline, lengths: Iterable[int]) -> None:
    """Validate every program of a run, one bounded window per distinct length (see below).

    [Note: window validation] A run is a sequence of programs, each draining at its end
    (the run is cut at epoch ends, checkpoints and resume points; ``lengths`` are the
    programs' lengths). Programs run one after another: each one's messages on a channel
    precede the next one's, each one's all-reduces are its own, so the run is valid when
    each distinct program is. A generator's program of n units is warm-up, steady periods
    of ``period`` units, and drain; beyond a few periods a longer program only repeats
    the steady period more times, with unit numbers shifted. So each program is checked
    on a window of ``window(n)`` units: the same warm-up and drain, the same residue of
    the period, and at least two steady periods, never more than a bounded number of units
    whatever n is. ``tests/test_schedule_window.py`` checks that this agrees with validating
    every program whole, on a grid of cases small enough for both, broken ones included.
    """
    gen = get_schedule(schedule) if isinstance(schedule, str) else schedule
    seen: set[int] = set()
    lengths_seen: set[int] = set()
    for units in lengths:
        if units in lengths_seen:  # a run of a million steps is cut into few distinct lengths
            continue
        lengths_seen.add(units)
        gen.check_units(pipe, units)
        length = gen.window(pipe, units)
        if length not in seen:
            seen.add(length)
            validate_program(window_program(gen, pipe, units), trains=gen.trains)


def _fail(program: Program, message: str, worker: Worker, index: int) -> ScheduleError:
    return ScheduleError(message, draw_grid(program, marks=[(worker, index)]), worker, index)


def _check_worker(program: Program, w: Worker, instrs: Sequence[Instr], trains: bool, chunked: bool) -> None:
    name = worker_name(w)
    forwarded: set[tuple[int, int]] = set()  # (unit, chunk)
    backwarded: set[tuple[int, int]] = set()
    weighted: set[tuple[int, int]] = set()
    for i, ins in enumerate(instrs):
        key = (ins.unit, ins.chunk)
        if ins.kind in SENDS | RECVS:
            if ins.peer is None or ins.peer not in program:
                raise _fail(program, f"{name} {ins}: its peer is not a worker of the program", w, i)
            later = ins.kind in (Kind.SEND_ACT, Kind.RECV_GRAD)
            if chunked:
                # Virtual stages wrap round the workers (chunk c of stage s is c * S + s): a
                # message may go to any other stage, never to another replica of the worker's
                # own; to the worker itself where two neighbouring chunks are its own (a V's turn).
                if ins.peer[0] == w[0] and ins.peer != w:
                    raise _fail(program, f"{name} {ins}: the peer must be at another stage than {w[0]}", w, i)
            elif (ins.peer[0] > w[0]) != later:
                side = "a later" if later else "an earlier"
                raise _fail(program, f"{name} {ins}: the peer must be at {side} stage than {w[0]}", w, i)
        elif ins.peer is not None:
            raise _fail(program, f"{name} {ins}: {ins.kind.name} takes no peer", w, i)
        if ins.kind is Kind.SEND_ACT and key not in forwarded:
            raise _fail(
                program, f"{name} {ins}: sends unit {ins.unit}'s activations before its forward", w, i
            )
        if ins.kind is Kind.SEND_GRAD and key not in backwarded:
            raise _fail(program, f"{name} {ins}: sends unit {ins.unit}'s gradients before its backward", w, i)
        if ins.kind is Kind.FORWARD:
            if key in forwarded:
                raise _fail(program, f"{name} {ins}: unit {ins.unit} is forwarded twice", w, i)
            forwarded.add(key)
        elif ins.kind is Kind.BACKWARD:
            if key in backwarded:
                raise _fail(program, f"{name} {ins}: unit {ins.unit} is backwarded twice", w, i)
            if key not in forwarded:
                raise _fail(program, f"{name} {ins}: backward of unit {ins.unit} before its forward", w, i)
            backwarded.add(key)
        elif ins.kind is Kind.WEIGHT:
            if key in weighted:
                raise _fail(
                    program, f"{name} {ins}: unit {ins.unit}'s weight gradients are taken twice", w, i
                )
            if key not in backwarded:
                raise _fail(
                    program, f"{name} {ins}: weight gradients of unit {ins.unit} before its backward", w, i
                )
            weighted.add(key)
    if not trains:  # the validation pass: forwards only
        return
    for u, c in sorted(forwarded - backwarded):
        i = next(
            j for j, ins in enumerate(instrs) if ins.kind is Kind.FORWARD and (ins.unit, ins.chunk) == (u, c)
        )
        raise _fail(program, f"{name} {instrs[i]}: unit {u} is forwarded but never backwarded", w, i)
    if weighted:  # a worker that splits its backwards splits every one
        for u, c in sorted(backwarded - weighted):
            i = next(
                j
                for j, ins in enumerate(instrs)
                if ins.kind is Kind.BACKWARD and (ins.unit, ins.chunk) == (u, c)
            )
            raise _fail(program, f"{name} {instrs[i]}: unit {u} has no weight-gradient instruction (W)", w, i)


def _check_messages(program: Program) -> None:
    # channel (kind of message, sender, receiver) -> [((unit, chunk), index)] in program order
    sent: dict[tuple[str, Worker, Worker], list[tuple[tuple[int, int], int]]] = {}
    received: dict[tuple[str, Worker, Worker], list[tuple[tuple[int, int], int]]] = {}
    for w, instrs in program.items():
        for i, ins in enumerate(instrs):
            if ins.peer is None:
                continue
            if ins.kind in SENDS:
                sent.setdefault((ins.kind.value[1], w, ins.peer), []).append(((ins.unit, ins.chunk), i))
            elif ins.kind in RECVS:
                received.setdefault((ins.kind.value[1], ins.peer, w), []).append(((ins.unit, ins.chunk), i))
    what = {"A": ("SA", "RA", "activations"), "G": ("SG", "RG", "gradients")}
    for chan in sorted(set(sent) | set(received)):
        kind, src, dst = chan
        send_code, recv_code, noun = what[kind]
        outs, gets = sent.get(chan, []), received.get(chan, [])
        recv_units = [u for u, _ in gets]
        send_units = [u for u, _ in outs]
        # Counted once per channel: linear in the messages (list.count per unit was quadratic).
        send_count, recv_count = Counter(send_units), Counter(recv_units)
        for u, i in outs:
            send_text = f"{worker_name(src)} {send_code}{_unit_text(u)}>{_peer_text(dst)}"
            recv_text = f"{recv_code}{_unit_text(u)}<{_peer_text(src)}"
            if send_count[u] > 1:
                raise _fail(program, f"{send_text}: sent {send_count[u]} times", src, i)
            if recv_count[u] == 0:
                raise _fail(program, f"{send_text}: no matching {recv_text} on {worker_name(dst)}", src, i)
            if recv_count[u] > 1:
                j = [k for uu, k in gets if uu == u][1]
                raise _fail(program, f"{worker_name(dst)} {recv_text}: received twice", dst, j)
        for u, i in gets:
            if u not in send_count:
                raise _fail(
                    program,
                    f"{worker_name(dst)} {recv_code}{_unit_text(u)}<{_peer_text(src)}: no matching "
                    f"{send_code}{_unit_text(u)}>{_peer_text(dst)} on {worker_name(src)}",
                    dst,
                    i,
                )
        if send_units != recv_units:
            j = next(k for k, (a, b) in enumerate(zip(send_units, recv_units, strict=True)) if a != b)
            raise _fail(
                program,
                f"{worker_name(src)} sends {noun} to {worker_name(dst)} in the order "
                f"{_units_text(send_units)} but {worker_name(dst)} receives them in the order "
                f"{_units_text(recv_units)} (messages arrive in send order)",
                dst,
                gets[j][1],
            )


def _unit_text(key: tuple[int, int]) -> str:
    """A message's unit as instructions write it: ``3``, or ``3.1`` from chunk 1."""
    return f"{key[0]}.{key[1]}" if key[1] else str(key[0])


def _units_text(keys: Sequence[tuple[int, int]]) -> str:
    if not any(c for _, c in keys):
        return str([u for u, _ in keys])
    return "[" + ", ".join(_unit_text(k) for k in keys) + "]"


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
