"""The schedule search (``pdplan --schedule auto``): the fastest simulated plan that fits memory.

PipeDream's DP minimises the paper's cost (``pdplan.costs``): the bottleneck stage's time,
with no pipeline fill, drain or flush, no optimizer step and no wait for a message. The
schedule pdrun runs pays all of these, so a partition the DP ranks second may run faster.
Here the DP proposes partitions and the simulator (``pdplan.schedule_sim``, the same
instruction lists pdrun executes) chooses among partition x schedule x microbatches:

- partitions: on a small graph every one (every chain of downsets, every split of the
  workers among its stages); otherwise the DP's best under each cost model and at
  bandwidths scaled down (which favours fewer and cheaper cuts), and balanced splits of a
  topological order into k stages of N / k replicas each, for every k dividing N;
- schedules: ``1f1b``, ``1f1b-flush``, ``gpipe``, ``zb-h1`` and ``2bw``, the flush schedules at
  every M of :func:`microbatch_range` (or only ``--microbatches M`` when given); and
  ``interleaved-1f1b`` on one level of workers, its V x S chunks on S worker stages of r
  replicas each, for every V of :data:`VIRTUAL_STAGES` and every r dividing the N workers;
- memory: every stage of a candidate must fit ``--memory`` by the full memory model
  (``pdplan.memory``); candidates that do not fit are not simulated.

Candidates are simulated in the order of a lower bound on their time per unit (the
busiest worker's compute, step and all-reduce per unit, which no schedule beats); once
that bound exceeds the best simulated time the rest cannot win and are skipped, so the
choice is that of simulating them all. Times equal to nine significant digits are a tie, which
goes to a synchronous schedule over ``1f1b`` and ``2bw`` (they train on stale weights), then to the
smaller peak memory, then to the earlier candidate; pdplan says when it chooses ``1f1b`` or ``2bw``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from pdplan.antichain import cut_bytes
from pdplan.build import (
    Partition,
    PlanConfig,
    assemble,
    dp_partition,
    memory_text,
    over_memory,
    with_memory,
    worker_peaks,
)
from pdplan.costs import allreduce_s, span_bandwidth
from pdplan.memory import held_units
from pdplan.more_schedules import interleave, two_bw_least
from pdplan.problem import Problem, prepare_layers
from pdplan.schedule_sim import as_run, backward_shares, simulate_plan, stage_costs
from shared.errors import PlanError, UserError
from shared.graph import LayerGraph
from shared.plan import Alternative, Plan
from shared.schedule import Instr, Kind, ScheduleError, make_pipeline
from shared.simulate import Costs

SCHEDULES = ("1f1b", "1f1b-flush", "gpipe", "zb-h1", "2bw")  # one model chunk per worker
VIRTUAL_STAGES = (2, 3, 4)  # the V interleaved-1f1b tries (one level of workers), unless --virtual-stages
# Every partition of a graph this small is tried (past it, or past the budget, the DP's few).
EXHAUSTIVE_NODES = 10
EXHAUSTIVE_PARTITIONS = 400
BANDWIDTH_SCALES = (1.0, 0.5, 0.25, 0.1)
BALANCED_MAX_NODES = 400
ALTERNATIVES = 8  # runners-up recorded in the plan
LOCAL_SEEDS = 3
LOCAL_ROUNDS = 20
LOCAL_SIMS = 40  # simulations the local search may spend (a count, so that the search is deterministic)


def microbatch_range(stages: int) -> list[int]:
    """The M tried for the flush schedules: powers of two up to 4 S, and S, 2 S, 4 S (at most 64)."""
    top = min(64, 4 * stages)
    values = {m for m in (1, 2, 4, 8, 16, 32, 64) if m <= top} | {min(64, k * stages) for k in (1, 2, 4)}
    return sorted(values)


@dataclass(frozen=True)
class Tried:
    """One candidate plan and its figures."""

    plan: Plan
    time_s: float  # simulated seconds per unit
    bubble: float
    memory_bytes: float  # the largest stage's peak
    order: int
    part: Partition


def auto_plan(graph: LayerGraph, config: PlanConfig) -> Plan:
    """The fastest simulated plan of :func:`candidates` x schedules x M that fits ``config.memory``."""
    config.levels()  # validate before searching
    began = time.perf_counter()
    problem = prepare_layers(graph)
    parts = candidates(graph, config, problem)
    tried, leanest = search(graph, config, parts)
    if not tried and leanest is None:
        raise PlanError(
            f"graph: no plan runs on {math.prod(config.workers)} workers: every candidate has a stage whose "
            "values reach no later stage; use fewer workers"
        )
    if not tried:
        raise PlanError(
            f"graph: no plan fits --memory {config.memory:g} bytes per worker on {math.prod(config.workers)} "
            f"workers: the leanest candidate, {leanest}; raise --memory or add workers"
        )
    tried.sort(key=_preference)
    best = tried[0]
    alternatives = [
        Alternative(
            schedule=t.plan.schedule,
            microbatches=t.plan.microbatches,
            virtual_stages=t.plan.virtual_stages,
            replicas=[s.replicas for s in t.plan.stages],
            stage_layers=[len(s.layers) for s in t.plan.stages],
            simulated_time_per_minibatch_s=t.time_s,
            simulated_bubble=t.bubble,
            memory_bytes=t.memory_bytes,
        )
        for t in tried[:ALTERNATIVES]
    ]
    return _searched(best, parts, began).model_copy(update={"alternatives": alternatives})


def _searched(best: Tried, parts: Sequence[Partition], began: float) -> Plan:
    """``best``'s plan with its simulated figures and what was searched: the DP's first proposal's
    search (whichever candidate won), or "exhaustive" where every split was tried, and the time since
    ``began``."""
    assert best.plan.predicted is not None
    dp = next((p for p in parts if p.states is not None), None)
    predicted = best.plan.predicted.model_copy(
        update={
            "simulated_time_per_minibatch_s": best.time_s,
            "simulated_bubble": best.bubble,
            "solve_s": time.perf_counter() - began,
            "states": dp.states if dp is not None else None,
            "search": dp.search if dp is not None else "exhaustive",
            "antichain_states": dp.antichain_states if dp is not None else None,
        }
    )
    return best.plan.model_copy(update={"predicted": predicted})


def search(
    graph: LayerGraph, config: PlanConfig, parts: Sequence[Partition]
) -> tuple[list[Tried], str | None]:
    """Every candidate that fits memory, simulated unless its lower bound cannot win; and the leanest's text.

    Past the first ranking, on a graph too big for every partition (and of at most
    ``BALANCED_MAX_NODES`` layers), a local search moves one
    layer across a stage boundary or one replica between neighbouring stages of the best
    partitions while that simulates faster (``LOCAL_ROUNDS`` rounds, ``LOCAL_SIMS`` simulations at most).
    """
    state = _Search(graph, config)
    state.run(parts)
    # The local search costs a plan per neighbour: on a big graph (hundreds of layers at a boundary) not run.
    small = bool(parts) and parts[0].problem.size <= BALANCED_MAX_NODES
    if small and parts[0].search != "exhaustive":
        # LOCAL_SIMS simulations past the first ranking, counted inside a round too (a round of three
        # seeds' neighbours could otherwise spend dozens: GNMT's 2bw plans on 8 x 2 workers).
        state.budget = state.attempts + LOCAL_SIMS
        for _ in range(LOCAL_ROUNDS):
            before = state.best
            for seed in _distinct_partitions(state.tried, LOCAL_SEEDS):
                # The neighbours under the seed's own schedule and M: a layer or a replica moved.
                choice = [(seed.plan.schedule, seed.plan.microbatches)]
                state.run([n for n in neighbours(seed.part, config.straight)], choice)
            if not state.best < before or state.attempts >= state.budget:
                break
    return state.tried, state.leanest[1] if state.leanest is not None else None


def _distinct_partitions(tried: Sequence[Tried], count: int) -> list[Tried]:
    out: list[Tried] = []
    seen = set()
    for t in sorted(tried, key=_preference):
        key = (tuple(map(tuple, t.part.stage_nodes)), tuple(map(tuple, t.part.ranks)), t.part.chunks)
        if key not in seen:
            seen.add(key)
            out.append(t)
        if len(out) == count:
            break
    return out


class _Search:
    """The candidates ranked so far: the best simulated time, the leanest that did not fit."""

    def __init__(self, graph: LayerGraph, config: PlanConfig) -> None:
        self.graph = graph
        self.config = config
        self.tried: list[Tried] = []
        self.best = math.inf
        self.leanest: tuple[float, str] | None = None
        self.order = 0
        self.seen: set[tuple[object, ...]] = set()
        self.simulated = 0
        self.attempts = 0  # simulations begun, those a ScheduleError ended included
        self.budget = math.inf  # attempts after which run simulates no more (the local search's)

    def run(self, parts: Sequence[Partition], choices: Sequence[tuple[str, int]] | None = None) -> None:
        graph, config = self.graph, self.config
        shares = backward_shares(graph)
        pending: list[tuple[float, int, Plan, Partition, bool]] = []
        for part in parts:
            key = (tuple(map(tuple, part.stage_nodes)), tuple(map(tuple, part.ranks)), part.chunks)
            if key in self.seen:
                continue
            self.seen.add(key)
            if part.chunks > 1:
                # The V x S chunks as stages of r replicas each on V x S x r ranks of the one level (the
                # same costs), then placed onto the S x r workers: round-robin (interleaved-1f1b) and,
                # for 2 chunks, in a V (zb-v). Its memory is the chunked program's, added below.
                r = len(part.ranks[0])
                flat = replace(config, workers=(len(part.stage_nodes) * r,), straight=r == 1, memory=None)
                base = assemble(graph, flat, part, "1f1b", 1, memory=False)
                placed = {
                    name: interleave(
                        graph, base, config.levels(), part.chunks, 1, config.straight, False, name
                    )
                    for name in chunked_schedules(part.chunks)
                }
                costs_of = {name: stage_costs(graph, p) for name, p in placed.items()}
                costs, edges = costs_of["interleaved-1f1b"]
                if edges != [(s, s + 1) for s in range(len(part.stage_nodes) - 1)]:
                    continue  # a chunk that feeds none after it: no chain (values that skip are relayed)
                replicas = [r] * (len(part.stage_nodes) // part.chunks)
            else:
                base = assemble(graph, config, part, "1f1b", config.microbatches or 1)
                costs, edges = stage_costs(graph, base)
                replicas = [len(r) for r in part.ranks]
            # The memory model reads each (schedule, M)'s program: without --memory it is needed only
            # for the candidates simulated (most are cut off by their bound), so it waits for them.
            limit = config.memory
            for schedule, m in choices or list(schedule_choices(config, replicas, part.chunks)):
                if part.chunks > 1:
                    plan = placed[schedule].model_copy(update={"microbatches": m})
                    costs = costs_of[schedule][0]
                elif schedule == "1f1b":
                    plan = base  # assemble's memory is 1f1b's
                else:
                    plan = base.model_copy(update={"schedule": schedule, "microbatches": m})
                if limit is not None:
                    plan = with_memory(plan, graph) if plan is not base else plan
                    if over_memory(plan, limit) is not None:
                        self._note_lean(plan)
                        continue
                bound = lower_bound(plan, as_run(plan, costs, shares), edges)
                pending.append((bound, self.order, plan, part, limit is None and plan is not base))
                self.order += 1
        pending.sort(key=lambda c: (c[0], c[1]))
        for bound, index, plan, part, stale in pending:
            if bound > self.best and len(self.tried) >= ALTERNATIVES:
                break  # sorted: no later candidate can beat the best
            if self.attempts >= self.budget:
                break
            self.attempts += 1
            try:
                sim = simulate_plan(graph, plan)
            except ScheduleError:
                continue  # a stage whose values reach no later stage: no schedule runs it
            if stale:
                plan = with_memory(plan, graph)
            self.simulated += 1
            t = max(0.0, sim.time_per_minibatch_s)
            self.best = min(self.best, t)
            peak = max(worker_peaks(plan))
            self.tried.append(Tried(plan, t, min(1.0, max(0.0, sim.bubble)), peak, index, part))

    def _note_lean(self, plan: Plan) -> None:
        # A stage's, or under interleaved-1f1b a worker's (memory_text names either).
        peaks = worker_peaks(plan)
        if self.leanest is None or max(peaks) < self.leanest[0]:
            self.leanest = (max(peaks), memory_text(plan, peaks.index(max(peaks))))


def neighbours(part: Partition, straight: bool) -> Iterator[Partition]:
    """One layer moved across a stage boundary (stages stay convex and non-empty), or one replica moved."""
    problem = part.problem
    owner = {v: s for s, nodes in enumerate(part.stage_nodes) for v in nodes}
    n = len(part.stage_nodes)
    for s in range(n - 1):
        for v in part.stage_nodes[s]:
            # v may go to s + 1 when everything it feeds is already past s.
            if len(part.stage_nodes[s]) > 1 and all(owner[w] > s for w in problem.succs[v]):
                yield _moved(part, v, s, s + 1)
        for v in part.stage_nodes[s + 1]:
            if len(part.stage_nodes[s + 1]) > 1 and all(owner[u] <= s for u in problem.preds[v]):
                yield _moved(part, v, s + 1, s)
    if straight or part.chunks > 1:
        return  # interleaved-1f1b's chunks run at one replica count (shared.schedule_more)
    sizes = [len(r) for r in part.ranks]
    for s in range(n - 1):
        for a, b in ((s, s + 1), (s + 1, s)):
            if sizes[a] > 1:
                new = list(sizes)
                new[a] -= 1
                new[b] += 1
                starts = [sum(new[:i]) for i in range(n)]
                ranks = [list(range(x, x + r)) for x, r in zip(starts, new, strict=True)]
                yield replace(part, ranks=ranks, time_s=None, search="local")


def _moved(part: Partition, v: int, src: int, dst: int) -> Partition:
    nodes = [list(ns) for ns in part.stage_nodes]
    nodes[src].remove(v)
    nodes[dst] = sorted([*nodes[dst], v])
    return replace(part, stage_nodes=nodes, time_s=None, search="local")


def chunked_schedules(chunks: int) -> tuple[str, ...]:
    """The schedules that run ``chunks`` model chunks per worker: interleaved-1f1b, and zb-v at 2."""
    return ("interleaved-1f1b", "zb-v") if chunks == 2 else ("interleaved-1f1b",)


def schedule_choices(
    config: PlanConfig, replicas: Sequence[int], chunks: int = 1
) -> Iterator[tuple[str, int]]:
    """(schedule, M) pairs to try for a plan of stages with these ``replicas`` (or of ``chunks`` per worker).

    Every schedule at every M of :func:`microbatch_range` (only ``--microbatches M`` when
    given; 1 for ``1f1b``) that its generator accepts: ``2bw`` also at its least M
    (:func:`pdplan.more_schedules.two_bw_microbatches`), and only at M >= its depth;
    ``interleaved-1f1b`` at the multiples of its replicas x stages, M's range taken over that many,
    and with 2 chunks ``zb-v`` at the multiples of its replicas in the same range.
    """
    # interleaved's M is a multiple of replicas x stages (each replica runs groups of S microbatches).
    width = len(replicas) * replicas[0] if chunks > 1 else len(replicas)
    ms = [config.microbatches] if config.microbatches else microbatch_range(width)
    names = chunked_schedules(chunks) if chunks > 1 else SCHEDULES
    for schedule in names:
        if config.synchronous and schedule in ASYNCHRONOUS:
            continue
        if schedule == "1f1b":
            yield "1f1b", config.microbatches or 1
            continue
        options = ms
        if schedule == "2bw" and not config.microbatches:
            options = sorted({*ms, two_bw_least(replicas)})
        for m in options:
            try:
                make_pipeline(schedule, replicas, microbatches=m, chunks=chunks)
            except ScheduleError:
                continue  # e.g. 2bw below its depth, interleaved at M not a multiple of the workers
            yield schedule, m


def lower_bound(plan: Plan, costs: Costs, edges: Sequence[tuple[int, int]]) -> float:
    """Seconds per unit no run of ``plan``'s schedule beats (with ``costs`` as it runs them, :func:`as_run`).

    A worker of stage s with r replicas computes every r-th unit, so per unit it needs at
    least its own work: under ``1f1b`` each unit's forward, backward, all-reduce and step,
    over r; under ``2bw`` the step's share of M units' forwards and backwards, one
    all-reduce and one step. Under both also Little's law: a worker holds at most k units
    (its peak in flight) and each stays at least its round trip R (its forward, the trip
    to the last stage and back, its backward), so r k units per R. Under a flush schedule a
    step at stage s cannot begin before the step's first unit reached it (the fill), and
    the input stage's step waits for s's last backward (zb-h1: its last B; its W may
    follow) to come back (the drain): a step takes at least fill + s's ``ceil(M / r)``
    forwards and backwards + drain + the input stage's all-reduce and step, for M units,
    and at least s's own work (with zb-h1's W). Under ``interleaved-1f1b`` a step takes at
    least a worker's M units through each of its chunks and its step, and at least one
    unit's trip through every chunk and back before the first worker's step.
    """
    if plan.virtual_stages > 1:
        return _interleaved_bound(plan, costs)
    n = len(plan.stages)
    f, b = costs.forward, costs.backward
    w = costs.weight if costs.weight else [0.0] * n
    consumers: dict[int, list[int]] = {s: [] for s in range(n)}
    producers: dict[int, list[int]] = {s: [] for s in range(n)}
    for a, c in edges:
        consumers[a].append(c)
        producers[c].append(a)
    reps = [s.replicas for s in plan.stages]
    step = [costs.of(Instr(Kind.STEP, 0), s) for s in range(n)]
    reduce = [costs.of(Instr(Kind.ALLREDUCE, 0), s) for s in range(n)]
    worst = 0.0
    m = plan.microbatches
    if plan.schedule in ("1f1b", "2bw"):
        held = held_units(plan)
        trip = [0.0] * n
        for s in reversed(range(n)):
            later = max((2 * costs.link(s, c) + trip[c] for c in consumers[s]), default=0.0)
            trip[s] = f[s] + b[s] + later
            if plan.schedule == "1f1b":
                own = (f[s] + b[s] + step[s] + reduce[s]) / reps[s]
            else:
                own = ((m // reps[s]) * (f[s] + b[s]) + step[s] + reduce[s]) / m
            worst = max(worst, own, trip[s] / (reps[s] * max(1, held[s])))
        return worst
    fill = [0.0] * n
    drain = [0.0] * n
    for s in range(n):
        fill[s] = max((fill[a] + f[a] + costs.link(a, s) for a in producers[s]), default=0.0)
        drain[s] = max((drain[a] + b[a] + costs.link(a, s) for a in producers[s]), default=0.0)
        units = math.ceil(m / reps[s])
        worst = max(
            worst,
            fill[s] + units * (f[s] + b[s]) + drain[s] + reduce[0] + step[0],
            units * (f[s] + b[s] + w[s]) + reduce[s] + step[s],
        )
    return worst / m


def _interleaved_bound(plan: Plan, costs: Costs) -> float:
    """:func:`lower_bound` of an interleaved plan: a worker's own work per step, one unit's round trip.

    A replica of r runs M / r of the step's units through each of its chunks, then its
    chunks' all-reduces and its step (``chunked_costs`` sums both over the chunks).
    """
    v = plan.virtual_stages
    workers = len(plan.stages) // v
    m = plan.microbatches
    units = m // plan.stages[0].replicas

    def end(s: int) -> float:
        return costs.of(Instr(Kind.ALLREDUCE, 0), s) + costs.of(Instr(Kind.STEP, 0), s)

    own = [
        units * sum(costs.forward[c] + costs.backward[c] + _weight(costs, c) for c in plan.worker_chunks(s))
        + end(s)
        for s in range(workers)
    ]
    chunks = len(plan.stages)
    trip = sum(costs.forward) + sum(costs.backward)
    trip += 2 * sum(costs.link(plan.chunk_worker(k), plan.chunk_worker(k + 1)) for k in range(chunks - 1))
    return max(*own, trip + end(0)) / m


def _weight(costs: Costs, v: int) -> float:
    """Virtual stage ``v``'s weight-gradient seconds (W, zb-v's split backward), 0 where B does it all."""
    return float(costs.weight[v]) if v < len(costs.weight) else 0.0


# ---------------------------------------------------------------------------- partitions


def candidates(graph: LayerGraph, config: PlanConfig, problem: Problem) -> list[Partition]:
    """Every partition of a small graph; else the DP's proposals and balanced splits; then interleaved's chunks."""
    return [*stage_candidates(graph, config, problem), *chunk_candidates(graph, config, problem)]


def virtual_range(config: PlanConfig, size: int, stages: int) -> list[int]:
    """The V interleaved-1f1b is tried at on ``stages`` worker stages: ``--virtual-stages`` or
    :data:`VIRTUAL_STAGES`, as many chunks as layers at most.

    Only on one level of workers (as ``pdplan --schedule interleaved-1f1b``), at least two of them.
    """
    workers = math.prod(config.workers)
    if len(config.workers) != 1 or workers < 2:
        return []
    vs = (config.virtual_stages,) if config.virtual_stages is not None else VIRTUAL_STAGES
    return [v for v in vs if v >= 2 and v * stages <= size]


def chunk_replicas(config: PlanConfig) -> list[int]:
    """The replicas r of every worker stage interleaved-1f1b is tried at: each r dividing N that leaves S = N / r >= 2.

    ``--straight`` (one replica a stage) only 1. The generator runs every stage at one
    replica count (each replica index a pipeline of its own, ``shared.schedule_more``).
    """
    workers = math.prod(config.workers)
    if config.straight:
        return [1]
    return [r for r in range(1, workers // 2 + 1) if workers % r == 0]


def chunk_candidates(graph: LayerGraph, config: PlanConfig, problem: Problem) -> list[Partition]:
    """interleaved-1f1b's V x S chunks, on S worker stages of r replicas each (S r = N).

    For every r of :func:`chunk_replicas` and V of :func:`virtual_range`: on a small graph
    every split into V x S stages; otherwise the DP's best for V x S straight workers (what
    ``--schedule interleaved-1f1b`` plans at r = 1) and the balanced split of a topological
    order; past ``BALANCED_MAX_NODES`` nodes only at ``--virtual-stages V``. Chunk k gets r
    ranks of its own here; the search puts it on worker stage k mod S's. Chunks that send
    values past the next are dropped in the search.
    """
    workers = math.prod(config.workers)
    out: list[Partition] = []
    if problem.size > BALANCED_MAX_NODES and config.virtual_stages is None:
        # A big graph's DP takes seconds (NASNet-Mobile on 16 workers: ~20 s a V, 105 s for V = 2,
        # 3, 4): as in stage_candidates it runs only as asked, here at --virtual-stages V.
        return out
    splits: dict[int, list[Partition]] = {}  # by chunk count: V x S repeats across r (8 = 2 x 4 = 4 x 2)
    for r in chunk_replicas(config):
        stages = workers // r
        for v in virtual_range(config, problem.size, stages):
            k = v * stages
            if k not in splits:
                splits[k] = _chunk_splits(graph, config, problem, k)
            out.extend(_as_chunks(splits[k], v, r))
    return out


def _as_chunks(splits: Sequence[Partition], v: int, r: int) -> list[Partition]:
    """``splits`` into V x S chunks as chunked candidates: chunk k on r ranks of its own (the search
    puts it on worker stage k mod S's), recosted by the search."""
    ranks = [list(range(i * r, (i + 1) * r)) for i in range(len(splits[0].stage_nodes))] if splits else []
    return [replace(part, ranks=ranks, chunks=v, time_s=None) for part in splits]


# The schedules whose units train on stale weights: PipeDream's 1F1B applies each unit's gradient to
# weights newer than the ones it used (weight stashing), 2BW each step's one step late. They change what
# training computes (a new user's ViT under 2bw and Adam stayed at chance where 1f1b-flush reached 95%),
# so an equally fast synchronous plan wins, and pdplan says when one of these is chosen (asynchronous_note).
ASYNCHRONOUS = ("1f1b", "2bw")
# Simulated times that agree to this many significant digits are a tie: a one-stage plan's 2bw and
# 1f1b-flush simulated 1.8083573759035269 and 1.808357375903527 ms, and the last bit chose between them.
TIE_DIGITS = 9


def _preference(t: Tried) -> tuple[float, bool, float, int]:
    """How candidates rank, best first: the fastest simulated (to :data:`TIE_DIGITS`), then synchronous
    before asynchronous, then the leanest, then the first tried."""
    return (float(f"{t.time_s:.{TIE_DIGITS}g}"), t.plan.schedule in ASYNCHRONOUS, t.memory_bytes, t.order)


def asynchronous_note(plan: Plan) -> str | None:
    """For a searched plan whose schedule trains on stale weights: what that means, and the fastest
    synchronous runner-up beside it (None for a synchronous or a named schedule)."""
    if not plan.alternatives or plan.schedule not in ASYNCHRONOUS:
        return None
    how = {
        "1f1b": "each unit's gradient is applied to weights newer than it used (PipeDream's weight stashing)",
        "2bw": "each step's gradient is applied one step late (PipeDream-2BW)",
    }[plan.schedule]
    text = f"{plan.schedule} was chosen: {how}, which some optimizers and learning rates do not tolerate"
    chosen = plan.alternatives[0].simulated_time_per_minibatch_s
    sync = next((a for a in plan.alternatives if a.schedule not in ASYNCHRONOUS), None)
    # The search stops simulating candidates that cannot beat its best, so the synchronous ones it kept are
    # a sample: --synchronous, the same search without 1f1b and 2bw, may find a faster one (a new user's did,
    # on 1 stage x 2 replicas at 0.501 ms where the runner-up noted here was 2 stages at 0.523).
    if sync is None:
        return text + "; --synchronous searches the synchronous schedules alone"
    slower = sync.simulated_time_per_minibatch_s / chosen - 1 if chosen > 0 else 0.0
    # Its layout too: a named --schedule plans PipeDream's partition, which may not be this one (the runner-up
    # a note once offered as "--schedule 1f1b-flush --microbatches 4" was data parallel; those options gave
    # 2 stages at 11.3 ms where it said 9.5).
    return (
        f"{text}; the fastest synchronous runner-up, {sync.schedule} M={sync.microbatches} on "
        f"{layout_text(sync.replicas)}, simulates {sync.simulated_time_per_minibatch_s * 1000:.3f} ms/minibatch "
        f"({slower:+.1%}); --synchronous searches the synchronous schedules alone (it may find a faster one)"
    )


def layout_text(replicas: Sequence[int]) -> str:
    """``[2]`` -> "1 stage x 2 replicas (data parallel)"; ``[1, 1]`` -> "2 stages"; else the replicas."""
    if len(replicas) == 1:
        return f"1 stage x {replicas[0]} replicas (data parallel)" if replicas[0] > 1 else "1 stage"
    if all(r == 1 for r in replicas):
        return f"{len(replicas)} stages"
    return f"{len(replicas)} stages (replicas {'-'.join(str(r) for r in replicas)})"


def best_chunking(
    graph: LayerGraph, config: PlanConfig, chunks: int, schedule: str, microbatches: int
) -> Plan | None:
    """A named chunked schedule's plan on ``config``'s one level of S workers: of the splits into ``chunks``
    x S chunks (:func:`_chunk_splits`: every split of a small graph, else the DP's for that many straight
    workers and the balanced one), the one whose ``schedule`` program at ``microbatches`` simulates
    fastest and fits ``config.memory``; None when none does.

    The DP balances the chunks against each other, not a worker's chunks summed: on the MNIST CNN its
    4 chunks left one of 2 workers 3.1 ms of work a unit and the other 6.5 ms, and interleaved-1f1b ran
    35.5-38.2 ms a step where the split chosen here ran 30.3-30.5 (idle fraction 0.31 against 0.22).
    """
    began = time.perf_counter()
    k = chunks * config.workers[0]
    parts = _as_chunks(_chunk_splits(graph, config, prepare_layers(graph), k), chunks, 1)
    state = _Search(graph, config)
    state.run(parts, [(schedule, microbatches)])
    if not state.tried:
        return None
    return _searched(min(state.tried, key=_preference), parts, began)


def _chunk_splits(graph: LayerGraph, config: PlanConfig, problem: Problem, k: int) -> list[Partition]:
    """Splits into ``k`` chunks: every one of a small graph, else the DP's for k straight workers and the balanced."""
    flat = replace(config, workers=(k,), straight=True, memory=None, schedule="1f1b")
    parts = all_partitions(problem, k, True)
    if parts is None:
        parts = []
        with contextlib.suppress(UserError):
            parts.append(dp_partition(graph, flat))
        if problem.size <= BALANCED_MAX_NODES:
            parts.append(balanced_split(problem, flat, k))
    return parts


def stage_candidates(graph: LayerGraph, config: PlanConfig, problem: Problem) -> list[Partition]:
    """Every partition of a small graph; else the DP's proposals and balanced splits."""
    workers = math.prod(config.workers)
    every = all_partitions(problem, workers, config.straight)
    if every is not None:
        return every
    out: list[Partition] = []
    seen: set[tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]] = set()

    def add(part: Partition) -> None:
        key = (tuple(map(tuple, part.stage_nodes)), tuple(map(tuple, part.ranks)))
        if key not in seen:
            seen.add(key)
            out.append(part)

    models = dict.fromkeys((config.cost_model, "pipedream", "pipedream-compute"))
    scales: tuple[float, ...] = BANDWIDTH_SCALES
    if problem.size > BALANCED_MAX_NODES:
        # A big graph's DP takes seconds: there it runs once, as asked.
        models, scales = {config.cost_model: None}, BANDWIDTH_SCALES[:1]
    for model in models:
        for scale in scales:
            bandwidths = tuple(b * scale for b in config.bandwidths)
            for memory in dict.fromkeys((None, config.memory)):
                try:
                    add(
                        dp_partition(
                            graph, replace(config, cost_model=model, bandwidths=bandwidths, memory=memory)
                        )
                    )
                except UserError:
                    continue  # no plan under the paper's memory rule: the others may still fit
    if problem.size <= BALANCED_MAX_NODES:
        for k in range(1, min(workers, problem.size) + 1):
            if workers % k == 0 and (not config.straight or k == workers):
                add(balanced_split(problem, config, k))
    if not out:
        raise PlanError(
            f"graph: no plan fits {workers} workers (levels {list(config.workers)}) with these options"
        )
    return out


