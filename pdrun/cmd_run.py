"""``pdrun PLAN``: load and check the plan, then train (the runtime lands in pdrun.runtime)."""

from __future__ import annotations

import click

from shared.errors import UserError
from shared.plan import load_plan


@click.command("run")
@click.argument("plan", default="-")
def run(plan: str) -> None:
    """Train with PLAN (a path or - for stdin)."""
    p = load_plan(plan)
    raise UserError(f"pdrun: the runtime for {p.schedule} is not built yet")
