"""Run metrics (``pdrun.metrics/1``, Parquet) and the run's summary, from every rank's result.

One row per optimizer step and rank: ``step``, ``loss`` (NaN except on the last stage),
``rank``, ``stage``, ``replica``, ``samples_per_s``, ``compute_s`` (forward, backward and
optimizer step), ``comm_s`` (posting sends, all-reduce), ``idle_s`` (waiting in receives
for a peer), ``wall_s``, ``versions`` (weight versions held) and ``peak_memory_bytes`` (the
worker's peak so far, ``pdrun.peak``; files written before it have no such column); and the
same time by part:
``forward_s``, ``backward_s``, ``optimizer_s``, ``send_s``, ``allreduce_s``, ``recv_wait_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pdrun.notes import EDITED
from pdrun.result import WorkerResult
from pdrun.shape import units_per_step
from pdrun.step_rows import INT_FIELDS
from pdrun.worker import PARTS
from shared.plan import Plan

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "step",
    "loss",
    "rank",
    "stage",
    "replica",
    "samples_per_s",
    "compute_s",
    "comm_s",
    "idle_s",
    "wall_s",
    "versions",
    "peak_memory_bytes",
    *PARTS,
)


def frame(results: list[WorkerResult]) -> pd.DataFrame:
    """Every rank's step rows as one table, by step then rank."""
    import pandas as pd  # here, not at the top: the launcher's start-up does not wait for pandas (0.7 s)

    rows = [row for r in results for row in r.rows]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    for col in INT_FIELDS:
        df[col] = df[col].astype("int64")
    return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def save(results: list[WorkerResult], path: str, plan: Plan, options: dict[str, Any]) -> None:
    from shared.tables import RUN_METRICS, save_table  # pandas and pyarrow: at the end, not at start-up

    meta = {
        "spec": plan.spec.model_dump(),
        "schedule": plan.schedule,
        "batch_size": plan.batch_size,
        "graph_hash": plan.graph_hash,
        "options": options,
    }
    save_table(frame(results), path, RUN_METRICS, meta)