def all_partitions(problem: Problem, workers: int, straight: bool) -> list[Partition] | None:
    """Every convex split into stages with every split of the workers, or None past the budget."""
    n = problem.size
    if n > EXHAUSTIVE_NODES:
        return None
    anc = problem.ancestor_masks()
    full = (1 << n) - 1
    # Downsets: closed under predecessors, each containing the first source (as the DP's states).
    downsets = [
        d
        for d in range(1, full + 1)
        if d >> problem.first_source & 1 and all(anc[v] & ~d == 0 for v in range(n) if d >> v & 1)
    ]
    downsets.sort(key=lambda d: (bin(d).count("1"), d))
    out: list[Partition] = []

    def chains(prefix: list[int]) -> Iterator[list[int]]:
        last = prefix[-1]
        if last == full:
            yield prefix
            return
        for d in downsets:
            if d & last == last and d != last:
                yield from chains([*prefix, d])

    for chain in itertools.chain.from_iterable(chains([d]) for d in downsets):
        parts = len(chain)
        if parts > workers or (straight and parts != workers):
            continue
        nodes = [
            [v for v in range(n) if (hi & ~lo) >> v & 1]
            for lo, hi in zip([0, *chain[:-1]], chain, strict=True)
        ]
        for reps in compositions(workers, parts):
            if straight and any(r != 1 for r in reps):
                continue
            out.append(Partition(problem, nodes, consecutive_ranks(reps), search="exhaustive"))
            if len(out) > EXHAUSTIVE_PARTITIONS:
                return None
    return out


