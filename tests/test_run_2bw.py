"""pdrun runs PipeDream-2BW: its weights follow W(t+1) = W(t) - lr * grad f(W(t-1)) exactly, on two versions.

Real workers (gloo over 127.0.0.1) train a small ResMLP in float64; the expected weights are
computed here step by step with the paper's update rule, independently of pdrun's code.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.plans import cut_plan
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.schedule_more import two_bw_version
from tests.test_run_flush import RESMLP, assert_same, pipeline_params, sequential, unit_batch


def two_bw_by_hand(
    steps: int, batch: int, microbatches: int, seed: int, lr: float, momentum: float = 0.0
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Final weights and every version W(0..steps) of 2BW: step t's gradient on W(max(0, t-1)), applied
    to W(t) by SGD (with heavy-ball ``momentum``, torch's rule: v = momentum v + g, W -= lr v)."""
    assert RESMLP.model is not None and RESMLP.data is not None
    torch.manual_seed(seed)
    model = resolve_model(RESMLP.model, RESMLP.model_args).to(torch.float64)
    data = resolve_dataset(RESMLP.data, RESMLP.data_args)
    loss_fn = resolve_loss(RESMLP.loss)
    versions = [{k: v.detach().clone() for k, v in model.named_parameters()}]
    velocity: dict[str, torch.Tensor] = {}
    for t in range(steps):
        used = {k: v.clone().requires_grad_(True) for k, v in versions[max(0, t - 1)].items()}
        # The step's m microbatches are one batch of m x batch samples; the loss is their mean.
        x, y = unit_batch(data, t, batch * microbatches, seed, torch.float64)
        loss = loss_fn(functional_call(model, used, (x,)), y)
        grads = torch.autograd.grad(loss, list(used.values()))
        for k, g in zip(used, grads, strict=True):
            velocity[k] = g.clone() if k not in velocity else momentum * velocity[k] + g
        versions.append({k: versions[t][k] - lr * velocity[k] for k in used})
    return versions[-1], versions


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cuts", "microbatches"), [([5], 2), ([3, 6, 9], 4)])
def test_2bw_follows_its_update_rule(cuts: list[int], microbatches: int) -> None:
    batch, steps, seed, lr = 8, 5, 2, 0.3
    plan = cut_plan(RESMLP, cuts, batch_size=batch, schedule="2bw", microbatches=microbatches)
    cfg = RunConfig(steps=steps, seed=seed, dtype="float64", lr=lr, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None and len(results) == len(cuts) + 1
    want, versions = two_bw_by_hand(steps, batch, microbatches, seed, lr)
    got = pipeline_params(results)
    assert_same(got, want, 1e-6)
    # The one-step delay is there to see: 2BW is not flushed training on the same batches.
    _, flushed = sequential(
        RESMLP, steps=steps, batch=batch * microbatches, seed=seed, dtype=torch.float64, lr=lr
    )
    assert max((flushed[k] - want[k]).abs().max().item() for k in want) > 1e-4
    assert max((want[k] - versions[0][k]).abs().max().item() for k in want) > 1e-3
    for r in results:
        assert r.steps == steps and r.max_versions <= 2  # two versions, not one per unit in flight
        seen = [(v["unit"], v["forward_version"], v["backward_version"]) for v in r.versions]
        assert sorted(u for u, _, _ in seen) == list(range(steps * microbatches))
        for u, fwd, bwd in seen:
            assert fwd == bwd == two_bw_version(u, microbatches), (r.stage, u, fwd, bwd)


@pytest.mark.timeout(120)
def test_2bw_with_momentum_follows_its_update_rule() -> None:
    # The momentum buffer lives on the live weights and takes each step's (one step late) gradient.
    batch, steps, seed, lr, momentum = 8, 6, 2, 0.3, 0.9
    plan = cut_plan(RESMLP, [5], batch_size=batch, schedule="2bw", microbatches=2)
    cfg = RunConfig(
        steps=steps, seed=seed, dtype="float64", lr=lr, momentum=momentum, record=True, validate=False
    )
    results = launch(plan, cfg)
    assert results is not None
    want, _ = two_bw_by_hand(steps, batch, 2, seed, lr, momentum)
    assert_same(pipeline_params(results), want, 1e-6)
    plain, _ = two_bw_by_hand(steps, batch, 2, seed, lr)
    assert max((plain[k] - want[k]).abs().max().item() for k in want) > 1e-3  # momentum is there


def _delayed_heavy_ball(lr_h: float, momentum: float, delay: int, steps: int = 4000) -> float:
    """|x| after ``steps`` of heavy-ball SGD on f(x) = h x^2 / 2 (torch's rule), its gradient ``delay`` steps late."""
    xs, v = [1.0] * (delay + 1), 0.0
    for _ in range(steps):
        v = momentum * v + lr_h * xs[-1 - delay]
        xs.append(xs[-1] - v)
    return abs(xs[-1])


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_the_notes_stability_bound_is_the_delayed_recurrences(momentum: float) -> None:
    # pdrun.notes.delayed_stable_share's bound: one step late, stable while lr h < 1 - m; on time, 2 (1 + m).
    late, on_time = 1 - momentum, 2 * (1 + momentum)
    for bound, delay in ((late, 1), (on_time, 0)):
        assert _delayed_heavy_ball(0.97 * bound, momentum, delay) < 1e-2
        assert not _delayed_heavy_ball(1.03 * bound, momentum, delay) < 1  # grown, or overflowed to NaN


def test_pdrun_notes_2bw_under_high_momentum_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    from pdrun.launch import check

    plan = cut_plan(RESMLP, [5], batch_size=8, schedule="2bw", microbatches=2)
    check(plan, RunConfig(steps=1, lr=0.01, momentum=0.9, validate=False), 2)
    assert (
        "pdrun: note: 2bw applies every gradient one step late; under --momentum 0.9 that is stable only "
        "below about 2.6% of" in capsys.readouterr().err
    )
    for quiet in (
        RunConfig(steps=1, momentum=0.9, optimizer="adam", validate=False),
        RunConfig(steps=1, momentum=0.3, validate=False),
    ):
        check(plan, quiet, 2)
        assert "2bw applies" not in capsys.readouterr().err
    flush = cut_plan(RESMLP, [5], batch_size=8, schedule="1f1b-flush", microbatches=2)
    check(flush, RunConfig(steps=1, momentum=0.9, validate=False), 2)
    assert "2bw applies" not in capsys.readouterr().err
