"""Simulating a schedule's program with per-stage costs: makespan, idle time, throughput, bubble.

The same instruction lists that pdrun executes run here against a clock: forwards and
backwards take their stage's seconds, sends are non-blocking and arrive after the edge's
transfer time (or, with ``blocking_sends``, keep the sender busy that long), receives block until their message has arrived, an all-reduce waits for
every replica of its stage and then takes its cost, a step takes its cost. Timing is a
max-plus recurrence over the program's dependencies, so the order in which workers are
advanced does not change any figure. No torch: the planner and the benchmarks use it to
predict pdrun's time, and :mod:`shared.schedule` uses it (at unit costs) to draw grids
and find deadlocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from shared.schedule import (
    COMPUTE,
    RECVS,
    SENDS,
    Instr,
    Kind,
    Program,
    ScheduleError,
    Worker,
    chunk_virtual,
    max_in_flight,
    worker_name,
)

# A message's channel, the same at both ends: activations (SA matches RA) or gradients (SG, RG).
_CHANNEL = {Kind.SEND_ACT: "A", Kind.RECV_ACT: "A", Kind.SEND_GRAD: "G", Kind.RECV_GRAD: "G"}


@dataclass(frozen=True)
class Costs:
    """Seconds per unit: ``forward[s]``/``backward[s]`` per stage, ``transfer[(a, b)]`` per stage edge.

    ``weight[s]`` is a weight-gradient instruction (W, zero bubble), whose B then costs
    ``backward[s]`` alone. With ``chunks`` V > 1 the compute costs are per virtual stage:
    ``forward[c * S + s]`` is chunk c of stage s (S = ``len(forward) // V`` stages; in a V,
    ``vshape``, odd chunks count the stages backwards: ``shared.schedule.chunk_virtual``), while
    all-reduce and step stay per stage; with V = 1 every chunk of a stage costs its stage's.

    ``transfer[(a, b)]`` is the time one unit's activations take from stage a to stage b,
    and its gradients from b back to a (missing edges cost nothing); ``allreduce[s]`` is
    one all-reduce among stage s's replicas once all have arrived; ``step[s]`` is one
    optimizer step. Missing stages in ``allreduce``/``step`` cost nothing.
    """

    forward: Sequence[float]
    backward: Sequence[float]
    transfer: Mapping[tuple[int, int], float] = field(default_factory=dict)
    allreduce: Sequence[float] = ()
    step: Sequence[float] = ()
    weight: Sequence[float] = ()
    chunks: int = 1
    vshape: bool = False  # the chunks sit in a V (zb-v): virtual stage by ``shared.schedule.chunk_virtual``
    # A send keeps its worker busy for the transfer (pdrun posting sends itself, an emulated link).
    blocking_sends: bool = False
    # Tied parameters across stages (pdrun.tied): each is (its stages, the sum's seconds). Before
    # every step, every worker of those stages sums the tie's gradient with the others, a blocking
    # collective: a stage's step waits for the other stages' backward of the same unit.
    ties: Sequence[tuple[tuple[int, ...], float]] = ()

    @classmethod
    def uniform(
        cls,
        stages: int,
        forward: float = 1.0,
        backward: float = 1.0,
        transfer: float = 0.0,
        allreduce: float = 0.0,
        step: float = 0.0,
        stage_edges: Sequence[tuple[int, int]] | None = None,
        weight: float = 1.0,
    ) -> Costs:
        """The same costs at every stage and on every edge (the chain unless ``stage_edges``)."""
        edges = stage_edges if stage_edges is not None else [(s, s + 1) for s in range(stages - 1)]
        return cls(
            forward=[forward] * stages,
            backward=[backward] * stages,
            transfer={(a, b): transfer for a, b in edges},
            allreduce=[allreduce] * stages,
            step=[step] * stages,
            weight=[weight] * stages,
        )

    @cached_property
    def _by_kind(self) -> dict[Kind, Sequence[float]]:
        # Built once per Costs (cached_property writes the instance dict, frozen or not): ``of``
        # runs for every simulated instruction.
        return {
            Kind.FORWARD: self.forward,
            Kind.BACKWARD: self.backward,
            Kind.WEIGHT: self.weight,
            Kind.ALLREDUCE: self.allreduce,
            Kind.STEP: self.step,
        }

    def of(self, instr: Instr, stage: int) -> float:
        """How long ``instr`` keeps its worker busy (zero for sends and receives)."""
        costs = self._by_kind.get(instr.kind)
        if costs is None:
            return 0.0
        if self.chunks > 1 and instr.kind in COMPUTE:
            stage = chunk_virtual(len(self.forward) // self.chunks, stage, instr.chunk, self.vshape)
        if stage >= len(costs):
            return 0.0
        return float(costs[stage])

    def link(self, a: int, b: int) -> float:
        """Transfer seconds between stages a and b, either direction."""
        return float(self.transfer.get((min(a, b), max(a, b)), 0.0))


class Op(NamedTuple):
    """One executed instruction: which worker, its position in the worker's list, when.

    A named tuple, not a frozen dataclass: the planner's schedule search simulates tens of
    thousands of instructions per plan, and a frozen dataclass takes three times as long to make.
    """

    worker: Worker
    position: int
    instr: Instr
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every executed instruction; ``blocked`` maps each stuck worker to its stuck instruction (deadlock)."""

    ops: tuple[Op, ...]
    blocked: Mapping[Worker, int]

    @property
    def deadlocked(self) -> bool:
        return bool(self.blocked)


