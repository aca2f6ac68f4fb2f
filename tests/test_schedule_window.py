"""Window validation agrees with whole-program validation, on programs that run and on broken ones.

``validate_run`` checks each program of a run on a bounded window (warm-up, two or more
steady periods, drain; see [Note: window validation] in shared/schedule_check.py). Here,
over a grid of (schedule, replicas, units, cuts) small enough to validate every program
whole, both must say the same: pass, or fail. The broken programs come from generators
with a fault injected (a dropped receive, two instructions swapped, a missing all-reduce,
warm-up bounds that deadlock), placed as a schedule would place it: at every unit of a
residue of the period, or at the program's warm-up or drain. (A fault at one absolute
unit deep inside a long run is not something a generator computed from a few integers
makes, and a bounded window cannot see it; that is the claim's limit.)
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import count, islice, pairwise

import pytest

from shared.schedule import (
    GENERATORS,
    Instr,
    Kind,
    Pipeline,
    Program,
    Schedule,
    ScheduleError,
    make_pipeline,
    worker_program,
)
from shared.schedule_check import validate_program, validate_run
from tests.schedule_helpers import Wrapped

REPLICAS = [(1,), (2,), (1, 1), (2, 1), (1, 2), (1, 1, 1), (2, 1, 1), (1, 2, 1, 1)]


class Faulty(Wrapped):
    """A schedule's generator with one fault injected into one worker's stream."""

    def __init__(self, inner: Schedule, fault: str, target: int, residue: int) -> None:
        super().__init__(inner)
        self.fault = fault
        self.target = target  # which worker, by index in rank order
        self.residue = residue  # which units: u % period == residue

    def compute(self, pipe: Pipeline, worker: tuple[int, int], first: int, stop: int) -> Iterator[Instr]:
        if self.fault == "deadlock" and pipe.stages > 1:
            # Warm-up bounds not lowered downstream: stage 0 admits one unit, stage 1 waits for two.
            pipe = replace(pipe, bounds=(1, *(max(b, 2) for b in pipe.bounds[1:])))
        return self.inner.compute(pipe, worker, first, stop)

    def program(self, pipe: Pipeline, worker: tuple[int, int], first: int, stop: int) -> Iterator[Instr]:
        instrs = list(super().program(pipe, worker, first, stop))
        if pipe.workers().index(worker) != self.target % len(pipe.workers()):
            return iter(instrs)
        p = self.period(pipe)
        hit = [i for i, ins in enumerate(instrs) if ins.unit % p == self.residue]
        if self.fault == "drop-recv":  # every receive of the units of one residue
            gone = {i for i in hit if instrs[i].kind in (Kind.RECV_ACT, Kind.RECV_GRAD)}
            instrs = [ins for i, ins in enumerate(instrs) if i not in gone]
        elif self.fault == "drop-last-recv":  # the drain's last receive
            recvs = [i for i, ins in enumerate(instrs) if ins.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
            if recvs:
                del instrs[recvs[-1]]
        elif self.fault == "drop-allreduce":
            instrs = [ins for i, ins in enumerate(instrs) if not (i in hit and ins.kind is Kind.ALLREDUCE)]
        elif self.fault == "swap-f-b":  # the backward of a residue's units before their forward
            for u in {instrs[i].unit for i in hit}:
                kinds = {ins.kind: i for i, ins in enumerate(instrs) if ins.unit == u}
                if Kind.FORWARD in kinds and Kind.BACKWARD in kinds:
                    f, b = kinds[Kind.FORWARD], kinds[Kind.BACKWARD]
                    instrs[f], instrs[b] = instrs[b], instrs[f]
        elif self.fault == "swap-recvs":  # two consecutive receives from one peer, in the wrong order
            recvs = [i for i, ins in enumerate(instrs) if ins.kind is Kind.RECV_ACT]
            for a, b in pairwise(recvs):
                if instrs[a].unit % p == self.residue and instrs[a].peer == instrs[b].peer:
                    instrs[a], instrs[b] = instrs[b], instrs[a]
                    break
        elif self.fault == "swap-warmup":  # the first two compute instructions swapped
            compute = [i for i, ins in enumerate(instrs) if ins.kind in (Kind.FORWARD, Kind.BACKWARD)]
            if len(compute) > 1:
                a, b = compute[0], compute[1]
                instrs[a], instrs[b] = instrs[b], instrs[a]
        return iter(instrs)


FAULTS = [
    "none",
    "drop-recv",
    "drop-last-recv",
    "drop-allreduce",
    "swap-f-b",
    "swap-recvs",
    "swap-warmup",
    "deadlock",
]


def _shifted(instrs: list[Instr], base: int) -> list[Instr]:
    return [ins._replace(unit=ins.unit + base) for ins in instrs]


def _whole(gen: Schedule, pipe: Pipeline, lengths: list[int]) -> Program:
    """The run's every program, end to end, unit numbers made global: what runs, validated whole."""
    program: Program = {w: [] for w in pipe.workers()}
    base = 0
    for n in lengths:
        gen.check_units(pipe, n)
        for w in program:
            program[w] += _shifted(list(gen.program(pipe, w, 0, n)), base)
        base += n
    return program


