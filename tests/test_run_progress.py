"""The progress bar shows the last step's real loss, also when the worker drawing it ran no unit in that step,
and the throughput of the last steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.plans import cut_plan
from pdrun.progress import RATE_STEPS, Progress
from shared.spec import RunSpec


def shown(progress: Progress) -> str:
    """The text the bar shows beside its count."""
    info: str = progress.bar.tasks[0].fields["info"]
    return info


@pytest.mark.timeout(120)
def test_the_bar_keeps_the_last_real_loss_when_its_replica_ran_no_unit(tmp_path: Path) -> None:
    # 1f1b-flush with one unit per step on a last stage of two replicas: replica 0 runs the units of the
    # even steps only, so its row of step 1 (the last) has no loss. Before the fix the bar ended "loss nan".
    spec = RunSpec(model="zoo:resmlp", model_args={"width": 32, "depth": 1}, data="zoo:digits")
    plan = cut_plan(spec, [2], batch_size=8, schedule="1f1b-flush", microbatches=1, replicas=[1, 2])
    results = launch(plan, RunConfig(steps=2, validate=False, timeout_s=60.0, progress=False))
    assert results is not None
    drawer = next(r for r in results if r.stage == 1 and r.replica == 0)  # the worker that draws the bar
    assert [row["step"] for row in drawer.rows] == [0, 1]
    assert not math.isnan(drawer.rows[0]["loss"]) and math.isnan(drawer.rows[1]["loss"])

    progress = Progress(RunConfig(progress=True), True, 2)
    progress.start()
    try:
        for row in drawer.rows:
            progress.step(row)
    finally:
        progress.close()
    assert progress.bar.tasks[0].completed == 2
    assert shown(progress).startswith(f"loss {drawer.rows[0]['loss']:.4f}  "), shown(progress)
    assert "nan" not in shown(progress)


def test_the_bar_shows_each_step_with_a_loss_and_the_rate_of_the_last_steps() -> None:
    progress = Progress(RunConfig(progress=True), True, 30)
    progress.start()
    try:
        progress.step({"loss": 2.5, "samples_per_s": 100.0, "wall_s": 1.0})
        assert shown(progress) == "loss 2.5000  100 samples/s"
        progress.step({"loss": 1.25, "samples_per_s": 80.0, "wall_s": 1.0})
        assert shown(progress) == "loss 1.2500  90 samples/s"  # 180 samples in 2 s, not the last step's 80
        progress.step({"loss": 1.0, "samples_per_s": 60.0, "wall_s": 2.0})
        assert shown(progress) == "loss 1.0000  75 samples/s"  # 300 samples in 4 s
        for _ in range(RATE_STEPS):
            progress.step({"loss": 0.5, "samples_per_s": 40.0, "wall_s": 1.0})
        assert shown(progress) == "loss 0.5000  40 samples/s"  # the first three steps are out of the window
    finally:
        progress.close()


def test_no_bar_under_quiet_or_off_the_drawing_worker() -> None:
    for cfg, show in ((RunConfig(progress=False), True), (RunConfig(progress=True), False)):
        progress = Progress(cfg, show, 3)
        progress.start()
        progress.step({"loss": 1.0, "samples_per_s": 1.0})  # nothing to draw on: no error either
        progress.close()
        assert progress.bar is None


def test_off_a_terminal_the_bar_prints_a_line_at_the_first_step_and_then_by_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Under pytest stderr is no terminal, as in a batch job's log: rich draws the bar only when it stops,
    # so without these lines a long run's log said nothing until its end.
    progress = Progress(RunConfig(progress=True), True, 1000, log_every_s=3600.0)
    progress.start()
    try:
        progress.step({"loss": 2.5, "samples_per_s": 100.0, "wall_s": 1.0})
        progress.step({"loss": 1.5, "samples_per_s": 100.0, "wall_s": 1.0})
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pdrun: step")]
        assert lines == [lines[0]] and lines[0].startswith("pdrun: step 1/1,000  loss 2.5000  100 samples/s")
        progress.log_every_s = 0.0  # every step is due
        progress.step({"loss": 0.75, "samples_per_s": 100.0, "wall_s": 1.0})
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pdrun: step")]
        assert len(lines) == 1 and lines[0].startswith("pdrun: step 3/1,000  loss 0.7500"), lines
    finally:
        progress.close()


def test_the_bar_of_a_replicated_stage_shows_the_runs_rate() -> None:
    # The drawing worker is one of its stage's 2 replicas, which share the units: its own rate was half
    # the closing line's (6,329 samples/s on the bar, 12,218 in the summary).
    progress = Progress(RunConfig(progress=True), True, 5, replicas=2)
    progress.start()
    try:
        progress.step({"loss": 1.0, "samples_per_s": 100.0, "wall_s": 1.0})
        assert shown(progress) == "loss 1.0000  200 samples/s"
    finally:
        progress.close()