def run_timeline(program: Program, costs: Costs) -> Timeline:
    """Execute ``program`` against a clock; stops (with ``blocked`` filled) when no worker can move.

    Messages are matched by (kind, sender, receiver, unit, chunk); the i-th all-reduce of each
    replica of a stage is one collective.
    """
    replicas: dict[int, int] = {}
    for stage, _ in program:
        replicas[stage] = replicas.get(stage, 0) + 1
    pc = dict.fromkeys(program, 0)
    clock = dict.fromkeys(program, 0.0)
    rounds_done = dict.fromkeys(program, 0)  # all-reduces each worker finished
    arrived: dict[tuple[str, Worker, Worker, int, int], float] = {}  # message -> arrival time
    waiting: dict[tuple[str, Worker, Worker, int, int], Worker] = {}  # message -> receiver stuck on it
    joined: dict[tuple[int, int], dict[Worker, float]] = {}  # (stage, round) -> worker -> time it came
    # Tied stages: the workers of each tie's stages meet before every step (their i-th step with the i-th).
    tie_of = {stage: i for i, (stages, _) in enumerate(costs.ties) for stage in stages}
    tie_workers = [sum(replicas.get(st, 0) for st in stages) for stages, _ in costs.ties]
    tie_rounds = dict.fromkeys(program, 0)
    tie_joined: dict[tuple[int, int], dict[Worker, float]] = {}
    ops: list[Op] = []
    ready = deque(sorted(program))
    queued = set(ready)

    def wake(w: Worker) -> None:
        if w not in queued:
            queued.add(w)
            ready.append(w)

    def meet(
        table: dict[tuple[int, int], dict[Worker, float]], key: tuple[int, int], size: int, w: Worker
    ) -> float | None:
        """Worker ``w`` joins collective ``key`` of ``size`` workers at its clock: None until all came,
        then (the others woken) the time the last came."""
        group = table.setdefault(key, {})
        group.setdefault(w, clock[w])
        if len(group) < size:
            return None
        for other in group:
            if other != w:
                wake(other)
        return max(group.values())

    # The loop below runs once per instruction of every program the planner's search simulates:
    # its lookups are hoisted into locals.
    of, link, blocking, append = costs.of, costs.link, costs.blocking_sends, ops.append
    while ready:
        w = ready.popleft()
        queued.discard(w)
        instrs = program[w]
        stage = w[0]
        i, n = pc[w], len(instrs)
        while i < n:
            ins = instrs[i]
            kind = ins.kind
            t = clock[w]
            if kind in COMPUTE or (kind is Kind.STEP and stage not in tie_of):
                end = t + of(ins, stage)
            elif kind in SENDS:
                assert ins.peer is not None
                key = (_CHANNEL[kind], w, ins.peer, ins.unit, ins.chunk)
                arrived[key] = end = t + link(stage, ins.peer[0])
                if key in waiting:
                    wake(waiting.pop(key))
                if not blocking:
                    end = t
            elif kind in RECVS:
                assert ins.peer is not None
                key = (_CHANNEL[kind], ins.peer, w, ins.unit, ins.chunk)
                if key not in arrived:
                    waiting[key] = w
                    break
                t = end = max(t, arrived.pop(key))
            elif kind is Kind.STEP:  # a step of a tied stage: after the tie's sum
                tie = tie_of[stage]
                met = meet(tie_joined, (tie, tie_rounds[w]), tie_workers[tie], w)
                if met is None:
                    break
                t = met + costs.ties[tie][1]
                end = t + of(ins, stage)
                tie_rounds[w] += 1
            else:  # ALLREDUCE: a collective among the stage's replicas
                met = meet(joined, (stage, rounds_done[w]), replicas[stage], w)
                if met is None:
                    break
                t = met
                end = t + of(ins, stage)
                rounds_done[w] += 1
            append(Op(w, i, ins, t, end))
            clock[w] = end
            i += 1
        pc[w] = i
    blocked = {w: pc[w] for w in sorted(program) if pc[w] < len(program[w])}
    return Timeline(tuple(ops), blocked)


