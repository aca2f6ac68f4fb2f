"""pdplan's command line: the pipe from pdprof, -o, show, validate and its errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdplan.report import recost
from shared.graph import load_graph
from shared.plan import load_plan

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}


def _run(args: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, input=stdin, capture_output=True, env=ENV, timeout=120)


@pytest.fixture(scope="module")
def vgg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vgg") / "vgg16.json"
    done = _run([str(BIN / "pdprof"), "import-pipedream", str(PROFILES / "vgg16.txt"), "-o", str(out)])
    assert done.returncode == 0, done.stderr.decode()
    return out


def test_pipe_from_pdprof_to_show() -> None:
    cmd = (
        f"{BIN / 'pdprof'} import-pipedream {PROFILES / 'vgg16.txt'} | "
        f"{BIN / 'pdplan'} --workers 16 --bandwidth 1e9 | {BIN / 'pdplan'} show -"
    )
    done = subprocess.run(cmd, shell=True, capture_output=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    err = done.stderr.decode()
    assert "speedup over data parallelism" in err
    assert "stage  0" in err and "rank" in err  # the diagram
    assert "pdplan: <stdin>: " in err  # the one-line summary of the planning step


def test_plan_to_file_and_validate(vgg: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = _run(
        [
            str(BIN / "pdplan"),
            str(vgg),
            "--workers",
            "4,2",
            "--bandwidth",
            "1e10,1e9",
            "--schedule",
            "1f1b-flush",
            "-o",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == b""
    plan = json.loads(out.read_text())
    assert plan["format"] == "pdplan.plan/1"
    assert plan["world_size"] == 8 and plan["schedule"] == "1f1b-flush"
    # Flush schedules default M to one unit per stage, rounded up to a multiple of every replica count.
    m, replicas = plan["microbatches"], [s["replicas"] for s in plan["stages"]]
    assert m >= len(replicas) and all(m % r == 0 for r in replicas)
    assert m - math.lcm(*replicas) < len(replicas)  # the smallest such
    assert [lv["workers"] for lv in plan["cluster"]["levels"]] == [4, 2]
    assert plan["predicted"]["speedup_over_data_parallel"] > 0
    ok = _run([str(BIN / "pdplan"), "validate", str(out), "--graph", str(vgg)])
    assert ok.returncode == 0 and b"ok" in ok.stderr


def test_hand_edited_plan_errors_name_stage_and_layer(vgg: Path, tmp_path: Path) -> None:
    done = _run([str(BIN / "pdplan"), str(vgg), "--workers", "4", "--bandwidth", "1e9", "--straight"])
    plan = json.loads(done.stdout)
    assert len(plan["stages"]) == 4
    # Move the last layer of stage 1 back into stage 0: a tensor now flows from stage 1 to stage 0.
    moved = plan["stages"][1]["layers"].pop()
    plan["stages"][0]["layers"].append(moved)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(plan))
    bad = _run([str(BIN / "pdplan"), "validate", str(edited), "--graph", str(vgg)])
    assert bad.returncode == 2
    msg = bad.stderr.decode()
    assert "not convex" in msg and "stages[" in msg and "layer" in msg
    assert "Traceback" not in msg


def test_show_recosts_a_hand_edited_plan(vgg: Path, tmp_path: Path) -> None:
    done = _run([str(BIN / "pdplan"), str(vgg), "--workers", "4", "--bandwidth", "1e9", "--straight"])
    plan = json.loads(done.stdout)
    graph = load_graph(vgg)
    g = graph.to_networkx()
    # Move a layer of a later stage whose inputs all come from earlier stages back one stage:
    # still convex, but no longer the optimum.
    owner = {layer: s for s, st in enumerate(plan["stages"]) for layer in st["layers"]}
    s, layer = next(
        (s, layer)
        for s, st in enumerate(plan["stages"])
        if s > 0 and len(st["layers"]) > 1
        for layer in st["layers"]
        if all(owner[p] < s for p in g.predecessors(layer))
    )
    plan["stages"][s]["layers"].remove(layer)
    plan["stages"][s - 1]["layers"].append(layer)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(plan))
    shown = _run([str(BIN / "pdplan"), "show", str(edited), "--graph", str(vgg)])
    assert shown.returncode == 0, shown.stderr.decode()
    assert b"re-costed from" in shown.stderr
    _, bottleneck, _ = recost(load_plan(edited), graph)
    assert bottleneck >= plan["predicted"]["time_per_minibatch_s"] * (1 - 1e-12)


def test_usage_errors_exit_2(vgg: Path) -> None:
    def pdplan(*args: str) -> subprocess.CompletedProcess[bytes]:
        return _run([str(BIN / "pdplan"), str(vgg), "--workers", *args])

    levels = pdplan("4,2", "--bandwidth", "1e9")
    assert levels.returncode == 2 and b"one bandwidth per level" in levels.stderr
    memory = pdplan("4", "--bandwidth", "1e9", "--straight", "--memory", "1e3")
    assert memory.returncode == 2 and b"--memory" in memory.stderr
    assert b"Traceback" not in memory.stderr
    # --synchronous filters the search; beside a named schedule it would do nothing, so it is refused.
    named = pdplan("4", "--bandwidth", "1e9", "--schedule", "gpipe", "--synchronous")
    assert named.returncode == 2 and named.stderr.decode().splitlines() == [
        "pdplan: error: --synchronous chooses among schedules (--schedule auto); --schedule gpipe names one "
        "(see pdplan plan --help)"
    ]


def test_validate_refuses_a_cluster_that_disagrees_with_the_ranks(vgg: Path, tmp_path: Path) -> None:
    done = _run([str(BIN / "pdplan"), str(vgg), "--workers", "4,2", "--bandwidth", "1e10,1e9"])
    plan = json.loads(done.stdout)
    plan["cluster"]["levels"][0]["workers"] = 2
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(plan))
    bad = _run([str(BIN / "pdplan"), "validate", str(edited), "--graph", str(vgg)])
    assert bad.returncode == 2
    assert b"cluster.levels: 2 x 2 = 4 workers but world_size is 8" in bad.stderr


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_a_flush_plan_of_replicas_defaults_to_a_unit_per_replica(tmp_path: Path, schedule: str) -> None:
    # AlexNet on 2 workers at 1e12 B/s is data parallel (one stage, 2 replicas). The former default,
    # one unit per stage, gave M=1: the replicas took turns (a 40% bubble in pdplan's own simulation).
    graph, out = tmp_path / "alexnet.json", tmp_path / "plan.json"
    assert (
        _run(
            [str(BIN / "pdprof"), "import-pipedream", str(PROFILES / "alexnet.txt"), "-o", str(graph)]
        ).returncode
        == 0
    )
    done = _run(
        [
            str(BIN / "pdplan"),
            str(graph),
            "--workers",
            "2",
            "--bandwidth",
            "1e12",
            "--schedule",
            schedule,
            "-o",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr
    plan = load_plan(out)
    assert [s.replicas for s in plan.stages] == [2]
    assert plan.microbatches == 2


def test_a_cpu_profile_taken_alone_is_noted_when_workers_share_a_host(vgg: Path, tmp_path: Path) -> None:
    # A CPU profile records how many busy workers it was taken beside (graph.concurrent); planning more
    # workers on one host than that says so, once, and how to profile as they will run.
    data = json.loads(vgg.read_text())
    for concurrent, workers, noted in [(1, 2, True), (2, 2, False), (1, 1, False), (2, 4, True)]:
        data["device"], data["graph"]["concurrent"] = "cpu", concurrent
        graph = tmp_path / f"cpu-{concurrent}.json"
        graph.write_text(json.dumps(data))
        done = _run(
            [
                *(str(BIN / "pdplan"), str(graph), "--workers", str(workers), "--bandwidth", "1e9"),
                *("--schedule", "1f1b", "-o", str(tmp_path / "plan.json")),
            ]
        )
        assert done.returncode == 0, done.stderr.decode()
        err = done.stderr.decode()
        assert (f"pdprof --concurrent {workers} profiles as they will run" in err) is noted, err
    # A GPU profile's workers have a device each: nothing to say.
    assert (
        "note:"
        not in _run(
            [str(BIN / "pdplan"), str(vgg), "--workers", "2", "--bandwidth", "1e9", "--schedule", "1f1b"]
        ).stderr.decode()
    )
