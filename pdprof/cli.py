"""pdprof's command line: profile (the default), zoo, import-pipedream, show."""

from __future__ import annotations

from shared.cli import tool_group

main = tool_group(
    "pdprof",
    "Profile a PyTorch model into a layer graph (JSON, stdout or -o) and a profile table (Parquet).\n\n"
    "Run `pdprof --model SPEC --data SPEC --batch-size N` to profile; the subcommands below do the rest.",
    default_command="profile",
    lazy={
        "profile": ("pdprof.cmd_profile:profile", "Profile a model (the default command)."),
        "zoo": ("pdprof.cmd_zoo:zoo", "List the built-in models and datasets."),
        "import-pipedream": (
            "pdprof.cmd_import:import_pipedream",
            "Convert a PipeDream profile (graph.txt).",
        ),
        "show": ("pdprof.cmd_show:show", "Show a layer graph as a table of layers."),
    },
)
