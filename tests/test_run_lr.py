"""The learning rate of each optimizer step: the linear warm-up and the cosine decay of ``RunConfig.lr_at``."""

from __future__ import annotations

import math

import pytest

from pdrun.config import RunConfig


def test_warmup_ramps_linearly_to_the_constant_rate() -> None:
    cfg = RunConfig(lr=0.05, warmup_steps=4)
    assert [cfg.lr_at(s, 100) for s in range(6)] == pytest.approx(
        [0.0125, 0.025, 0.0375, 0.05, 0.05, 0.05], abs=1e-15
    )


def test_warmup_scales_the_cosine_schedule_and_none_leaves_it_alone() -> None:
    cosine = RunConfig(lr=0.1, lr_schedule="cosine")
    warm = RunConfig(lr=0.1, lr_schedule="cosine", warmup_steps=10)
    total = 50
    for step in range(total + 1):
        decay = 0.1 * 0.5 * (1.0 + math.cos(math.pi * step / total))
        assert cosine.lr_at(step, total) == pytest.approx(decay, abs=1e-15)
        ramp = min(1.0, (step + 1) / 10)
        assert warm.lr_at(step, total) == pytest.approx(decay * ramp, abs=1e-15)
    assert RunConfig(lr=0.1).lr_at(0, total) == 0.1  # no warm-up: the first step at the full rate
