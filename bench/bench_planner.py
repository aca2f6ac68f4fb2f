"""The planner's speed beside the size of the problem, against the paper's optimizer's times.

Each case loads a layer graph (a PipeDream profile through ``pdprof import-pipedream``'s
parser, or a synthetic chain), plans it with ``pdplan``'s library call and records the
state count, the search used (all antichain states, the series-compressed DAG's, its
narrow-cut states beside topological prefixes, or prefixes alone) and the wall time of the
whole planning call (best of ``--repeat``), and beside them the exact number of states of
PipeDream's antichain DAG (``antichain_states``, counted by ``pdplan.statecount`` without
listing them; ``count_s`` its time, best of ``--repeat``): the search covers all of them
when ``states`` equals it. The table on stderr shows big counts as ``1.6e+11``; the JSON
rows carry the exact integer.
The reference times are those the issue measured for the paper's optimizer on this
machine (pure Python, cubic in the states).

    python -m bench.bench_planner              # JSON rows on stdout, a table on stderr
    python -m bench.bench_planner --only inception_v3_compressed --repeat 3
    python -m bench.bench_planner --auto       # --schedule auto against the paper-cost plan

``--auto`` compares, on PipeDream's VGG16, GNMT and ResNet-50 profiles for 4, 8 and 16
workers at 1e9 B/s and the 8,2 hierarchy at 1e10,1e9 B/s, the simulated time per minibatch
(``pdplan.schedule_sim``) of the paper-cost plan (PipeDream's DP, 1f1b) with that of the
plan ``--schedule auto`` writes. The planner is deterministic, so these figures do not
depend on the machine (only ``search_s`` does). Where every partition can be listed (a graph with
one topological order, one level of at most 4 workers: VGG16 on 4), ``every_partition_ms`` is the
fastest of them all (``bench.exhaustive``), so an auto plan no faster than the paper-cost plan shows
whether any plan is.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from bench import exhaustive
from pdplan.build import PlanConfig, make_plan
from pdplan.problem import prepare
from pdplan.report import with_simulation
from pdplan.statecount import count_states
from pdprof.pipedream_import import parse_pipedream
from shared.cli import console
from shared.graph import Edge, LayerGraph, Node
from shared.malloc import steady_malloc

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # a profile name or "chain:N"
    workers: tuple[int, ...]
    bandwidths: tuple[float, ...]
    reference_s: float | None = None  # the paper's optimizer, as measured in the issue
    target_s: float | None = None  # what the issue asks of ours


CASES = [
    Case("inception_v3_compressed", "inception_v3_compressed", (16,), (1e9,), 280.0, 2.8),
    Case("resnext101", "resnext101", (16,), (1e9,), 32.0, 0.32),
    Case("densenet121", "densenet121", (16,), (1e9,), 26.0, 0.26),
    Case("chain2000_3levels", "chain:2000", (8, 8, 16), (1e11, 1e10, 1e9), None, 10.0),
    Case("inception_v3", "inception_v3", (16,), (1e9,), None, 60.0),
    Case("nasnetamobile", "nasnetamobile", (16,), (1e9,), None, 60.0),
    Case("nasnetalarge", "nasnetalarge", (16,), (1e9,), None, None),
]


def synthetic_chain(n: int, seed: int = 0) -> LayerGraph:
    """A chain of ``n`` layers with random costs (seeded): the input, then n layers."""
    rng = random.Random(seed)
    nodes = [Node(id="input", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0)]
    edges = []
    prev = "input"
    for i in range(n):
        name = f"layer{i}"
        nodes.append(
            Node(
                id=name,
                forward_ms=rng.uniform(0.1, 5.0),
                backward_ms=rng.uniform(0.2, 10.0),
                activation_bytes=rng.uniform(1e5, 5e7),
                parameter_bytes=rng.uniform(0, 2e7),
            )
        )
        edges.append(Edge(source=prev, target=name))
        prev = name
    return LayerGraph(source=f"synthetic:chain{n}", batch_size=32, nodes=nodes, edges=edges)


def load(source: str) -> LayerGraph:
    if source.startswith("chain:"):
        return synthetic_chain(int(source.split(":", 1)[1]))
    path = PROFILES / f"{source}.txt"
    return parse_pipedream(path.read_text(), str(path))


def run(case: Case, repeat: int) -> dict[str, object]:
    graph = load(case.source)
    config = PlanConfig(workers=case.workers, bandwidths=case.bandwidths)
    best = float("inf")
    plan = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = make_plan(graph, config)
        best = min(best, time.perf_counter() - t0)
    assert plan is not None and plan.predicted is not None
    total, count_s = _count(graph, repeat)
    return {
        "case": case.name,
        "layers": len(graph.nodes),
        "workers": "x".join(map(str, case.workers)),
        "states": plan.predicted.states,
        "search": plan.predicted.search,
        "antichain_states": total,
        "count_s": round(count_s, 4),
        "plan_s": round(best, 4),
        "reference_s": case.reference_s,
        "faster": round(case.reference_s / best, 1) if case.reference_s else None,
        "target_s": case.target_s,
        "meets": None if case.target_s is None else best <= case.target_s,
        "time_per_minibatch_ms": round(plan.predicted.time_per_minibatch_s * 1000, 4),
        "stages": len(plan.stages),
        "speedup_over_dp": round(plan.predicted.speedup_over_data_parallel or 0.0, 3),
    }


AUTO_PROFILES = ("vgg16", "gnmt", "resnet50")
AUTO_CLUSTERS: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = (
    ((4,), (1e9,)),
    ((8,), (1e9,)),
    ((16,), (1e9,)),
    ((8, 2), (1e10, 1e9)),
)


def run_auto(profile: str, workers: tuple[int, ...], bandwidths: tuple[float, ...]) -> dict[str, object]:
    """The paper-cost plan's simulated time beside the auto plan's, for one profile and cluster."""
    graph = load(profile)
    paper = with_simulation(make_plan(graph, PlanConfig(workers=workers, bandwidths=bandwidths)), graph)
    config = PlanConfig(workers=workers, bandwidths=bandwidths, schedule="auto")
    t0 = time.perf_counter()
    auto = make_plan(graph, config)
    search_s = time.perf_counter() - t0
    every = exhaustive.best(graph, config)
    assert paper.predicted is not None and auto.predicted is not None
    p = paper.predicted.simulated_time_per_minibatch_s
    a = auto.predicted.simulated_time_per_minibatch_s
    assert p is not None and a is not None
    return {
        "profile": profile,
        "workers": ",".join(map(str, workers)),
        "bandwidth": ",".join(f"{b:g}" for b in bandwidths),
        "paper_ms": round(p * 1000, 2),
        "paper_shape": "-".join(str(s.replicas) for s in paper.stages),
        "paper_bubble": round(paper.predicted.simulated_bubble or 0.0, 2),
        "auto_ms": round(a * 1000, 2),
        "auto_schedule": auto.schedule + (f" M={auto.microbatches}" if auto.schedule != "1f1b" else ""),
        "auto_shape": "-".join(str(s.replicas) for s in auto.stages),
        "auto_bubble": round(auto.predicted.simulated_bubble or 0.0, 2),
        "auto_over_paper": round(a / p, 3),
        "below": a < p,
        "search_s": round(search_s, 1),
        # Where every partition can be listed (bench.exhaustive): the fastest of them all, and their number.
        "every_partition_ms": None if every is None else round(every[0] * 1000, 2),
        "partitions": None if every is None else every[1],
    }


def _count(graph: LayerGraph, repeat: int) -> tuple[int, float]:
    """PipeDream's exact state count of ``graph`` and the best time of counting it (from the graph)."""
    best, total = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        total = count_states(prepare(graph.to_networkx())).states
        best = min(best, time.perf_counter() - t0)
    return total, best


def _cell(value: object) -> str:
    # Counts like NASNet's 163,798,401,193 states read better as 1.6e+11 in a table.
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**7:
        return f"{value:.1e}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--repeat", type=int, default=1, help="plan each case this many times, keep the best")
    parser.add_argument("--auto", action="store_true", help="--schedule auto against the paper-cost plan")
    args = parser.parse_args()
    steady_malloc()  # as pdplan's command does at its entry: the figures are the command's
    if args.auto:
        rows = [
            run_auto(name, w, b)
            for name in AUTO_PROFILES
            if args.only is None or name in args.only
            for w, b in AUTO_CLUSTERS
        ]
        title = "pdplan --schedule auto against the paper-cost plan: simulated ms per minibatch"
    else:
        rows = [run(c, args.repeat) for c in CASES if args.only is None or c.name in args.only]
        title = "pdplan: planning time (the machine may be shared: figures are noisy)"
    table = Table(title=title)
    for col in rows[0] if rows else []:
        table.add_column(col)
    for row in rows:
        table.add_row(*(_cell(v) for v in row.values()))
    console.print(table, width=max(console.width, 160))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
