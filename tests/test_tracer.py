"""The tracer: layers and edges follow the data flow; grouping options; clear errors."""

from __future__ import annotations

import pytest
import torch

from shared.errors import TraceError
from shared.spec import TraceOptions
from shared.tracer import parameter_bytes, trace
from shared.zoo.models.small import resmlp
from tests.test_profile_usermodel import BRANCHY_EDGES, build, build_gated, build_two


def test_branches_and_skip_connections_become_dag_edges() -> None:
    traced = trace(build())
    assert set(traced.edges()) == BRANCHY_EDGES
    assert traced.layers[0].name == "x"
    assert traced.outputs == ("head",)
    ops = {layer.name: layer.op for layer in traced.layers}
    assert ops["x"] == "input" and ops["stem"] == "call_module" and ops["cat"] == "call_function"
    assert {layer.name: layer.target for layer in traced.layers}["relu"] == "torch.relu"


def test_trace_is_deterministic_and_runs_like_the_model() -> None:
    model = build()
    a, b = trace(model), trace(build())
    assert a.structure_hash() == b.structure_hash()
    x = torch.randn(5, 8)
    torch.testing.assert_close(a.module(x), model(x))


def test_two_inputs_are_two_input_layers() -> None:
    traced = trace(build_two())
    assert [layer.name for layer in traced.layers if layer.op == "input"] == ["a", "b"]
    # The module attributes `a` and `b` get the names a_1 and b_1: the inputs took a and b.
    assert set(traced.edges()) == {
        ("a", "a_1"),
        ("b", "b_1"),
        ("a_1", "mul"),
        ("b_1", "mul"),
        ("mul", "head"),
    }


def test_depth_keeps_children_as_single_layers() -> None:
    model = resmlp(width=8, depth=3)
    fine = trace(model)
    coarse = trace(model, TraceOptions(depth=1))
    assert "blocks_0_fc1" in {layer.name for layer in fine.layers}
    names = [layer.name for layer in coarse.layers]
    assert names == ["x", "flatten", "stem", "relu", "blocks", "head"]
    blocks = next(layer for layer in coarse.layers if layer.name == "blocks")
    expected = sum(p.numel() * 4 for p in model.blocks.parameters())
    assert parameter_bytes(coarse, blocks) == expected


def test_leaf_module_by_class_name() -> None:
    traced = trace(resmlp(width=8, depth=2), TraceOptions(leaf_modules=["ResidualBlock"]))
    names = [layer.name for layer in traced.layers]
    assert names == ["x", "flatten", "stem", "relu", "blocks_0", "blocks_1", "head"]
    assert ("blocks_0", "blocks_1") in traced.edges()


def test_untraceable_module_names_the_construct_and_the_option() -> None:
    with pytest.raises(TraceError) as info:
        trace(build_gated())
    message = str(info.value)
    assert "module 'gate' (Gate)" in message
    assert "control flow" in message
    assert "--leaf-module Gate" in message
    assert "\n" not in message
    traced = trace(build_gated(), TraceOptions(leaf_modules=["Gate"]))
    assert [layer.name for layer in traced.layers] == ["x", "fc", "gate", "head"]


def test_untraceable_forward_of_the_model_itself_suggests_grouping() -> None:
    class Top(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(int(x.shape[0])):  # a tensor's shape used as a Python int
                x = self.fc(x)
            return x

    with pytest.raises(TraceError) as info:
        trace(Top())
    assert "the model's own forward (Top)" in str(info.value)
    assert "used as a Python number" in str(info.value)
    assert "--leaf-module" in str(info.value) and "--depth" in str(info.value)


class _ZeroGrad(torch.autograd.Function):
    """Identity forward, no gradient back: what fx would lose if it traced through forward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


class _Scale(torch.autograd.Function):
    """Identity forward, gradient times ``factor`` (a non-tensor argument)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class _WithFunctions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.scaled, self.head = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = _ZeroGrad.apply(self.frozen(x))
        return self.head(_Scale.apply(self.scaled(x), 0.5))


def test_an_autograd_function_stays_one_call_and_keeps_its_backward() -> None:
    torch.manual_seed(0)
    model = _WithFunctions().double()
    traced = trace(model)
    calls = [layer for layer in traced.layers if layer.op == "call_function"]
    assert [c.target.rsplit(".", 1)[-1] for c in calls] == ["_ZeroGrad_apply", "_Scale_apply"]
    x = torch.randn(4, 8, dtype=torch.float64)
    traced.module(x).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0)
    assert torch.count_nonzero(got["frozen.weight"]) == 0  # the Function's backward, not view_as's
    assert torch.count_nonzero(got["scaled.weight"]) > 0
    assert torch.autograd.Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # restored


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.fc(x)


def test_a_forward_that_assigns_a_buffer_is_refused_and_the_model_left_whole() -> None:
    model = _Counting()
    with pytest.raises(TraceError, match=r"assigns 'seen'.*--leaf-module"):
        trace(model)
    assert isinstance(model.seen, torch.Tensor) and model.seen.item() == 0
    model.to(torch.float64)  # what failed later, far from the cause, before
    assert model(torch.ones(3, 8, dtype=torch.float64)).shape == (3, 2) and model.seen.item() == 3


class _Averaging(torch.nn.Module):
    """A step counter and a running mean kept in forward, as a new user wrote them (under no_grad)."""

    def __init__(self, update: str) -> None:
        super().__init__()
        self.update = update
        self.fc = torch.nn.Linear(8, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            if self.update == "counter":
                self.steps += 1  # a constant: fx ran it once, at trace time, and the graph never again
            else:
                self.ema.mul_(0.9).add_(0.1 * x.mean(0))  # one node on a traced value, without no_grad
        return self.fc(x)


@pytest.mark.parametrize(("update", "name"), [("counter", "steps"), ("ema", "ema")])
def test_a_buffer_updated_in_forward_is_refused_in_every_form(update: str, name: str) -> None:
    # Both traced without a word before: the counter stayed at 1, the EMA lost its decay and kept an
    # autograd graph (2.22 against 0.39 after 40 units in a user's run).
    model = _Averaging(update)
    with pytest.raises(TraceError, match=rf"assigns '{name}'.*--leaf-module"):
        trace(model)
    assert model.steps.item() == 0 and torch.count_nonzero(model.ema) == 0  # as it was
    # The documented fix: the module as one layer, whose forward then runs (and updates) at every call.
    kept = trace(torch.nn.Sequential(model, torch.nn.Tanh()), TraceOptions(leaf_modules=["_Averaging"]))
    kept.module(torch.ones(4, 8))
    kept.module(torch.ones(4, 8))
    inner = kept.module.get_submodule("0")
    assert inner.steps.item() == (2 if update == "counter" else 0)
    assert torch.count_nonzero(inner.ema) == (0 if update == "counter" else 8)
