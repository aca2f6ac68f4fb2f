"""Fast command lines: each command imports what it needs, when it needs it.

``--help`` of the three tools and planning a PipeDream profile are run in a fresh
interpreter, which then reports the heavy packages it loaded (torch ~2 s, networkx ~0.3 s,
pandas and pyarrow ~0.3 s, rich ~50 ms): a check of the import set rather than of wall time,
which on a busy machine says little.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "networkx", "pandas", "pyarrow", "numpy", "rich", "pydantic", "scipy")

# Runs a tool's main in this interpreter, then writes which of HEAVY it imported to argv[1].
PROBE = """
import json, sys
out, module, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [module.split(".")[0], *argv]
main = __import__(module, fromlist=["main"]).main
try:
    main()
except SystemExit:
    pass
loaded = sorted(h for h in HEAVY if h in sys.modules)
open(out, "w").write(json.dumps(loaded))
""".replace("HEAVY", repr(HEAVY))


def imported(tmp_path: Path, module: str, *argv: str) -> list[str]:
    out = tmp_path / "loaded.json"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), module, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.exists(), done.stderr
    loaded: list[str] = json.loads(out.read_text())
    return loaded


@pytest.mark.parametrize("module", ["pdprof.cli", "pdplan.cli", "pdrun.cli"])
@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_and_version_import_nothing_heavy(tmp_path: Path, module: str, argv: list[str]) -> None:
    assert imported(tmp_path, module, *argv) == []


def test_pdrun_run_help_loads_the_plan_model_only(tmp_path: Path) -> None:
    # Before, `pdrun run --help` imported the runtime (torch, pandas): 4.5 s; now 0.5 s (2026-12-03).
    assert imported(tmp_path, "pdrun.cli", "run", "--help") == ["pydantic"]  # the plan's fields
    assert imported(tmp_path, "pdrun.cli", "plan.json", "--help") == ["pydantic"]  # the default command


@pytest.mark.parametrize("command", ["profile", "zoo"])
def test_pdprof_command_help_imports_no_torch(tmp_path: Path, command: str) -> None:
    # Before, `pdprof profile --help` imported the profiler (torch): 4.6 s; `pdprof zoo --help` the zoo, 2.7 s.
    loaded = imported(tmp_path, "pdprof.cli", command, "--help")
    assert "torch" not in loaded and "pandas" not in loaded and "networkx" not in loaded, loaded


def test_planning_a_pipedream_profile_imports_only_numpy_and_pydantic(
    tmp_path: Path, profiles_dir: Path
) -> None:
    graph, plan = tmp_path / "graph.json", tmp_path / "plan.json"
    loaded = imported(
        tmp_path, "pdprof.cli", "import-pipedream", str(profiles_dir / "alexnet.txt"), "-o", str(graph)
    )
    assert loaded == ["pydantic"]  # the artifact's validation
    loaded = imported(
        tmp_path, "pdplan.cli", str(graph), "--workers", "4", "--bandwidth", "1e9", "-o", str(plan)
    )
    assert plan.exists()
    assert loaded == ["numpy", "pydantic"]  # the DP's arrays, the artifacts
    loaded = imported(tmp_path, "pdplan.cli", "validate", str(plan), "--graph", str(graph))
    assert "networkx" not in loaded and "torch" not in loaded


def test_the_problem_without_networkx_is_the_problem_with_it(profiles_dir: Path) -> None:
    # pdplan builds its problem from the layer graph directly; networkx's version stays for callers
    # holding a DiGraph. Every published profile (branches, tuple sinks, inputs) gives the same one.
    from pdplan.problem import prepare, prepare_layers
    from pdprof.pipedream_import import parse_pipedream

    profiles = sorted(profiles_dir.glob("*.txt"))
    assert len(profiles) >= 15
    for path in profiles:
        graph = parse_pipedream(path.read_text(), str(path))
        assert prepare_layers(graph) == prepare(graph.to_networkx()), path.name
