"""The three installed command lines: --help, --version, one-line errors, a terminal on stdin, the schema.

The console scripts in the virtual environment run as real subprocesses, all started
together (pdprof and pdrun import torch, which takes seconds each), with a timeout so that
a command waiting on a terminal fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from pdplan.cli import main as pdplan_main
from pdprof.cli import main as pdprof_main
from pdrun.cli import main as pdrun_main
from pdrun.plans import cut_plan
from shared.plan import Plan, Stage, StagePrediction, save_plan
from shared.spec import RunSpec
from shared.version import __version__

BIN = Path(sys.executable).parent
TOOLS = ("pdprof", "pdplan", "pdrun")


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    stdin: bytes | None = None  # None: a pseudo-terminal
    closed: bool = False  # start with standard input closed instead


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str


CASES = {
    **{f"{tool} --version": Case((tool, "--version"), b"") for tool in TOOLS},
    "empty object to pdplan show": Case(("pdplan", "show", "-"), b"{}\n"),
    "not json to pdrun": Case(("pdrun", "-"), b"not json\n"),
    "debug traceback": Case(("pdplan", "--debug", "show", "-"), b"{}\n"),
    "terminal to pdplan show": Case(("pdplan", "show")),
    "terminal to pdrun": Case(("pdrun", "-")),
    "closed stdin to pdplan show": Case(("pdplan", "show", "-"), closed=True),
    "schema": Case(("pdplan", "schema"), b""),
}


def _run(case: Case) -> Result:
    exe = str(BIN / case.argv[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("PIPEDREAM_DEBUG", None)
    if case.closed:
        done = subprocess.run(
            [exe, *case.argv[1:]], preexec_fn=lambda: os.close(0), capture_output=True, timeout=180, env=env
        )
    elif case.stdin is not None:
        done = subprocess.run(
            [exe, *case.argv[1:]], input=case.stdin, capture_output=True, timeout=180, env=env
        )
    else:
        controller, terminal = pty.openpty()
        try:
            done = subprocess.run(
                [exe, *case.argv[1:]], stdin=terminal, capture_output=True, timeout=180, env=env
            )
        finally:
            os.close(terminal)
            os.close(controller)
    return Result(done.returncode, done.stdout.decode(), done.stderr.decode())


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    with ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        futures = {name: pool.submit(_run, case) for name, case in CASES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("tool", TOOLS)
def test_version(results: dict[str, Result], tool: str) -> None:
    r = results[f"{tool} --version"]
    assert (r.code, r.stdout.strip()) == (0, f"{tool} {__version__}")


@pytest.mark.parametrize("tool", TOOLS)
def test_help_lists_the_commands(tool: str) -> None:
    main = {"pdprof": pdprof_main, "pdplan": pdplan_main, "pdrun": pdrun_main}[tool]
    result = CliRunner().invoke(main, ["--help"], prog_name=tool)
    assert result.exit_code == 0, result.output
    assert f"Usage: {tool} [OPTIONS] COMMAND [ARGS]..." in result.stdout
    assert "--version" in result.stdout and "--debug" in result.stdout
    for name in main.commands:
        assert f"  {name} " in result.stdout
        sub = CliRunner().invoke(main, [name, "--help"], prog_name=tool)
        assert sub.exit_code == 0 and f"Usage: {tool} {name}" in sub.stdout


def test_empty_object_to_pdplan_show_is_one_line(results: dict[str, Result]) -> None:
    r = results["empty object to pdplan show"]
    assert r.code == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "pdplan: error: <stdin>: format: required field is missing (expected 'pdplan.plan/1')"
    ]


def test_not_json_to_pdrun_is_one_line(results: dict[str, Result]) -> None:
    r = results["not json to pdrun"]
    assert r.code == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "pdrun: error: <stdin>: not valid JSON at line 1 column 1: Expecting value (expected a stage plan (pdplan.plan/1))"
    ]


def test_debug_shows_the_traceback(results: dict[str, Result]) -> None:
    r = results["debug traceback"]
    assert r.code == 2
    assert "Traceback (most recent call last)" in r.stderr and "ArtifactError" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("pdplan: error: <stdin>: format:")


@pytest.mark.parametrize(
    ("name", "tool"), [("terminal to pdplan show", "pdplan"), ("terminal to pdrun", "pdrun")]
)
def test_a_terminal_on_stdin_is_refused_with_a_hint(results: dict[str, Result], name: str, tool: str) -> None:
    r = results[name]
    assert r.code == 2
    assert r.stderr.splitlines() == [
        f"{tool}: error: expected a stage plan (pdplan.plan/1) on standard input, but it is a terminal: "
        "pass a file, or pipe one in (e.g. `pdprof ... | pdplan ...`)"
    ]


def test_a_closed_stdin_is_refused(results: dict[str, Result]) -> None:
    r = results["closed stdin to pdplan show"]
    assert r.code == 2
    assert r.stderr.splitlines() == [
        "pdplan: error: expected a stage plan (pdplan.plan/1) on standard input, but it is closed: pass a file instead"
    ]


# --- pdplan schema --------------------------------------------------------------------------


def _valid_plan() -> dict[str, Any]:
    plan = Plan(
        graph_hash="sha256:" + "ab" * 32,
        batch_size=32,
        schedule="1f1b",
        world_size=3,
        stages=[
            Stage(
                layers=["input", "conv1"],
                replicas=2,
                ranks=[0, 1],
                predicted=StagePrediction(compute_s=0.1, time_s=0.06),
            ),
            Stage(layers=["fc"], ranks=[2]),
        ],
    )
    return json.loads(plan.model_dump_json())  # type: ignore[no-any-return]


def _broken(change: str) -> dict[str, Any]:
    plan = _valid_plan()
    if change == "no stages":
        del plan["stages"]
    elif change == "empty stages":
        plan["stages"] = []
    elif change == "zero replicas":
        plan["stages"][1]["replicas"] = 0
    elif change == "negative compute":
        plan["stages"][0]["predicted"]["compute_s"] = -1
    elif change == "unknown schedule":
        plan["schedule"] = "2bw-fast"
    elif change == "typo field":
        plan["stages"][0]["replica"] = 2
    elif change == "bad hash":
        plan["graph_hash"] = "md5:1234"
    elif change == "other format":
        plan["format"] = "pdplan.plan/2"
    elif change == "string batch size":
        plan["batch_size"] = "thirty-two"
    elif change == "layer not a string":
        plan["stages"][1]["layers"] = [3]
    return plan


@pytest.fixture(scope="module")
def schema(results: dict[str, Result]) -> dict[str, Any]:
    r = results["schema"]
    assert r.code == 0 and r.stderr == ""
    loaded: dict[str, Any] = json.loads(r.stdout)
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


def test_schema_accepts_a_valid_plan(schema: dict[str, Any]) -> None:
    assert schema["title"] == "pdplan.plan/1"
    jsonschema.Draft202012Validator(schema).validate(_valid_plan())


@pytest.mark.parametrize(
    "change",
    ["no stages", "empty stages", "zero replicas", "negative compute", "unknown schedule", "typo field",
     "bad hash", "other format", "string batch size", "layer not a string"],
)  # fmt: skip
def test_schema_rejects_a_broken_plan(schema: dict[str, Any], change: str) -> None:
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(_broken(change)))
    assert errors, f"the schema accepted a plan with {change}"


@pytest.mark.parametrize("tool", TOOLS)
def test_python_dash_m_runs_the_same_command_as_the_script(tool: str, tmp_path: Path) -> None:
    """``python -m pdplan`` (a GPU host's own Python, the tree on PYTHONPATH, no console scripts)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", tool, "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and __version__ in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", tool, "--no-such-option"], capture_output=True, text=True, timeout=60, env=env
    )
    assert bad.returncode == 2 and bad.stderr.startswith(f"{tool}: error:"), bad.stderr


