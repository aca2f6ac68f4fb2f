"""From a layer graph and a cluster to a stage plan: the one library call behind ``pdplan``.

Pure: it takes the graph and a frozen config and returns a ``Plan``; it reads no files and
prints nothing. Every graph node lands in exactly one stage: the DP's nodes by their state
ranges, model inputs in stage 0, dropped tuple-indexing sinks beside their producer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from pdplan.antichain import (
    StateSpace,
    build_space,
    coarse_prefix_space,
    fitting_states,
    prefix_downsets,
    states_space,
)
from pdplan.antichain import _space as pairless_space
from pdplan.chain import chain_work
from pdplan.costs import StageCost, allreduce_s, cut_sizes, data_parallel_time, stage_costs
from pdplan.hierarchy import plan_levels
from pdplan.memory import OPTIMIZER_STATE, held_units, stage_memory
from pdplan.partition import LevelSpec
from pdplan.problem import Problem, compress_series, prepare_layers
from pdplan.statecount import pipedream_states
from shared.errors import PlanError, UserError
from shared.graph import LayerGraph
from shared.plan import SCHEDULES, Cluster, Level, Plan, Prediction, Stage, StagePrediction
from shared.schedule import default_microbatches

# pipedream: the design's cost model (docs/pdplan.md, "The cost model"), activations and gradients crossing a cut charged
# (2 O / (B r)); pipedream-compute: the paper's optimizer as it runs by default (without
# --activation_compression_ratio), where those transfers are not charged.
COST_MODELS = ("pipedream", "pipedream-compute")


@dataclass(frozen=True)
class PlanConfig:
    """What ``pdplan`` was asked for."""

    workers: tuple[int, ...]
    bandwidths: tuple[float, ...]
    latencies: tuple[float, ...] | None = None  # seconds per message per level (the schedule simulation only)
    blocking_sends: bool = False  # a send keeps its worker busy for the transfer (the simulation only)
    memory: float | None = None
    straight: bool = False
    schedule: str = "1f1b"  # or "auto": pdplan.auto's search over partitions, schedules and M
    synchronous: bool = False  # auto: only the schedules that train as one process does (pdplan.auto)
    microbatches: int | None = None
    virtual_stages: int | None = None  # auto: the only V interleaved-1f1b is tried at (pdplan.auto)
    optimizer: str = "sgd"  # sgd, momentum or adam: its state in the memory model
    cost_model: str = "pipedream"
    max_states: int = 500_000
    max_pairs: int = 4_000_000
    # Hierarchies solve every range at every inner level (cubic in the states with pairs, about
    # quadratic over prefixes, chain.py): the budget for an exact search, and the smaller one
    # for a coarse search past it (pair-steps, ~1e8/s).
    max_range_work: float = 1e9
    max_sweep_work: float = 4e8
    max_coarse_work: float = 2.5e8

    def levels(self) -> list[Level]:
        if len(self.workers) != len(self.bandwidths):
            raise UserError(
                f"--workers has {len(self.workers)} level(s) but --bandwidth has {len(self.bandwidths)}; "
                "give one bandwidth per level, innermost first (e.g. --workers 4,2 --bandwidth 1e10,1e9)"
            )
        if self.schedule not in (*SCHEDULES, "auto"):
            raise UserError(
                f"--schedule: unknown {self.schedule!r}; expected auto or one of {', '.join(SCHEDULES)}"
            )
        if self.optimizer not in OPTIMIZER_STATE:
            raise UserError(
                f"--optimizer: unknown {self.optimizer!r}; expected one of {', '.join(OPTIMIZER_STATE)}"
            )
        if self.cost_model not in COST_MODELS:
            raise UserError(
                f"--cost-model: unknown {self.cost_model!r}; expected one of {', '.join(COST_MODELS)}"
            )
        for w in self.workers:
            if w < 1:
                raise UserError(f"--workers: every level needs at least 1 worker, got {w}")
        for b in self.bandwidths:
            if not b > 0 or math.isinf(b):
                raise UserError(f"--bandwidth: expected a positive finite number of bytes/s, got {b}")
        if self.memory is not None and not self.memory > 0:
            raise UserError(f"--memory: expected a positive number of bytes, got {self.memory}")
        latencies = self.latencies if self.latencies is not None else (0.0,) * len(self.workers)
        if len(latencies) != len(self.workers) or any(not 0 <= s < math.inf for s in latencies):
            raise UserError(
                f"--latency: expected {len(self.workers)} finite number(s) of seconds >= 0, one per level like "
                f"--workers, got {','.join(f'{s:g}' for s in latencies)}"
            )
        return [
            Level(workers=w, bandwidth=b, latency_s=s)
            for w, b, s in zip(self.workers, self.bandwidths, latencies, strict=True)
        ]


def level_specs(config: PlanConfig, levels: list[Level]) -> list[LevelSpec]:
    out = []
    within = 1
    for level in levels:
        out.append(LevelSpec(level.workers, level.bandwidth, within, config.memory, config.straight))
        within = level.workers
    return out


def _range_work(space: StateSpace, config: PlanConfig) -> float:
    """About how many pair-steps solving every range at every inner level takes."""
    inner = config.workers[:-1]
    per_start = len(space.pair_k) / 3 * sum(w * (w - 1) / 2 for w in inner)
    return space.size * per_start


def _space(problem: Problem, config: PlanConfig, count: int | None) -> tuple[Problem, StateSpace]:
    if len(config.workers) == 1:
        # The bottleneck search (threshold.py) needs no pairs: one level, no memory limit.
        # Its sweeps cost about moves x N^2 / 2 per step: past ~4e8, a smaller search.
        n = config.workers[0]
        max_moves = int(config.max_sweep_work / max(1, n * (n - 1) // 2))
        pairless = config.memory is None
        return build_space(problem, config.max_states, config.max_pairs, pairless, max_moves, count)
    # A hierarchy solves every range at every inner level: exact over the antichain states (of
    # the DAG, then of its series-compressed form) while that fits the budget, else coarse.
    for candidate in (problem, compress_series(problem)):
        found = fitting_states(candidate, config.max_states, config.max_pairs)
        if found is not None:
            space = states_space(candidate, found, "antichain" if candidate is problem else "compressed")
            if _range_work(space, config) <= config.max_range_work:
                return candidate, space
    # A chain: its prefixes are all the antichain states, each range solved exactly at every
    # level by chain.py (about N^2 per worker split). (A DAG's prefixes are not all its states.)
    if _is_chain(problem):
        masks, maxima, moves = prefix_downsets(problem)
        if chain_work(len(masks), config.workers, config.straight) <= config.max_range_work:
            return problem, pairless_space(problem, masks, maxima, moves, "antichain", with_pairs=False)
    # Coarse prefixes: as many as a smaller budget allows (the work grows with their cube).
    probe = coarse_prefix_space(problem, 64)
    scale = _range_work(probe, config) / max(probe.size, 1) ** 3
    keep = max(2, int((config.max_coarse_work / max(scale, 1e-12)) ** (1 / 3)))
    return problem, coarse_prefix_space(problem, keep)


def _is_chain(problem: Problem) -> bool:
    """Each node feeds only the next one: then the prefixes are all the antichain states."""
    one_source = sum(not p for p in problem.preds) == 1
    return one_source and all(len(s) <= 1 for s in problem.succs) and all(len(p) <= 1 for p in problem.preds)


@dataclass(frozen=True)
class Partition:
    """Stages as problem nodes in pipeline order, with the ranks of each, and the DP's answer."""

    problem: Problem
    stage_nodes: list[list[int]]
    ranks: list[list[int]]
    time_s: float | None = None  # the DP's T(last, N); None: recost the stages
    states: int | None = None
    search: str | None = None
    antichain_states: int | None = None
    chunks: int = (
        1  # interleaved-1f1b's V: stage_nodes then lists V x N chunks, chunk c of worker w at c N + w
    )


