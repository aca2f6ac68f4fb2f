"""Planning for the second-wave schedules: interleaved 1F1B's chunks, 2BW's least microbatches.

``plan_for`` is what ``pdplan`` calls: PipeDream's three and zb-h1 plan as ``make_plan``
does; ``2bw`` then takes at least as many microbatches per step as units in flight (the
paper's m >= depth); ``interleaved-1f1b`` with ``--virtual-stages V`` on S workers asks the
DP for V x S straight stages of consecutive layers (the chunks, balanced against each
other) and puts chunk c of worker w at ``stages[c * S + w]`` on worker w's rank
(Narayanan et al., SC'21, section 2.2: "each device is assigned multiple pipeline stages
(model chunks)", round-robin).
"""

from __future__ import annotations

import math
from dataclasses import replace

from pdplan.build import PlanConfig, make_plan
from pdplan.costs import allreduce_s, data_parallel_time
from shared.errors import PlanError, UserError
from shared.graph import LayerGraph
from shared.plan import Plan
from shared.schedule import make_pipeline, pipeline
from shared.schedule_more import two_bw_depth


def plan_for(graph: LayerGraph, config: PlanConfig, virtual_stages: int | None = None) -> Plan:
    """The plan of ``config``'s schedule: ``make_plan``, or its chunked / 2BW form; UserError on bad options."""
    if config.schedule == "interleaved-1f1b":
        return make_interleaved_plan(graph, config, 2 if virtual_stages is None else virtual_stages)
    if virtual_stages not in (None, 1):
        raise UserError(
            f"--virtual-stages: {config.schedule} runs one model chunk per worker; "
            "use --schedule interleaved-1f1b --virtual-stages V"
        )
    plan = make_plan(graph, config)
    if config.schedule == "2bw" and config.microbatches is None:
        plan = plan.model_copy(update={"microbatches": two_bw_microbatches(plan)})
    _check_schedule(plan)
    return plan


def two_bw_microbatches(plan: Plan) -> int:
    """2BW's default step: the fewest microbatches >= the units in flight, a multiple of every stage's replicas."""
    replicas = [s.replicas for s in plan.stages]
    least = max(len(replicas), two_bw_depth(pipeline(replicas)))
    step = math.lcm(*replicas)
    return -(-least // step) * step


def make_interleaved_plan(graph: LayerGraph, config: PlanConfig, virtual_stages: int) -> Plan:
    """V x S chunks of consecutive layers, chunk c of worker w at ``stages[c * S + w]`` (see the module's note)."""
    v = virtual_stages
    if len(config.workers) != 1:
        raise UserError(
            f"--virtual-stages: interleaved-1f1b plans one level of workers, got --workers "
            f"{','.join(map(str, config.workers))}; give one level (e.g. --workers 4 --bandwidth 1e10)"
        )
    if config.memory is not None:
        raise UserError(
            "--memory: the memory limit is not modelled for interleaved-1f1b's chunks yet (a worker holds V "
            "of them); plan without --memory"
        )
    if v < 2:
        raise UserError(f"--virtual-stages: interleaved-1f1b needs at least 2 chunks per worker, got {v}")
    n = config.workers[0]
    if n < 2:
        raise UserError(f"--workers: interleaved-1f1b needs at least 2 workers, got {n}")
    try:
        chunks = make_plan(graph, replace(config, workers=(n * v,), straight=True, microbatches=None))
    except PlanError as err:
        if "layers to split" not in str(err):
            raise
        # make_plan's line speaks of the n * v straight workers it was given, not of the user's options.
        raise PlanError(
            f"graph: no plan fits: interleaved-1f1b cuts the graph into --virtual-stages x --workers = "
            f"{v} x {n} = {n * v} chunks of consecutive layers, more than it has layers to split; "
            "lower --virtual-stages or --workers"
        ) from None
    stages = [stage.model_copy(update={"ranks": [s % n]}) for s, stage in enumerate(chunks.stages)]
    levels = config.levels()
    # A worker runs its V chunks one after another: its time is their sum (the DP balanced the chunks).
    per_worker = [sum(st.predicted.time_s for st in stages[w::n] if st.predicted) for w in range(n)]
    t = max(per_worker)
    compute = sum(st.predicted.compute_s for st in stages if st.predicted)
    params = sum(st.predicted.parameter_bytes for st in stages if st.predicted)
    dp = data_parallel_time(compute, params, levels)
    assert chunks.predicted is not None and chunks.cluster is not None
    predicted = chunks.predicted.model_copy(
        update={
            "time_per_minibatch_s": t,
            "throughput_samples_per_s": graph.batch_size / t if t > 0 else None,
            "bottleneck_stage": max(range(n), key=lambda w: per_worker[w]),
            "data_parallel_time_per_minibatch_s": dp,
            "data_parallel_throughput_samples_per_s": graph.batch_size / dp if dp > 0 else None,
            "data_parallel_communication_bytes_per_sample": allreduce_s(params, n, 1.0) / graph.batch_size,
            "speedup_over_data_parallel": dp / t if t > 0 else None,
        }
    )
    plan = Plan.model_validate(
        chunks.model_copy(
            update={
                "schedule": "interleaved-1f1b",
                "microbatches": config.microbatches or n,
                "in_flight": n,
                "virtual_stages": v,
                "world_size": n,
                "stages": stages,
                "cluster": chunks.cluster.model_copy(update={"levels": levels, "straight": config.straight}),
                "predicted": predicted,
            }
        ).model_dump()
    )
    _check_schedule(plan)
    return plan


def _check_schedule(plan: Plan) -> None:
    """ScheduleError (one line, exit 2) when the plan's schedule cannot run on its stages and microbatches."""
    workers = len(plan.stages) // plan.virtual_stages
    make_pipeline(
        plan.schedule,
        [s.replicas for s in plan.stages[:workers]],
        microbatches=plan.microbatches,
        chunks=plan.virtual_stages,
    )
