"""pdrun.step_rows: a worker's per-step rows as columns, read back as the dicts they were."""

from __future__ import annotations

import math
import pickle

import pytest

from pdrun.step_rows import StepRows


def _row(step: int) -> dict[str, float | int]:
    return {
        "step": step,
        "loss": math.nan if step % 2 else 0.5 * step,
        "rank": 1,
        "versions": 2,
        "wall_s": 1e-3,
    }


def test_rows_read_back_equal_with_integers_kept() -> None:
    rows = StepRows()
    for i in range(5):
        rows.append(_row(i))
    assert len(rows) == 5
    back = list(rows)
    assert [r["step"] for r in back] == [0, 1, 2, 3, 4] and all(type(r["step"]) is int for r in back)
    assert back[2] == _row(2) and math.isnan(back[1]["loss"])
    assert rows[-1] == _row(4) and rows[1:3][0]["step"] == 1
    with pytest.raises(IndexError):
        rows[5]
    with pytest.raises(ValueError, match="differ"):
        rows.append({"step": 5})


def test_a_million_steps_take_machine_numbers_not_dicts() -> None:
    # 17 fields as pdrun's worker records them: 8 bytes each, where a dict per step took ~0.8 KB.
    fields = {f"f{i}": 0.0 for i in range(12)} | {
        "step": 0,
        "rank": 0,
        "stage": 0,
        "replica": 0,
        "versions": 1,
    }
    rows = StepRows()
    for i in range(1_000_000):
        fields["step"] = i
        rows.append(fields)
    size = len(pickle.dumps(rows))  # what the gather to rank 0 sends
    assert size < 1_000_000 * 17 * 8 * 1.05, size
    assert rows[999_999]["step"] == 999_999
