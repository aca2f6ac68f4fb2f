"""``pdplan show``: a plan as a table of stages, a diagram of its replicas and its speedup."""

from __future__ import annotations

import click
from rich.table import Table

from pdplan.cmd_tools import check_cluster
from pdplan.memory import held_units, stage_memory
from pdplan.report import cluster_text, recost, search_text, simulated_text
from pdplan.schedule_sim import simulate_plan
from shared.cli import console
from shared.graph import load_graph
from shared.io import display_name
from shared.plan import Plan, StageMemory, check_against_graph, load_plan


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.3f}"


def _diagram(p: Plan, width: int = 64) -> list[str]:
    """One row per stage: a bar per replica, placed at its ranks, ``->`` for the data flow."""
    per = max(1, min(3, width // max(1, p.world_size)))
    lines = []
    for s, stage in enumerate(p.stages):
        row = [" " * per] * p.world_size
        for rank in stage.ranks:
            row[rank] = ("#" * per) if per > 1 else "#"
        lines.append(f"stage {s:>2} |{''.join(row)}| x{stage.replicas}")
    ticks = "".join(str(r % 10).ljust(per) for r in range(p.world_size))
    lines.append(f"rank     |{ticks}|")
    return lines


@click.command("show")
@click.argument("plan", default="-")
@click.option(
    "--graph",
    "graph_path",
    default=None,
    metavar="GRAPH",
    help="Re-cost the plan's stages from this layer graph (for hand-edited plans).",
)
def show(plan: str, graph_path: str | None) -> None:
    """Render PLAN (a path or -) as a table of stages, a diagram of replicas and its speedup.

    \b
    Examples:
      pdplan show plan.json
      pdplan show edited.json --graph graph.json
    """
    p = load_plan(plan)
    costs = None
    recosted = None
    memory: list[StageMemory] | None = None
    if graph_path is not None:
        g = load_graph(graph_path)
        check_against_graph(p, g, display_name(plan))
        check_cluster(p, display_name(plan))
        costs, bottleneck, dp_time = recost(p, g)
        optimizer = p.cluster.optimizer if p.cluster is not None else "sgd"
        memory = stage_memory(g, p, optimizer, held_units(p))
        recosted = (bottleneck, dp_time, simulate_plan(g, p).time_per_minibatch_s)
    table = Table(
        title=f"{display_name(plan)}: {p.schedule}, {len(p.stages)} stages on {p.world_size} ranks "
        f"({cluster_text(p.cluster)}), {p.in_flight} in flight, M={p.microbatches}"
    )
    for column in (
        "stage",
        "layers",
        "replicas",
        "ranks",
        "compute ms",
        "all-reduce ms",
        "comm ms",
        "time ms",
        "memory MB",
        "weights MB",
        "grads+opt MB",
        "activations MB",
    ):
        table.add_column(column, justify="right" if "ms" in column or "MB" in column else "left")
    for s, stage in enumerate(p.stages):
        first, last = stage.layers[0], stage.layers[-1]
        span = first if first == last else f"{first} .. {last} ({len(stage.layers)})"
        pred = stage.predicted if costs is None else costs[s]
        m = (
            memory[s]
            if memory is not None
            else stage.predicted.memory
            if stage.predicted is not None
            else None
        )
        cells = ["-"] * 8
        if pred is not None:
            cells = [
                _ms(pred.compute_s),
                _ms(pred.allreduce_s),
                _ms(pred.communication_s),
                _ms(pred.time_s),
                f"{(m.total_bytes if m is not None else pred.memory_bytes) / 1e6:.1f}",
                *_memory_cells(m),
            ]
        table.add_row(str(s), span, str(stage.replicas), _ranks(stage.ranks), *cells)
    console.print(table, width=max(console.width, 172))
    for line in _diagram(p):
        console.print(line, markup=False, highlight=False)
    pr = p.predicted
    if pr is not None:
        speed = (
            f"{pr.speedup_over_data_parallel:.2f}x" if pr.speedup_over_data_parallel is not None else "n/a"
        )
        console.print(
            f"predicted: {_ms(pr.time_per_minibatch_s)} ms per minibatch ({_bottleneck(p)}), "
            f"data parallelism {_ms(pr.data_parallel_time_per_minibatch_s)} ms: [bold]speedup over data parallelism "
            f"{speed}[/]" + (f"; {search_text(pr)}" if pr.states else "") + simulated_text(pr, "; ")
        )
    if p.alternatives:
        console.print(_alternatives(p), width=max(console.width, 132))
    if p.edited_since_predicted():
        again = (
            "below, re-costed"
            if recosted is not None
            else f"add --graph GRAPH to re-cost {display_name(plan)}"
        )
        console.print(
            f"[yellow]note[/]: the plan was edited after pdplan predicted it: the predictions above are for the "
            f"layout pdplan wrote ({again})"
        )
    if recosted is not None:
        bottleneck, dp_time, simulated = recosted
        speed = f"{dp_time / bottleneck:.2f}x" if bottleneck > 0 else "n/a"
        console.print(
            f"re-costed from {display_name(graph_path or '')}: {_ms(bottleneck)} ms per minibatch, data parallelism "
            f"{_ms(dp_time)} ms: [bold]speedup over data parallelism {speed}[/]; schedule simulated: "
            f"{_ms(simulated)} ms/minibatch"
        )


def _bottleneck(p: Plan) -> str:
    """``bottleneck stage 2``; under interleaved-1f1b the worker, which runs V of the stages (its chunks)."""
    stage = p.predicted.bottleneck_stage if p.predicted is not None else None
    if p.virtual_stages == 1 or stage is None:
        return f"bottleneck stage {stage}"
    worker = p.chunk_worker(stage)
    chunks = ", ".join(str(s) for s in sorted(p.worker_chunks(worker)))
    return f"bottleneck worker {worker}, its chunks stages {chunks}"


def _memory_cells(m: StageMemory | None) -> list[str]:
    """Weights (x versions), gradients + optimizer state, activations (x units held), in MB."""
    if m is None:
        return ["-"] * 3
    return [
        f"{m.weight_bytes / 1e6:.1f} ({m.weight_versions}v)",
        f"{(m.gradient_bytes + m.optimizer_bytes) / 1e6:.1f}",
        f"{m.activation_bytes / 1e6:.1f} ({m.units_held}u)",
    ]


def _alternatives(p: Plan) -> Table:
    """The schedule search's candidates, fastest first: the chosen one, then the runners-up."""
    table = Table(title="schedule search (--schedule auto): the fastest candidates simulated")
    for column in ("", "schedule", "M", "replicas", "layers per stage", "simulated ms", "bubble", "peak MB"):
        table.add_column(
            column, justify="right" if column in ("M", "simulated ms", "bubble", "peak MB") else "left"
        )
    for i, alt in enumerate(p.alternatives):
        table.add_row(
            "chosen" if i == 0 else str(i + 1),
            alt.schedule + (f" V={alt.virtual_stages}" if alt.virtual_stages > 1 else ""),
            str(alt.microbatches),
            "-".join(map(str, alt.replicas)),
            "-".join(map(str, alt.stage_layers)),
            _ms(alt.simulated_time_per_minibatch_s),
            f"{alt.simulated_bubble:.0%}",
            f"{alt.memory_bytes / 1e6:.1f}",
        )
    return table


def _ranks(ranks: list[int]) -> str:
    """``0-12`` for consecutive ranks, else a comma list."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
