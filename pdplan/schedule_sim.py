"""What pdrun should measure for a plan: its schedule simulated with the profiled costs.

PipeDream's cost model (``pdplan.costs``) gives the bottleneck stage's time per minibatch,
the figure the DP minimises and the paper reports. It leaves out what a real run pays
besides: the optimizer step of every stage (once per unit in ``1f1b``), the loss at the
last stage, the pipeline's fill, drain and flush bubbles, and the time a message spends on
the wire before the next stage can start (PipeDream overlaps transfers with compute, but a
stage still waits for its input). Here the plan's own schedule is lowered to the same
instruction lists pdrun executes (``shared.schedule.build_program``) and run against a clock
(``shared.simulate``) with, per stage:

- forward and backward: the sums of its layers' ``forward_ms`` and ``backward_ms``, plus the
  loss's (``graph.loss_forward_ms``, ``graph.loss_backward_ms``, ``unattributed_backward_ms``)
  at the last stage, and fetching its part of a unit's batch as pdrun's workers do: the model
  inputs (``graph.data_ms``) at the stages that read them, the targets (``graph.target_ms``,
  every sample read where the dataset has no table of targets) at the last stage, both in one
  fetch (``graph.data_target_ms``) at a stage that does both (:func:`fetch_ms`);
- a stage boundary: ``graph.cut_backward_ms`` more backward for every stage that sends values
  to a later one, ``graph.cut_forward_ms`` more forward for every stage that receives them
  (what cutting a step in two cost in pdprof's measurement, ``pdprof.cut``);
- step: the sum of its layers' ``update_ms`` plus ``graph.update_overhead_ms`` (the first step
  after a backward costs more), when the stage has parameters;
- all-reduce among replicas: PipeDream's ``4 (r-1) p / (B r)`` (``costs.allreduce_s``) at the
  bandwidth its ranks span;
- a message between stages a and b: the bytes of the values a sends b (each value once, as
  pdrun sends a skip connection straight to its consumer; in a chunked plan a value read several
  chunks later is relayed, and its bytes count on every hop, ``shared.plan.crossing_values``)
  over the bandwidth the two stages' ranks span, plus that level's ``latency_s`` (``pdplan
  --latency``), in both directions (activations forward, gradients back). With the plan's
  ``cluster.blocking_sends`` a send also keeps its sender busy that long, as when pdrun's CPU
  workers post their own sends (no core to spare for a send thread) or the benchmarks emulate a
  slow link.

The steady-state seconds per unit of that simulation is the plan's
``simulated_time_per_minibatch_s``; imported PipeDream profiles have no update or loss
times, so for them it adds only the schedule's bubbles and transfer waits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdplan.costs import allreduce_s, span_bandwidth
from shared.graph import LayerGraph, Node
from shared.plan import Level, Plan, crossing_values
from shared.schedule import SPLIT_BACKWARD, Program, build_program, chunk_owner
from shared.simulate import Costs, simulate

# Qi et al. (ICLR'24, section 2) take the input-gradient and weight-gradient passes as about equal
# (T_B = T_W) for transformer layers: zero bubble's split where nothing was measured.
HALVES = (0.5, 0.5)

# Units simulated: enough steps that the quartile window of shared.simulate is steady state.
# A flushing schedule's steps repeat exactly (each drains), so 4 steps give the per-unit time of
# 16 to 1e-14 (PipeDream's AlexNet, VGG16, ResNet-18, GNMT, SqueezeNet on 2 to 8 workers; tests/
# test_plan_schedule_sim.py holds it against 32 steps); 2bw does not drain, and at 4 steps its
# warm-up still shows (up to 42% off AlexNet on 8 workers), at 8 within 0.3% of 16. The planner's search simulates dozens of
# programs per plan, so fewer units is start-up time saved (pdplan on AlexNet, issue 19).
MIN_STEPS = 16
FLUSH_STEPS = 4
TWO_BW_STEPS = 8
MAX_UNITS = 4096


@dataclass(frozen=True)
class ScheduleFigures:
    """The simulated run: seconds per unit in steady state, the idle share of the workers (the bubble)
    and their share in blocking sends (``shared.simulate.Simulation.sending_share``)."""

    time_per_minibatch_s: float
    bubble: float
    units: int
    sending: float = 0.0


def _extra_ms(graph: LayerGraph, key: str) -> float:
    value = graph.graph.get(key, 0.0)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) and value > 0 else 0.0


def fetch_ms(graph: LayerGraph, inputs: bool, targets: bool) -> float:
    """What a stage pays a unit to fetch its part of the batch (pdprof's ``FETCHES``): ``data_ms`` for the
    model inputs, ``target_ms`` for the targets alone, ``data_target_ms`` for both in one fetch. A graph
    from before pdprof timed the last two charges the inputs' fetch alone, as it did then."""
    if inputs and targets:
        return _extra_ms(graph, "data_target_ms") or _extra_ms(graph, "data_ms")
    if inputs:
        return _extra_ms(graph, "data_ms")
    return _extra_ms(graph, "target_ms") if targets else 0.0


def stage_costs(graph: LayerGraph, plan: Plan) -> tuple[Costs, list[tuple[int, int]]]:
    """The simulator's costs for ``plan``'s stages, and the stage edges values cross."""
    assert plan.cluster is not None
    levels = plan.cluster.levels
    nodes = {n.id: n for n in graph.nodes}
    owner = {layer: s for s, stage in enumerate(plan.stages) for layer in stage.layers}
    last = len(plan.stages) - 1
    forward = [0.0] * len(plan.stages)
    backward = [0.0] * len(plan.stages)
    update = [0.0] * len(plan.stages)
    for layer, s in owner.items():
        node = nodes.get(layer)
        if node is None:
            continue
        forward[s] += node.forward_ms / 1000
        backward[s] += node.backward_ms / 1000
        update[s] += node.update_ms / 1000
    forward[last] += _extra_ms(graph, "loss_forward_ms") / 1000
    # Fetching its part of a unit's batch, as pdrun's workers do: the stages that read model inputs
    # those, the last stage its targets.
    readers = {owner[n.id] for n in graph.nodes if n.op == "input" and n.id in owner}
    for s in range(len(plan.stages)):
        forward[s] += fetch_ms(graph, s in readers, s == last) / 1000
    backward[last] += (
        _extra_ms(graph, "loss_backward_ms") + _extra_ms(graph, "unattributed_backward_ms")
    ) / 1000
    overhead = _extra_ms(graph, "update_overhead_ms") / 1000
    step = [u + overhead if u > 0 else 0.0 for u in update]

    # Bytes from stage a to stage b, as pdrun sends them (a chunked plan relays a value along its chain).
    sent = crossing_values(graph, owner, plan.virtual_stages > 1)
    # A stage boundary's own cost (pdprof.cut): the earlier stage's backward is a call of its own,
    # started from a gradient that arrived, and the later stage's forward starts from a leaf.
    for s in {a for a, _ in sent}:
        backward[s] += _extra_ms(graph, "cut_backward_ms") / 1000
    for s in {b for _, b in sent}:
        forward[s] += _extra_ms(graph, "cut_forward_ms") / 1000
    transfer: dict[tuple[int, int], float] = {}
    for (a, b), values in sent.items():
        size = sum(nodes[v].activation_bytes for v in values)
        ranks = [*plan.stages[a].ranks, *plan.stages[b].ranks]
        transfer[(a, b)] = size / span_bandwidth(levels, ranks) + span_latency(levels, ranks)
    allreduce = []
    for stage in plan.stages:
        r = stage.replicas
        p = graph.held_parameter_bytes(stage.layers)
        allreduce.append(allreduce_s(p, r, span_bandwidth(levels, stage.ranks)) if r > 1 else 0.0)
    costs = Costs(
        forward=forward,
        backward=backward,
        transfer=transfer,
        allreduce=allreduce,
        step=step,
        blocking_sends=plan.cluster.blocking_sends,
        ties=tie_costs(graph, plan, owner, nodes),
    )
    return costs, sorted(transfer)


def tie_costs(
    graph: LayerGraph, plan: Plan, owner: dict[str, int], nodes: dict[str, Node]
) -> list[tuple[tuple[int, ...], float]]:
    """The ties (pdprof's ``graph.ties``) the plan splits over stages: (their stages, the sum's seconds).

    pdrun sums a tied parameter's gradient over its stages before every step (``pdrun.tied``),
    a blocking collective. Ties that share a stage are one meeting. The sum costs an all-reduce
    of the tensor (``graph.tie_bytes``) over the
    link spanning those stages, plus its latency.
    """
    assert plan.cluster is not None
    levels = plan.cluster.levels
    groups: list[tuple[set[int], float]] = []
    for layers, tied in graph.ties():
        stages = {owner[layer] for layer in layers if layer in owner}
        if len(stages) < 2:
            continue
        # A graph from before pdprof wrote the tie's size: the smallest reader's bytes stand for it.
        size = (
            tied
            if tied is not None
            else min(nodes[layer].parameter_bytes for layer in layers if layer in nodes)
        )
        for other in [g for g in groups if g[0] & stages]:
            groups.remove(other)
            stages |= other[0]
            size += other[1]
        groups.append((stages, size))
    out = []
    for stages, size in groups:
        ranks = [r for st in sorted(stages) for r in plan.stages[st].ranks]
        seconds = allreduce_s(size, len(stages), span_bandwidth(levels, ranks)) + span_latency(levels, ranks)
        out.append((tuple(sorted(stages)), seconds))
    return out


def span_latency(levels: Sequence[Level], ranks: Sequence[int]) -> float:
    """The latency of the outermost level ``ranks`` spread across (the innermost's if one rank)."""
    unit = 1
    latency = levels[0].latency_s
    for level in levels:
        if len({r // unit for r in ranks}) > 1:
            latency = level.latency_s
        unit *= level.workers
    return latency


def _units(plan: Plan, min_steps: int = MIN_STEPS) -> int:
    replicas = [s.replicas for s in plan.stages]
    period = math.lcm(*replicas, plan.microbatches)
    per_step = plan.microbatches if plan.schedule != "1f1b" else 1
    wanted = max(min_steps * per_step, 4 * len(plan.stages) * max(replicas), 4 * plan.in_flight)
    units = -(-wanted // period) * period
    return min(units, max(period, MAX_UNITS // period * period))


def simulate_plan(graph: LayerGraph, plan: Plan, scale: Sequence[float] | None = None) -> ScheduleFigures:
    """Simulate ``plan``'s schedule on ``graph``'s profiled costs (the plan must record its cluster).

    A flushing schedule drains at every step, so its steps repeat exactly: a few of them give
    the steady state (the quartile window of ``shared.simulate`` then spans whole steps).
    2bw's steps of M units do not drain: twice as many steps, past its warm-up.

    ``scale``, one factor per stage, multiplies each stage's compute (forward, backward, step):
    the same schedule with other stage costs, such as those a run measured (``bench.bench_runtime``
    reads a run's own limit so).
    """
    costs, stage_edges = schedule_costs(graph, plan, scale)
    steps = {"1f1b": MIN_STEPS, "2bw": TWO_BW_STEPS}.get(plan.schedule, FLUSH_STEPS)
    units = _units(plan, steps)
    workers = len(plan.stages) // plan.virtual_stages
    program = _program(
        plan.schedule,
        tuple(s.replicas for s in plan.stages[:workers]),
        units,
        plan.microbatches,
        None if stage_edges is None else tuple(stage_edges),
        plan.in_flight if plan.schedule == "1f1b" else None,
        plan.virtual_stages,
    )
    run = simulate(program, costs)
    return ScheduleFigures(
        time_per_minibatch_s=run.time_per_unit, bubble=run.bubble, units=units, sending=run.sending_share
    )


@functools.lru_cache(maxsize=64)
def _program(
    schedule: str,
    replicas: tuple[int, ...],
    units: int,
    microbatches: int,
    stage_edges: tuple[tuple[int, int], ...] | None,
    in_flight: int | None,
    chunks: int,
) -> Program:
    """``build_program``'s program, kept for the next plan of the same shape (read only: shared).

    A program depends on the integers alone, not on the stages' costs: the planner's local
    search simulates many partitions that differ only in where a layer sits (AlexNet on 4
    workers: 12 of its 20 simulations are one 2bw program).
    """
    return build_program(
        schedule,
        replicas,
        units,
        microbatches=microbatches,
        stage_edges=stage_edges,
        in_flight=in_flight,
        chunks=chunks,
    )


def schedule_costs(
    graph: LayerGraph, plan: Plan, scale: Sequence[float] | None = None
) -> tuple[Costs, list[tuple[int, int]] | None]:
    """:func:`stage_costs` as the plan's schedule runs them: per chunk (interleaved), or B split from W
    (zb-h1); each stage's compute times ``scale[s]`` when given (:func:`simulate_plan`)."""
    costs, edges = stage_costs(graph, plan)
    if scale is not None:
        if len(scale) != len(plan.stages):
            raise ValueError(f"scale has {len(scale)} factors for {len(plan.stages)} stages")
        costs = replace(
            costs,
            forward=[f * k for f, k in zip(costs.forward, scale, strict=True)],
            backward=[b * k for b, k in zip(costs.backward, scale, strict=True)],
            step=[u * k for u, k in zip(costs.step, scale, strict=True)],
        )
    run = as_run(plan, costs, backward_shares(graph))
    return run, None if plan.virtual_stages > 1 else edges  # chunked: the chain of chunks


def as_run(plan: Plan, costs: Costs, shares: tuple[float, float] = HALVES) -> Costs:
    """``stage_costs``' ``costs`` as ``plan``'s schedule runs them: per chunk (interleaved-1f1b, zb-v), and
    B split from W (zb-h1, zb-v) by ``shares`` (:func:`backward_shares`)."""
    if plan.virtual_stages > 1:
        costs = chunked_costs(costs, plan.virtual_stages, plan.vshape)
    return split_backward(costs, shares) if plan.schedule in SPLIT_BACKWARD else costs


def chunked_costs(costs: Costs, chunks: int, vshape: bool = False) -> Costs:
    """Per-chunk costs of V x S virtual stages on S workers: chunk c of worker w is virtual stage c S + w
    (in a V, ``vshape``, ``shared.schedule.chunk_virtual``'s zig-zag).

    Forward and backward stay per virtual stage (``Costs.chunks``); a worker steps all its
    chunks at once, so its step costs their sum; a transfer between two workers costs the
    most that any boundary of chunks between them carries (they differ by boundary, and the
    simulator keys a link by the pair of workers), and one between two chunks of the same
    worker costs nothing (it stays in the process); a tie joins the workers of its chunks. With
    replicas, a worker's all-reduce is its chunks' in turn, so it costs their sum.
    """
    n = len(costs.forward) // chunks

    def worker(v: int) -> int:
        return chunk_owner(n, v, vshape)[0]

    def per_worker(per_chunk: Sequence[float]) -> list[float]:
        out = [0.0] * n
        for v, x in enumerate(per_chunk[: n * chunks]):
            out[worker(v)] += x
        return out

    step = per_worker(costs.step)
    transfer: dict[tuple[int, int], float] = {}
    for (a, b), t in costs.transfer.items():
        key = (min(worker(a), worker(b)), max(worker(a), worker(b)))
        if key[0] != key[1]:
            transfer[key] = max(transfer.get(key, 0.0), t)
    # A tie across chunks: pdrun's rank adds its own chunks' copies, then sums with the other workers
    # before its step (pdrun.interleaved): a tie of the workers holding it, or of none when one does.
    ties = []
    for stages, seconds in costs.ties:
        workers = tuple(sorted({worker(v) for v in stages}))
        if len(workers) > 1:
            ties.append((workers, seconds))
    # With replicas, every chunk all-reduces among its stage's replicas, one after another (pdrun).
    allreduce = per_worker(costs.allreduce)
    return replace(
        costs, transfer=transfer, allreduce=allreduce, step=step, chunks=chunks, ties=ties, vshape=vshape
    )


def backward_shares(graph: LayerGraph) -> tuple[float, float]:
    """B's and W's shares of a stage's profiled backward (``pdprof.split_timing``): the graph's
    measured ``backward_input_share`` and ``backward_weight_share``, or halves where it has none (an
    imported PipeDream profile, a model without a cut)."""
    b, w = (graph.graph.get(k) for k in ("backward_input_share", "backward_weight_share"))
    if isinstance(b, int | float) and isinstance(w, int | float) and b > 0 and w > 0:
        return float(b), float(w)
    return HALVES


def split_backward(costs: Costs, shares: tuple[float, float] = HALVES) -> Costs:
    """Each backward as B (input gradients) and W (weight gradients): zero bubble's split.

    B costs ``shares[0]`` of the profiled backward and W ``shares[1]`` (:func:`backward_shares`;
    together often more than one backward). The model's first (virtual) stage received nothing that
    needs a gradient: pdrun's B there computes nothing and its W the whole backward
    (``shared.weight_pass``), so it is charged so.
    """
    b_share, w_share = shares
    b = [0.0 if v == 0 else x * b_share for v, x in enumerate(costs.backward)]
    w = [x if v == 0 else x * w_share for v, x in enumerate(costs.backward)]
    return replace(costs, backward=b, weight=w)
