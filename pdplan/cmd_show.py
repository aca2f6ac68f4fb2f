"""``pdplan show``: a plan as a table of stages for a person."""

from __future__ import annotations

import click
from rich.table import Table

from shared.cli import console
from shared.io import display_name
from shared.plan import load_plan


@click.command("show")
@click.argument("plan", default="-")
def show(plan: str) -> None:
    """Render PLAN (a path or -) as a table of stages."""
    p = load_plan(plan)
    table = Table(title=f"{display_name(plan)}: {p.schedule}, {len(p.stages)} stages, {p.world_size} ranks")
    for column in ("stage", "layers", "replicas", "ranks"):
        table.add_column(column)
    for s, stage in enumerate(p.stages):
        first, last = stage.layers[0], stage.layers[-1]
        span = first if first == last else f"{first} .. {last} ({len(stage.layers)})"
        table.add_row(str(s), span, str(stage.replicas), ",".join(map(str, stage.ranks)))
    console.print(table)
