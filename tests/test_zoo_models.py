"""The zoo's models: exact sizes, tracing, forward and backward, and learning on their paired datasets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from pdprof.inputs import model_call, prepare
from shared.resolve import cross_entropy, resolve_dataset, resolve_model
from shared.spec import RunSpec
from shared.tracer import trace
from shared.zoo import registry

TORCHVISION_COUNTS = {
    "vgg16": 138_357_544,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "mobilenet_v2": 3_504_872,
    "alexnet": 61_100_840,
    "inception_v3": 27_161_264,
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def paired_data(name: str, n: int = 4) -> Any:
    """The model's paired dataset, matching the model's small arguments."""
    entry = registry.models()[name]
    args = {}
    if entry.dataset == "synthetic_images":
        args = {
            "image_size": entry.defaults["image_size"],
            "num_classes": entry.defaults["num_classes"],
            "size": n,
        }
    return resolve_dataset(f"zoo:{entry.dataset}", args)


def paired_batch(name: str, n: int = 4, data: Any = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A batch of the model's paired dataset (or of ``data``: its samples as (inputs, target) pairs)."""
    x, y = next(iter(DataLoader(paired_data(name, n) if data is None else data, batch_size=n)))
    return (tuple(x) if isinstance(x, (list, tuple)) else (x,)), y


def test_every_model_is_registered_with_a_paired_dataset() -> None:
    models = registry.models()
    datasets = registry.datasets()
    expected = {"vgg16", "resnet50", "alexnet", "inception_v3", "s2vt", "gnmt", "gpt", "resmlp", "mnist_cnn"}
    assert expected <= set(models)
    for entry in models.values():
        assert entry.dataset in datasets, entry.name


@pytest.mark.parametrize("name", sorted(TORCHVISION_COUNTS))
def test_parameter_counts_equal_torchvision(name: str) -> None:
    with torch.device("meta"):
        model = resolve_model(f"zoo:{name}")
    assert n_params(model) == TORCHVISION_COUNTS[name]


@pytest.mark.parametrize(("version", "count"), [("1_0", 1_248_424), ("1_1", 1_235_496)])
def test_squeezenet_parameter_counts_equal_torchvision(version: str, count: int) -> None:
    with torch.device("meta"):
        model = resolve_model("zoo:squeezenet", {"version": version})
    assert n_params(model) == count
    relus = [m for m in model.modules() if isinstance(m, torch.nn.ReLU)]
    assert len(relus) == 26 and all(m.inplace for m in relus)  # after every conv, as torchvision's


@pytest.mark.parametrize("name", sorted(registry.models()))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_traced_module_computes_what_the_model_computes(name: str, mode: str) -> None:
    torch.manual_seed(0)
    args = dict(registry.models()[name].defaults)
    if "dropout" in args:
        args["dropout"] = 0.3  # so that training mode really draws dropout masks
    model = resolve_model(f"zoo:{name}", args).train(mode == "train")
    # The options pdprof decides (keyword inputs, torch.export for Hugging Face models); default otherwise.
    run = RunSpec(model=f"zoo:{name}", data=f"zoo:{registry.models()[name].dataset}")
    spec, data = prepare(run, model, paired_data(name), 4)
    inputs, _ = paired_batch(name, data=data)
    traced = trace(model, spec.trace)
    assert any(layer.op == "call_module" for layer in traced.layers)
    if spec.inputs is not None:
        expected_call = model_call(model, spec)  # by keyword, the recorded output field
    with torch.no_grad():
        torch.manual_seed(1)
        expected = (expected_call if spec.inputs is not None else model)(*inputs)
        torch.manual_seed(1)  # the same dropout masks, drawn in the same order
        got = traced.module(*inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "image_size"),
    [("vgg16", 32), ("resnet18", 32), ("resnet50", 64), ("mobilenet_v2", 32), ("alexnet", 64)],
)
def test_full_size_vision_model_runs_forward_and_backward(name: str, image_size: int) -> None:
    torch.manual_seed(0)
    model = resolve_model(f"zoo:{name}", {"image_size": image_size}).train()
    assert n_params(model) == TORCHVISION_COUNTS[name]
    x = torch.randn(2, 3, image_size, image_size)
    y = torch.tensor([3, 999])
    out = model(x)
    assert out.shape == (2, 1000)
    loss = cross_entropy(out, y)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # The first convolution sits at the far end of backward: a nonzero gradient there shows it went all the way.
    first = next(p for p in model.parameters() if p.dim() == 4)
    assert first.grad is not None and first.grad.abs().sum() > 0


