"""pdrun's command line: run (the default) and schedule."""

from __future__ import annotations

import importlib

from shared.cli import tool_group

main = tool_group(
    "pdrun",
    "Train with a stage plan: launch one worker per rank and run its pipeline schedule.\n\n"
    "Run `pdrun PLAN` (PLAN or - for stdin); the subcommands below do the rest.",
    default_command="run",
)

for _module, _attr in (("pdrun.cmd_run", "run"), ("pdrun.cmd_schedule", "schedule")):
    try:
        main.add_command(getattr(importlib.import_module(_module), _attr))
    except ModuleNotFoundError as _exc:
        if _exc.name != _module:
            raise
