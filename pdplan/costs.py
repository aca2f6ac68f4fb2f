"""PipeDream's cost model: its all-reduce term, and its figures for a given sequence of stages.

``allreduce_s`` is the one place the paper's data-parallel communication term is written;
the DP (``partition``, ``chain``, ``threshold``), the schedule simulation and ``auto``'s
balanced split all call it. The per-stage figures below are the same figures the DP minimises, stage by stage, so that a plan's stated prediction can
be checked against its stages and a hand-edited plan can be re-costed:

- stage compute ``c`` (forward + backward, one replica), parameters ``p``, activations ``a``;
- with ``r`` replicas its time is ``(c + 4 (r-1) p / (B r)) / r``;
- a stage after the first pays ``2 O_in / (B r)`` for its input cut and, unless it is the
  last, ``2 O_out / (B r)`` for its output cut (the first stage's output is charged to the
  second, as in the paper's recurrence);
- its memory, as PipeDream's constraint counts it, is ``ceil(W_after / r) * (a + p)``.

With ``transfers=False`` (``--cost-model pipedream-compute``) the cut transfers are not charged.

For a one-level cluster ``max`` over the stages of these terms is exactly the DP's
``T(last, N)``. On a hierarchy the DP nests levels; the per-stage figures then use the
bandwidth of the outermost level a stage's replicas (or a cut) span, as an estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from pdplan.antichain import FloatArray, cut_bytes
from pdplan.problem import Problem
from shared.plan import Level


@overload
def allreduce_s(parameter_bytes: float, replicas: int, bandwidth: float) -> float: ...
@overload
def allreduce_s(parameter_bytes: FloatArray, replicas: int | FloatArray, bandwidth: float) -> FloatArray: ...
@overload
def allreduce_s(parameter_bytes: float, replicas: FloatArray, bandwidth: float) -> FloatArray: ...


def allreduce_s(
    parameter_bytes: float | FloatArray, replicas: int | FloatArray, bandwidth: float
) -> float | FloatArray:
    """Seconds to all-reduce ``p`` bytes of gradients among ``r`` replicas: ``4 (r-1) p / (B r)``.

    PipeDream's weight-synchronisation time (Narayanan et al., SOSP 2019, section 3.1: with an
    all-reduce among ``m`` replicas each one sends and receives ``(m-1)/m`` of the weights),
    with the constant its optimizer (``optimizer_graph_hierarchical.py``) uses:
    ``4 (m-1) |w| / (B m)``. It is 0 for one replica and works element-wise on arrays. Every
    caller's expression had this order of operations, so the DP's tables stay the same to the
    bit. At ``bandwidth=1.0`` it is the bytes the term charges (``communication_bytes_per_sample``).
    """
    return 4 * (replicas - 1) * parameter_bytes / (bandwidth * replicas)


@dataclass(frozen=True)
class StageCost:
    """The cost model's figures for one stage."""

    compute_s: float
    allreduce_s: float
    communication_s: float
    time_s: float
    parameter_bytes: float
    activation_bytes: float
    memory_bytes: float

    @property
    def bound_s(self) -> float:
        """What this stage contributes to the bottleneck: its time or its communication."""
        return max(self.time_s, self.communication_s)


def span_bandwidth(levels: Sequence[Level], ranks: Sequence[int]) -> float:
    """The bandwidth of the outermost level that ``ranks`` spread across (innermost if one rank)."""
    unit = 1
    bandwidth = levels[0].bandwidth
    for level in levels:
        units = {r // unit for r in ranks}
        if len(units) > 1:
            bandwidth = level.bandwidth
        unit *= level.workers
    return bandwidth


def stage_costs(
    problem: Problem,
    stage_nodes: Sequence[Sequence[int]],
    ranks: Sequence[Sequence[int]],
    levels: Sequence[Level],
    transfers: bool = True,
) -> list[StageCost]:
    """Cost every stage; ``stage_nodes`` are problem nodes in pipeline order, ``ranks`` their ranks."""
    downset = 0
    cuts: list[float] = []
    for nodes in stage_nodes[:-1]:
        for v in nodes:
            downset |= 1 << v
        cuts.append(cut_bytes(problem, downset))
    out: list[StageCost] = []
    total = sum(len(r) for r in ranks)
    after = total
    for i, nodes in enumerate(stage_nodes):
        r = len(ranks[i])
        after -= r
        c = sum(problem.compute_s[v] for v in nodes)
        p = sum(problem.parameter_bytes[v] for v in nodes)
        a = sum(problem.activation_bytes[v] for v in nodes)
        bw = span_bandwidth(levels, ranks[i])
        allreduce = allreduce_s(p, r, bw)
        comm = 0.0
        if i > 0 and transfers:
            link_in = span_bandwidth(levels, [*ranks[i - 1], *ranks[i]])
            comm = 2.0 * cuts[i - 1] / (link_in * r)
            if i < len(stage_nodes) - 1:
                link_out = span_bandwidth(levels, [*ranks[i], *ranks[i + 1]])
                comm = max(comm, 2.0 * cuts[i] / (link_out * r))
        out.append(
            StageCost(
                compute_s=c,
                allreduce_s=allreduce,
                communication_s=comm,
                time_s=(c + allreduce) / r,
                parameter_bytes=p,
                activation_bytes=a,
                memory_bytes=math.ceil(after / r) * (a + p),
            )
        )
    return out


def data_parallel_time(compute_s: float, parameter_bytes: float, levels: Sequence[Level]) -> float:
    """PipeDream's baseline: ``t = (t + 4 (n-1) P / (B n) / w) / n`` level by level, innermost first."""
    t = compute_s
    within = 1
    for level in levels:
        n = level.workers
        t = (t + allreduce_s(parameter_bytes, n, level.bandwidth) / within) / n
        within = n
    return t


def cut_sizes(problem: Problem, stage_nodes: Sequence[Sequence[int]]) -> list[float]:
    """Bytes crossing each boundary between consecutive stages."""
    downset = 0
    out = []
    for nodes in stage_nodes[:-1]:
        for v in nodes:
            downset |= 1 << v
        out.append(cut_bytes(problem, downset))
    return out