def _verdict(check: Callable[[], None]) -> str:
    try:
        check()
    except ScheduleError:
        return "fails"
    return "runs"


def _cases() -> list[tuple[str, tuple[int, ...], int]]:
    cases = []
    for name in ("1f1b", "1f1b-flush", "gpipe", "forward"):
        for replicas in REPLICAS:
            for micro in (1, 3) if name in ("1f1b-flush", "gpipe") else (1,):
                cases.append((name, replicas, micro))
    return cases


RESIDUE_FAULTS = {"drop-recv", "drop-allreduce", "swap-f-b", "swap-recvs"}


def _faults(pipe: Pipeline, p: int) -> list[tuple[str, int, int]]:
    """(fault, target worker, residue): on the first and last workers and a replica, at two residues."""
    workers = pipe.workers()
    targets = sorted({0, len(workers) - 1, next((i for i, w in enumerate(workers) if w[1] == 1), 0)})
    out = [("none", 0, 0), ("deadlock", 0, 0)]
    for fault in FAULTS[1:-1]:
        residues = sorted({0, p - 1}) if fault in RESIDUE_FAULTS else [0]
        out += [(fault, t, r) for t in targets for r in residues]
    return out


@pytest.mark.parametrize(("name", "replicas", "micro"), _cases())
def test_window_agrees_with_whole_program(name: str, replicas: tuple[int, ...], micro: int) -> None:
    inner = GENERATORS[name]
    pipe = make_pipeline(name, replicas, microbatches=micro)
    step = inner.units_per_step(pipe)
    p = inner.period(pipe)
    # Programs longer than their window, one of each residue of the period (shorter ones are their
    # own window); and cuts: a long program then a short one (a checkpoint), a short one first (a resume).
    cut_short = list(islice((n for n in count(step, step) if inner.window(pipe, n) < n), p // step))
    runs = [[n] for n in cut_short]
    runs += [[cut_short[-1], n] for n in (step, 2 * step)] + [[step, cut_short[0]]]
    for fault, target, residue in _faults(pipe, p):
        gen = Faulty(inner, fault, target, residue)
        for run in runs:
            whole = _verdict(lambda g=gen, r=run: validate_program(_whole(g, pipe, r), trains=g.trains))
            window = _verdict(lambda g=gen, r=run: validate_run(g, pipe, r))
            assert whole == window, (name, replicas, micro, fault, target, residue, run, whole)


def test_the_grid_holds_programs_that_fail() -> None:
    # The faults are real: each breaks the program it is put in, whole and in its window.
    pipe = make_pipeline("1f1b", (2, 1, 1))
    inner = GENERATORS["1f1b"]
    n = inner.window(pipe, 10**9) + 2 * inner.period(pipe)
    for fault, target, residue in [
        ("drop-recv", 2, 0),
        ("drop-last-recv", 3, 0),
        ("drop-allreduce", 1, 1),  # s0.r1: its units are odd
        ("swap-f-b", 2, 0),
        ("swap-recvs", 3, 0),
        ("swap-warmup", 0, 0),
        ("deadlock", 0, 0),
    ]:
        gen = Faulty(inner, fault, target, residue)
        with pytest.raises(ScheduleError):
            validate_run(gen, pipe, [n])
        with pytest.raises(ScheduleError):
            validate_program(_whole(gen, pipe, [n]))


@pytest.mark.parametrize("name", ["1f1b", "1f1b-flush", "gpipe"])
def test_a_million_steps_cost_what_a_hundred_do(name: str) -> None:
    # Start-up does not grow with the run: the window and one worker's first instructions.
    pipe = make_pipeline(name, (2, 1), microbatches=4)
    gen = GENERATORS[name]
    per_step = gen.units_per_step(pipe)
    costs = []
    for steps in (100, 10**6):
        tracemalloc.start()
        t0 = time.perf_counter()
        validate_run(name, pipe, [steps * per_step])
        stream = worker_program(name, pipe, (0, 0), steps * per_step)
        first = [next(stream) for _ in range(50)]
        costs.append((time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]))
        tracemalloc.stop()
        assert first[0] == Instr(Kind.FORWARD, 0)
    (t_small, m_small), (t_big, m_big) = costs
    assert gen.window(pipe, 10**6 * per_step) <= gen.window(pipe, 10**9)  # bounded
    assert m_big < 1.5 * m_small + 100_000, costs
    assert t_big < 5 * t_small + 0.5, costs