def test_debug_is_taken_anywhere_on_the_line(tmp_path: Path) -> None:
    """The one-line errors say "rerun with --debug"; a user appends it, after the command's own options."""
    done = subprocess.run(
        [
            str(BIN / "pdplan"),
            str(tmp_path / "missing.json"),
            "--workers",
            "2",
            "--bandwidth",
            "1e9",
            "--debug",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" in done.stderr and "No such option" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("pdplan: error: ")


def test_an_output_that_would_fail_or_overwrite_an_input_is_refused_before_the_work(tmp_path: Path) -> None:
    # pdprof found a missing -o directory only after profiling (7 s of a small model, minutes of a real
    # one); pdplan -o graph.json replaced the graph with the plan, pdrun --metrics plan.json the plan with
    # Parquet, and pdprof -o model.py would have replaced the user's model.
    model = tmp_path / "m.py"
    model.write_text("import torch\ndef build():\n    return torch.nn.Linear(4, 2)\n")
    graph = tmp_path / "graph.json"
    graph.write_text("{}")
    plan = tmp_path / "plan.json"
    save_plan(cut_plan(RunSpec(model="zoo:resmlp", data="zoo:digits"), [], batch_size=8), plan)
    planned = plan.read_text()
    prof = ["--model", f"{model}:build", "--data", "zoo:synthetic", "--batch-size", "8"]
    cases = [
        (
            pdprof_main,
            [*prof, "-o", str(tmp_path / "nodir" / "g.json")],
            "-o {d}/nodir/g.json: directory {d}/nodir does not exist",
        ),
        (
            pdprof_main,
            [*prof, "-o", str(model)],
            "-o {d}/m.py: is the model file, which this would overwrite",
        ),
        (
            pdprof_main,
            [*prof, "-o", str(tmp_path / "t"), "--table", str(tmp_path / "t")],
            "-o {d}/t: is the --table output",
        ),
        (
            pdplan_main,
            [str(graph), "--workers", "2", "--bandwidth", "1e9", "-o", str(graph)],
            "-o {d}/graph.json: is the layer graph",
        ),
        (
            pdrun_main,
            [str(plan), "--metrics", str(plan)],
            "--metrics {d}/plan.json: is the plan, which this would overwrite",
        ),
    ]
    for tool, argv, expected in cases:
        res = CliRunner().invoke(tool, argv)
        assert res.exit_code == 2, (argv, res.output)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected.format(d=tmp_path) in lines[0], (argv, res.stderr)
    assert graph.read_text() == "{}" and "def build" in model.read_text() and plan.read_text() == planned


@pytest.mark.parametrize(("columns", "width"), [(None, 120), ("250", 250)])
def test_off_a_terminal_the_tables_take_columns_when_set(columns: str | None, width: int) -> None:
    # A new user's COLUMNS=250 was ignored with stderr not a terminal: pdplan show cut layer names to "model_…".
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    done = subprocess.run(
        [sys.executable, "-c", "from shared.cli import rich_console; print(rich_console().width)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(done.stdout) == width
