"""The run's shape (pdrun/shape.py): steps, segments and chunks, computed from the plan and the options alone."""

from __future__ import annotations

import itertools

import pytest

from pdrun.config import RunConfig
from pdrun.plans import cut_plan
from pdrun.shape import (
    Segments,
    chunk_lengths,
    chunks,
    effective_plan,
    segments,
    units_per_step,
    updates_per_step,
)
from shared.errors import UserError
from shared.plan import Plan
from shared.spec import RunSpec

SPEC = RunSpec(model="zoo:resmlp", model_args={"width": 16, "depth": 1}, data="zoo:digits")


@pytest.fixture(scope="module")
def replicated() -> Plan:
    """1f1b on a stage of 2 replicas and one of 3: a step is one round of lcm(2, 3) = 6 units."""
    return cut_plan(SPEC, [2], batch_size=8, schedule="1f1b", replicas=[2, 3])


def test_a_1f1b_step_is_a_round_of_lcm_replicas_units_and_each_stage_updates_lcm_over_r_times(
    replicated: Plan,
) -> None:
    assert units_per_step(replicated) == 6
    assert [updates_per_step(replicated, s) for s in (0, 1)] == [3, 2]
    flush = effective_plan(replicated, RunConfig(schedule="1f1b-flush", microbatches=4))
    assert (flush.schedule, flush.microbatches) == ("1f1b-flush", 4)
    assert units_per_step(flush) == 4 and [updates_per_step(flush, s) for s in (0, 1)] == [1, 1]


def test_segments_are_the_steps_or_whole_steps_of_each_epoch(replicated: Plan) -> None:
    assert segments(replicated, RunConfig(steps=3), per_epoch=100) == Segments((18,), False, 6)
    assert segments(replicated, RunConfig(steps=3), per_epoch=100).steps == 3
    by_epoch = segments(replicated, RunConfig(epochs=2), per_epoch=20)  # 20 units: 3 whole steps of 6
    assert by_epoch == Segments((18, 18), True, 6, 18) and by_epoch.steps == 6
    # Resumed 5 steps (30 units) in: the first segment finishes that epoch, and the run ends at an epoch's end.
    resumed = segments(replicated, RunConfig(epochs=2), per_epoch=20, start=30)
    assert resumed == Segments((6, 18), True, 6, 18) and resumed.epoch_at(54, 20) == 2
    with pytest.raises(
        UserError, match=r"one epoch holds 5 units of 8 samples, fewer than one step \(6 units\)"
    ):
        segments(replicated, RunConfig(), per_epoch=5)


def test_chunks_cut_a_segment_at_every_multiple_of_the_checkpoint_interval() -> None:
    assert list(chunks(10, 0, 4)) == [4, 4, 2]
    assert list(chunks(10, 3, 4)) == [1, 4, 4, 1]  # from global unit 3: up to 4, 8, 12, then the rest
    assert list(chunks(10, 0, 0)) == [10]
    assert list(chunks(8, 0, 4)) == [4, 4]


@pytest.mark.parametrize(
    ("lengths", "ups", "every"), list(itertools.product([(10,), (6, 6, 6), (7, 3)], [1, 2], [0, 1, 2, 3]))
)
def test_chunk_lengths_are_the_lengths_of_the_programs_the_run_cuts(
    lengths: tuple[int, ...], ups: int, every: int
) -> None:
    # chunk_lengths computes per segment what cutting every segment with chunks() gives, without cutting.
    segs = Segments(lengths, False, ups)
    base, cut = 0, set()
    for length in lengths:
        cut |= set(chunks(length, base, ups * every))
        base += length
    assert chunk_lengths(segs, RunConfig(checkpoint_every=every or None)) == cut