def test_inception_v3_trains_with_its_auxiliary_head_traced_and_eager() -> None:
    torch.manual_seed(0)
    model = resolve_model("zoo:inception_v3").train()
    assert n_params(model) == TORCHVISION_COUNTS["inception_v3"]
    traced = trace(model)  # traced in training mode: the auxiliary branch is in the graph
    assert any(layer.name.startswith("auxlogits") or "AuxLogits" in layer.target for layer in traced.layers)
    x = torch.randn(2, 3, 299, 299)
    torch.manual_seed(1)
    logits, aux = model(x)
    torch.manual_seed(1)  # the same dropout mask for the traced run
    t_logits, t_aux = traced.module(x)
    assert logits.shape == aux.shape == (2, 1000)
    torch.testing.assert_close((t_logits, t_aux), (logits, aux), rtol=0, atol=0)
    loss = cross_entropy((logits, aux), torch.tensor([1, 2]))
    # The built-in loss adds 0.4 of the auxiliary loss, as the paper trains it.
    torch.testing.assert_close(
        loss, cross_entropy(logits, torch.tensor([1, 2])) + 0.4 * cross_entropy(aux, torch.tensor([1, 2]))
    )
    loss.backward()
    aux_fc = model.get_submodule("AuxLogits.fc")
    assert aux_fc.weight.grad is not None and aux_fc.weight.grad.abs().sum() > 0
    assert model.get_submodule("Conv2d_1a_3x3.conv").weight.grad.abs().sum() > 0
    model.eval()
    assert model(x[:1]).shape == (1, 1000)  # evaluation returns the logits alone


def test_inception_v3_rejects_images_too_small_for_the_auxiliary_head() -> None:
    from shared.errors import SpecError

    with pytest.raises(SpecError, match="299"):
        resolve_model("zoo:inception_v3", {"image_size": 128})


# (model, optimiser steps, learning rate, the fraction of the first loss the last must fall below)
LEARNERS = [
    ("resmlp", 15, 1e-2, 0.6),
    ("mnist_cnn", 20, 3e-3, 0.7),
    ("gpt", 25, 3e-3, 0.7),  # 4.6 (uniform over 98 characters) falls below 3.2
    ("gnmt", 25, 1e-2, 0.85),
    ("s2vt", 25, 1e-2, 0.5),
]


@pytest.mark.parametrize(("name", "steps", "lr", "ratio"), LEARNERS)
def test_small_model_learns_on_its_paired_dataset(name: str, steps: int, lr: float, ratio: float) -> None:
    torch.manual_seed(0)
    entry = registry.models()[name]
    model = resolve_model(f"zoo:{name}", entry.defaults).train()
    data = resolve_dataset(f"zoo:{entry.dataset}")
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        inputs = tuple(x) if isinstance(x, (list, tuple)) else (x,)
        loss = cross_entropy(model(*inputs), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = losses[0], sum(losses[-3:]) / 3
    assert last < ratio * first, f"{name}: loss {first:.3f} -> {last:.3f} over {steps} steps"


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = resolve_model("zoo:gpt", registry.models()["gpt"].defaults).eval()
    idx = torch.randint(0, 98, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 98
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gnmt_attention_ignores_padded_source_positions() -> None:
    from shared.zoo.models.gnmt import Attention

    torch.manual_seed(0)
    attn = Attention(8)
    q, keys = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    noisy = keys.clone()
    noisy[0, 3:] = 100 * torch.randn(2, 8)  # whatever sits under the padding must not matter
    torch.testing.assert_close(attn(q, keys, pad)[0], attn(q, noisy, pad)[0])
    assert not torch.allclose(attn(q, keys, pad)[0], attn(q, keys, torch.zeros_like(pad))[0])


def test_sequence_models_take_tuple_inputs_and_return_per_step_logits() -> None:
    for name, vocab in (("gnmt", registry.models()["gnmt"].defaults["tgt_vocab"]), ("s2vt", 32)):
        model = resolve_model(f"zoo:{name}", registry.models()[name].defaults).eval()
        inputs, target = paired_batch(name, n=3)
        assert len(inputs) == 2
        out = model(*inputs)
        assert out.shape == (*target.shape, vocab)
        assert (target == -100).any()  # padded targets, which the loss ignores
