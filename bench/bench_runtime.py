"""pdrun against torch.distributed.pipelining, single-process training and DDP, at equal settings.

Two cases, each one model, one dataset, one split (the planner's 2-stage plan, wherever it
cuts: the baselines run the same split), the same microbatch size, microbatches per step,
steps, warm-up, optimizer and one thread per process for every system: the MNIST CNN, where
the runtime's overheads weigh most, and a transformer where compute dominates (the zoo's GPT,
4 layers x 256 wide, batch 16), so that the CNN alone does not overstate the advantage. pdrun runs the plan through its command line; the alternatives run in
``bench.baselines``. Each system runs ``repeats`` times, interleaved, and its best run
counts (the machine is shared; the best run is the least disturbed one). Every ratio is
pdrun's samples/s over the alternative's, measured in the same invocation. Beside them, for
each of pdrun's schedules, the measured busy fraction (computing time over workers x wall
time) against that schedule's own ideal: the busy fraction the planner's simulator gives for
the same program with the profiled costs, the limit a perfect runtime reaches.

Run alone: ``python -m bench.bench_runtime [--quick]``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from bench import toolchain
from bench.baselines import Result, Settings, run
from bench.measure import Figure, PdrunTiming, Report, check, pdrun_timing, work_args
from pdplan.schedule_sim import simulate_plan, stage_costs
from shared.graph import LayerGraph, load_graph
from shared.plan import Plan, load_plan
from shared.zoo.datasets.pydoc_text import VOCAB_SIZE as PYDOC_VOCAB

# pdrun runs: label -> (schedule, --memory-format). The "nchw" runs keep the contiguous layout the
# baselines run in, so the table shows what the layout brings apart from the runtime itself.
PDRUN_RUNS = {
    "1f1b-flush": ("1f1b-flush", "auto"),
    "gpipe": ("gpipe", "auto"),
    "1f1b": ("1f1b", "auto"),
    "1f1b-flush nchw": ("1f1b-flush", "contiguous"),
    "gpipe nchw": ("gpipe", "contiguous"),
}
# Baselines: label -> (system, channels-last). pipelining's stages also run in pdrun's layout (gloo
# sends only contiguous tensors, so each stage hands its output on as NCHW, as a user would).
BASELINES = {
    "pipe-1f1b": ("pipe-1f1b", False),
    "pipe-gpipe": ("pipe-gpipe", False),
    "pipe-1f1b channels-last": ("pipe-1f1b", True),
    "pipe-gpipe channels-last": ("pipe-gpipe", True),
    "single": ("single", False),
    "ddp": ("ddp", False),
}
# Which baseline each pdrun schedule is compared with at equal settings.
PAIRS = (
    (
        "1f1b-flush",
        "pipe-1f1b channels-last",
        "pdrun 1F1B-flush / pipelining Schedule1F1B, both channels-last",
    ),
    ("gpipe", "pipe-gpipe channels-last", "pdrun GPipe / pipelining ScheduleGPipe, both channels-last"),
    ("1f1b", "pipe-1f1b channels-last", "pdrun 1F1B (async) / pipelining Schedule1F1B, both channels-last"),
    ("1f1b-flush", "pipe-1f1b", "pdrun 1F1B-flush / pipelining Schedule1F1B"),
    ("gpipe", "pipe-gpipe", "pdrun GPipe / pipelining ScheduleGPipe"),
    ("1f1b", "pipe-1f1b", "pdrun 1F1B (async) / pipelining Schedule1F1B"),
    ("1f1b", "single", "pdrun 1F1B (async) / single process"),
    ("1f1b", "ddp", "pdrun 1F1B (async) / DDP"),
    ("1f1b-flush", "ddp", "pdrun 1F1B-flush / DDP"),
    ("1f1b-flush nchw", "pipe-1f1b", "pdrun 1F1B-flush, NCHW layout / pipelining Schedule1F1B"),
    ("gpipe nchw", "pipe-gpipe", "pdrun GPipe, NCHW layout / pipelining ScheduleGPipe"),
)
# The split of a rank's time the "where time goes" table gives, where a system measures it.
PARTS = ("forward_s", "backward_s", "loss_s", "optimizer_s", "send_s", "recv_wait_s")


@dataclass(frozen=True)
class Config:
    microbatches: int = 4
    steps: int = 40  # timed optimizer steps (flush schedules); 1F1B runs as many units
    warmup: int = 4
    bandwidth: float = 1e9  # what the plan assumes between the two workers, bytes/s
    repeats: int = 3  # best of three interleaved runs: the machine is shared
    lr: float = 0.05
    momentum: float = 0.9
    profile_warmup: int = 4  # pdprof --warmup / --repeats (its defaults)
    profile_repeats: int = 10


QUICK = Config(steps=6, warmup=2, repeats=1, profile_warmup=1, profile_repeats=2)


@dataclass(frozen=True)
class Case:
    """One model the systems are compared on: what runs, and which pairs are compared."""

    name: str  # "" for the MNIST CNN (its figures keep their names), else prefixes figures and tables
    model: str
    data: str
    batch_size: int
    model_args: tuple[tuple[str, Any], ...] = ()
    pdrun_runs: tuple[str, ...] = tuple(PDRUN_RUNS)
    baselines: tuple[str, ...] = tuple(BASELINES)
    pairs: tuple[tuple[str, str, str], ...] = PAIRS
    target: float | None = 1.2  # the ratio over pipelining the issue asks of pdrun (None: reported only)
    steps: int | None = None  # timed steps, if fewer than the config's (a slower model)


CNN = Case("", "zoo:mnist_cnn", "zoo:mnist5k", 64)
# The zoo's GPT at 4 layers x 256 wide: 3-d activations, so no layout variants; no target, only the figure.
GPT = Case(
    "GPT 4x256",
    "zoo:gpt",
    "zoo:pydoc_text",
    16,
    # The zoo builds GPT-2 small's vocabulary and context unless told: pydoc_text's characters, 64 of them.
    model_args=(
        ("n_layer", 4),
        ("n_embd", 256),
        ("n_head", 4),
        ("block_size", 64),
        ("vocab_size", PYDOC_VOCAB),
    ),
    pdrun_runs=("1f1b-flush", "gpipe", "1f1b"),
    baselines=("pipe-1f1b", "pipe-gpipe", "single", "ddp"),
    pairs=(
        ("1f1b-flush", "pipe-1f1b", "pdrun 1F1B-flush / pipelining Schedule1F1B"),
        ("gpipe", "pipe-gpipe", "pdrun GPipe / pipelining ScheduleGPipe"),
        ("1f1b", "pipe-1f1b", "pdrun 1F1B (async) / pipelining Schedule1F1B"),
        ("1f1b", "single", "pdrun 1F1B (async) / single process"),
        ("1f1b", "ddp", "pdrun 1F1B (async) / DDP"),
        ("1f1b-flush", "ddp", "pdrun 1F1B-flush / DDP"),
    ),
    target=None,
    steps=12,
)
CASES = (CNN, GPT)


def settings_from_plan(plan: Plan, cfg: Config) -> Settings:
    """The baselines' settings: the plan's model, data, split and unit, the benchmark's step counts."""
    spec = plan.spec
    assert spec.model is not None and spec.data is not None
    return Settings(
        model=spec.model,
        model_args=dict(spec.model_args),
        data=spec.data,
        data_args={**spec.data_args, "split": "train"},
        loss=spec.loss,
        trace=spec.trace,
        batch_size=plan.batch_size,
        microbatches=cfg.microbatches,
        stage_of=plan.stage_of(),
        steps=cfg.steps,
        warmup=cfg.warmup,
        lr=cfg.lr,
        momentum=cfg.momentum,
    )