def dp_partition(graph: LayerGraph, config: PlanConfig) -> Partition:
    """PipeDream's optimizer: the DP's best partition for ``config``'s cluster (the paper's memory rule)."""
    levels = config.levels()
    base = prepare_layers(graph)
    # The exact size of PipeDream's state space, reported beside the states searched and used to
    # choose them: counted by a frontier DP (statecount.py, ~1.3 s for NASNet-Large's 5.8e12),
    # never enumerated; None past its budget.
    total_states = pipedream_states(base)
    problem, space = _space(base, config, total_states)
    if config.cost_model == "pipedream-compute":
        space.output_bytes[:] = 0.0
    solution = plan_levels(space, level_specs(config, levels))
    if solution is None:
        raise PlanError(_no_plan(config, problem, graph))
    # Problem nodes of each stage (the state range's new nodes), in pipeline order.
    stage_nodes: list[list[int]] = []
    for st in solution.stages:
        before = space.masks[st.start] if st.start >= 0 else 0
        new = space.masks[st.end] & ~before
        stage_nodes.append([v for v in range(problem.size) if new >> v & 1])
    return Partition(
        problem,
        stage_nodes,
        [list(st.ranks) for st in solution.stages],
        solution.time_s,
        space.size,
        space.search,
        total_states,
    )


