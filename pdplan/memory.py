"""The memory model: what one worker of each stage holds at its peak, by part.

Per worker of stage s, with ``P`` the bytes of its layers' parameters and ``A`` what it
holds per unit until that unit's backward: the bytes its layers' tensors take that some
layer saves for backward (the graph's measured ``saved_bytes``, each tensor once, charged
to the layer that made it; a graph that measured none, such as an imported PipeDream
profile, counts each layer's output ``activation_bytes`` instead, as the paper's optimizer
does), plus the values it receives from earlier stages (each once: the worker keeps them
for their gradients, and the copy the sender saved is the sender's), plus the values it
sends on that none of its layers saved (pdrun's worker keeps a unit's outputs until their
gradients come back, to start the backward from them):

    weights     = versions x P   (the live weights and every stashed version)
    gradients   = P
    optimizer   = k x P          (k = 0 for plain SGD, 1 for SGD with momentum, 2 for Adam)
    activations = held x A
    messages    = sum over its links of bytes x (held_sender + held_receiver)
    overhead    = F + (O - F) x share         (once per worker process; O = R - (P_all + A_all) - L)
    loss        = L                           (the last stage: the loss's own, pdprof.loss_memory)

The messages are the transport's buffers, which both ends of a link map and touch (pdrun's
shared-memory slots, ``pdrun.transport.shm``; over gloo, the posted receives): a link carries
an activation for each unit its sender has forwarded and not yet backwarded, and a gradient
for each its receiver has, so about ``held`` of each are in flight at once. Measured on the
MNIST CNN cut after ``conv1`` (1F1B, two workers, 3.2 MB a message): 9.4 MB of shared memory
in each worker's resident set, three slots, where the sender holds two units and the receiver one.

The overhead is what a process training the model holds beyond the model's own tensors: oneDNN's
kernels' caches and scratch buffers, and the free blocks glibc's heap keeps (pdrun, like pdprof,
fixes malloc's thresholds and never trims), not the library code it pages in (shared by every
process on the host and counted by neither side, ``shared.highwater``). It is measured, not
modelled: pdprof runs the whole model's first training steps and records the high-water rise ``R``
(``graph.memory_rise_bytes``), and the part of ``R`` the terms above do not explain (the whole
model as one stage, one unit held, plain SGD: gradients ``P_all`` and saved activations
``A_all``) is the whole model's overhead, less the loss's part ``L`` (``graph.loss_rise_bytes``:
the loss's saved tensors and its backward's on the model's output, measured alone), which only the
last stage pays. On the zoo's GPT with GPT-2's 50,257-token vocabulary (batch 16 x 64 tokens) ``L``
is about 600 MB of a 645 MB overhead: the first stage measured 94-123 MB where charging it the whole
overhead predicted 708-717 MB.

A worker pays a fixed part of ``O`` whatever its stage, and the rest by its share. The rule is
empirical: the process floor ``F`` (15 MB, at most ``O``), plus the rest of ``O`` times the
stage's share of the whole model's step tensors (gradients twice, made and accumulated, plus
saved activations; :func:`tensor_share`), so that the whole model as one stage gets ``O``
exactly. A stage of under a tenth of those tensors pays the floor in proportion to its share
(``FLOOR_RAMP_SHARE``, since 2026-12-07 evening: a stage of 0.4% of them rose 0.6-1.0 MB, not
9.4). Fitted (2026-12-07, the measure without library pages) on the stages of eight models,
three runs (``bench.fit_memory``): the harness's MNIST CNN, residual MLP and 2-block GPT (1F1B,
1F1B-flush, GPipe; 12 steps) and the prediction benchmark's cases (torchvision's ResNet-18,
MobileNetV2 and VGG-16 recipes, transformers' BERT and GPT-2, the MNIST CNN and a 512-wide
residual MLP; two workers, 1F1B, momentum, 160-310 steps). 64 of 92 within 20% (the rule before, a
2.5 MB floor and the square root of the share, 59), and 64 with each model's stages predicted by
the rule fitted without them. The misses are GPT-2's stages after 310 steps, where glibc's heap has
grown past the early peak the probe measures (1.28-1.62, docs/pdplan.md), BERT's and the MNIST
CNN's first stages, whose measured peaks move from run to run (the same 1F1B plan: 31.0 and 41.4
MB), and a stage of almost nothing (0.4% of the tensors, rising 0.8 MB), which the floor charges
15 MB. Most models' whole overhead is below the floor,
so each of their workers pays all of it: the MNIST CNN's 13-18 MB, the 2-block GPT's 7.6 MB,
BERT's 2.8 MB. ResNet-18 at batch 16 has 52 MB, of which a stage of 31% of the tensors pays 26
MB. A graph without the probe (an imported PipeDream profile, a graph from before it) has none.

``held`` is the most units the worker has forwarded and not yet backwarded at once, read
off the schedule's own program (``shared.schedule.peak_held``), not from a second
formula: GPipe holds all of a step's M units (its replica's share), 1F1B-flush
``min(M, S - s)``, 1F1B PipeDream's in-flight bound. Weight versions follow the paper's
stashing rule (Harlap et al., SOSP 2019, section 3.3: "Weight stashing maintains multiple
versions of the weights, one for each active minibatch"): under ``1f1b`` a stage keeps
one version per unit in flight (the newest of which shares the live weights' memory, see
``pdrun.weights``), with vertical sync the input stage's count (a unit may name any
version the input stage used while it was in flight); the flushing schedules keep one.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

from shared.graph import LayerGraph
from shared.plan import Plan, StageMemory, crossing_values
from shared.schedule import (
    VSHAPED,
    Instr,
    Kind,
    ScheduleError,
    build_program,
    chunk_owner,
    get_schedule,
    make_pipeline,
    peak_held,
)

# Schedules whose workers run PipeDream's 1F1B order (``shared.schedule.one_f_one_b_order``): their
# warm-up forwards, then a forward only after a backward, so a worker holds the most at its first
# backward. Reading each worker's instructions up to there gives the peak of the whole program:
# on 1,024 workers (bench_planner's 2,000-layer chain, 224 stages) the whole program was 5 million
# instructions and half the planner's 16.6 s.
WARMUP_PEAKED = ("1f1b", "2bw")

# Optimizer state per parameter byte (torch.optim: SGD keeps a momentum buffer only when
# momentum is set; Adam keeps exp_avg and exp_avg_sq).
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}


def saved_per_unit(graph: LayerGraph, layers: Sequence[str]) -> float:
    """Bytes ``layers`` save for backward per unit (their outputs when the graph measured none).

    Measured saved bytes are charged to the layer that made each tensor, each tensor once
    (``pdprof.sizes``), so a model input saved by the first layer counts at its input node.
    """
    measured = any(n.saved_bytes > 0 for n in graph.nodes)
    nodes = {n.id: n for n in graph.nodes}
    return float(
        sum(
            (nodes[layer].saved_bytes if measured else nodes[layer].activation_bytes)
            for layer in layers
            if layer in nodes and (measured or nodes[layer].op != "input")
        )
    )


def sent_per_unit(graph: LayerGraph, layers: Sequence[str]) -> float:
    """Bytes of the values ``layers`` pass to layers outside them per unit that they did not save.

    pdrun's worker keeps each unit's sent values until the unit's backward starts from them
    (``pdrun.worker``). A value its maker saved is already in :func:`saved_per_unit`; that part
    of its output is not counted twice (``max(0, output - saved)``, the maker's saved bytes
    being mostly its output: a ReLU's, a softmax's). A graph that measured no saved bytes
    counts every output as saved already: nothing more.
    """
    if not any(n.saved_bytes > 0 for n in graph.nodes):
        return 0.0
    inside = set(layers)
    nodes = {n.id: n for n in graph.nodes}
    sources = {e.source for e in graph.edges if e.source in inside and e.target not in inside}
    return float(
        sum(max(0.0, nodes[v].activation_bytes - nodes[v].saved_bytes) for v in sources if v in nodes)
    )


Crossings = dict[tuple[int, int], set[str]]  # per stage edge, the values crossing it (crossing_values)


def _crossings(graph: LayerGraph, stages: Sequence[Sequence[str]], chunked: bool) -> Crossings:
    owner = {layer: s for s, layers in enumerate(stages) for layer in layers}
    return crossing_values(graph, owner, chunked)


def message_bytes(
    graph: LayerGraph,
    stages: Sequence[Sequence[str]],
    held: Sequence[int],
    chunked: bool = False,
    crossings: Crossings | None = None,
) -> list[float]:
    """Per stage, the transport's buffers for its links (module doc): each link's bytes per unit
    times the units its two ends hold, charged to both ends. ``chunked``: the stages are a chunked
    plan's, whose values go along the chain of chunks (``shared.plan.crossing_values``, or
    ``crossings`` where the caller has them)."""
    nodes = {n.id: n for n in graph.nodes}
    out = [0.0] * len(stages)
    for (a, b), values in (_crossings(graph, stages, chunked) if crossings is None else crossings).items():
        buffers = sum(nodes[v].activation_bytes for v in values if v in nodes) * (held[a] + held[b])
        out[a] += buffers
        out[b] += buffers
    return out


def relayed_bytes(
    graph: LayerGraph, stages: Sequence[Sequence[str]], crossings: Crossings | None = None
) -> list[float]:
    """Per chunk of a chunked plan, the bytes of the values it relays per unit (``pdrun.partition``):
    received from the chunk before and sent on, read by none of its layers. It keeps them, as every
    received value, until the unit's backward. ``crossings``: the plan's chunked crossings, where the
    caller has them."""
    owner = {layer: s for s, layers in enumerate(stages) for layer in layers}
    nodes = {n.id: n for n in graph.nodes}
    read: list[set[str]] = [set() for _ in stages]
    for e in graph.edges:
        if e.target in owner:
            read[owner[e.target]].add(e.source)
    out = [0.0] * len(stages)
    for (_, b), values in (
        _crossings(graph, stages, True) if crossings is None else crossings
    ).items():  # hops (b - 1, b) only
        out[b] += sum(nodes[v].activation_bytes for v in values - read[b] if v in nodes)
    return out


def received_per_unit(graph: LayerGraph, layers: Sequence[str]) -> float:
    """Bytes of the values ``layers`` take from outside them per unit, each value once.

    pdrun's worker keeps every unit's received values until that unit's backward (it reads
    their gradients to send back, ``pdrun.worker``): a stage's own copy, beside the sender's.
    """
    inside = set(layers)
    nodes = {n.id: n for n in graph.nodes}
    sources = {e.source for e in graph.edges if e.target in inside and e.source not in inside}
    return float(sum(nodes[v].activation_bytes for v in sources if v in nodes))


def weight_grad_per_unit(graph: LayerGraph, layers: Sequence[str]) -> float:
    """Bytes a unit keeps from its B to its W under a split backward: the gradient arriving at each layer that
    reads a parameter, the size of its output (``shared.weight_pass``: W starts from them)."""
    inside = set(layers)
    tied = {layer for readers, _ in graph.ties() for layer in readers}
    return float(
        sum(
            n.activation_bytes
            for n in graph.nodes
            if n.id in inside and (n.parameter_bytes > 0 or n.id in tied)
        )
    )


def awaiting_units(plan: Plan) -> list[int]:
    """Per stage, the most units one of its workers has past B and not yet past W (0 without a split backward)."""
    return [waiting for _, waiting in _stage_peaks(plan)]


def held_units(plan: Plan) -> list[int]:
    """Per stage, the most units one of its workers holds at once under the plan's schedule."""
    return [held for held, _ in _stage_peaks(plan)]


