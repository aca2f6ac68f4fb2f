"""pdplan's command line: plan (the default), show, schema, validate."""

from __future__ import annotations

import importlib

from pdplan.cmd_tools import schema, validate
from shared.cli import tool_group

main = tool_group(
    "pdplan",
    "Partition a layer graph into pipeline stages with PipeDream's optimizer and write a stage plan.\n\n"
    "Run `pdplan GRAPH --workers N --bandwidth B` (GRAPH or - for stdin); the subcommands below do the rest.",
    default_command="plan",
)
main.add_command(schema)
main.add_command(validate)

for _module, _attr in (("pdplan.cmd_plan", "plan"), ("pdplan.cmd_show", "show")):
    try:
        main.add_command(getattr(importlib.import_module(_module), _attr))
    except ModuleNotFoundError as _exc:
        if _exc.name != _module:
            raise