def make_plan(graph: LayerGraph, config: PlanConfig) -> Plan:
    """Partition ``graph`` for ``config``'s cluster: PipeDream's optimizer, or the schedule search (auto)."""
    if config.schedule == "auto":
        from pdplan.auto import auto_plan  # auto builds on this module's DP and assembly

        return auto_plan(graph, config)
    began = time.perf_counter()
    part = dp_partition(graph, config)
    microbatches = config.microbatches or (
        1 if config.schedule == "1f1b" else default_microbatches([len(r) for r in part.ranks])
    )
    plan = assemble(graph, config, part, config.schedule, microbatches)
    plan = plan.model_copy(
        update={"predicted": plan.predicted.model_copy(update={"solve_s": time.perf_counter() - began})}  # type: ignore[union-attr]
    )
    if config.memory is not None:
        # The DP bounds memory by the paper's rule; every stage must also fit the full model.
        over = over_memory(plan, config.memory)
        if over is not None:
            raise PlanError(over + "; raise --memory, add workers, or let pdplan search (--schedule auto)")
    return plan


def over_memory(plan: Plan, limit: float) -> str | None:
    """One line naming the stage of ``plan`` that needs more than ``limit`` bytes, or None if all fit."""
    if plan.virtual_stages > 1:
        peaks = worker_peaks(plan)
        worst = max(range(len(peaks)), key=lambda w: peaks[w])
        if peaks[worst] > limit:
            return f"graph: no plan fits --memory {limit:g} bytes per worker: {memory_text(plan, worst)}"
        return None
    for s, stage in enumerate(plan.stages):
        pred = stage.predicted
        if pred is not None and pred.memory is not None and pred.memory.total_bytes > limit:
            return f"graph: no plan fits --memory {limit:g} bytes per worker: {memory_text(plan, s)}"
    return None


def worker_peaks(plan: Plan) -> list[float]:
    """Each worker's predicted bytes: its stage's, or under interleaved-1f1b the sum of its V chunks'."""
    workers = len(plan.stages) // plan.virtual_stages
    peaks = [0.0] * workers
    for s, stage in enumerate(plan.stages):
        peaks[plan.chunk_worker(s)] += stage.predicted.memory_bytes if stage.predicted is not None else 0.0
    return peaks


