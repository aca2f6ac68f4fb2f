"""``pdplan schema`` and ``pdplan validate``: the plan's JSON Schema, and checking a plan by hand."""

from __future__ import annotations

import click

from shared.cli import console
from shared.errors import PlanError
from shared.graph import load_graph
from shared.io import display_name
from shared.plan import Plan, check_against_graph, load_plan, plan_schema


def check_cluster(p: Plan, source: str) -> None:
    """The cluster a plan records must have as many workers as the plan has ranks."""
    mismatch = p.cluster_mismatch()
    if mismatch is not None:
        raise PlanError(f"{source}: {mismatch}; make them agree (or remove cluster to skip this check)")


@click.command("schema")
def schema() -> None:
    """Print the JSON Schema of pdplan.plan/1 (for editors and validators)."""
    click.echo(plan_schema(), nl=False)


@click.command("validate")
@click.argument("plan", default="-")
@click.option(
    "--graph", "graph_path", required=True, metavar="GRAPH", help="The layer graph the plan is for."
)
def validate(plan: str, graph_path: str) -> None:
    """Check PLAN (a path or -) on its own and against GRAPH: every layer once, convex stages, the hash.

    \b
    Example:
      pdplan validate plan.json --graph graph.json
    """
    p = load_plan(plan)
    g = load_graph(graph_path)
    check_against_graph(p, g, display_name(plan))
    check_cluster(p, display_name(plan))
    console.print(
        f"[green]ok[/]: {display_name(plan)}: {len(p.stages)} stages on {p.world_size} ranks cover all "
        f"{len(g.nodes)} layers of {display_name(graph_path)}"
    )
