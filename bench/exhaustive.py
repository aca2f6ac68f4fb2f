"""The fastest plan of every partition, where every partition can be listed: what ``--schedule auto`` is checked against.

``pdplan --schedule auto`` simulates every partition of a graph of at most ten nodes and, on a
bigger one, the DP's proposals, balanced splits and a local search around the best
(``pdplan.auto``). Where its plan is no faster than the paper-cost plan (VGG16 on 4 workers,
205.19 ms each), the question is whether any plan is. A graph whose topological order is unique
(each node follows the one before it, skip connections inside allowed: PipeDream's VGG16 profile)
has as its pipeline partitions exactly the splits of that order into consecutive runs, so they
can all be listed: C(n-1, k-1) splits into k stages times the ways to share the workers among
them, 11,480 for VGG16's 40 nodes on 4 workers. :func:`best` hands them all to the auto search's
own ranking (``pdplan.auto.search``: each schedule and microbatch count it tries, cut off only
by a lower bound that cannot win) and returns the fastest, about 20 s for that case.

One model chunk per worker: interleaved-1f1b's chunked plans are not among them.
"""

from __future__ import annotations

import itertools
import math

from pdplan.auto import compositions, consecutive_ranks, search
from pdplan.build import Partition, PlanConfig
from pdplan.problem import Problem, prepare_layers
from shared.graph import LayerGraph

MAX_WORKERS = 4  # 8 workers on VGG16 would be C(39, 7) = 15 million splits into 8 stages alone


def unique_order(problem: Problem) -> bool:
    """Whether the problem's nodes have one topological order (each follows the one before it)."""
    return all(i - 1 in problem.preds[i] for i in range(1, problem.size))


def partitions(problem: Problem, workers: int) -> list[Partition]:
    """Every split of the (unique) order into consecutive stages, with every sharing of ``workers``."""
    n = problem.size
    out: list[Partition] = []
    for k in range(1, min(workers, n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            nodes = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
            out.extend(
                Partition(problem, nodes, consecutive_ranks(reps), search="exhaustive")
                for reps in compositions(workers, k)
            )
    return out


def best(graph: LayerGraph, config: PlanConfig) -> tuple[float, int] | None:
    """(the fastest simulated seconds per minibatch, partitions listed), or None where they cannot all be listed here."""
    workers = math.prod(config.workers)
    if len(config.workers) != 1 or workers > MAX_WORKERS:
        return None
    problem = prepare_layers(graph)
    if not unique_order(problem):
        return None
    parts = partitions(problem, workers)
    tried, _ = search(graph, config, parts)
    return (min(t.time_s for t in tried), len(parts)) if tried else None