def memory_text(plan: Plan, s: int) -> str:
    """``stage 1 of the 1f1b plan (2 stages) needs 33.2 MB (weights 2 x 11.1 MB, ...)``.

    Under interleaved-1f1b ``s`` is a worker, which holds its V chunks: their sum.
    """
    if plan.virtual_stages > 1:
        workers = len(plan.stages) // plan.virtual_stages
        chunks = [plan.stages[c].predicted for c in plan.worker_chunks(s)]
        parts = [p.memory for p in chunks if p is not None and p.memory is not None]
        return (
            f"worker {s} of the {plan.schedule} plan ({workers} workers x {plan.virtual_stages} chunks, "
            f"M={plan.microbatches}) needs {sum(m.total_bytes for m in parts) / 1e6:.3g} MB (weights "
            f"{sum(m.weight_bytes for m in parts) / 1e6:.3g} MB, gradients and optimizer "
            f"{sum(m.gradient_bytes + m.optimizer_bytes for m in parts) / 1e6:.3g} MB, activations "
            f"{sum(m.activation_bytes for m in parts) / 1e6:.3g} MB over its chunks"
            f"{_extra_text(sum(m.message_bytes for m in parts), sum(m.overhead_bytes for m in parts))})"
        )
    pred = plan.stages[s].predicted
    assert pred is not None and pred.memory is not None
    m = pred.memory
    mb = 1e6
    return (
        f"stage {s} of the {plan.schedule} plan ({len(plan.stages)} stages, M={plan.microbatches}) needs "
        f"{m.total_bytes / mb:.3g} MB (weights {m.weight_versions} x {m.weight_bytes / m.weight_versions / mb:.3g} MB, "
        f"gradients {m.gradient_bytes / mb:.3g} MB, optimizer {m.optimizer_bytes / mb:.3g} MB, activations "
        f"{m.units_held} units {m.activation_bytes / mb:.3g} MB{_extra_text(m.message_bytes, m.overhead_bytes)})"
    )


def _extra_text(messages: float, overhead: float) -> str:
    """The memory model's parts beyond the tensors, where there are any."""
    text = f", messages {messages / 1e6:.3g} MB" if messages > 0 else ""
    return text + (f", process overhead {overhead / 1e6:.3g} MB" if overhead > 0 else "")


def assemble(
    graph: LayerGraph,
    config: PlanConfig,
    part: Partition,
    schedule: str,
    microbatches: int,
    memory: bool = True,
) -> Plan:
    """The plan of ``part``'s stages under ``schedule``: the paper's costs and the memory model per stage.

    ``memory=False`` leaves the memory model out (the paper's figure stays), for a caller that
    replaces the stages' memory anyway: it reads a program of the schedule, which costs more than
    the rest of the plan (a 16-chunk straight 1F1B program for AlexNet's interleaved candidates).
    """
    levels = config.levels()
    problem = part.problem
    stage_nodes, stage_ranks = part.stage_nodes, part.ranks
    transfers = config.cost_model != "pipedream-compute"
    costs = stage_costs(problem, stage_nodes, stage_ranks, levels, transfers=transfers)
    layers = _stage_layers(graph, problem, stage_nodes)
    stages = [
        Stage(layers=ls, replicas=len(rk), ranks=rk, predicted=_stage_prediction(c))
        for ls, rk, c in zip(layers, stage_ranks, costs, strict=True)
    ]
    total_c = sum(problem.compute_s)
    total_p = sum(problem.parameter_bytes)
    dp_time = data_parallel_time(total_c, total_p, levels)
    workers = math.prod(config.workers)
    comm_bytes = sum(2.0 * o for o in cut_sizes(problem, stage_nodes)) + sum(
        allreduce_s(c.parameter_bytes, len(rk), 1.0) for rk, c in zip(stage_ranks, costs, strict=True)
    )
    bottleneck = max(range(len(costs)), key=lambda i: costs[i].bound_s)
    t = part.time_s if part.time_s is not None else costs[bottleneck].bound_s
    predicted = Prediction(
        time_per_minibatch_s=t,
        throughput_samples_per_s=graph.batch_size / t if t > 0 else None,
        communication_bytes_per_sample=comm_bytes / graph.batch_size,
        bottleneck_stage=bottleneck,
        data_parallel_time_per_minibatch_s=dp_time,
        data_parallel_throughput_samples_per_s=graph.batch_size / dp_time if dp_time > 0 else None,
        data_parallel_communication_bytes_per_sample=allreduce_s(total_p, workers, 1.0) / graph.batch_size,
        speedup_over_data_parallel=dp_time / t if t > 0 else None,
        states=part.states,
        search=part.search,
        antichain_states=part.antichain_states,
    )
    plan = Plan(
        graph_hash=graph.structure_hash(),
        graph_source=graph.source,
        spec=graph.spec,
        batch_size=graph.batch_size,
        input_shape=graph.input_shape,
        schedule=schedule,
        microbatches=microbatches,
        in_flight=math.ceil(workers / stages[0].replicas),
        world_size=workers,
        cluster=Cluster(
            levels=levels,
            memory_bytes=config.memory,
            straight=config.straight,
            cost_model=config.cost_model,
            blocking_sends=config.blocking_sends,
            optimizer=config.optimizer,
            schedule_search="auto" if config.schedule == "auto" else "given",
        ),
        stages=stages,
        predicted=predicted,
    )
    return with_memory(plan, graph) if memory else plan


