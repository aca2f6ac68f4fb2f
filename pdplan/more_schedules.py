"""Planning for the second-wave schedules: interleaved 1F1B's chunks, 2BW's least microbatches.

``plan_for`` is what ``pdplan`` calls: PipeDream's three and zb-h1 plan as ``make_plan``
does; ``2bw`` then takes at least as many microbatches per step as units in flight (the
paper's m >= depth); ``interleaved-1f1b`` with ``--virtual-stages V`` on S workers cuts
V x S chunks of consecutive layers, the split whose program simulates fastest
(``pdplan.auto.best_chunking``: every split of a small graph, else the DP's for V x S
straight stages, which balances the chunks against each other, and a balanced split), and
puts chunk c of worker w at ``stages[c * S + w]`` on worker w's rank
(Narayanan et al., SC'21, section 2.2: "each device is assigned multiple pipeline stages
(model chunks)", round-robin); ``zb-v`` asks for 2 x S chunks the same way and places them
in a V, chunk 1 of worker w at ``stages[2S - 1 - w]`` (Qi et al., ICLR'24, section 6), 2S
microbatches a step unless told (at least the 2S - 1 that fill the paper's V,
``shared.schedule_more.zb_v_orders``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pdplan.build import PlanConfig, make_plan, over_memory, with_memory
from pdplan.costs import allreduce_s, data_parallel_time
from shared.blame import naming_source
from shared.errors import PlanError, UserError
from shared.graph import LayerGraph
from shared.plan import Level, Plan, StagePrediction
from shared.schedule import VSHAPED, chunk_owner, chunk_virtual, make_pipeline, pipeline
from shared.schedule_more import two_bw_depth


def plan_for(graph: LayerGraph, config: PlanConfig, virtual_stages: int | None = None) -> Plan:
    """The plan of ``config``'s schedule: ``make_plan``, or its chunked / 2BW form; UserError on bad options."""
    if config.schedule == "interleaved-1f1b":
        return make_interleaved_plan(graph, config, 2 if virtual_stages is None else virtual_stages)
    if config.schedule == "zb-v":
        if virtual_stages not in (None, 2):
            raise UserError(
                f"--virtual-stages: zb-v places exactly 2 model chunks on each worker (a V), got {virtual_stages}"
            )
        return make_interleaved_plan(graph, config, 2)
    if config.schedule == "auto":
        if virtual_stages is not None and virtual_stages > 1 and len(config.workers) != 1:
            raise UserError(
                f"--virtual-stages: interleaved-1f1b plans one level of workers, got --workers "
                f"{','.join(map(str, config.workers))}; drop --virtual-stages or give one level"
            )
        # auto tries interleaved-1f1b at this V only (V = 1: not at all), pdplan.auto.
        return make_plan(graph, replace(config, virtual_stages=virtual_stages))
    if virtual_stages not in (None, 1):
        raise UserError(
            f"--virtual-stages: {config.schedule} runs one model chunk per worker; "
            "use --schedule interleaved-1f1b --virtual-stages V"
        )
    plan = make_plan(graph, config)
    if config.schedule == "2bw" and config.microbatches is None:
        plan = plan.model_copy(update={"microbatches": two_bw_microbatches(plan)})
    _check_schedule(plan, config)
    return plan


def two_bw_microbatches(plan: Plan) -> int:
    """2BW's default step: the fewest microbatches >= the units in flight, a multiple of every stage's replicas."""
    return two_bw_least([s.replicas for s in plan.stages])


