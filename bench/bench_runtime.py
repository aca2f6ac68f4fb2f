"""pdrun against torch.distributed.pipelining, single-process training and DDP, at equal settings.

One model, one dataset, one split (the planner's 2-stage plan), the same microbatch size,
microbatches per step, steps, warm-up, optimizer and one thread per process for every
system. pdrun runs the plan through its command line; the alternatives run in
``bench.baselines``. Each system runs ``repeats`` times, interleaved, and its best run
counts (the machine is shared; the best run is the least disturbed one). Every ratio is
pdrun's samples/s over the alternative's, measured in the same invocation.

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
from shared.plan import Plan, load_plan

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
    model: str = "zoo:mnist_cnn"
    data: str = "zoo:mnist5k"
    batch_size: int = 64
    microbatches: int = 4
    steps: int = 40  # timed optimizer steps (flush schedules); 1F1B runs as many units
    warmup: int = 4
    bandwidth: float = 1e9  # what the plan assumes between the two workers, bytes/s
    repeats: int = 3  # best of three interleaved runs: the machine is shared
    lr: float = 0.05
    momentum: float = 0.9


QUICK = Config(steps=6, warmup=2, repeats=1)


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


def make_plan(work: Path, cfg: Config) -> tuple[Path, list[str]]:
    """Profile the model and plan it onto 2 workers, one stage each."""
    graph, plan_path = work / "graph.json", work / "plan-2stage.json"
    cmds = [toolchain.profile(graph, cfg.model, cfg.data, cfg.batch_size).cmd]
    cmds.append(
        toolchain.plan(graph, plan_path, 2, cfg.bandwidth, "1f1b-flush", cfg.microbatches, straight=True).cmd
    )
    return plan_path, cmds


def bench(work: Path, cfg: Config) -> Report:
    report = Report("pdrun against the alternatives", "python -m bench.bench_runtime")
    plan_path, cmds = make_plan(work, cfg)
    plan = load_plan(plan_path)
    s = settings_from_plan(plan, cfg)
    report.notes.append(
        f"{cfg.model} on {cfg.data}: {len(plan.stages)} stages "
        f"({' | '.join(str(len(st.layers)) + ' layers' for st in plan.stages)}), microbatch {cfg.batch_size}, "
        f"{cfg.microbatches} microbatches per step ({s.global_batch} samples), {cfg.steps} timed steps after "
        f"{cfg.warmup} warm-up steps, SGD lr {cfg.lr} momentum {cfg.momentum}, one thread per process, "
        f"gloo on 127.0.0.1; best of {cfg.repeats} interleaved runs. Plan: {' && '.join(cmds)}"
    )
    best_runs: dict[str, PdrunRun] = {}
    best_base: dict[str, Result] = {}
    for _ in range(cfg.repeats):
        for label, (schedule, memory_format) in PDRUN_RUNS.items():
            got = run_pdrun(plan_path, schedule, cfg, work, "rt", memory_format)
            best = best_runs.get(label)
            if best is None or got.timing.steady_samples_per_s > best.timing.steady_samples_per_s:
                best_runs[label] = got
        for label, (system, channels_last) in BASELINES.items():
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
    report.tables["throughput"] = rows
    for ours, theirs, name in PAIRS:
        ratio = best_pd[ours][1].steady_samples_per_s / best_base[theirs].steady_samples_per_s
        target = ">= 1.2" if theirs.startswith("pipe") else ""
        report.add(
            Figure(
                name,
                ratio,
                "x",
                f"{best_pd[ours][0]}  vs  {base_cmd}",
                target=target,
                meets=check(ratio, ">=", 1.2) if target else None,
            )
        )
    # Equal settings, checked: the flush schedules train exactly what one process trains.
    for ours, theirs in (("1f1b-flush", "pipe-1f1b"), ("1f1b-flush", "single"), ("gpipe", "pipe-gpipe")):
        a, b = best_pd[ours][1].losses, best_base[theirs].losses
        if a and len(a) == len(b):
            diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
            report.add(
                Figure(
                    f"same training: largest per-step loss difference, pdrun {ours} vs {theirs}",
                    diff,
                    "",
                    f"{best_pd[ours][0]}  vs  {base_cmd}",
                    note="equal settings: ~0 up to float rounding",
                )
            )
    report.tables["where_time_goes"] = _breakdown(best_runs, best_base)
    eff = _efficiency(plan, best_pd["1f1b"][1])
    if eff is not None:
        measured, ideal = eff
        report.add(
            Figure(
                "pdrun 1F1B pipeline efficiency (busy fraction of the workers)",
                measured,
                "",
                best_pd["1f1b"][0],
            )
        )
        report.add(Figure("planner's ideal efficiency for this plan", ideal, "", cmds[-1]))
        report.add(
            Figure(
                "measured efficiency / planner's ideal",
                measured / ideal,
                "",
                best_pd["1f1b"][0],
                target=">= 0.85",
                meets=check(measured / ideal, ">=", 0.85),
            )
        )
    return report


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


def _efficiency(plan: Plan, t: PdrunTiming) -> tuple[float, float] | None:
    """(measured busy fraction, the plan's ideal busy fraction): computing time over workers x wall."""
    stage_times = [st.predicted.time_s for st in plan.stages if st.predicted is not None]
    if len(stage_times) != len(plan.stages) or not stage_times or max(stage_times) <= 0:
        return None
    ideal = sum(stage_times) / (len(stage_times) * max(stage_times))
    busy = sum(r["compute_s"] for r in t.ranks) / (len(t.ranks) * t.seconds)
    return busy, ideal


def main(argv: list[str] | None = None) -> Report:
    work, quick = work_args(__doc__, argv)
    cfg = QUICK if quick else Config()
    report = bench(work, cfg)
    report.save(work / "bench_runtime.json")
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
