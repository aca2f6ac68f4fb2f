"""pdprof's zero-bubble figures: B and W of the part after the cut against its one backward, and the
planner charging a stage's split backward by them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdplan.schedule_sim import HALVES, backward_shares, simulate_plan, split_backward
from pdprof.clock import clock_for
from pdprof.profiler import _split_shares
from pdprof.split_timing import split_after_cut
from shared.graph import LayerGraph
from shared.simulate import Costs
from shared.tracer import trace
from tests.test_plan_more_schedules import _graph, _plan
from tests.test_profile_usermodel import SlowBackward

CE = nn.functional.cross_entropy
B_SLEEP, W_SLEEP = 0.03, 0.02


class SlowWeight(nn.Module):
    """A linear layer whose weight's gradient sleeps: the weight reaches the product through an
    identity whose backward sleeps (tests.test_profile_usermodel's), on the weight's side only."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16) / 4)
        self.slow = SlowBackward(seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.slow(self.weight)
        return x @ weight.t()


class SplitSleepy(nn.Module):
    """fc -> relu (the cut) -> slow (sleeps in its input's gradient: B's) -> head (whose weight's
    gradient sleeps: W's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.slow = SlowBackward(B_SLEEP)
        self.head = SlowWeight(W_SLEEP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.slow(self.relu(self.fc(x))))
        return out


def test_split_after_cut_times_b_and_w_apart_and_their_gradients_are_one_backwards() -> None:
    torch.manual_seed(0)
    model = SplitSleepy().double()
    traced = trace(model)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(4, (4,))
    clock = clock_for(torch.device("cpu"))
    # The process's first split backward pays a one-off ~0.2 s (pdprof's cut check takes it).
    split_after_cut(traced.module, (x,), y, CE, clock, "relu", split=True)
    model.zero_grad(set_to_none=True)
    fused, nothing = split_after_cut(traced.module, (x,), y, CE, clock, "relu", split=False)
    one = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    b, w = split_after_cut(traced.module, (x,), y, CE, clock, "relu", split=True)
    split = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # The part after the cut gets its gradients, the part before none (its graph is dropped).
    assert set(split) == set(one) == {"head.weight"}
    for name, grad in one.items():
        torch.testing.assert_close(split[name], grad, rtol=0, atol=1e-12)
    # One backward pays both sleeps; B pays the input path's, W the weight's. Bounds as loose as the
    # CPU clock on a loaded host needs (tests/test_profile_cut.py); a B that ran W's work, or a W that
    # redid B's, would be off by a whole sleep.
    assert nothing == 0.0
    assert 40 <= fused < 70
    assert 22 <= b < 40
    assert 14 <= w < 28


def test_a_cut_whose_value_needs_no_gradient_is_refused() -> None:
    traced = trace(SplitSleepy())
    clock = clock_for(torch.device("cpu"))
    with pytest.raises(ValueError, match="no value that requires grad"):
        # The input placeholder needs no gradient: not a stage boundary to split at.
        split_after_cut(traced.module, (torch.randn(2, 8),), torch.randint(4, (2,)), CE, clock, "x", True)


def test_the_shares_are_the_figures_over_the_one_backward() -> None:
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    splits = [(10.0, 7.0, 4.0), (12.0, 9.0, 3.0), (11.0, 8.0, 5.0)]
    shares = _split_shares(splits, median)
    assert shares == {"backward_input_share": 8.0 / 11.0, "backward_weight_share": 4.0 / 11.0}
    assert _split_shares([], median) == {"backward_input_share": None, "backward_weight_share": None}


def _with_shares(graph: LayerGraph, b: float | None, w: float | None) -> LayerGraph:
    extras = {**graph.graph, "backward_input_share": b, "backward_weight_share": w}
    return graph.model_copy(update={"graph": extras})


def test_the_planner_reads_the_shares_and_halves_without_them() -> None:
    graph = _graph()
    assert backward_shares(graph) == HALVES
    assert backward_shares(_with_shares(graph, 0.9, 0.35)) == (0.9, 0.35)
    assert backward_shares(_with_shares(graph, None, None)) == HALVES
    assert backward_shares(_with_shares(graph, 0.0, 0.5)) == HALVES  # a broken figure is not a cost


def test_split_backward_charges_the_shares_and_the_first_stage_all_w() -> None:
    costs = Costs(forward=[1.0, 1.0, 1.0], backward=[2.0, 4.0, 6.0])
    run = split_backward(costs, (0.75, 0.5))
    # The first stage received nothing that needs a gradient: pdrun's B there is empty, its W whole.
    assert list(run.backward) == [0.0, 3.0, 4.5]
    assert list(run.weight) == [2.0, 2.0, 3.0]
    assert list(run.forward) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule, virtual", [("zb-h1", 1), ("zb-v", None)])
def test_the_simulation_of_a_split_schedule_follows_the_measured_shares(
    schedule: str, virtual: int | None
) -> None:
    plan = _plan(schedule, virtual)
    halves = simulate_plan(_graph(), plan).time_per_minibatch_s
    assert simulate_plan(_with_shares(_graph(), 0.5, 0.5), plan).time_per_minibatch_s == halves
    # B and W dearer than one backward (B 0.9, W 0.35 of it, as on the MNIST CNN): slower.
    dearer = simulate_plan(_with_shares(_graph(), 0.9, 0.35), plan).time_per_minibatch_s
    assert dearer > halves
    # Cheaper: faster.
    assert simulate_plan(_with_shares(_graph(), 0.4, 0.4), plan).time_per_minibatch_s < halves