def with_memory(plan: Plan, graph: LayerGraph) -> Plan:
    """``plan`` with the memory model's figures in every stage's prediction (``pdplan.memory``)."""
    optimizer = plan.cluster.optimizer if plan.cluster is not None else "sgd"
    parts = stage_memory(graph, plan, optimizer, held_units(plan))
    stages = []
    for stage, m in zip(plan.stages, parts, strict=True):
        pred = stage.predicted or StagePrediction(compute_s=0, time_s=0)
        paper = pred.paper_memory_bytes if pred.paper_memory_bytes is not None else pred.memory_bytes
        update = {"memory": m, "memory_bytes": m.total_bytes, "paper_memory_bytes": paper}
        stages.append(stage.model_copy(update={"predicted": pred.model_copy(update=update)}))
    return plan.model_copy(update={"stages": stages})


def _no_plan(config: PlanConfig, problem: Problem, graph: LayerGraph) -> str:
    workers = math.prod(config.workers)
    if config.straight and problem.size < max(config.workers):
        return (
            f"graph: no plan fits: --straight gives each of the {max(config.workers)} workers of a level its "
            f"own stage, but the graph has only {problem.size} layers to split; use fewer workers or drop --straight"
        )
    if config.memory is not None:
        # Name what the plan without the limit needs on its largest stage.
        free = make_plan(graph, replace(config, memory=None))
        worst = max(range(len(free.stages)), key=lambda s: free.stages[s].predicted.memory_bytes)  # type: ignore[union-attr]
        return (
            f"graph: no plan fits --memory {config.memory:g} bytes per worker on {workers} workers (PipeDream's "
            f"rule, ceil(W_after / r) x (activations + parameters)); without the limit, {memory_text(free, worst)}"
        )
    return f"graph: no plan fits {workers} workers (levels {list(config.workers)}) with these options"


def _stage_prediction(c: StageCost) -> StagePrediction:
    return StagePrediction(
        compute_s=c.compute_s,
        allreduce_s=c.allreduce_s,
        communication_s=c.communication_s,
        time_s=c.time_s,
        parameter_bytes=c.parameter_bytes,
        activation_bytes=c.activation_bytes,
        memory_bytes=c.memory_bytes,
        paper_memory_bytes=c.memory_bytes,
    )


def _stage_layers(graph: LayerGraph, problem: Problem, stage_nodes: list[list[int]]) -> list[list[str]]:
    """Graph layer ids of each stage, in the graph's order; set-aside nodes put back."""
    owner: dict[str, int] = {}
    for s, nodes in enumerate(stage_nodes):
        for v in nodes:
            for layer in problem.layers_of(v):
                owner[layer] = s
    for layer in problem.inputs:
        owner[layer] = 0
    last = len(stage_nodes) - 1
    for sink, producer in problem.attached.items():
        owner[sink] = owner.get(producer, 0) if producer else 0
    for node in graph.nodes:
        # Nodes no state reaches form an up-set (nothing inside depends on them): the last stage is convex.
        owner.setdefault(node.id, last)
    layers: list[list[str]] = [[] for _ in stage_nodes]
    for node in graph.nodes:
        layers[owner[node.id]].append(node.id)
    return layers
