"""The command-line start-up benchmark runs every command it times and judges each against its target."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from bench.bench_cli import Config, Rounds, bench, wall_s


def test_every_command_runs_and_is_judged(tmp_path: Path) -> None:
    report = bench(tmp_path, Config(rounds=1, runs=1))
    names = [f.name for f in report.figures]
    assert names == [
        "wall time, pdprof --help",
        "wall time, pdplan --help",
        "wall time, pdrun --help",
        "wall time, pdplan on AlexNet (PipeDream's profile, 4 workers)",
    ]
    assert all(math.isfinite(f.value) and f.value > 0 and f.meets is not None for f in report.figures)
    assert [f.target for f in report.figures] == ["<= 0.3", "<= 0.3", "<= 0.3", "<= 0.5"]
    assert (tmp_path / "plan-alexnet-cli.json").is_file()  # the plan it timed was written


def test_a_failing_command_is_an_error_not_a_fast_figure(tmp_path: Path) -> None:
    from bench.bench_cli import _tool

    with pytest.raises(RuntimeError, match="exited 2"):
        wall_s([_tool("pdplan"), str(tmp_path / "missing.json"), "--workers", "2", "--bandwidth", "1e9"])


def test_rounds_are_taken_when_asked_and_a_failure_waits_for_the_report(tmp_path: Path) -> None:
    # make bench takes a round between benchmarks: the figure is the median of the rounds taken, and its
    # noise spans all of them.
    rounds = Rounds(tmp_path, Config(rounds=1, runs=1))
    for _ in range(3):
        rounds.take()
    report = rounds.report("between the benchmarks")
    assert [len(r["rounds_s"].split()) for r in report.tables["cli"]] == [3, 3, 3, 3]
    assert all(f.noise is not None for f in report.figures)
    assert "median of 3 rounds, between the benchmarks" in report.notes[0]

    broken = Rounds(tmp_path / "missing" / "folder", Config(rounds=1, runs=1))
    broken.take()  # the AlexNet graph cannot be written: kept, not raised, so the next benchmark runs
    broken.take()
    with pytest.raises(subprocess.CalledProcessError):
        broken.report("between the benchmarks")
