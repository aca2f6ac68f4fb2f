"""pdprof show: every PipeDream profile imports and renders; a fresh profile renders with its timing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdprof.cli import main
from pdprof.pipedream_import import parse_pipedream
from pdprof.report import human_bytes
from tests.conftest import PROFILES

HERE = Path(__file__).resolve().parent
PIPEDREAM_FILES = sorted(PROFILES.glob("*.txt"))


def invoke(args: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args, input=stdin, env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


def test_there_are_pipedream_profiles() -> None:
    assert len(PIPEDREAM_FILES) >= 14


@pytest.mark.parametrize("path", PIPEDREAM_FILES, ids=lambda p: p.stem)
def test_every_pipedream_profile_imports_and_renders(path: Path) -> None:
    code, graph_json, err = invoke(["import-pipedream", str(path)])
    assert code == 0, err
    code, out, err = invoke(["show", "-", "--top", "3", "--sort", "time"], stdin=graph_json)
    assert code == 0, err
    assert out == ""  # the report is for a person: stderr
    graph = parse_pipedream(path.read_text(), str(path))
    heaviest = max(graph.nodes, key=lambda n: n.forward_ms + n.backward_ms)
    total = sum(n.forward_ms + n.backward_ms for n in graph.nodes)
    # every layer has a row, the footer counts them, and the heaviest layer leads both tables
    rows = re.findall(r"^│ (\S+) +│", err, flags=re.MULTILINE)
    assert set(rows) >= {node.id for node in graph.nodes}
    assert f"{len(graph.nodes)} layers" in err
    assert "heaviest 3 layers" in err
    share = f"{100 * (heaviest.forward_ms + heaviest.backward_ms) / total:.1f}%"
    lines = [line for line in err.splitlines() if line.startswith(f"│ {heaviest.id} ")]
    assert len(lines) == 2 and all(share in line for line in lines)
    assert human_bytes(sum(n.parameter_bytes for n in graph.nodes)) in err


def test_show_renders_a_profile_with_its_timing(tmp_path: Path) -> None:
    user = tmp_path / "model.py"
    shutil.copy(HERE / "test_profile_usermodel.py", user)
    out = tmp_path / "g.json"
    code, _, err = invoke(
        [
            "--model",
            f"{user}:build",
            "--data",
            f"{user}:data",
            "--batch-size",
            "8",
            "--repeats",
            "2",
            "-o",
            str(out),
        ]
    )
    assert code == 0, err
    code, _, err = invoke(["show", str(out), "--wide"])
    assert code == 0, err
    assert "batch 8, device cpu, 1 thread(s), 2 repeats" in err
    assert "ratio" in err and "perf_counter" in err
    assert "torch.cat" in err and "[8, 32]" in err  # the wide columns: target and output shape
    code, _, err = invoke(["show", str(out), "--narrow"])
    assert code == 0 and "torch.cat" not in err


def test_show_rejects_what_is_not_a_graph(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "pdplan.plan/1"}')
    code, _, err = invoke(["show", str(bad)])
    assert code == 2
    assert err.strip().splitlines() == [
        f"pdprof: error: {bad}: format: expected 'pdprof.graph/1', got 'pdplan.plan/1'"
    ]
