"""pdrun's command line: run (the default), schedule and link."""

from __future__ import annotations

from shared.cli import tool_group

main = tool_group(
    "pdrun",
    "Train with a stage plan: launch one worker per rank and run its pipeline schedule.\n\n"
    "Run `pdrun PLAN` (PLAN or - for stdin); the subcommands below do the rest.",
    default_command="run",
    lazy={
        "run": ("pdrun.cmd_run:run", "Train with a plan (the default command)."),
        "schedule": ("pdrun.cmd_schedule:schedule", "Draw a schedule's grid of instructions."),
        "link": ("pdrun.cmd_link:link", "Measure bandwidth and latency between two workers on this machine."),
    },
    before={"run": "pdrun.preload:warm_for_run"},
)
