"""What a stopped run keeps (pdrun/stopped.py): each rank's rows cut to the steps every rank finished."""

from __future__ import annotations

from pdrun.result import WorkerResult
from pdrun.step_rows import StepRows
from pdrun.stopped import common_steps


def _result(rank: int, steps: int, ragged: bool = False) -> WorkerResult:
    rows = StepRows()
    for step in range(steps):
        rows.append({"step": step, "rank": rank, "loss": 1.0 / (step + 1)})
    if ragged:
        rows.columns["step"].append(steps)  # the signal landed between two columns' appends
    return WorkerResult(
        rank=rank, stage=rank, replica=0, steps=steps, units=steps * 2, wall_s=1.0, rows=rows, events=[]
    )


def test_every_rank_is_cut_to_the_steps_all_finished() -> None:
    kept = common_steps([_result(0, 5), _result(1, 3, ragged=True)], units_per_step=2)
    assert [(r.steps, r.units, [row["step"] for row in r.rows]) for r in kept] == [(3, 6, [0, 1, 2])] * 2
    assert all(len(set(map(len, r.rows.columns.values()))) == 1 for r in kept)  # type: ignore[attr-defined]


def test_a_rank_that_finished_no_step_leaves_nothing_to_write() -> None:
    # pdrun then writes no metrics and no summary (it wrote "stopped after 0 steps" and an empty table).
    kept = common_steps([_result(0, 4), _result(1, 0)], units_per_step=1)
    assert [len(r.rows) for r in kept] == [0, 0] and all(r.steps == 0 for r in kept)
