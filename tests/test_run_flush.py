"""Flushing schedules (1f1b-flush, gpipe) train exactly like one process with batch M x batch size.

Each test launches real workers (gloo over 127.0.0.1) and compares every parameter after
10 steps with sequential training written here, independently of pdrun's data code.
"""

from __future__ import annotations

import os
from typing import Any, cast

import pytest
import torch

from pdrun.config import Dtype, Optimizer, RunConfig
from pdrun.launch import launch
from pdrun.metrics import transport_of
from pdrun.plans import cut_plan
from pdrun.result import WorkerResult
from shared.host import send_thread_pays
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.spec import RunSpec

RESMLP = RunSpec(model="zoo:resmlp", model_args={"width": 32, "depth": 2}, data="zoo:digits", data_args={})


def sequential(
    spec: RunSpec,
    *,
    steps: int,
    batch: int,
    seed: int,
    dtype: torch.dtype,
    lr: float,
    momentum: float = 0.0,
    optimizer: str = "sgd",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial, final) parameters of plain training on ``batch`` samples per step, data reshuffled per epoch."""
    assert spec.model is not None and spec.data is not None
    torch.manual_seed(seed)
    model = resolve_model(spec.model, spec.model_args).to(dtype)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = resolve_dataset(spec.data, spec.data_args)
    loss_fn = resolve_loss(spec.loss)
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return initial, _train(model, data, loss_fn, opt, steps, batch, seed, dtype)


def unit_batch(
    data: Any, k: int, batch: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``k`` of ``batch`` samples: epoch ``k // B`` shuffled with seed + epoch, full batches only."""
    n = len(data)
    epoch, b = divmod(k, n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    idx = order[b * batch : (b + 1) * batch]
    x = torch.stack([data[int(i)][0] for i in idx]).to(dtype)
    y = torch.stack([torch.as_tensor(data[int(i)][1]) for i in idx])
    return x, y


def _train(
    model: Any, data: Any, loss_fn: Any, opt: Any, steps: int, batch: int, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    for step in range(steps):
        x, y = unit_batch(data, step, batch, seed, dtype)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def pipeline_params(results: list[WorkerResult]) -> dict[str, torch.Tensor]:
    """The pipelined model's parameters, from replica 0 of every stage; each name held by exactly one stage."""
    merged: dict[str, torch.Tensor] = {}
    for r in sorted(results, key=lambda r: r.rank):
        if r.replica != 0:
            continue
        overlap = set(merged) & set(r.params)
        assert not overlap, f"stage {r.stage} holds parameters of another stage: {overlap}"
        merged.update(r.params)
    return merged


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        diff = (got[name].to(want[name].dtype) - want[name]).abs().max().item()
        assert diff <= tol, f"{name}: pipelined and sequential differ by {diff:.3g} > {tol}"


CASES = [
    # schedule, cut points (layer index), microbatches, dtype, optimizer
    ("1f1b-flush", [5], 4, "float64", "sgd"),
    ("gpipe", [5], 4, "float64", "adam"),
    ("1f1b-flush", [3, 6, 9], 4, "float64", "sgd"),
    ("gpipe", [3, 6, 9], 3, "float32", "sgd"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "cuts", "microbatches", "dtype", "optimizer"), CASES)
def test_flush_equals_sequential(
    schedule: str, cuts: list[int], microbatches: int, dtype: str, optimizer: str
) -> None:
    batch = 16
    plan = cut_plan(RESMLP, cuts, batch_size=batch, schedule=schedule, microbatches=microbatches)  # type: ignore[arg-type]
    lr, momentum = (0.01, 0.0) if optimizer == "adam" else (0.2, 0.9)
    cfg = RunConfig(
        steps=10,
        seed=3,
        dtype=cast(Dtype, dtype),
        optimizer=cast(Optimizer, optimizer),
        lr=lr,
        momentum=momentum,
        record=True,
        validate=False,
    )
    results = launch(plan, cfg)
    assert results is not None and len(results) == len(cuts) + 1
    torch_dtype = torch.float64 if dtype == "float64" else torch.float32
    initial, want = sequential(
        RESMLP,
        steps=10,
        batch=batch * microbatches,
        seed=3,
        dtype=torch_dtype,
        lr=lr,
        momentum=momentum,
        optimizer=optimizer,
    )
    got = pipeline_params(results)
    assert_same(got, want, 1e-6 if dtype == "float64" else 1e-5)
    moved = max((want[k] - initial[k]).abs().max().item() for k in want)
    assert moved > 1e-3, "training did not move the weights: the comparison would prove nothing"
    assert all(r.steps == 10 for r in results)
    # One row per step and rank; the loss is known on the last stage only.
    for r in results:
        assert [row["step"] for row in r.rows] == list(range(10))
        losses = [row["loss"] for row in r.rows]
        if r.stage == len(cuts):
            assert all(0 < x < 10 for x in losses)
        else:
            assert all(x != x for x in losses)  # NaN


CNN = RunSpec(model="zoo:mnist_cnn", model_args={"channels": 4}, data="zoo:mnist5k")

CNN_CASES = [
    # schedule, cuts, dtype, memory format, send thread, transport: a 4-d activation and its gradient
    # cross every boundary but the last; the sends go from a helper thread or from the worker itself,
    # the values through shared memory (auto, one host) or gloo.
    ("1f1b-flush", ["conv2"], "float32", "auto", "on", "auto"),  # auto: channels-last (a float32 CNN on CPU)
    ("gpipe", ["relu1", "conv2"], "float64", "channels-last", "off", "auto"),
    ("1f1b-flush", ["conv2"], "float64", "contiguous", "on", "gloo"),
    ("1f1b-flush", ["conv2"], "float32", "auto", "off", "gloo"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("schedule", "cuts", "dtype", "memory_format", "send_thread", "transport"), CNN_CASES
)
def test_cnn_flush_equals_sequential_in_either_layout(
    schedule: str, cuts: list[str], dtype: str, memory_format: str, send_thread: str, transport: str
) -> None:
    # Channels-last changes where activations sit in memory (and how they travel), not what they are.
    batch, microbatches = 16, 4
    plan = cut_plan(CNN, cuts, batch_size=batch, schedule=schedule, microbatches=microbatches)  # type: ignore[arg-type]
    cfg = RunConfig(
        steps=10,
        seed=1,
        dtype=cast(Dtype, dtype),
        lr=0.1,
        momentum=0.9,
        record=True,
        validate=False,
        memory_format=memory_format,  # type: ignore[arg-type]
        send_thread=send_thread,  # type: ignore[arg-type]
        transport=transport,  # type: ignore[arg-type]
    )
    results = launch(plan, cfg)
    assert results is not None and len(results) == len(cuts) + 1
    assert [r.send_thread for r in results] == [send_thread == "on"] * len(results)
    assert [transport_of(r) for r in results] == ["shm" if transport == "auto" else "gloo"] * len(results)
    torch_dtype = torch.float64 if dtype == "float64" else torch.float32
    initial, want = sequential(
        CNN, steps=10, batch=batch * microbatches, seed=1, dtype=torch_dtype, lr=0.1, momentum=0.9
    )
    got = pipeline_params(results)
    assert_same(got, want, 1e-6 if dtype == "float64" else 1e-5)
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3
    conv = got["conv2.weight"]  # (8, 4, 3, 3): one layout or the other, not both
    assert conv.is_contiguous(memory_format=torch.channels_last) == (memory_format != "contiguous")


def test_a_send_thread_pays_only_with_a_core_to_spare() -> None:
    cores = len(os.sched_getaffinity(0))
    if cores > 1:
        assert send_thread_pays("cpu", 1, cores - 1)
    assert not send_thread_pays("cpu", cores, 1)
    assert not send_thread_pays("cpu", 1, cores)
    assert send_thread_pays("cuda", cores, 1)  # the worker's CPU mostly waits for the GPU