@dataclass
class PdrunRun:
    """One pdrun run: its command, its timing and each rank's seconds per part (``PARTS``) over the timed steps."""

    cmd: str
    timing: PdrunTiming
    parts: dict[int, dict[str, float]]


def run_pdrun(
    plan_path: Path, schedule: str, cfg: Config, work: Path, tag: str, memory_format: str = "auto", **kw: Any
) -> PdrunRun:
    """pdrun on ``plan_path`` with ``schedule``: the same samples as the baselines' warm-up + timed steps."""
    ups = 1 if schedule == "1f1b" else cfg.microbatches
    # In 1F1B each unit is a step: run as many units as the flush schedules do.
    scale = cfg.microbatches // ups
    metrics = work / f"run-{tag}-{schedule}-{memory_format}.parquet"
    extra = ["--schedule", schedule, "--microbatches", str(cfg.microbatches), "--lr", f"{cfg.lr:g}"]
    extra += ["--momentum", f"{cfg.momentum:g}", "--no-val", "-q"]
    if memory_format != "auto":
        extra += ["--memory-format", memory_format]
    done, _ = toolchain.pdrun(plan_path, metrics, steps=(cfg.steps + cfg.warmup) * scale, extra=extra, **kw)
    return PdrunRun(
        done.cmd, pdrun_timing(metrics, cfg.warmup * scale), _pdrun_parts(metrics, cfg.warmup * scale)
    )


