"""bench.measure: pdrun's metrics read back as the planner counts time per minibatch."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from bench.measure import pdrun_timing


def test_time_per_minibatch_counts_every_replica_of_the_input_stage(tmp_path: Path) -> None:
    # Two replicas of one stage (ranks 0, 1): each step, each trains one minibatch of 64 in 0.5 s.
    # Per step 128 samples in 0.5 s: 0.25 s a minibatch, not the 0.5 s of seconds / steps.
    rows = [
        {"step": s, "stage": 0, "rank": r, "samples_per_s": 64 / 0.5, "wall_s": 0.5, "loss": 1.0}
        | {"compute_s": 0.4, "comm_s": 0.05, "idle_s": 0.05}
        for s in range(6)
        for r in (0, 1)
    ]
    path = tmp_path / "run.parquet"
    pd.DataFrame(rows).to_parquet(path)
    t = pdrun_timing(path, warmup_steps=2)
    assert (t.steps, t.samples, t.seconds) == (4, 4 * 128, pytest.approx(2.0))
    assert t.seconds_per_minibatch(64) == pytest.approx(2.0 / 8)