@dataclass(frozen=True)
class Simulation:
    """What a program costs: times in seconds, fractions in [0, 1]."""

    makespan: float
    busy: dict[Worker, float]  # forward, backward, weight-gradient and step time
    allreduce: dict[Worker, float]  # all-reduce time after every replica arrived
    sending: dict[Worker, float]  # time in blocking sends (``Costs.blocking_sends``; else 0)
    idle: dict[Worker, float]  # the rest of the makespan
    time_per_unit: float  # steady state: seconds between unit completions, fill and drain left out
    bubble: float  # idle share of all workers' time
    timeline: Timeline

    @property
    def sending_share(self) -> float:
        """Blocking sends' share of all workers' time: neither computing nor the bubble. A run's measured
        idle fraction (all but computing, ``bench.bench_runtime``) is :attr:`bubble` plus this."""
        total = self.makespan * len(self.sending)
        return sum(self.sending.values()) / total if total > 0 else 0.0

    @cached_property
    def peak_in_flight(self) -> dict[Worker, int]:
        """Per worker, the most units forwarded but not yet backwarded at once.

        Read off the run when asked (the grid drawing asks; the planner's search, simulating
        dozens of programs per plan, does not): each worker's ops are in its program's order.
        """
        executed: Program = {w: [] for w in self.busy}
        for op in self.timeline.ops:
            executed[op.worker].append(op.instr)
        return max_in_flight(executed)


def _time_per_unit(ops: Sequence[Op], makespan: float, period: int) -> float:
    """Seconds per unit between optimizer steps a quarter and three quarters into the run.

    A unit (or a flush step's units) completes with its STEP; replicas that all-reduce
    together complete ``period`` units at once, so only steps that end such a round
    count. Measuring between the quartiles leaves out the pipeline's fill and drain;
    with fewer than two such steps it is the makespan over the units.
    """
    done: dict[int, float] = {}
    for op in ops:
        if op.instr.kind is Kind.STEP:
            done[op.instr.unit] = max(done.get(op.instr.unit, 0.0), op.end)
    steps = sorted(done)
    rounds = [u for u in steps if (u + 1) % period == 0] or steps
    if len(rounds) < 2:
        return makespan / (steps[-1] + 1) if steps else 0.0
    lo = rounds[len(rounds) // 4]
    hi = rounds[max(len(rounds) // 4 + 1, (3 * len(rounds)) // 4)]
    return (done[hi] - done[lo]) / (hi - lo)


def simulate(program: Program, costs: Costs) -> Simulation:
    """Run ``program`` with ``costs``; raises :class:`ScheduleError` if it deadlocks."""
    timeline = run_timeline(program, costs)
    if timeline.deadlocked:
        stuck = ", ".join(f"{worker_name(w)} at {program[w][i]}" for w, i in timeline.blocked.items())
        raise ScheduleError(f"the program deadlocks: {stuck}")
    makespan = max((op.end for op in timeline.ops), default=0.0)
    replicas: dict[int, int] = {}
    for stage, _ in program:
        replicas[stage] = replicas.get(stage, 0) + 1
    busy = dict.fromkeys(program, 0.0)
    reduce = dict.fromkeys(program, 0.0)
    sending = dict.fromkeys(program, 0.0)
    for op in timeline.ops:
        kind = op.instr.kind
        part = reduce if kind is Kind.ALLREDUCE else sending if kind in SENDS else busy
        part[op.worker] += op.end - op.start  # a non-blocking send or a receive takes no time
    idle = {w: makespan - busy[w] - reduce[w] - sending[w] for w in program}
    total = makespan * len(program)
    return Simulation(
        makespan=makespan,
        busy=busy,
        allreduce=reduce,
        sending=sending,
        idle=idle,
        time_per_unit=_time_per_unit(timeline.ops, makespan, math.lcm(*replicas.values()) if replicas else 1),
        bubble=sum(idle.values()) / total if total > 0 else 0.0,
        timeline=timeline,
    )