def _pdrun_parts(metrics: Path, warmup_steps: int) -> dict[int, dict[str, float]]:
    """Per rank, seconds per part over the steps after the warm-up (pdrun's loss is inside its forward)."""
    df = pd.read_parquet(metrics)
    timed = df[df["step"] >= warmup_steps]
    out: dict[int, dict[str, float]] = {}
    for rank, rows in timed.groupby("rank"):
        out[int(str(rank))] = {p: float(rows[p].sum()) for p in PARTS if p in rows}
    return out


def make_plan(work: Path, cfg: Config, case: Case = CNN) -> tuple[Path, Path, list[str]]:
    """Profile the case's model and plan it onto 2 workers, one stage each: (graph, plan, commands)."""
    tag = _slug(case.name)
    graph, plan_path = work / f"graph{tag}.json", work / f"plan-2stage{tag}.json"
    prof = toolchain.profile(
        graph,
        case.model,
        case.data,
        case.batch_size,
        dict(case.model_args),
        timeout_s=900,
        extra=["--warmup", str(cfg.profile_warmup), "--repeats", str(cfg.profile_repeats)],
    )
    cmds = [prof.cmd]
    cmds.append(
        toolchain.plan(graph, plan_path, 2, cfg.bandwidth, "1f1b-flush", cfg.microbatches, straight=True).cmd
    )
    return graph, plan_path, cmds


def _slug(name: str) -> str:
    return "-" + "".join(c if c.isalnum() else "-" for c in name.lower()) if name else ""


def bench(work: Path, cfg: Config, cases: tuple[Case, ...] = CASES) -> Report:
    report = Report("pdrun against the alternatives", "python -m bench.bench_runtime")
    for case in cases:
        bench_case(work, replace(cfg, steps=min(cfg.steps, case.steps or cfg.steps)), case, report)
    return report


