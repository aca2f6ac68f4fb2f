"""Portable plans: file specs typed relative to one directory work from any other.

pdprof records a model file given relative to its working directory as an absolute path,
and a relative path in an artifact (a hand-written plan) is read against the artifact's own
folder, so ``pdrun /elsewhere/plan.json`` needs no particular working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.graph import load_graph
from shared.plan import load_plan, save_plan
from shared.spec import RunSpec, anchored_spec

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

NET = """
import torch
from torch import nn


def build(width=16):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
"""


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=ENV, timeout=150)


def test_relative_file_specs_are_anchored_to_a_folder() -> None:
    assert anchored_spec("../models.py:build", "/a/b") == "/a/models.py:build"
    assert anchored_spec("sub/net:build", "/a") == "/a/sub/net:build"  # a path without .py is a file too
    for untouched in ("zoo:resmlp", "pkg.models:build", "/abs/net.py:build", "cross_entropy"):
        assert anchored_spec(untouched, "/a") == untouched
    spec = RunSpec(model="net.py:build", data="data.py:train", loss="losses.py:loss").anchored("/p")
    assert (spec.model, spec.data, spec.loss) == ("/p/net.py:build", "/p/data.py:train", "/p/losses.py:loss")


@pytest.mark.timeout(300)
def test_profile_and_plan_with_a_relative_model_path_then_run_from_elsewhere(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "models").mkdir(parents=True)
    (project / "out").mkdir()
    elsewhere.mkdir()
    (project / "models" / "net.py").write_text(NET)
    model = [
        "--model",
        "models/net.py:build",
        "--data",
        "zoo:digits",
        "--batch-size",
        "16",
        "--concurrent",
        "1",
    ]
    done = _run(
        [str(BIN / "pdprof"), *model, "--warmup", "1", "--repeats", "2", "-o", "out/graph.json"], project
    )
    assert done.returncode == 0, done.stderr
    graph = load_graph(project / "out" / "graph.json")
    assert graph.spec.model == f"{project / 'models' / 'net.py'}:build"
    plan_args = [
        "out/graph.json",
        "--workers",
        "2",
        "--bandwidth",
        "1e6",
        "--straight",
        "-o",
        "out/plan.json",
    ]
    done = _run([str(BIN / "pdplan"), *plan_args], project)
    assert done.returncode == 0, done.stderr
    plan_path = project / "out" / "plan.json"
    assert json.loads(plan_path.read_text())["spec"]["model"] == f"{project / 'models' / 'net.py'}:build"
    for where in (str(plan_path), "../project/out/plan.json"):
        done = _run([str(BIN / "pdrun"), where, "--steps", "2", "-q", "--no-val"], elsewhere)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["steps"] == 2


def test_a_hand_written_relative_path_is_read_against_the_plans_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "net.py").write_text(NET)
    monkeypatch.chdir(tmp_path)
    from pdrun.plans import cut_plan

    plan = cut_plan(RunSpec(model="net.py:build", data="zoo:digits"), [2], batch_size=8)
    save_plan(plan, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["spec"]["model"] == "net.py:build"
    monkeypatch.chdir("/")
    assert load_plan(tmp_path / "plan.json").spec.model == f"{tmp_path / 'net.py'}:build"
