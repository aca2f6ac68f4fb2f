"""``pdrun schedule``: draw a schedule's program as a step-by-worker grid, or print it as JSON.

Given a plan, it draws the program pdrun runs for that plan: its schedule, stages, replicas,
microbatches, model chunks and the stage DAG its layers make (traced from the plan's model, as
``pdrun PLAN`` traces it), ``--microbatches`` overriding the plan's as it does for a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import click

from shared.blame import naming_source
from shared.cli import console
from shared.errors import UserError
from shared.plan import load_plan
from shared.schedule import (
    ALL_SCHEDULES,
    Kind,
    Program,
    build_program,
    program_to_text,
    worker_name,
)
from shared.schedule_check import validate_program
from shared.schedule_grid import draw_grid
from shared.simulate import Costs, simulate


@dataclass(frozen=True)
class ScheduleConfig:
    """What to draw: a schedule over a stage DAG with replicas, for a number of units."""

    schedule: str
    replicas: tuple[int, ...]
    units: int
    microbatches: int
    edges: tuple[tuple[int, int], ...] | None
    in_flight: int | None
    chunks: int = 1


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers like 2,1,1, got {text!r}", param_hint=option
        ) from None
    if any(v < 1 for v in values):
        raise click.BadParameter(f"every count must be at least 1, got {text!r}", param_hint=option)
    return values


def _edges(text: str) -> tuple[tuple[int, int], ...]:
    pairs: list[tuple[int, int]] = []
    for part in text.split(","):
        a, sep, b = part.partition("-")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise click.BadParameter(f"expected pairs like 0-1,1-2,0-2, got {part!r}", param_hint="--edges")
        pairs.append((int(a), int(b)))
    return tuple(pairs)


def _chunks(schedule: str, virtual_stages: int | None) -> int:
    """Model chunks per worker: ``--virtual-stages`` for interleaved-1f1b (2 unless given), 2 for zb-v, else 1."""
    if schedule == "interleaved-1f1b":
        return 2 if virtual_stages is None else virtual_stages
    if schedule == "zb-v":
        if virtual_stages not in (None, 2):
            raise click.BadParameter(
                "zb-v places exactly 2 model chunks on each worker (a V)", param_hint="--virtual-stages"
            )
        return 2
    if virtual_stages not in (None, 1):
        raise click.BadParameter(
            f"{schedule} runs one model chunk per worker; --virtual-stages is for interleaved-1f1b",
            param_hint="--virtual-stages",
        )
    return 1


# The options a plan sets; given beside one, each is refused rather than ignored.
PLAN_SETS = {
    "schedule_name": "--schedule",
    "stages": "--stages",
    "replicas": "--replicas",
    "edges": "--edges",
    "in_flight": "--in-flight",
    "virtual_stages": "--virtual-stages",
}


def _given(ctx: click.Context, name: str) -> bool:
    """Whether the command line named option ``name`` (not its default)."""
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)


def _from_plan(source: str, microbatches: int | None, steps: int) -> ScheduleConfig:
    """What ``pdrun PLAN`` runs, as integers (``pdrun.shape.pipeline_of``'s), the stage DAG traced."""
    from pdrun.launch import check_schedule_runs
    from pdrun.partition import partition
    from pdrun.plans import traced_for
    from pdrun.shape import units_per_step

    plan = load_plan(source)
    if microbatches is not None:
        plan = plan.model_copy(update={"microbatches": microbatches})
    check_schedule_runs(plan, source)
    part = partition(traced_for(plan.spec), plan, source)
    workers = len(plan.stages) // plan.virtual_stages
    per_step = units_per_step(plan)  # a step as pdrun counts it
    if plan.schedule == "1f1b" and microbatches is not None:
        per_step = microbatches  # as without a plan: 1f1b draws --microbatches units a step
    return ScheduleConfig(
        schedule=plan.schedule,
        replicas=tuple(s.replicas for s in plan.stages[:workers]),
        units=per_step * steps,
        microbatches=plan.microbatches,
        edges=tuple(sorted(part.edges())) if plan.virtual_stages == 1 else None,
        in_flight=plan.in_flight if plan.schedule == "1f1b" else None,
        chunks=plan.virtual_stages,
    )


def _summary(config: ScheduleConfig, program: Program) -> str:
    run = simulate(program, Costs.uniform(len(config.replicas), stage_edges=config.edges))
    chunks = f", {config.chunks} chunks per worker" if config.chunks > 1 else ""
    split = any(i.kind is Kind.WEIGHT for instrs in program.values() for i in instrs)
    unit = "f=b=w=1" if split else "f=b=1"
    per = "a step each" if config.schedule == "1f1b" else f"{config.microbatches} per step"
    peaks = " ".join(f"{worker_name(w)}={n}" for w, n in sorted(run.peak_in_flight.items()))
    return (
        f"{config.schedule}: {len(config.replicas)} stages, {len(program)} workers{chunks}, {config.units} units"
        f" ({per}): {run.makespan:g} slots at {unit}, {run.time_per_unit:.3g} per unit in steady state,"
        f" bubble {run.bubble:.1%}, peak in-flight {peaks}"
    )


@click.command("schedule")
@click.argument("plan_file", metavar="[PLAN]", required=False)
@click.option(
    "--schedule",
    "schedule_name",
    type=click.Choice(ALL_SCHEDULES),
    default="1f1b",
    show_default=True,
    help="The pipeline schedule.",
)
@click.option("--stages", type=int, default=None, help="Number of stages (default: from --replicas, else 4).")
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Units per optimizer step (flush schedules); for 1f1b, units per --steps.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Draw this many steps of --microbatches units (with a PLAN: of pdrun's steps).",
)
@click.option("--replicas", default=None, help="Replicas per stage, e.g. 2,1,1,1 (default: 1 each).")
@click.option("--edges", default=None, help="Stage DAG as a-b pairs, e.g. 0-1,1-2,0-2 (default: the chain).")
@click.option(
    "--in-flight",
    type=click.IntRange(min=1),
    default=None,
    help="1f1b: units admitted per input-stage worker (default NOAM).",
)
@click.option(
    "--virtual-stages",
    type=click.IntRange(min=1),
    default=None,
    help="interleaved-1f1b: model chunks per worker (default 2); a cell F3.1 is unit 3 on chunk 1.",
)
@click.option(
    "--detail", is_flag=True, help="Draw every instruction (receives, sends, all-reduce, step), not only F/B."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print each worker's instruction list (compact text form) as JSON.",
)
def schedule(
    plan_file: str | None,
    schedule_name: str,
    stages: int | None,
    microbatches: int,
    steps: int,
    replicas: str | None,
    edges: str | None,
    in_flight: int | None,
    virtual_stages: int | None,
    detail: bool,
    as_json: bool,
) -> None:
    """Draw a schedule's program: rows are workers (s0.r0 = stage 0, replica 0), columns are time slots.

    Example: pdrun schedule --schedule 1f1b --stages 4 --microbatches 8
    (or --schedule interleaved-1f1b --virtual-stages 2, zb-h1, 2bw);
    pdrun schedule plan.json draws what `pdrun plan.json` runs.
    """
    if plan_file is not None:
        ctx = click.get_current_context()
        given = [flag for name, flag in PLAN_SETS.items() if _given(ctx, name)]
        if given:
            raise UserError(
                f"{given[0]}: the plan {plan_file} sets it; draw without the plan to choose it, or plan again "
                "with pdplan"
            )
        mine = microbatches if _given(ctx, "microbatches") else None
        with naming_source({} if mine is None else {"microbatches": mine}, plan_file):
            _draw(_from_plan(plan_file, mine, steps), detail, as_json)
        return
    reps = _ints(replicas, "--replicas") if replicas else (1,) * (stages if stages is not None else 4)
    if stages is not None and stages != len(reps):
        raise click.BadParameter(
            f"--stages {stages} but --replicas names {len(reps)} stages", param_hint="--stages"
        )
    if stages is not None and stages < 1:
        raise click.BadParameter("must be at least 1", param_hint="--stages")
    config = ScheduleConfig(
        schedule=schedule_name,
        replicas=reps,
        units=microbatches * steps,
        microbatches=microbatches,
        edges=_edges(edges) if edges else None,
        in_flight=in_flight,
        chunks=_chunks(schedule_name, virtual_stages),
    )
    with naming_source({"microbatches": microbatches, "schedule": schedule_name}, None):
        _draw(config, detail, as_json)


def _draw(config: ScheduleConfig, detail: bool, as_json: bool) -> None:
    """The program's grid (or JSON) on stdout, its simulated summary on stderr."""
    program = build_program(
        config.schedule,
        config.replicas,
        config.units,
        microbatches=config.microbatches,
        stage_edges=config.edges,
        in_flight=config.in_flight,
        chunks=config.chunks,
    )
    validate_program(program)
    if as_json:
        click.echo(json.dumps(program_to_text(program), indent=1))
    else:
        click.echo(draw_grid(program, detail=detail))
    console.print(_summary(config, program), markup=False)