def bench_case(work: Path, cfg: Config, case: Case, report: Report) -> None:
    """Run every system of ``case`` and add its figures and tables to ``report``."""
    graph_path, plan_path, cmds = make_plan(work, cfg, case)
    plan = load_plan(plan_path)
    s = settings_from_plan(plan, cfg)
    prefix = f"{case.name}: " if case.name else ""
    suffix = f" {case.name}" if case.name else ""
    report.notes.append(
        f"{prefix}{case.model} {dict(case.model_args) or ''} on {case.data}: {len(plan.stages)} stages "
        f"({' | '.join(str(len(st.layers)) + ' layers' for st in plan.stages)}, the cut before "
        f"{plan.stages[-1].layers[0]!r}), microbatch {case.batch_size}, "
        f"{cfg.microbatches} microbatches per step ({s.global_batch} samples), {cfg.steps} timed steps after "
        f"{cfg.warmup} warm-up steps, SGD lr {cfg.lr} momentum {cfg.momentum}, one thread per process, "
        f"gloo on 127.0.0.1; best of {cfg.repeats} interleaved runs. Plan: {' && '.join(cmds)}"
    )
    best_runs: dict[str, PdrunRun] = {}
    best_base: dict[str, Result] = {}
    for _ in range(cfg.repeats):
        for label in case.pdrun_runs:
            schedule, memory_format = PDRUN_RUNS[label]
            got = run_pdrun(plan_path, schedule, cfg, work, "rt" + _slug(case.name), memory_format)
            best = best_runs.get(label)
            if best is None or got.timing.steady_samples_per_s > best.timing.steady_samples_per_s:
                best_runs[label] = got
        for label in case.baselines:
            system, channels_last = BASELINES[label]
            r = run(system, replace(s, channels_last=channels_last), 2 if system == "ddp" else None)
            if label not in best_base or r.steady_samples_per_s > best_base[label].steady_samples_per_s:
                best_base[label] = r
    best_pd = {label: (r.cmd, r.timing) for label, r in best_runs.items()}
    rows: list[dict[str, Any]] = []
    for schedule, (cmd, t) in best_pd.items():
        rows.append(
            {
                "system": f"pdrun {schedule}",
                "samples_per_s": t.steady_samples_per_s,
                "whole_interval_samples_per_s": t.samples_per_s,
                "seconds": t.seconds,
                "final_loss": t.losses[-1] if t.losses else math.nan,
                "command": cmd,
            }
        )
    base_cmd = "python -m bench.bench_runtime"
    for system, r in best_base.items():
        rows.append(
            {
                "system": system,
                "samples_per_s": r.steady_samples_per_s,
                "whole_interval_samples_per_s": r.samples_per_s,
                "seconds": r.seconds,
                "final_loss": r.losses[-1] if r.losses else math.nan,
                "command": base_cmd,
            }
        )
    report.tables[f"throughput{suffix}"] = rows
    for ours, theirs, name in case.pairs:
        ratio = best_pd[ours][1].steady_samples_per_s / best_base[theirs].steady_samples_per_s
        wanted = case.target if theirs.startswith("pipe") else None
        report.add(
            Figure(
                prefix + name,
                ratio,
                "x",
                f"{best_pd[ours][0]}  vs  {base_cmd}",
                target=f">= {wanted}" if wanted is not None else "",
                meets=check(ratio, ">=", wanted) if wanted is not None else None,
            )
        )
    # Equal settings, checked: the flush schedules train exactly what one process trains.
    for ours, theirs in (("1f1b-flush", "pipe-1f1b"), ("1f1b-flush", "single"), ("gpipe", "pipe-gpipe")):
        if ours not in best_pd or theirs not in best_base:
            continue
        a, b = best_pd[ours][1].losses, best_base[theirs].losses
        if a and len(a) == len(b):
            diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
            report.add(
                Figure(
                    f"{prefix}same training: largest per-step loss difference, pdrun {ours} vs {theirs}",
                    diff,
                    "",
                    f"{best_pd[ours][0]}  vs  {base_cmd}",
                    note="equal settings: ~0 up to float rounding",
                )
            )
    report.tables[f"where_time_goes{suffix}"] = _breakdown(best_runs, best_base)
    graph = load_graph(graph_path)
    busy_rows: list[dict[str, Any]] = []
    for label in case.pdrun_runs:
        schedule, _ = PDRUN_RUNS[label]
        measured = _busy_fraction(best_runs[label].timing)
        ideal = ideal_busy_fraction(graph, plan, schedule, cfg.microbatches)
        busy_rows.append(
            {
                "schedule": label,
                "measured_busy_fraction": measured,
                "ideal_busy_fraction": ideal,
                "measured_over_ideal": measured / ideal if ideal > 0 else math.nan,
                "command": best_runs[label].cmd,
            }
        )
    report.tables[f"busy_fraction{suffix}"] = busy_rows
    for row in busy_rows:
        if row["schedule"] != "1f1b":
            continue
        report.add(
            Figure(
                f"{prefix}pdrun 1F1B pipeline efficiency (busy fraction of the workers)",
                row["measured_busy_fraction"],
                "",
                row["command"],
            )
        )
        report.add(
            Figure(
                f"{prefix}1F1B's ideal busy fraction for this plan (the simulator's, same program)",
                row["ideal_busy_fraction"],
                "",
                cmds[-1],
            )
        )
        ratio = row["measured_over_ideal"]
        report.add(
            Figure(
                f"{prefix}measured efficiency / the schedule's ideal",
                ratio,
                "",
                row["command"],
                target=">= 0.85",
                meets=check(ratio, ">=", 0.85),
            )
        )


