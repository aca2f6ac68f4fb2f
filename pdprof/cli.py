"""pdprof's command line: profile (the default), zoo, import-pipedream, show."""

from __future__ import annotations

from pdprof.cmd_import import import_pipedream
from shared.cli import tool_group

main = tool_group(
    "pdprof",
    "Profile a PyTorch model into a layer graph (JSON, stdout or -o) and a profile table (Parquet).\n\n"
    "Run `pdprof --model SPEC --data SPEC --batch-size N` to profile; the subcommands below do the rest.",
    default_command="profile",
)
main.add_command(import_pipedream)


def _register_optional() -> None:
    # Commands whose modules land separately; each registers itself when present.
    import importlib

    for module, attr in (("pdprof.cmd_profile", "profile"), ("pdprof.cmd_zoo", "zoo"), ("pdprof.cmd_show", "show")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        main.add_command(getattr(mod, attr))


_register_optional()