def two_bw_least(replicas: Sequence[int]) -> int:
    """:func:`two_bw_microbatches` of stages with these replicas."""
    least = max(len(replicas), two_bw_depth(pipeline(replicas)))
    step = math.lcm(*replicas)
    return -(-least // step) * step


def make_interleaved_plan(graph: LayerGraph, config: PlanConfig, virtual_stages: int) -> Plan:
    """V x S chunks of consecutive layers, chunk c of worker w at ``stages[c * S + w]`` (see the module's note;
    zb-v's V at ``shared.schedule.chunk_virtual``'s)."""
    v = virtual_stages
    name = config.schedule
    if len(config.workers) != 1:
        raise UserError(
            f"--virtual-stages: {name} plans one level of workers, got --workers "
            f"{','.join(map(str, config.workers))}; give one level (e.g. --workers 4 --bandwidth 1e10)"
        )
    if v < 2:
        raise UserError(f"--virtual-stages: {name} needs at least 2 chunks per worker, got {v}")
    n = config.workers[0]
    if n < 2:
        raise UserError(f"--workers: {name} needs at least 2 workers, got {n}")
    m = config.microbatches or (2 * n if name == "zb-v" else n)
    from pdplan.auto import best_chunking  # pdplan.auto builds on this module

    best = best_chunking(graph, config, v, name, m)
    if best is not None:
        _check_schedule(best, config)
        return best
    # No split runs and fits: the DP's chunks say why, in the lines below.
    try:
        # The paper's memory rule counts n * v workers of one chunk each: the limit is checked per worker below.
        chunks = make_plan(
            graph, replace(config, workers=(n * v,), straight=True, microbatches=None, memory=None)
        )
    except PlanError as err:
        if "layers to split" not in str(err):
            raise
        # make_plan's line speaks of the n * v straight workers it was given, not of the user's options.
        raise PlanError(
            f"graph: no plan fits: {name} cuts the graph into --virtual-stages x --workers = "
            f"{v} x {n} = {n * v} chunks of consecutive layers, more than it has layers to split; "
            "lower --virtual-stages or --workers"
        ) from None
    plan = interleave(graph, chunks, config.levels(), v, m, config.straight, schedule=name)
    _check_schedule(plan, config)
    if config.memory is not None:
        over = over_memory(plan, config.memory)
        if over is not None:
            raise PlanError(
                over
                + f", nor does any other split into {v} x {n} chunks tried; raise --memory, add workers, "
                "or let pdplan search (--schedule auto)"
            )
    return plan


def interleave(
    graph: LayerGraph,
    flat: Plan,
    levels: list[Level],
    chunks: int,
    microbatches: int,
    straight: bool,
    memory: bool = True,
    schedule: str = "interleaved-1f1b",
) -> Plan:
    """``flat``'s ``chunks x S`` stages as ``schedule``'s chunks: chunk c of worker stage w at ``stages[c S + w]``
    (zb-v: in a V, ``shared.schedule.chunk_virtual``).

    ``flat``'s stages each carry r replicas (``levels``' N workers = S x r): worker stage w
    runs on ranks ``w r .. w r + r - 1``, every replica a pipeline of its own (``shared.schedule_more``).
    Each chunk runs on its worker's ranks; a worker's predicted time is its chunks' (see
    :func:`worker_bounds`), and the memory model counts what each chunk holds under the
    interleaved program (``pdplan.memory``), a worker's memory being its chunks' sum
    (``memory=False``: left as ``flat``'s, for a caller that adds it later with ``with_memory``).
    """
    v = chunks
    n = len(flat.stages) // v  # worker stages
    r = math.prod(level.workers for level in levels) // n  # each one's replicas
    assert flat.predicted is not None and flat.cluster is not None
    assert all(stage.replicas == r for stage in flat.stages), "flat's chunks carry the replicas they run at"
    vshape = schedule in VSHAPED

    def worker(s: int) -> int:
        return chunk_owner(n, s, vshape)[0]

    # Worker stage w's replicas are ranks w r .. w r + r - 1, as pdrun numbers them.
    stages = [
        stage.model_copy(update={"ranks": [worker(s) * r + j for j in range(r)]})
        for s, stage in enumerate(flat.stages)
    ]
    costs = [st.predicted for st in stages]
    bounds = worker_bounds([bounds_of(c) for c in costs], n, vshape)
    worst = max(range(n), key=lambda w: bounds[w])
    t = bounds[worst]
    # The stage field names a stage (bench/bench_predict.py reads stages[bottleneck_stage]): the
    # bottleneck worker's slowest chunk.
    slowest = max(
        (chunk_virtual(n, worst, c, vshape) for c in range(v)), key=lambda s: max(bounds_of(costs[s]))
    )
    compute = sum(st.predicted.compute_s for st in stages if st.predicted)
    params = sum(st.predicted.parameter_bytes for st in stages if st.predicted)
    dp = data_parallel_time(compute, params, levels)
    predicted = flat.predicted.model_copy(
        update={
            "time_per_minibatch_s": t,
            "throughput_samples_per_s": graph.batch_size / t if t > 0 else None,
            "bottleneck_stage": slowest,
            "data_parallel_time_per_minibatch_s": dp,
            "data_parallel_throughput_samples_per_s": graph.batch_size / dp if dp > 0 else None,
            "data_parallel_communication_bytes_per_sample": allreduce_s(params, n * r, 1.0)
            / graph.batch_size,
            "speedup_over_data_parallel": dp / t if t > 0 else None,
        }
    )
    plan = Plan.model_validate(
        flat.model_copy(
            update={
                "schedule": schedule,
                "microbatches": microbatches,
                "in_flight": n,
                "virtual_stages": v,
                "world_size": n * r,
                "stages": stages,
                "cluster": flat.cluster.model_copy(update={"levels": levels, "straight": straight}),
                "predicted": predicted,
            }
        ).model_dump()
    )
    return with_memory(plan, graph) if memory else plan


def bounds_of(pred: StagePrediction | None) -> tuple[float, float]:
    """A stage's (time, communication) terms of the paper's cost, zero when it has no prediction."""
    return (0.0, 0.0) if pred is None else (pred.time_s, pred.communication_s)


def worker_bounds(
    stage_terms: Sequence[tuple[float, float]], workers: int, vshape: bool = False
) -> list[float]:
    """Per worker of an interleaved plan, the paper's bound summed over its chunks: ``max(sum time, sum comm)``.

    ``stage_terms`` are each chunk's (time, communication) (``pdplan.costs.StageCost``): a
    worker runs its V chunks one after another, and its link carries every chunk's cuts, so
    both its compute and its transfers add up, the larger bounding the worker as
    ``StageCost.bound_s`` bounds a stage.
    """
    time = [0.0] * workers
    comm = [0.0] * workers
    for s, (t, c) in enumerate(stage_terms):
        w = chunk_owner(workers, s, vshape)[0]
        time[w] += t
        comm[w] += c
    return [max(t, c) for t, c in zip(time, comm, strict=True)]


def _check_schedule(plan: Plan, config: PlanConfig) -> None:
    """ScheduleError (one line, exit 2) when the plan's schedule cannot run on its stages and microbatches,
    naming ``--microbatches`` where the user gave it."""
    workers = len(plan.stages) // plan.virtual_stages
    given = {} if config.microbatches is None else {"microbatches": config.microbatches}
    with naming_source(given, None):
        make_pipeline(
            plan.schedule,
            [s.replicas for s in plan.stages[:workers]],
            microbatches=plan.microbatches,
            chunks=plan.virtual_stages,
        )