def _breakdown(runs: dict[str, PdrunRun], base: dict[str, Result]) -> list[dict[str, Any]]:
    """Per system and rank: seconds computing (forward, backward, loss, optimizer step), in communication
    calls or waiting for a peer, and the rest (the framework's own work between them); then the same
    time by part where the system measures it: forward, backward, loss (pdrun: inside its forward),
    optimizer, posting sends (gloo writes into the socket there) and waiting for receives."""
    rows: list[dict[str, Any]] = []
    for label, pd_run in runs.items():
        for r in pd_run.timing.ranks:
            rank = int(r["rank"])
            rest = r["total_s"] - r["compute_s"] - r["comm_s"] - r["idle_s"]
            rows.append(
                {
                    "system": f"pdrun {label}",
                    "rank": rank,
                    "total_s": r["total_s"],
                    "compute_s": r["compute_s"],
                    "comm_wait_s": r["comm_s"] + r["idle_s"],
                    "other_s": max(0.0, rest),
                    **_parts(pd_run.parts.get(rank, {})),
                }
            )
    for system, res in base.items():
        for k in res.ranks:
            known = {**k.parts, "optimizer_s": k.optimizer_s} if k.parts else {}
            rows.append(
                {
                    "system": system,
                    "rank": k.rank,
                    "total_s": k.total_s,
                    "compute_s": k.compute_s + k.optimizer_s,
                    "comm_wait_s": k.comm_s,
                    "other_s": k.other_s,
                    **_parts(known),
                }
            )
    return rows


def _parts(known: dict[str, float]) -> dict[str, float | None]:
    """Every column of ``PARTS``, None where not measured."""
    return {p: known.get(p) for p in PARTS}


def _busy_fraction(t: PdrunTiming) -> float:
    """Measured: every rank's computing time (forward, backward, loss, optimizer step) over ranks x wall."""
    return sum(r["compute_s"] for r in t.ranks) / (len(t.ranks) * t.seconds) if t.seconds > 0 else math.nan


def ideal_busy_fraction(graph: LayerGraph, plan: Plan, schedule: str, microbatches: int) -> float:
    """The busy fraction a perfect runtime reaches with ``schedule``: the planner's simulation of the same
    program pdrun runs (``pdrun --schedule S --microbatches M``), in steady state. Per unit, each stage
    computes its forward and backward and ``1/M`` of a step (every unit is a step in 1f1b); over the
    simulated seconds per unit, that is the share of the workers' time spent computing."""
    ups = 1 if schedule == "1f1b" else microbatches
    run_plan = plan.model_copy(update={"schedule": schedule, "microbatches": ups})
    costs, _ = stage_costs(graph, run_plan)
    per_unit = simulate_plan(graph, run_plan).time_per_minibatch_s
    workers = sum(st.replicas for st in run_plan.stages)
    if per_unit <= 0 or workers == 0:
        return math.nan
    busy = sum(
        costs.forward[s] + costs.backward[s] + costs.step[s] / ups for s in range(len(run_plan.stages))
    )
    return busy / (workers * per_unit)


def main(argv: list[str] | None = None) -> Report:
    work, quick = work_args(__doc__, argv)
    cfg = QUICK if quick else Config()
    report = bench(work, cfg)
    report.save(work / "bench_runtime.json")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
