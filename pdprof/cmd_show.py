"""``pdprof show``: a layer graph as a table for a person (on stderr, like all human output)."""

from __future__ import annotations

import click

from pdprof.report import WIDE_COLUMNS, render
from shared.cli import console
from shared.graph import load_graph
from shared.io import display_name


@click.command("show")
@click.argument("graph", default="-", metavar="GRAPH")
@click.option(
    "--top",
    default=5,
    show_default=True,
    type=click.IntRange(min=0),
    help="How many heaviest layers to list.",
)
@click.option(
    "--sort",
    "order",
    type=click.Choice(["graph", "time"]),
    default="graph",
    show_default=True,
    help="Row order: the graph's (topological) order, or by forward+backward time.",
)
@click.option(
    "--wide/--narrow",
    default=None,
    help="Show kind, target and output shape columns (default: when the terminal is wide enough).",
)
def show(graph: str, top: int, order: str, wide: bool | None) -> None:
    """Render GRAPH (a pdprof.graph/1 file, or - for stdin) as a table of layers.

    \b
    Examples:
      pdprof show graph.json
      pdprof import-pipedream vgg16.txt | pdprof show - --sort time --top 10
    """
    loaded = load_graph(graph)
    console.print(
        render(
            loaded,
            display_name(graph),
            top=top,
            order=order,
            wide=wide if wide is not None else console.width >= WIDE_COLUMNS,
        )
    )
