"""``pdprof zoo``: list the built-in models and datasets."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from shared.cli import console


def _shape(desc: Any) -> str:
    """A sample's structure (``pdprof.zoo_catalog.describe``) in a table cell."""
    if isinstance(desc, list):
        return "(" + ", ".join(_shape(d) for d in desc) + ")"
    if set(desc) == {"shape", "dtype"}:
        return f"{desc['dtype']} {tuple(desc['shape'])}"
    if set(desc) == {"type"}:
        return str(desc["type"])
    return ", ".join(f"{key} {_shape(value)}" for key, value in desc.items())  # a dict sample's fields


def _render(listing: dict[str, Any]) -> None:
    models = Table(title="models (zoo:NAME; --model-arg key=value)", title_justify="left")
    for col in ("name", "parameters", "small", "input", "dataset"):
        models.add_column(col, justify="right" if col in ("parameters", "small") else "left")
    for m in listing["models"]:
        models.add_row(
            m["name"], f"{m['parameters']:,}", f"{m['small_parameters']:,}", m["input"], m["dataset"] or "-"
        )
    datasets = Table(title="datasets (zoo:NAME; --data-arg key=value)", title_justify="left")
    for col in ("name", "train", "val", "input", "target"):
        datasets.add_column(col, justify="right" if col in ("train", "val") else "left")
    for d in listing["datasets"]:
        datasets.add_row(
            d["name"],
            f"{d['samples']['train']:,}",
            f"{d['samples']['val']:,}",
            _shape(d["input"]),
            _shape(d["target"]),
        )
    console.print(models)
    console.print(
        "[dim]small: the parameters with the small arguments tests and demos use (pdprof zoo --json)[/]"
    )
    console.print(datasets)


@click.command("zoo")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the listing as JSON on stdout (tables go to stderr)."
)
def zoo(as_json: bool) -> None:
    """List the built-in models (parameter counts, expected input, paired dataset) and datasets (sizes, shapes).

    \b
    Example:
      pdprof zoo
      pdprof zoo --json | jq '.models[] | {name, parameters}'
    """
    from pdprof.zoo_catalog import catalog  # the zoo's models import torch: not for `pdprof zoo --help`

    listing = catalog()
    if as_json:
        click.echo(json.dumps(listing, indent=2))
    else:
        _render(listing)
