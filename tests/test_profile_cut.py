"""pdprof's stage-boundary measurement: a training step cut in two against the same step whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdprof.clock import clock_for
from pdprof.cut import cut_step, find_cut
from pdprof.profiler import ProfileConfig, profile_model, profile_spec
from shared.spec import RunSpec
from shared.tracer import trace
from shared.zoo.models.small import mnist_cnn
from tests.test_profile_usermodel import Branchy, Sleepy

CE = nn.functional.cross_entropy


def test_the_cut_is_the_narrow_one_nearest_the_middle() -> None:
    # mnist_cnn is a chain: every layer boundary is narrow; the middle of its ten layers is relu2.
    assert find_cut(trace(mnist_cnn(channels=4)).module) == "relu2"
    # Branchy's skip from relu to add spans the branches and the merge: only stem, relu and add are
    # narrow, and relu is the nearest the middle (add is as near; the earlier wins).
    assert find_cut(trace(Branchy(8)).module) == "relu"
    # One layer: nothing to cut between.
    assert find_cut(trace(nn.Sequential(nn.Linear(4, 2))).module) is None


def test_a_cut_step_computes_the_whole_steps_gradients() -> None:
    torch.manual_seed(0)
    model = mnist_cnn(channels=4)
    traced = trace(model)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(10, (8,))
    clock = clock_for(torch.device("cpu"))
    cut_step(traced.module, (x,), y, CE, clock, None)
    whole = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cut_step(traced.module, (x,), y, CE, clock, "relu2")
    cut = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # conv1 and conv2 lie before the cut: their gradients come from the second backward call.
    assert set(cut) == set(whole) and {"conv1.weight", "conv2.weight"} <= set(cut)
    for name, grad in whole.items():
        torch.testing.assert_close(cut[name], grad)


def test_a_cut_step_times_both_parts_backward() -> None:
    """The sleeping backward lies before the cut: its 30 ms count only if the second call runs."""
    model = Sleepy(forward_s=0.02, backward_s=0.03)
    traced = trace(model)
    x, y = torch.randn(4, 8), torch.randint(4, (4,))
    clock = clock_for(torch.device("cpu"))
    for cut in (None, "slow_bwd"):
        forward, backward = cut_step(traced.module, (x,), y, CE, clock, cut)
        # A few ms under the sleeps is the CPU clock's doing on a loaded host: it takes off the time the
        # thread sat runnable, and the kernel books a wait when the thread next runs, which can be after the
        # step's first mark (27.5 ms measured once under make test). A backward missing the second call
        # would be a fraction of a millisecond.
        assert 15 <= forward < 35
        assert 22 <= backward < 45


@pytest.mark.serial  # times the machine: run alone (Makefile)
def test_the_profile_records_the_cut_and_what_it_cost() -> None:
    spec = RunSpec(
        model="zoo:mnist_cnn",
        model_args={"channels": 8},
        data="zoo:synthetic",
        data_args={"size": 32, "shape": (1, 28, 28)},
    )
    result = profile_spec(ProfileConfig(spec, batch_size=16, warmup=1, repeats=4))
    extras, timing = result.graph.graph, result.graph.timing
    assert extras["cut_at"] == "relu2"
    assert len(result.table_meta["cut_ms"]) == 4
    assert timing is not None and timing.step_ms is not None
    # A real cut costs little next to the step; a cut step that lost a part of its work (the first
    # part's backward, say) would show as minus that part.
    for key in ("cut_forward_ms", "cut_backward_ms"):
        assert abs(extras[key]) < 0.3 * timing.step_ms
    assert sum(result.table_meta["cut_ms"]) / 4 == pytest.approx(
        extras["cut_forward_ms"] + extras["cut_backward_ms"]
    )
    # Zero bubble's B and W after the cut (pdprof.split_timing): each a real part of the backward, and
    # together at least most of it (B alone carries every activation gradient).
    b, w = extras["backward_input_share"], extras["backward_weight_share"]
    assert 0.2 < b < 2 and 0.02 < w < 2 and b + w > 0.7


def test_a_model_without_a_narrow_cut_records_none() -> None:
    # One layer: nothing to cut between, so nothing is timed cut and nothing is recorded.
    model = nn.Sequential(nn.Linear(8, 4))
    config = ProfileConfig(RunSpec(model="one-layer", data="random"), batch_size=4, warmup=1, repeats=2)
    result = profile_model(model, (torch.randn(4, 8),), torch.randint(4, (4,)), CE, config)
    extras = result.graph.graph
    assert extras["cut_at"] is None and extras["cut_forward_ms"] is None and extras["cut_backward_ms"] is None
    assert extras["backward_input_share"] is None and extras["backward_weight_share"] is None
    assert result.table_meta["cut_ms"] == []
