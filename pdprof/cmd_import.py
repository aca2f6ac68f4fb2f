"""``pdprof import-pipedream``: a PipeDream profile file becomes our layer graph."""

from __future__ import annotations

import click

from pdprof.pipedream_import import parse_pipedream
from shared.cli import say
from shared.graph import graph_json
from shared.io import display_name, read_text, write_output


@click.command("import-pipedream")
@click.argument("profile", default="-", metavar="GRAPH_TXT")
@click.option(
    "-o", "--output", "out", default=None, metavar="FILE", help="Write the graph here (default: stdout)."
)
@click.option(
    "--batch-size",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="The batch size the profile was taken at (PipeDream's files do not record it).",
)
def import_pipedream(profile: str, out: str | None, batch_size: int) -> None:
    """Convert PipeDream's profile file GRAPH_TXT (or - for stdin) into a pdprof.graph/1 layer graph.

    \b
    Example:
      pdprof import-pipedream vgg16.txt -o vgg16.json
      pdprof import-pipedream vgg16.txt | pdplan --workers 16 --bandwidth 1e9
    """
    text = read_text(profile, "a PipeDream profile (graph.txt)")
    graph = parse_pipedream(text, display_name(profile), batch_size=batch_size)
    write_output(graph_json(graph), out)
    say(
        f"pdprof: imported {len(graph.nodes)} layers and {len(graph.edges)} edges from "
        f"{display_name(profile)}" + (f" -> {out}" if out else "")
    )
