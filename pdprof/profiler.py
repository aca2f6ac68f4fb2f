"""The profiler: a model and a batch become a layer graph (figures) and a profile table (samples).

Steps: trace the model (``shared.tracer``, the same layers pdrun will build), measure
sizes once, then run ``warmup + repeats`` rounds. Each round runs one directly timed
training step of the user's model, one step timed per layer and, where the model has a
narrow cut, the same step whole and cut in two through the interpreter (``pdprof.cut``:
what a stage boundary costs), in alternating order, so that drift and the noise of a shared
machine fall on all alike; the figures of the warm-up rounds are dropped. Every sample goes
into the table; the graph holds one figure per layer and phase, the mean of its rounds by
default (``--statistic``).

Why the mean: the planner predicts a rate (time per minibatch over a run), and a run pays
every round's cost, the slow ones too. Per layer, the slow rounds are rare but add up: on
zoo:mnist_cnn beside a sibling (100 rounds), the sums of the layers' medians were 2.2%
(forward) and 3.3% (backward) below the sums of their means, and the plans' simulated time
per minibatch ran below pdrun's measured one by about as much. The median (``--statistic
median``) is the steadier figure from one profile to the next, for comparing profiles.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import pandas as pd
import torch
from torch import nn

from pdprof.batch import batch_shape, first_batch
from pdprof.calibrate import Calibration, anchored, calibrate
from pdprof.clock import Clock, CpuClock, clock_for
from pdprof.cut import cut_step, find_cut
from pdprof.inputs import check_target, check_vocabulary, model_call, prepare
from pdprof.loss_memory import loss_rise
from pdprof.siblings import siblings
from pdprof.sizes import LayerSize, measure_sizes, shape_of
from pdprof.split_timing import split_after_cut
from pdprof.timing import LossFn, StepTimes, profiled_step, whole_step
from pdprof.update import OptimizerName, UpdateTimer, describe
from shared.batches import checked_gather
from shared.errors import UserError
from shared.graph import Edge, LayerGraph, Node, Timing
from shared.highwater import mark, rise
from shared.layout import MemoryFormat, inputs_to_channels_last, module_to_channels_last, use_channels_last
from shared.malloc import building_malloc, malloc_is_steady, steady_malloc
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.spec import RunSpec
from shared.ties import ties
from shared.tracer import TracedModel, owned_parameter_bytes, place, trace

# (phase, done, total): phase is "tracing", "memory", "sizes", "warmup" or "timing".
Progress = Callable[[str, int, int], None]


Statistic = Literal["mean", "median"]  # how a layer's timed rounds become its figure


@dataclass(frozen=True)
class ProfileConfig:
    """Everything a profile depends on besides the model's own code."""

    spec: RunSpec
    batch_size: int
    device: str = "cpu"
    # Four untimed rounds: with two, the first profile of a process ran ~6% slow on ResNet-50
    # (allocator growth, first-touch pages) and two runs disagreed by up to 30% on some layers.
    warmup: int = 4
    repeats: int = 10
    threads: int = 1
    steady_malloc: bool = True  # fix glibc's malloc thresholds (shared.malloc) for repeatable CPU figures
    optimizer: OptimizerName = "sgd"  # the optimizer whose step is timed per layer (as pdrun will run it)
    momentum: float = 0.0
    # CPU: profile beside concurrent-1 sibling trainers (pdprof.siblings); None: as many as this host's
    # cores hold at ``threads`` each (:func:`auto_concurrent`), pdprof's command-line default.
    concurrent: int | None = 1
    memory_format: MemoryFormat = (
        "auto"  # the activations' layout, decided as pdrun decides it (shared.layout)
    )
    statistic: Statistic = "mean"  # how a layer's rounds become its figure (see the module's docstring)


@dataclass
class ProfileResult:
    """The layer graph, the raw samples, and the table's description."""

    graph: LayerGraph
    table: pd.DataFrame
    table_meta: dict[str, Any] = field(default_factory=dict)


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"--device {name}: CUDA is not available here (torch {torch.__version__}); use --device cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: only cpu and cuda are supported")
    return device