def _stage_peaks(plan: Plan) -> list[tuple[int, int]]:
    """:func:`_peaks` for ``plan``, per stage as the plan lists them."""
    v = plan.virtual_stages
    workers = len(plan.stages) // v
    peaks = _peaks(
        plan.schedule,
        tuple(s.replicas for s in plan.stages[:workers]),
        plan.microbatches,
        plan.in_flight if plan.schedule == "1f1b" else None,
        v,
    )
    # Chunked: the peaks are per virtual stage, as stages lists them.
    return [
        peaks[s] if len(peaks) == len(plan.stages) else peaks[s % workers] for s in range(len(plan.stages))
    ]


def _held(
    schedule: str, replicas: tuple[int, ...], microbatches: int, in_flight: int | None, chunks: int
) -> tuple[int, ...]:
    """Per stage (per virtual stage when chunked), the most units one worker holds: :func:`_peaks`' first."""
    return tuple(held for held, _ in _peaks(schedule, replicas, microbatches, in_flight, chunks))


@functools.lru_cache(maxsize=4096)
def _peaks(
    schedule: str, replicas: tuple[int, ...], microbatches: int, in_flight: int | None, chunks: int
) -> tuple[tuple[int, int], ...]:
    """Read off the program pdrun runs, over enough units that the peak is reached: one flush
    step, or a 1F1B run well past its warm-up at every stage. Its compute instructions alone
    (``messages=False``) tell what is held; the messages around them do not change it, and
    leaving them out makes the schedule search's memory checks about twice as fast. Per stage: the
    units held (forwarded, and not yet backwarded or, where the backward is split, not yet past W),
    and of those the most past their B (zero bubble's W reads what B kept)."""
    period = math.lcm(*replicas, microbatches)
    if schedule == "1f1b":
        wanted = 2 * ((in_flight or microbatches) + len(replicas)) * max(replicas) * max(1, microbatches)
    elif schedule == "2bw":
        # 1F1B's order, whose peak is its warm-up (at most M units, 2bw's rule): a few steps past it.
        wanted = 2 * (microbatches + len(replicas)) * max(replicas)
    else:
        wanted = microbatches
    units = -(-wanted // period) * period
    try:
        if schedule in WARMUP_PEAKED:
            return tuple(
                (held, 0) for held in _warmup_peaks(schedule, replicas, units, microbatches, in_flight)
            )
        program = build_program(
            schedule,
            replicas,
            units,
            microbatches=microbatches,
            in_flight=in_flight,
            chunks=chunks,
            messages=False,
        )
    except ScheduleError:
        # Options this schedule refuses (pdplan.more_schedules fixes them after the DP): all M held.
        return tuple((max(1, microbatches), 0) for _ in replicas)
    if chunks > 1:
        # Each chunk holds the units it forwarded and has not backwarded: counted per chunk, by virtual stage.
        s_ = len(replicas)
        owners = [chunk_owner(s_, v, schedule in VSHAPED) for v in range(chunks * s_)]
        return tuple(_unit_peaks(program[(w, 0)], c) for w, c in owners)
    peaks = {w: _unit_peaks(instrs) for w, instrs in program.items()}
    return tuple(
        (max(peaks[(s, r)][0] for r in range(n)), max(peaks[(s, r)][1] for r in range(n)))
        for s, n in enumerate(replicas)
    )


def _warmup_peaks(
    schedule: str, replicas: tuple[int, ...], units: int, microbatches: int, in_flight: int | None
) -> tuple[int, ...]:
    """Per stage, the most units a worker holds under a schedule in ``WARMUP_PEAKED``: each worker's
    instructions read lazily up to its first backward, where its warm-up ends."""
    gen = get_schedule(schedule)
    pipe = make_pipeline(schedule, replicas, microbatches=microbatches, in_flight=in_flight)
    gen.check_units(pipe, units)
    peaks = {
        w: peak_held(
            itertools.takewhile(lambda i: i.kind is not Kind.BACKWARD, gen.compute(pipe, w, 0, units))
        )
        for w in pipe.workers()
    }
    return tuple(max(peaks[(s, r)] for r in range(n)) for s, n in enumerate(replicas))


def _unit_peaks(instrs: Sequence[Instr], chunk: int | None = None) -> tuple[int, int]:
    """(the most units a worker (or its chunk ``chunk``) holds at once: forwarded, and not yet backwarded or,
    where the backward is split (zb-h1, zb-v), whose weight gradients (W) are not yet taken, W reading the
    layers' saved inputs through the graph B kept; the most of those past their B, waiting for W)."""
    if not any(ins.kind is Kind.WEIGHT for ins in instrs):
        return peak_held(instrs, Kind.BACKWARD, chunk), 0
    return peak_held(instrs, Kind.WEIGHT, chunk), peak_held(instrs, Kind.WEIGHT, chunk, since=Kind.BACKWARD)


def _measured(graph: LayerGraph, key: str) -> float | None:
    value = graph.graph.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def process_overhead(graph: LayerGraph) -> float:
    """Bytes a worker's process holds beyond the model's tensors: pdprof's measured rise less the
    model's own terms for the whole model as one stage (0 when the graph measured none)."""
    measured = _measured(graph, "memory_rise_bytes")
    if measured is None:
        return 0.0
    own = sum(n.parameter_bytes for n in graph.nodes) + saved_per_unit(graph, [n.id for n in graph.nodes])
    return max(0.0, measured - own)


def output_unsaved(graph: LayerGraph) -> float:
    """Bytes of the model's outputs (the layers nothing reads) that no layer saved: the loss reads them,
    so the last stage holds them through the loss, yet they are in no layer's saved bytes (a language
    model's logits: its largest tensor)."""
    sources = {e.source for e in graph.edges}
    return float(
        sum(
            max(0.0, n.activation_bytes - n.saved_bytes)
            for n in graph.nodes
            if n.op != "input" and n.id not in sources
        )
    )


def loss_overhead(graph: LayerGraph) -> float:
    """The part of :func:`process_overhead` that is the loss's, which only the last stage pays: what the
    loss adds to a step (``graph.loss_rise_bytes``, ``pdprof.loss_memory``) plus the model's outputs it
    reads (:func:`output_unsaved`), at most the whole overhead. 0 for a graph without the probe."""
    overhead = process_overhead(graph)
    if overhead <= 0:
        return 0.0
    return min(overhead, (_measured(graph, "loss_rise_bytes") or 0.0) + output_unsaved(graph))


# The part of the whole model's overhead every worker pays, whatever its share (module doc): fitted on
# 92 stages of eight models (bench.fit_memory, three runs), 64 within 20% with each model held out,
# where the square root of the share with a 2.5 MB floor (fitted with library pages counted) gave 59.
PROCESS_FLOOR_BYTES = 15e6


def step_tensors(graph: LayerGraph, layers: Sequence[str] | None = None) -> float:
    """Bytes of the step tensors ``layers`` (None: the whole model) make: gradients counted twice (made,
    then accumulated into), plus saved activations."""
    if layers is None:
        return 2 * sum(n.parameter_bytes for n in graph.nodes) + saved_per_unit(
            graph, [n.id for n in graph.nodes]
        )
    inside = set(layers)
    return 2 * sum(n.parameter_bytes for n in graph.nodes if n.id in inside) + saved_per_unit(graph, layers)


def tensor_share(graph: LayerGraph, layers: Sequence[str], whole: float | None = None) -> float:
    """The share of the whole model's step tensors (``whole``, :func:`step_tensors` of the model, when the
    caller has it) that ``layers`` make. 1 for the whole model; 0 for an empty one."""
    whole = step_tensors(graph) if whole is None else whole
    if whole <= 0:
        return 1.0
    return min(1.0, step_tensors(graph, layers) / whole)


# A worker whose stage makes under this share of the model's step tensors pays the floor in proportion:
# the floor is what working processes hold (kernel scratch, heap slack), and a stage of almost nothing
# does almost no work. The MNIST CNN's slow-link plan cuts off a last stage of 0.4% of the tensors that
# rose 0.6-1.0 MB in every run where the full floor charged it 9.4 MB (measured / predicted 0.06-0.10);
# at 0.1 it is predicted 0.62 MB, measured / predicted 1.14 in a bench.fit_memory run and 1.54-1.58 in
# two runs after (its 0.4 MB swing is more than a fifth of it), and no other stage of that run's 32 (the
# smallest share next, 0.23) moves. One stage sets the figure: the next model with stages that small
# should check it.
FLOOR_RAMP_SHARE = 0.1


def shared_overhead(
    rest: float,
    share: float,
    floor: float = PROCESS_FLOOR_BYTES,
    power: float = 1.0,
    ramp: float = FLOOR_RAMP_SHARE,
) -> float:
    """A worker's part of the whole model's overhead ``rest``: the floor (at most ``rest``; under the
    ``ramp`` share, that times ``share / ramp``), plus the remainder times ``share ** power`` (module doc;
    ``bench.fit_memory`` tries other floors and powers)."""
    paid = min(rest, floor)
    scale = min(1.0, share / ramp) if ramp > 0 else 1.0
    return paid * scale + (rest - paid) * math.pow(share, power)


def worker_overhead(graph: LayerGraph, layers: Sequence[str]) -> float:
    """The overhead of a worker running ``layers`` (module doc): the process floor, plus the rest of the
    whole model's overhead (the loss's part aside) times its :func:`tensor_share`."""
    return shared_overhead(_rest_overhead(graph), tensor_share(graph, layers))


def _rest_overhead(graph: LayerGraph) -> float:
    """The whole model's overhead that the workers share: the loss's part goes to the last stage alone."""
    return process_overhead(graph) - loss_overhead(graph)


def stage_memory(graph: LayerGraph, plan: Plan, optimizer: str, held: Sequence[int]) -> list[StageMemory]:
    """The memory model's parts for every stage of ``plan`` (``held`` from :func:`held_units`).

    The process overhead goes to one stage per worker (an interleaved worker's first chunk, for the
    layers of all its chunks): a worker is one process, however many chunks it runs."""
    k = OPTIMIZER_STATE[optimizer]
    loss = loss_overhead(graph)
    workers = len(plan.stages) // plan.virtual_stages
    # worker_overhead per worker, the whole model's figures taken once (a plan may have 1,000 workers).
    rest, whole = _rest_overhead(graph), step_tensors(graph)
    per_worker = [
        shared_overhead(
            rest,
            tensor_share(
                graph, [layer for c in plan.worker_chunks(w) for layer in plan.stages[c].layers], whole
            ),
        )
        for w in range(workers)
    ]
    layers = [stage.layers for stage in plan.stages]
    chunked = plan.virtual_stages > 1
    crossings = _crossings(graph, layers, chunked)  # once, for the messages and the relays both
    messages = message_bytes(graph, layers, held, chunked, crossings)
    relayed = relayed_bytes(graph, layers, crossings) if chunked else [0.0] * len(layers)
    waiting = awaiting_units(plan)
    out = []
    for s, stage in enumerate(plan.stages):
        p = graph.held_parameter_bytes(stage.layers)  # tied parameters: a copy on every stage holding one
        if plan.schedule == "2bw":
            versions = 2  # PipeDream-2BW: the live weights and one shadow version
        elif plan.schedule != "1f1b":
            versions = 1
        elif plan.vertical_sync:
            versions = max(held[0], held[s])
        else:
            versions = max(1, held[s])
        a = (
            saved_per_unit(graph, stage.layers)
            + received_per_unit(graph, stage.layers)
            + sent_per_unit(graph, stage.layers)
            + relayed[s]
        )
        extra = (per_worker[s] if s < workers else 0.0) + (loss if s == len(plan.stages) - 1 else 0.0)
        # Zero bubble: a unit past its B keeps, besides its graph, the gradients its W starts from (ALBERT's
        # last stage under zb-h1 measured 37.9 MB where this model, without them and counting units only
        # until B, said 12.7, as for 1f1b-flush, which measured 16.2).
        kept = waiting[s] * weight_grad_per_unit(graph, stage.layers) if waiting[s] else 0.0
        out.append(
            StageMemory(
                weight_bytes=versions * p,
                weight_versions=versions,
                gradient_bytes=p,
                optimizer_bytes=k * p,
                activation_bytes=held[s] * a,
                units_held=held[s],
                message_bytes=messages[s],
                overhead_bytes=extra,
                weight_grad_bytes=kept,
                total_bytes=versions * p + p + k * p + held[s] * a + kept + messages[s] + extra,
            )
        )
    return out
