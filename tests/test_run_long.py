"""A run of a million steps starts as soon as a short one, and ``--steps`` counts optimizer steps.

Each rank generates its own instructions as it runs them and validates a bounded window
of the program (shared/schedule.py, shared/schedule_check.py): nothing grows with the
run's length. Before, every process built and validated every worker's program for the
whole run, and ``--steps 100000`` never reached its first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdrun.cli import main
from pdrun.plans import cut_plan
from shared.plan import save_plan
from shared.tables import RUN_METRICS, load_table
from tests.test_reliability_failures import error_lines, marked_processes, run_pdrun
from tests.test_reliability_resume import make_plan
from tests.test_run_flush import RESMLP

STOP = 12  # the injected fault stops the run in the forward of this global unit


@pytest.mark.serial  # times the machine: run alone (Makefile)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-flush"])
def test_a_million_steps_reach_their_first_steps_as_fast_as_a_hundred(tmp_path: Path, schedule: str) -> None:
    plan = make_plan(tmp_path, schedule)
    seconds = {}
    for steps in (100, 1_000_000):
        args = [str(plan), "--steps", str(steps), "-q", "--no-val"]
        done, seconds[steps], mark = run_pdrun(args, {"PIPEDREAM_FAULT": f"raise:0:{STOP}"}, timeout=200)
        # It trained up to the fault: the run started, whatever its length.
        assert done.returncode == 1, done.stderr
        assert error_lines(done.stderr) == [
            f"pdrun: error: worker rank 0 failed: InjectedFault: injected fault at unit {STOP}"
        ], done.stderr
        assert marked_processes(mark) == []
    # Start-up does not grow with --steps (before: minutes at 10^5, hours at 10^6).
    assert seconds[1_000_000] < 1.5 * seconds[100] + 5, seconds


@pytest.mark.timeout(200)
def test_steps_of_a_replicated_1f1b_plan_are_optimizer_steps(tmp_path: Path) -> None:
    # Data parallelism on 2 workers under 1f1b: a step is one all-reduced update of 2 units.
    plan = cut_plan(RESMLP, [], batch_size=8, schedule="1f1b", replicas=[2])
    path = tmp_path / "dp.json"
    save_plan(plan, path)
    metrics = tmp_path / "run.parquet"
    res = CliRunner().invoke(main, [str(path), "-q", "--no-val", "--steps", "6", "--metrics", str(metrics)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["steps"] == 6 and summary["units"] == 12  # before: steps 3, units 6
    df, _ = load_table(metrics, RUN_METRICS)
    for rank in (0, 1):
        assert df[df["rank"] == rank]["step"].tolist() == list(range(6))