def warmup_steps(steps: int) -> int:
    """The first steps a run's steady rate leaves out: a tenth of them, at least one when there are two
    or more (the first step pays for what the run's start defers: kernel caches, the allocator's first
    blocks, the pipeline's fill; on the MNIST CNN it ran ten times the steady step), at most ten."""
    return 0 if steps < 2 else min(10, max(1, steps // 10))


def samples_and_seconds(rows: Iterable[Mapping[str, Any]], first: int) -> tuple[float, float]:
    """(samples, seconds) of the steps from ``first`` on, from metrics rows (every rank's): the samples
    one stage's replicas trained (each row's samples/s times its wall time; every stage sees every
    sample), and the slowest rank's wall time, which bounds the steps. pdrun's summary and the
    benchmarks read a run so. The stage is the first whose rows are there: a rank running several
    chunks reports one of them (its loss's, if it has the last), so under zb-v, whose first worker
    holds the first and the last chunk, no row says stage 0."""
    kept = [row for row in rows if row["step"] >= first]
    counted = min((row["stage"] for row in kept), default=0)
    samples, wall = 0.0, dict[int, float]()
    for row in kept:
        if row["stage"] == counted:
            samples += row["samples_per_s"] * row["wall_s"]
        wall[row["rank"]] = wall.get(row["rank"], 0.0) + row["wall_s"]
    return samples, max(wall.values(), default=0.0)


def steady_rate(results: list[WorkerResult]) -> tuple[float | None, int | None]:
    """(samples/s over the steps after :func:`warmup_steps`, the first step counted); (None, None)
    without rows."""
    steps = sorted({row["step"] for r in results for row in r.rows})
    if not steps:
        return None, None
    first = steps[warmup_steps(len(steps))]
    samples, seconds = samples_and_seconds((row for r in results for row in r.rows), first)
    return (samples / seconds if seconds > 0 else None), first


def summary(results: list[WorkerResult], plan: Plan, planned: Plan | None = None) -> dict[str, Any]:
    """The figures a person wants at the end: steps, losses, throughput, validation.

    ``steps``, ``units`` and ``samples`` are what this invocation trained: after ``--resume``, those
    after the checkpoint's step (the metrics' ``step`` column goes on counting from it). ``plan`` is
    what ran, ``planned`` the plan as pdplan wrote it (before ``--schedule``, ``--microbatches`` and
    ``--vertical-sync``): its predictions are for its own schedule, so beside a run of another they
    are left out (``predicted_for`` says which run they are for).
    """
    last = [r for r in results if r.stage == len(plan.stages) - 1]
    losses: dict[int, list[float]] = {}
    for r in last:
        for row in r.rows:
            if not math.isnan(row["loss"]):
                losses.setdefault(row["step"], []).append(row["loss"])
    final = sum(losses[max(losses)]) / len(losses[max(losses)]) if losses else None
    wall = max((sum(row["wall_s"] for row in r.rows) for r in results), default=0.0)
    # A rank's steps and units are positions in the whole training, a resumed run's counted from the
    # start; the summary counts what this invocation trained (after ``resumed_from_step``, cmd_run).
    resumed = next((r.resumed_from for r in results if r.resumed_from is not None), 0)
    steps = max((r.steps for r in results), default=0) - resumed
    units = max((r.units for r in results), default=0) - resumed * units_per_step(plan)
    steady, steady_from = steady_rate(results)
    out: dict[str, Any] = {
        "schedule": plan.schedule,
        "stages": len(plan.stages),
        "world_size": plan.world_size,
        "steps": steps,
        "units": units,
        "samples": units * plan.batch_size,
        "final_loss": final,
        "samples_per_s": units * plan.batch_size / wall if wall > 0 else None,
        # The rate once warm: a short run's first steps would hide it (issue 17).
        "steady_samples_per_s": steady,
        "steady_from_step": steady_from,
        "train_s": wall,
        "max_weight_versions": {r.rank: r.max_versions for r in results},
        # What carried each rank's messages and sums (pdrun/transport/choose.py): shm, gloo, or mixed.
        "transport": {r.rank: transport_of(r) for r in results},
        "links": {r.rank: dict(sorted(r.links.items())) for r in results},  # per rank, per peer
        "replica_sum": {r.rank: r.replica_sum for r in results if r.replica_sum is not None},
        "tie_sum": {r.rank: r.tie_sum for r in results if r.tie_sum is not None},
        "memory": memory_summary(results, plan, planned),
    }
    mismatch = _predicted_for(plan, planned)
    simulated = plan.predicted.simulated_time_per_minibatch_s if plan.predicted is not None else None
    # The plan's schedule simulated (pdplan.schedule_sim): a unit is one minibatch of batch_size samples.
    out["predicted_samples_per_s"] = plan.batch_size / simulated if simulated and mismatch is None else None
    if mismatch is not None:
        out["predicted_for"] = mismatch
    # The limit the plan was made to fit (pdplan --memory), beside what each worker measured.
    out["memory_limit_bytes"] = planned_limit(planned or plan)
    # Present in every summary, null without validation: a script reading s["val_accuracy"] must not fail.
    out.update(validation=[], val_loss=None, val_accuracy=None)
    if last and last[0].validation:
        per_epoch = []
        for entry in last[0].validation:
            count = entry["count"]
            per_epoch.append(
                {
                    "epoch": entry["epoch"],
                    "step": entry["step"],
                    "val_loss": entry["loss_sum"] / count if count else None,
                    "val_accuracy": entry["correct"] / entry["scored"] if entry["scored"] else None,
                }
            )
        out["validation"] = per_epoch
        out["val_loss"] = per_epoch[-1]["val_loss"]
        out["val_accuracy"] = per_epoch[-1]["val_accuracy"]
    return out


def planned_limit(plan: Plan) -> float | None:
    """The memory per worker the plan was made to fit (``pdplan --memory``), None when none was given."""
    return plan.cluster.memory_bytes if plan.cluster is not None else None


def over_limit_note(summary: dict[str, Any]) -> str | None:
    """A line for a run whose workers measured more than the plan's ``--memory`` limit (None when none did):
    the plan fitted it by prediction, and a run over it is what the limit was for."""
    limit = summary.get("memory_limit_bytes")
    if not limit:
        return None
    over = [
        f"stage {m['stage']} rank {rank} {peak / 1e6:.1f} MB"
        for m in summary["memory"]
        for rank, peak in m["measured_bytes"].items()
        if peak > limit
    ]
    if not over:
        return None
    return (
        f"note: measured peak memory over the plan's --memory {limit / 1e6:.1f} MB per worker: {', '.join(over)} "
        "(the plan fitted it by prediction; the summary's memory entries say by how much that was off)"
    )


def transport_of(result: WorkerResult) -> str:
    """What carried a rank's messages and its sums (its replicas', its ties'): "shm", "gloo" (the backend),
    "mixed", or "none"."""
    kinds = {*result.links.values(), *(k for k in (result.replica_sum, result.tie_sum) if k)}
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _predicted_for(plan: Plan, planned: Plan | None) -> str | None:
    """None when the run is the plan's own; else which run the plan's predictions are for."""
    if (planned or plan).edited_since_predicted():
        return f"the layout pdplan wrote: {EDITED}; pdplan show PLAN --graph GRAPH predicts this one"
    if planned is None:
        return None
    key = ("schedule", "microbatches", "vertical_sync")
    if all(getattr(plan, k) == getattr(planned, k) for k in key):
        return None
    return (
        f"{planned.schedule}, {planned.microbatches} microbatches"
        + (", vertical sync" if planned.vertical_sync else "")
        + f": plan again with pdplan --schedule {plan.schedule} --microbatches {plan.microbatches} to predict this run"
    )


def memory_summary(
    results: list[WorkerResult], plan: Plan, planned: Plan | None = None
) -> list[dict[str, Any]]:
    """Per stage: each rank's measured peak bytes beside the plan's predicted peak (``pdplan.memory``),
    the prediction left out where the run's schedule is not the plan's (:func:`summary`).

    Under interleaved-1f1b a rank is one process holding V chunks: one entry per worker, under its
    first chunk's stage, with ``chunks`` (its stages) and the sum of their predictions (as
    ``pdplan`` predicts a worker's), beside the rank's one measured peak.
    """
    workers = len(plan.stages) // plan.virtual_stages
    own = _predicted_for(plan, planned) is None  # the run is the one the plan predicts
    peaks: dict[int, float] = {}
    for r in results:
        seen = [row.get("peak_memory_bytes", math.nan) for row in r.rows]
        if seen and not all(math.isnan(p) for p in seen):
            peaks[r.rank] = max(p for p in seen if not math.isnan(p))
    out = []
    for s in range(workers):
        chunks = sorted(plan.worker_chunks(s)) if plan.virtual_stages > 1 else [s]
        parts = [plan.stages[c].predicted for c in chunks]
        totals = [p.memory.total_bytes for p in parts if p is not None and p.memory is not None]
        predicted = sum(totals) if len(totals) == len(chunks) and own else None
        measured = {rank: peaks[rank] for rank in plan.stages[s].ranks if rank in peaks}
        worst = max(measured.values(), default=None)
        entry: dict[str, Any] = {"stage": s}
        if plan.virtual_stages > 1:
            entry["chunks"] = chunks
        entry.update(
            predicted_bytes=predicted,
            measured_bytes=measured,
            measured_over_predicted=worst / predicted if worst is not None and predicted else None,
        )
        out.append(entry)
    return out


# Below this predicted time a unit, pdrun's own per-instruction work (dispatch, messages, bookkeeping: about
# 0.1-0.15 ms an instruction on a 2-core CPU host, measured on the README's MLP) is a large share of a step,
# and the simulation, which charges the profiled compute and the transfers only, reads fast.
SHORT_UNIT_S = 2e-3
SLOW_RATIO = 0.8


def short_step_note(summary: dict[str, Any], batch_size: int) -> str | None:
    """A line for a run that measured well below a sub-millisecond-scale prediction: why (None otherwise)."""
    predicted = summary.get("predicted_samples_per_s")
    measured = summary.get("steady_samples_per_s") or summary.get("samples_per_s")
    if not predicted or not measured or measured / predicted >= SLOW_RATIO:
        return None
    unit_predicted, unit_measured = batch_size / predicted, batch_size / measured
    if unit_predicted >= SHORT_UNIT_S:
        return None
    return (
        f"note: a unit took {unit_measured * 1000:.2f} ms where the plan predicted {unit_predicted * 1000:.2f}: at "
        "this size pdrun's own work per instruction (dispatch, messages, bookkeeping; of the order of 0.1 ms each "
        "on a CPU), which "
        "the prediction leaves out, is much of a step (larger units or batches spread it)"
    )