def profile_spec(config: ProfileConfig, progress: Progress | None = None) -> ProfileResult:
    """Resolve the specs in ``config`` and profile the model on the first batch of the dataset."""
    spec = config.spec
    if spec.model is None or spec.data is None:
        raise UserError("profiling needs a model spec (--model) and a dataset spec (--data)")
    device = _device(config.device)
    if device.type == "cpu" and config.steady_malloc:
        # As a pdrun worker builds (pdrun.runner): big blocks mapped afresh until profile_model fixes
        # the steady thresholds, so the memory probe starts from a heap without the build's holes.
        building_malloc()
    torch.manual_seed(0)
    model = resolve_model(spec.model, spec.model_args)
    dataset = resolve_dataset(spec.data, spec.data_args)
    if len(dataset) < config.batch_size:  # pdrun trains on whole batches: it would refuse this one
        raise UserError(
            f"--batch-size {config.batch_size}: dataset {spec.data} has {len(dataset)} samples, fewer than one "
            "batch; pdrun trains on whole batches (lower --batch-size or use more data)"
        )
    # Keyword samples, the frontend and the example shapes: decided here, recorded in the graph's spec.
    spec, dataset = prepare(spec, model, dataset, config.batch_size)
    config = replace(config, spec=spec)
    assert spec.data is not None
    loss_fn = resolve_loss(spec.loss)
    inputs, target = first_batch(dataset, config.batch_size, device, spec.data)
    check_vocabulary(spec, model, inputs)
    check_target(spec, inputs, target)
    if config.concurrent is None:
        config = replace(config, concurrent=auto_concurrent(device, config.threads))
    assert config.concurrent is not None
    if config.concurrent > 1 and device.type != "cpu":
        raise UserError(
            "--concurrent: only for CPU workers sharing a host; on a GPU each worker has its own device"
        )
    with siblings(spec, config.batch_size, config.concurrent - 1, config.threads, config.memory_format):
        return profile_model(
            model,
            inputs,
            target,
            loss_fn,
            config,
            progress,
            data_loader(dataset, config.batch_size, f"dataset {spec.data}"),
        )


# ``--concurrent auto`` profiles beside at most this many workers: past it the siblings' start-up
# and memory cost more than a host that full is likely to see (a user names N for more).
AUTO_CONCURRENT_MAX = 8


def auto_concurrent(device: torch.device, threads: int, cores: int | None = None) -> int:
    """The workers a pipeline puts beside each other on this host: on CPU as many as its cores hold at
    ``threads`` each (at most :data:`AUTO_CONCURRENT_MAX`), on a GPU one (each worker has its own).

    Two workers on this 2-core VM run each layer of a 4 x 64 GPT-2 about 35% slower than one alone, so
    a profile taken alone predicted a two-stage run 29% fast (simulated / measured 0.71) and one taken
    beside a sibling 10% (0.90)."""
    if device.type != "cpu":
        return 1
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_CONCURRENT_MAX, cores // max(1, threads)))


# What each kind of stage fetches of a unit's batch (pdrun.worker: the stages that read model inputs
# fetch those, the last stage its targets, a stage that is both all in one fetch), and the graph's
# figure for it. A keyword dataset has no table of targets: the last stage reads every sample for
# its labels (transformers' BERT on zoo:pydoc_lines, batch 16: 0.6 ms a unit, 5% of its time).
FETCHES: dict[str, tuple[bool, bool]] = {
    "data_ms": (True, False),
    "target_ms": (False, True),
    "data_target_ms": (True, True),
}


def data_loader(dataset: Any, batch_size: int, name: str = "dataset") -> Callable[[bool, bool], Any]:
    """A batch of random samples as pdrun's workers fetch it (``shared.batches``): ``load(inputs, target)``
    gathers the parts asked for; a sample that fails to read or to stack is a ``DataError`` naming it."""
    generator = torch.Generator().manual_seed(0)

    def load(inputs: bool, target: bool) -> Any:
        indices = torch.randint(len(dataset), (batch_size,), generator=generator)
        return checked_gather(dataset, indices, name, inputs=inputs, target=target)

    return load


