"""pdplan's command line: plan (the default), show, schema, validate."""

from __future__ import annotations

from shared.cli import tool_group

main = tool_group(
    "pdplan",
    "Partition a layer graph into pipeline stages with PipeDream's optimizer and write a stage plan.\n\n"
    "Run `pdplan GRAPH --workers N --bandwidth B` (GRAPH or - for stdin); the subcommands below do the rest.",
    default_command="plan",
    lazy={
        "plan": ("pdplan.cmd_plan:plan", "Plan stages for a cluster (the default command)."),
        "show": ("pdplan.cmd_show:show", "Show a plan: stages, replicas, predictions."),
        "schema": ("pdplan.cmd_tools:schema", "Print the plan's JSON Schema."),
        "validate": ("pdplan.cmd_tools:validate", "Check a plan against its layer graph."),
    },
)
