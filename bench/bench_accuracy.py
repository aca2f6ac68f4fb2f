"""Time to accuracy on MNIST-5k: asynchronous 1F1B, 1F1B-flush and DDP, on a fast and an emulated slow link.

zoo:mnist_cnn trains on zoo:mnist5k (4,000 training and 1,000 validation images) on two
workers: pdrun's 1F1B (PipeDream: each 64-sample unit is an optimizer step, weight
stashing) and 1F1B-flush (4 units of 64 per step) run the planner's 2-stage plan; DDP runs
the whole model on both workers, 128 samples each per step. All use SGD with the same
learning rate and momentum, the same seed and the same data order. Validation accuracy
is measured after every epoch; training time excludes validation (pdrun: the sum of the
time each rank spends in its instructions, the slowest rank; DDP: a clock paused while
rank 0 validates). Time to accuracy is the training time at the end of the first epoch
whose validation accuracy reaches the target.

The slow link is emulated the same way for all (see ``bench.slow_link``): before sending
``b`` bytes to another worker, a worker sleeps ``b / bandwidth``.

Run alone: ``python -m bench.bench_accuracy [--quick]``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from bench import toolchain
from bench.baselines import Settings, run
from bench.measure import Figure, Report, work_args
from shared.plan import load_plan
from shared.resolve import resolve_dataset

SYSTEMS = ("pdrun 1f1b", "pdrun 1f1b-flush", "ddp")


@dataclass(frozen=True)
class Config:
    model: str = "zoo:mnist_cnn"
    data: str = "zoo:mnist5k"
    batch_size: int = 64
    microbatches: int = 4
    epochs: int = 5
    target: float = 0.90
    lr: float = 0.02
    momentum: float = 0.9
    slow_bandwidth: float = 2e7  # bytes/s of the emulated slow link
    fast_bandwidth: float = 1e9  # what the plan assumes without emulation


QUICK = Config(epochs=1, target=0.5)


@dataclass
class Curve:
    """Validation accuracy after each epoch against training seconds."""

    system: str
    link: str
    points: list[tuple[float, float]]  # (train seconds, val accuracy)
    command: str

    def time_to(self, target: float) -> float:
        return next((t for t, acc in self.points if acc >= target), math.nan)


def pdrun_curve(
    plan: Path, schedule: str, cfg: Config, work: Path, link: str, bandwidth: float | None
) -> Curve:
    metrics = work / f"acc-{link}-{schedule}.parquet"
    extra = ["--schedule", schedule, "--microbatches", str(cfg.microbatches), "--lr", f"{cfg.lr:g}"]
    extra += ["--momentum", f"{cfg.momentum:g}", "-q"]
    done, summary = toolchain.pdrun(plan, metrics, epochs=cfg.epochs, extra=extra, bandwidth=bandwidth)
    df = pd.read_parquet(metrics)
    # Time in instructions only: validation between epochs is not training time.
    df["busy_s"] = df["compute_s"] + df["comm_s"] + df["idle_s"]
    per_rank = df.sort_values("step").groupby("rank")
    points: list[tuple[float, float]] = []
    for entry in summary.get("validation", []):
        last_step = int(entry["step"]) - 1  # steps are counted from 0; entry["step"] is how many ran
        t = max(float(rows[rows["step"] <= last_step]["busy_s"].sum()) for _, rows in per_rank)
        points.append((t, float(entry["val_accuracy"])))
    return Curve(f"pdrun {schedule}", link, points, done.cmd)


def ddp_curve(cfg: Config, link: str, bandwidth: float | None, stage_of: dict[str, int]) -> Curve:
    train_samples = len(resolve_dataset(cfg.data, {"split": "train"}))
    steps_per_epoch = max(1, train_samples // cfg.batch_size // cfg.microbatches)
    s = Settings(
        model=cfg.model,
        data=cfg.data,
        batch_size=cfg.batch_size,
        microbatches=cfg.microbatches,
        stage_of=stage_of,
        lr=cfg.lr,
        momentum=cfg.momentum,
        bandwidth=bandwidth,
        warmup=0,
        eval_data_args={"split": "val"},
        steps=steps_per_epoch * cfg.epochs,
    )
    r = run("ddp", s, 2)
    cmd = "python -m bench.bench_accuracy"
    return Curve("ddp", link, [(t, acc) for t, _, acc in r.evals], cmd)


def bench(work: Path, cfg: Config) -> tuple[Report, list[Curve]]:
    report = Report("time to accuracy on MNIST-5k", "python -m bench.bench_accuracy")
    graph = work / "acc-graph.json"
    cmds = [toolchain.profile(graph, cfg.model, cfg.data, cfg.batch_size).cmd]
    curves: list[Curve] = []
    for link, bandwidth in (("fast", None), ("slow", cfg.slow_bandwidth)):
        plan = work / f"acc-plan-{link}.json"
        planned_bw = bandwidth or cfg.fast_bandwidth
        cmds.append(toolchain.plan(graph, plan, 2, planned_bw, "1f1b", 1, straight=True).cmd)
        stage_of = load_plan(plan).stage_of()
        for schedule in ("1f1b", "1f1b-flush"):
            curves.append(pdrun_curve(plan, schedule, cfg, work, link, bandwidth))
        curves.append(ddp_curve(cfg, link, bandwidth, stage_of))
    report.notes.append(
        f"{cfg.model} on {cfg.data}, {cfg.epochs} epochs, target validation accuracy {cfg.target:.0%}, "
        f"SGD lr {cfg.lr} momentum {cfg.momentum}; slow link: {cfg.slow_bandwidth:g} bytes/s emulated by a "
        f"sleep of bytes/bandwidth before every send (pipelines) or every all-reduce bucket (DDP, for the "
        f"2(n-1)/n share a ring sends). Plans: {' && '.join(cmds)}"
    )
    rows: list[dict[str, Any]] = []
    for c in curves:
        rows.append(
            {
                "system": c.system,
                "link": c.link,
                "time_to_target_s": c.time_to(cfg.target),
                "final_accuracy": c.points[-1][1] if c.points else math.nan,
                "train_s": c.points[-1][0] if c.points else math.nan,
                "command": c.command,
            }
        )
    report.tables["time_to_accuracy"] = rows
    by = {(c.system, c.link): c for c in curves}
    for link in ("fast", "slow"):
        ddp = by[("ddp", link)].time_to(cfg.target)
        for system in ("pdrun 1f1b", "pdrun 1f1b-flush"):
            ours = by[(system, link)].time_to(cfg.target)
            report.add(
                Figure(
                    f"DDP time to {cfg.target:.0%} / {system} time to {cfg.target:.0%} ({link} link)",
                    ddp / ours if ours > 0 else math.nan,
                    "x",
                    f"{by[(system, link)].command}  vs  {report.command}",
                    note="> 1: pdrun reaches the target sooner; NaN: one of them never reached it",
                )
            )
    return report, curves


def main(argv: list[str] | None = None) -> tuple[Report, list[Curve]]:
    work, quick = work_args(__doc__, argv)
    report, curves = bench(work, QUICK if quick else Config())
    report.tables["curves"] = [
        {"system": c.system, "link": c.link, "train_s": t, "val_accuracy": a}
        for c in curves
        for t, a in c.points
    ]
    report.save(work / "bench_accuracy.json")
    return report, curves


if __name__ == "__main__":
    main()
    sys.exit(0)
