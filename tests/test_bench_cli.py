"""The command-line start-up benchmark runs every command it times and judges each against its target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.bench_cli import Config, bench, wall_s


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