def consecutive_ranks(replicas: Sequence[int]) -> list[list[int]]:
    """Each stage's ranks, in order: ``replicas`` [2, 1] gives [[0, 1], [2]]."""
    starts = itertools.accumulate(replicas, initial=0)
    return [list(range(a, a + r)) for a, r in zip(starts, replicas, strict=False)]


def compositions(total: int, parts: int) -> Iterator[list[int]]:
    """Every way to write ``total`` as ``parts`` positive counts, in order."""
    for cut in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cut, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def balanced_split(problem: Problem, config: PlanConfig, k: int) -> Partition:
    """``k`` stages of ``N / k`` replicas each, cut along the topological order at the paper's min-max cost."""
    levels = config.levels()
    workers = math.prod(config.workers)
    r = workers // k
    ranks = [list(range(i * r, (i + 1) * r)) for i in range(k)]
    n = problem.size
    comp = [0.0]
    par = [0.0]
    for v in range(n):
        comp.append(comp[-1] + problem.compute_s[v])
        par.append(par[-1] + problem.parameter_bytes[v])
    cut = [0.0] * (n + 1)
    mask = 0
    for i in range(1, n):
        mask |= 1 << (i - 1)
        cut[i] = cut_bytes(problem, mask) if config.cost_model != "pipedream-compute" else 0.0
    bw = span_bandwidth(levels, list(range(workers)))
    inner = span_bandwidth(levels, ranks[0])

    def stage(i: int, j: int) -> float:
        c, p = comp[j] - comp[i], par[j] - par[i]
        t = (c + allreduce_s(p, r, inner)) / r
        return max(t, 2 * cut[i] / (bw * r), 2 * cut[j] / (bw * r) if j < n else 0.0)

    # best[s][j]: the min-max cost of the first j nodes in s stages; back[s][j] its last cut.
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    back = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            for i in range(s - 1, j):
                t = max(best[s - 1][i], stage(i, j))
                if t < best[s][j]:
                    best[s][j], back[s][j] = t, i
    bounds = [n]
    for s in range(k, 0, -1):
        bounds.append(back[s][bounds[-1]])
    bounds.reverse()
    nodes = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
    return Partition(problem, nodes, ranks, search="balanced")