def profile_model(
    model: nn.Module,
    inputs: tuple[Any, ...],
    target: Any,
    loss_fn: LossFn,
    config: ProfileConfig,
    progress: Progress | None = None,
    load_batch: Callable[[bool, bool], Any] | None = None,
) -> ProfileResult:
    """Profile ``model`` on one batch (already on the device): ``model(*inputs)`` against ``target``.

    ``load_batch``, when given, fetches a batch from the dataset as pdrun will; each round times each
    kind of stage's fetch (:data:`FETCHES`: ``graph.data_ms``, ``target_ms``, ``data_target_ms``).
    """
    report = progress or (lambda phase, done, total: None)
    device = _device(config.device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        report("tracing", 0, 1)
        traced = trace(model, config.spec.trace)
        # The graph records the options as traced (the output field the loss reads).
        config = replace(config, spec=config.spec.model_copy(update={"trace": traced.options}))
        whole = model_call(model, config.spec)
        model.to(device).train()
        place(traced.module, device, traced.options)
        traced.module.train()
        # The layout pdrun will run in (same model, float32, same device: the same decision).
        channels_last = use_channels_last(config.memory_format, model, device, torch.float32)
        if channels_last:
            module_to_channels_last(model)  # the traced module holds the same parameters
            inputs = inputs_to_channels_last(inputs)
        clock = clock_for(device)
        host = clock_for(torch.device("cpu"))
        # Process-wide once set: the method string says whether it holds, not whether this call asked.
        steady = device.type == "cpu" and (steady_malloc() if config.steady_malloc else malloc_is_steady())

        report("memory", 0, 1)
        memory_rise = _memory_rise(model, whole, inputs, target, loss_fn, (clock, device))
        loss_rise_bytes = loss_rise(model, whole, inputs, target, loss_fn, device)
        report("sizes", 0, 1)
        sizes = _first_run(traced, inputs, target, loss_fn, config.spec)
        model.zero_grad(set_to_none=True)
        _check_backward(whole, inputs, target, loss_fn, config.spec)
        cut = _usable_cut(traced, inputs, target, loss_fn, clock)
        model.zero_grad(set_to_none=True)

        rounds = config.warmup + config.repeats
        steps: list[float] = []
        samples: list[StepTimes] = []
        updater = UpdateTimer(traced, config.optimizer, config.momentum, clock, whole=anchored(device.type))
        updates: list[dict[str, float]] = []
        whole_updates: list[float] = []
        overheads: list[float] = []
        loads: dict[str, list[float]] = {name: [] for name in FETCHES}
        cuts: list[tuple[float, float]] = []  # (forward, backward) ms: the step cut in two less whole
        splits: list[tuple[float, float, float]] = []  # after the cut: (one backward, B, W) ms
        # The whole step: the user's model, which the layer sum is checked against; where the figures
        # are anchored to it (pdprof.calibrate), the traced graph itself, which pdrun's stages run (an
        # exported Hugging Face graph of aten ops runs slower than the model: GPT-2 4 x 64 at batch 8,
        # 18.9 ms a step against 14.0 on this CPU).
        stepped = traced.module if anchored(device.type) else whole
        kinds: list[Callable[[], Any]] = [
            lambda: whole_step(stepped, inputs, target, loss_fn, clock),
            lambda: profiled_step(traced.module, inputs, target, loss_fn, clock),
            lambda: cut_step(traced.module, inputs, target, loss_fn, clock, None),
            lambda: cut_step(traced.module, inputs, target, loss_fn, clock, cut),
            # The part after the cut as a stage: one backward, then B and W (pdprof.split_timing).
            lambda: split_after_cut(traced.module, inputs, target, loss_fn, clock, str(cut), False),
            lambda: split_after_cut(traced.module, inputs, target, loss_fn, clock, str(cut), True),
        ]
        order = [0, 1, 2, 3, 4, 5] if cut is not None else [0, 1]
        for r in range(rounds):
            # Alternate the order, so that no kind of step always runs on a warmer cache.
            results: dict[int, Any] = {}
            for k in order if r % 2 == 0 else order[::-1]:
                results[k] = kinds[k]()
                if k == 1:
                    update, overhead = updater.time()  # the profiled step's gradients are still set
                    whole_update = updater.time_whole()
                model.zero_grad(set_to_none=True)
            if r >= config.warmup:
                steps.append(results[0])
                samples.append(results[1])
                updates.append(update)
                overheads.append(overhead)
                if whole_update is not None:
                    whole_updates.append(whole_update)
                if cut is not None:
                    (wf, wb), (cf, cb) = results[2], results[3]
                    cuts.append((cf - wf, cb - wb))
                    splits.append((results[4][0], *results[5]))
            if load_batch is not None:
                # Fetching a batch is host work: on the host's clock (a CPU profile's), not CUDA events,
                # and in the warm-up rounds too, untimed, as a run's steady state is warm
                # (zoo:synthetic_images at 224 x 224, batch 32: 37, 29, 23, 20 and 19 ms for the first five
                # fetches on this 2-core host).
                # In a rotating order: the first fetch after the steps finds the caches colder.
                names = list(FETCHES)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    want_inputs, want_target = FETCHES[name]
                    start = host.mark()
                    load_batch(want_inputs, want_target)
                    if r >= config.warmup:
                        loads[name].append(host.ms(start, host.mark()))
            phase = "warmup" if r < config.warmup else "timing"
            report(phase, r + 1, rounds)
        return _assemble(
            traced,
            sizes,
            steps,
            samples,
            (updates, overheads, loads, whole_updates),
            (cut, cuts, splits),
            inputs,
            config,
            device,
            clock,
            steady,
            channels_last,
            (memory_rise, loss_rise_bytes),
        )
    finally:
        torch.set_num_threads(previous_threads)


# The memory probe's steps: the first pays for the library code and kernels it pages in, the
# next few for the allocator's free blocks, then the rise stops (the MNIST CNN at batch 64: 37,
# 43, 50, 52 MB over its first 5 steps and 52 MB at step 60; ResNet-18 at batch 16: 92 MB, then
# 101 MB from step 2 on). It runs until the rise has held for STABLE_STEPS steps.
PROBE_MIN_STEPS = 5
PROBE_MAX_STEPS = 30
STABLE_STEPS = 3


def _memory_rise(
    model: nn.Module,
    call: nn.Module,
    inputs: tuple[Any, ...],
    target: Any,
    loss_fn: LossFn,
    where: tuple[Clock, torch.device],
) -> float:
    """The high-water rise (``shared.highwater``) over the process's first training steps of the model.

    Taken before anything else trains, so the heap is as fresh as a pdrun worker's when its stage
    starts: the rise holds the gradients and saved activations of one unit and what the process
    pays beyond the model's tensors, which the planner reads off as a per-worker overhead
    (``pdplan.memory``).
    """
    clock, device = where
    # A pdrun worker has torch._dynamo imported before its memory mark (its forkserver preloads it, as
    # every optimizer imports it), so its rise holds none of the modules it pulls in. Here it would:
    # torch's MultiheadAttention given a key padding mask imports sympy and mpmath through it on its
    # first call, 486 modules and 36 MB, which the planner charged to every worker of an
    # nn.TransformerEncoder as overhead (predicted 40 MB a worker where pdrun measured 6-7).
    import torch._dynamo  # noqa: F401

    since = mark(device)
    seen: list[float] = []
    while len(seen) < PROBE_MAX_STEPS:
        try:
            whole_step(call, inputs, target, loss_fn, clock)
        except Exception:
            return math.nan  # a model or loss that fails on the batch: the sizes run next names it
        finally:
            model.zero_grad(set_to_none=True)  # as pdrun's optimizer step leaves them
        seen.append(rise(since))
        if len(seen) >= max(PROBE_MIN_STEPS, STABLE_STEPS + 1) and seen[-1] == seen[-1 - STABLE_STEPS]:
            break
    return seen[-1]


def _first_run(
    traced: TracedModel, inputs: tuple[Any, ...], target: Any, loss_fn: LossFn, spec: RunSpec
) -> dict[str, LayerSize]:
    """Measure sizes; a model or loss that fails on this batch is the user's input error, said in one line."""
    model_name = spec.model or type(traced.module).__name__
    shapes = batch_shape(inputs)
    try:
        sizes, output = measure_sizes(traced.module, inputs)
    except Exception as exc:  # any failure of user code on user data
        raise UserError(
            f"model {model_name!r} failed on a batch of shape {shapes} from {spec.data!r}: {_first_line(exc)}"
        ) from exc
    try:
        loss = loss_fn(output, target)
    except Exception as exc:
        target_shape = list(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise UserError(
            f"loss {spec.loss!r} failed on the model's output {shape_of(output)} and target {target_shape}: "
            f"{_first_line(exc)}"
        ) from exc
    _check_loss(loss, spec.loss)
    try:
        loss.backward()  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise _backward_failed(model_name, shapes, spec, exc) from exc
    return sizes


def _backward_failed(model_name: str, shapes: Any, spec: RunSpec, exc: BaseException) -> UserError:
    return UserError(
        f"model {model_name!r} failed in its backward on a batch of shape {shapes} from {spec.data!r}: "
        f"{_first_line(exc)}"
    )


def _check_backward(
    whole: nn.Module, inputs: tuple[Any, ...], target: Any, loss_fn: LossFn, spec: RunSpec
) -> None:
    """One step of the user's own model: one that writes in place a tensor its backward needs fails here, in
    one line (it said "internal error", exit 1, in the timing loop; the traced graph, which makes such
    writes out of place (shared.inplace), does not fail, so the sizes run cannot catch it)."""
    try:
        loss_fn(whole(*inputs), target).backward()  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise _backward_failed(spec.model or type(whole).__name__, batch_shape(inputs), spec, exc) from exc
    finally:
        whole.zero_grad(set_to_none=True)


def _usable_cut(
    traced: TracedModel, inputs: tuple[Any, ...], target: Any, loss_fn: LossFn, clock: Clock
) -> str | None:
    """The cut pdprof.cut times, if the model has one and a step cut there runs."""
    cut = find_cut(traced.module)
    if cut is None:
        return None
    try:
        cut_step(traced.module, inputs, target, loss_fn, clock, cut)
        split_after_cut(traced.module, inputs, target, loss_fn, clock, cut, True)
    except (RuntimeError, ValueError):
        # e.g. an in-place op on the cut's value, which a leaf that requires grad refuses
        return None
    return cut


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _check_loss(loss: Any, spec: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
        what = (
            f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        )
        why = "" if not isinstance(loss, torch.Tensor) or loss.dim() != 0 else " that does not require grad"
        raise UserError(
            f"loss {spec!r}: returned {what}{why}; expected a scalar tensor to call backward() on"
        )


def _figure(values: list[float], statistic: Statistic) -> float:
    if not values:
        return 0.0
    return float(statistics.fmean(values) if statistic == "mean" else statistics.median(values))


def _clock_name(clock: Clock, device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return "cuda events"
    wait = " less run-queue wait" if isinstance(clock, CpuClock) and clock.corrects_waits else ""
    return f"cpu perf_counter{wait}, {threads} thread(s)"


def _split_shares(
    splits: list[tuple[float, float, float]], fig: Callable[[list[float]], float]
) -> dict[str, float | None]:
    """``backward_input_share`` and ``backward_weight_share``: B's and W's figure over the fused
    backward's (None without a cut, or where the backward took no measurable time)."""
    fused = fig([f for f, _, _ in splits]) if splits else 0.0
    if fused <= 0:
        return {"backward_input_share": None, "backward_weight_share": None}
    return {
        "backward_input_share": fig([b for _, b, _ in splits]) / fused,
        "backward_weight_share": fig([w for _, _, w in splits]) / fused,
    }


def _assemble(
    traced: TracedModel,
    sizes: dict[str, LayerSize],
    steps: list[float],
    samples: list[StepTimes],
    update_samples: tuple[list[dict[str, float]], list[float], dict[str, list[float]], list[float]],
    cut_samples: tuple[str | None, list[tuple[float, float]], list[tuple[float, float, float]]],
    inputs: tuple[Any, ...],
    config: ProfileConfig,
    device: torch.device,
    clock: Clock,
    steady: bool,
    channels_last: bool,
    memory: tuple[float, float],
) -> ProfileResult:
    def fig(values: list[float]) -> float:
        return _figure(values, config.statistic)

    rows: list[dict[str, Any]] = []
    updates, overheads, loads, whole_updates = update_samples
    cut, cuts, splits = cut_samples
    # A folded parameter's own node (its read, its gradient's accumulation) is charged to its first reader.
    first_reader: dict[str, str] = {}
    for layer in traced.layers:
        for p in layer.params:
            first_reader.setdefault(p, layer.name)
    charged = {
        layer.name: [layer.name, *(p for p in layer.params if first_reader[p] == layer.name)]
        for layer in traced.layers
    }
    figures: dict[str, dict[str, float]] = {}  # per layer: forward, backward, update ms
    for layer in traced.layers:
        figures[layer.name] = {}
        for phase in ("forward", "backward"):
            values = [
                0.0 if layer.op == "input" else sum(s.of(phase).get(n, 0.0) for n in charged[layer.name])
                for s in samples
            ]
            rows += [
                {"layer": layer.name, "phase": phase, "repeat": i, "ms": v} for i, v in enumerate(values)
            ]
            figures[layer.name][phase] = fig(values)
        if layer.name in updates[0]:
            values = [u[layer.name] for u in updates]
            rows += [
                {"layer": layer.name, "phase": "update", "repeat": i, "ms": v} for i, v in enumerate(values)
            ]
        figures[layer.name]["update"] = fig([u.get(layer.name, 0.0) for u in updates])
    step_ms = fig(steps)
    loss = {
        "loss_forward_ms": fig([s.loss_forward for s in samples]),
        "loss_backward_ms": fig([s.loss_backward for s in samples]),
        "unattributed_backward_ms": fig([s.unattributed_backward for s in samples]),
    }
    measured_sum = sum(f["forward"] + f["backward"] for f in figures.values())
    scale = calibrate(
        device.type,
        step_ms,
        measured_sum + sum(loss.values()),
        fig(whole_updates) if whole_updates else None,
        sum(f["update"] for f in figures.values()),
    )
    nodes: list[Node] = []
    owned = owned_parameter_bytes(traced)  # a tensor several layers read counts once (graph.ties)
    tied = ties(traced)
    for layer in traced.layers:
        size, f = sizes[layer.name], figures[layer.name]
        nodes.append(
            Node(
                id=layer.name,
                op=layer.op,
                target=layer.target,
                forward_ms=f["forward"] * scale.compute,
                backward_ms=f["backward"] * scale.compute,
                update_ms=f["update"] * scale.update,
                activation_bytes=size.activation_bytes,
                activation_parts=[float(p) for p in size.activation_parts] if size.activation_parts else None,
                parameter_bytes=owned[layer.name],
                saved_bytes=size.saved_bytes,
                output_shape=size.output_shape,
            )
        )
    by_name = {n.id: n for n in nodes}
    edges = [Edge(source=s, target=t, bytes=by_name[s].activation_bytes) for s, t in traced.edges()]
    layer_sum = sum(n.forward_ms + n.backward_ms for n in nodes)
    method = (
        _clock_name(clock, device, config.threads)
        + ("; glibc malloc thresholds fixed" if steady else "")
        + "; forward per fx node; backward split at autograd node hooks; interleaved with whole steps"
        + f"; {config.statistic} of the rounds"
        + (
            "; scaled to the whole step and one optimizer step (calibration)"
            if scale != Calibration()
            else ""
        )
    )
    timing = Timing(
        method=method,
        warmup=config.warmup,
        repeats=config.repeats,
        step_ms=step_ms,
        layer_sum_ms=layer_sum,
        ratio=layer_sum / step_ms if step_ms > 0 else None,
    )
    extras = {
        **{name: ms * scale.compute for name, ms in loss.items()},
        "update": describe(config.optimizer, config.momentum),
        "update_overhead_ms": fig(overheads) if updates and updates[0] else 0.0,
        **{name: fig(samples) for name, samples in loads.items()},
        # The factors pdprof.calibrate applied (CUDA), and the layer sum / whole step before them.
        "calibration": scale.as_record(measured_sum / step_ms if step_ms > 0 else None),
        "cut_at": cut,
        "cut_forward_ms": fig([f for f, _ in cuts]) if cut is not None else None,
        "cut_backward_ms": fig([b for _, b in cuts]) if cut is not None else None,
        # Zero bubble's B and W of the part after the cut, over its one backward (pdprof.split_timing).
        **_split_shares(splits, fig),
        "memory_format": "channels-last" if channels_last else "contiguous",
        "concurrent": config.concurrent,
        # The whole model's first training steps, one unit, gradients and no optimizer state:
        # the planner's per-worker overhead is this less its own terms (pdplan.memory).
        "memory_rise_bytes": memory[0] if math.isfinite(memory[0]) else None,
        # Of that, the loss's own (pdprof.loss_memory): the last stage's alone.
        "loss_rise_bytes": memory[1] if math.isfinite(memory[1]) else None,
        # Layers that read one parameter (a tied embedding and head): pdrun sums its gradient over
        # the stages holding it, which the planner's simulation charges (pdplan.schedule_sim), and every
        # stage holding one of them holds a copy, of "tie_bytes" (pdplan.memory.stage_parameter_bytes).
        "ties": [layers for layers, _ in tied],
        "tie_bytes": [size for _, size in tied],
        "host": platform.node(),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
    }
    graph = LayerGraph(
        spec=config.spec,
        batch_size=config.batch_size,
        input_shape=batch_shape(inputs),
        device=str(device),
        threads=config.threads,
        timing=timing,
        graph=extras,
        nodes=nodes,
        edges=edges,
    )
    table = pd.DataFrame(rows, columns=["layer", "phase", "repeat", "ms"])
    meta = {
        "spec": config.spec.model_dump(),
        "batch_size": config.batch_size,
        "device": str(device),
        "threads": config.threads,
        "graph_hash": graph.structure_hash(),
        "step_ms": steps,
        "cut_ms": [f + b for f, b in cuts],
    }
    return ProfileResult(graph, table, meta)
