"""The run's shape: the effective plan, its steps, segments and chunks, and which stages stash weights.

Everything here is computed from the plan and the command line alone, the same on every
rank and in the launcher, before any worker starts: the launcher validates every program
the run will execute from it, and each worker cuts its run the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdrun.config import RunConfig
from pdrun.partition import Partition
from shared.errors import UserError
from shared.plan import Plan
from shared.schedule import Pipeline, in_flight_bounds, make_pipeline


@dataclass(frozen=True)
class Segments:
    """How the run is cut: units per program, and whether an epoch ends after each."""

    lengths: tuple[int, ...]
    epochs: bool
    units_per_step: int
    epoch_units: int = 0  # with --epochs: the units of a whole epoch (a resumed run's first may finish one)

    @property
    def steps(self) -> int:
        """The optimizer steps this invocation runs (after a resume: on top of the checkpoint's)."""
        return sum(self.lengths) // self.units_per_step

    def epoch_at(self, end: int, per_epoch: int) -> int:
        """The epoch a validation pass after global unit ``end`` closes, counted from the first run, not
        from a ``--resume`` (whose segments restart at 0): with ``--epochs``, the run's epoch segments
        (whole steps of an epoch, so a label per pass even where ``per_epoch`` is not a whole number of
        steps); with ``--steps``, the data's epoch (``per_epoch`` units) of the last unit trained."""
        span = self.epoch_units if self.epochs else per_epoch
        return max(0, end - 1) // max(1, span)


def effective_plan(plan: Plan, cfg: RunConfig) -> Plan:
    """The plan with the command line's overrides applied (schedule, microbatches, vertical sync)."""
    update: dict[str, Any] = {}
    if cfg.schedule is not None:
        update["schedule"] = cfg.schedule
    if cfg.microbatches is not None:
        update["microbatches"] = cfg.microbatches
    if cfg.vertical_sync is not None and (cfg.schedule or plan.schedule) == "1f1b":
        update["vertical_sync"] = cfg.vertical_sync  # elsewhere not used, and said (vertical_sync_note)
    return plan.model_copy(update=update) if update else plan


def overrides(cfg: RunConfig) -> dict[str, object]:
    """The plan fields the command line overrode, by the name of both (``--microbatches``, ``--schedule``)."""
    return {
        k: v for k, v in (("microbatches", cfg.microbatches), ("schedule", cfg.schedule)) if v is not None
    }


def units_per_step(plan: Plan) -> int:
    """Units in one optimizer step of the run (what ``--steps`` counts).

    Flushing schedules: the plan's ``microbatches``. ``1f1b``: one unit per step when no
    stage is replicated (PipeDream: every minibatch is an update at every stage). A stage
    of r replicas all-reduces once per r units, one from each replica, so its weights are
    updated once per r units; a step is then one round of ``lcm(replicas)`` units, after
    which every replica of every stage has made a whole number of identical updates
    (``lcm / r``; one for the most replicated stages, more for stages with fewer replicas).
    It is what data parallelism calls a step: one update of a global batch, r units wide.
    """
    if plan.schedule != "1f1b":
        return plan.microbatches
    return math.lcm(*(s.replicas for s in plan.stages))


def updates_per_step(plan: Plan, s: int) -> int:
    """Optimizer updates a worker of stage ``s`` makes in one step of the run.

    One, but under ``1f1b`` ``lcm(replicas) / r`` for a stage of r replicas (see :func:`units_per_step`);
    a metrics row covers one step of the run.
    """
    if plan.schedule != "1f1b":
        return 1
    return units_per_step(plan) // plan.stages[s].replicas


def segments(plan: Plan, cfg: RunConfig, per_epoch: int, start: int = 0) -> Segments:
    """Cut the run into programs; raises ``UserError`` when nothing would run.

    ``start`` is the units trained before this run (``--resume``). With ``--epochs N`` the run ends at the
    N-th epoch end from there: resumed mid-epoch, its first segment finishes that epoch (it ran a whole
    epoch's length from the checkpoint instead, and validated mid-epoch, labelled as the next one)."""
    ups = units_per_step(plan)
    if cfg.steps is not None:
        return Segments((cfg.steps * ups,), False, ups)
    epochs = cfg.epochs or 1
    units = per_epoch - per_epoch % ups
    if units < 1:
        raise UserError(
            f"dataset: one epoch holds {per_epoch} units of {plan.batch_size} samples, fewer than one step "
            f"({ups} units); use --steps or a smaller --microbatches"
        )
    rest = units - start % units if start % units else units
    return Segments((rest,) + (units,) * (epochs - 1), True, ups, units)


def chunk_lengths(segs: Segments, cfg: RunConfig, base: int = 0) -> set[int]:
    """The distinct lengths of the run's programs (its segments cut at every ``--checkpoint-every``).

    Computed per segment, not per program: a million steps checkpointed every step are one length.
    """
    every = segs.units_per_step * (cfg.checkpoint_every or 0)
    out: set[int] = set()
    for length in segs.lengths:
        if every <= 0:
            out.add(length)
        else:
            head = min(length, (every - base % every) % every or every)  # up to the next multiple
            out.add(head)
            rest = length - head
            if rest >= every:
                out.add(every)
            if rest % every:
                out.add(rest % every)
        base += length
    return out


def chunks(length: int, base: int, every: int) -> Iterator[int]:
    """Cut a segment of ``length`` units starting at global unit ``base`` at multiples of ``every`` (0: not)."""
    if every <= 0:
        yield length
        return
    while length > 0:
        n = min(length, every - base % every)
        yield n
        length -= n
        base += n


def pipeline_of(plan: Plan, part: Partition | None) -> Pipeline:
    """The few integers the plan's schedule generator is computed from (``part`` None: the stages taken as a
    chain, which the launcher checks before it traces the model)."""
    workers = len(plan.stages) // plan.virtual_stages  # interleaved: the stages are the chunks
    # A chunked plan's values go along its chain of chunks, relayed (pdrun.partition): only such edges.
    edges = None if part is None else sorted(part.edges())
    assert plan.virtual_stages == 1 or edges is None or all(b == a + 1 for a, b in edges), edges
    return make_pipeline(
        plan.schedule,
        [s.replicas for s in plan.stages[:workers]],
        microbatches=plan.microbatches,
        stage_edges=edges if plan.virtual_stages == 1 else None,
        in_flight=plan.in_flight if plan.schedule == "1f1b" else None,
        chunks=plan.virtual_stages,
    )


def needs_stash(plan: Plan, part: Partition, s: int) -> bool:
    """Whether stage ``s`` of an asynchronous 1F1B plan must stash weight versions.

    A stage that forwards one unit before each backward (warm-up bound 1: the last stage of a
    straight pipeline, a lone or purely replicated stage) steps only after the backward of the
    unit it forwarded last, so its backward sees the forward's weights without a stash, and runs
    the stage's module directly instead of ``functional_call`` over a version (about 7% of its
    compute). Vertical sync still needs the versions: a unit runs on the input stage's.
    """
    if plan.vertical_sync:
        return True
    replicas = [st.replicas for st in plan.stages]
    return in_flight_bounds(replicas, sorted(part.edges()), plan.in_flight)[s] > 1
