"""Profiling as the workers will run: beside N-1 sibling processes training the same model.

On a CPU host the pipeline's workers share the machine: each has its own cores, but they
share the last-level cache and the memory bandwidth, and a layer runs slower while its
neighbours work than alone (measured here: a 512-wide ResMLP step at batch 128 took 16.8 ms
alone and 18.4 ms with a second copy running beside it). ``pdprof --concurrent N`` starts
N-1 sibling processes that run training steps of the same model on the same batch, one
thread each, for as long as the profile takes, so the figures are those of one of N busy
workers. The siblings are spawned (a fresh interpreter: forking a process that has run
torch can hang) and stopped by an event; their own figures are thrown away.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shared.errors import UserError
from shared.layout import MemoryFormat
from shared.spec import RunSpec

# Seconds a sibling may take to import torch, build the model and run a first step.
START_TIMEOUT_S = 120.0


def _busy(
    spec: dict[str, Any],
    batch_size: int,
    threads: int,
    memory_format: MemoryFormat,
    ready: Any,
    stop: Any,
    errors: Any,
) -> None:
    """A sibling's life; an error becomes one line on ``errors`` and exit status 1, not a traceback on
    the terminal: the profiled process meets the same model and says what went wrong itself."""
    try:
        _train(spec, batch_size, threads, memory_format, ready, stop)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        errors.put(f"{type(exc).__name__}: {first}")
        raise SystemExit(1) from None


def _train(
    spec: dict[str, Any], batch_size: int, threads: int, memory_format: MemoryFormat, ready: Any, stop: Any
) -> None:
    import torch

    from pdprof.batch import first_batch
    from pdprof.inputs import model_call
    from shared.fields import keyword_dataset
    from shared.layout import inputs_to_channels_last, module_to_channels_last, use_channels_last
    from shared.malloc import steady_malloc
    from shared.resolve import resolve_dataset, resolve_loss, resolve_model

    torch.set_num_threads(threads)
    steady_malloc()
    run = RunSpec.model_validate(spec)
    assert run.model is not None and run.data is not None
    torch.manual_seed(0)
    model = resolve_model(run.model, run.model_args)
    loss_fn = resolve_loss(run.loss)
    data = keyword_dataset(resolve_dataset(run.data, run.data_args), run.inputs, run.target, run.data)
    inputs, target = first_batch(data, batch_size, torch.device("cpu"))
    # In the layout the profiled process and pdrun's workers use: a sibling in another layout loads
    # the cache and memory differently (NCHW convolutions here run ~40% longer).
    if use_channels_last(memory_format, model, torch.device("cpu"), torch.float32):
        module_to_channels_last(model)
        inputs = inputs_to_channels_last(inputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model.train()
    call = model_call(model, run)  # keyword inputs and the output field, as the profiled step calls it
    ready.set()
    while not stop.is_set():
        loss_fn(call(*inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@contextmanager
def siblings(
    spec: RunSpec, batch_size: int, count: int, threads: int = 1, memory_format: MemoryFormat = "auto"
) -> Iterator[None]:
    """Run ``count`` sibling trainers of ``spec``'s model, in ``memory_format``, until the block ends."""
    if count <= 0:
        yield
        return
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ready = [ctx.Event() for _ in range(count)]
    errors = ctx.SimpleQueue()
    procs = [
        ctx.Process(
            target=_busy,
            args=(spec.model_dump(), batch_size, threads, memory_format, r, stop, errors),
            daemon=True,
        )
        for r in ready
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for p, r in zip(procs, ready, strict=True):
            # Wait in slices, so a sibling that died is reported at once rather than at the deadline.
            while not r.wait(0.2) and p.is_alive() and time.monotonic() < deadline:
                pass
            if not r.is_set():
                if p.exitcode is None:
                    why = f"not ready in {START_TIMEOUT_S:.0f} s"
                else:
                    why = f"exited with {p.exitcode}" + (f": {errors.get()}" if not errors.empty() else "")
                raise UserError(f"--concurrent: a sibling process training {spec.model} {why}")
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
