"""Time to accuracy on MNIST-5k: asynchronous 1F1B, 1F1B-flush, 2BW and DDP, each at its own best learning rate.

zoo:mnist_cnn trains on zoo:mnist5k (4,000 training and 1,000 validation images) on two
workers: pdrun's 1F1B (PipeDream: each 64-sample unit is an optimizer step, weight
stashing), 1F1B-flush (4 units of 64 per step) and 2BW (PipeDream-2BW: 4 units of 64 per
step, no flush, every update one step late) run the planner's 2-stage plan; DDP runs
the whole model on both workers, 128 samples each per step. So the systems take optimizer
steps of different sizes (64, 256, 256 and 256 samples): compared at one learning rate, the one
with four times the steps wins by the steps, not by the pipeline. Each system therefore runs
at its own best setting from the same small sweep (``Config.sweep``: SGD with momentum 0.9 at three
learning rates, Adam at two): the best is the one reaching the target in the fewest epochs (ties: the
higher final accuracy; accuracy is a property of the arithmetic, so the choice does not depend on how
loaded the host is). Adam is in the sweep for 2BW's sake: its paper trains with Adam, and a gradient
one step late under heavy-ball momentum is stable only at a step about ``(1 - momentum) / 2(1 + momentum)``
of the undelayed one's largest (on a quadratic: the delayed recurrence's roots stay inside the unit circle
while ``lr * curvature < 1 - momentum``, against ``2 (1 + momentum)`` without the delay), so at momentum 0.9
2BW's loss falls for three epochs and then climbs back as the model sharpens. 1F1B-flush and DDP compute what one process computes whatever the split, and 2BW's one-step
delay is the same at every stage (``W(t+1) = W(t) - lr grad f(W(t-1))``, Narayanan et al.,
ICML'21), so their sweep runs on the fast link and the slow link reruns the chosen rate; asynchronous 1F1B's arithmetic
depends on the split (which layers run a step stale), and the planner may cut the two links'
plans differently, so it sweeps on each link.
All use the same seed and data order. Validation accuracy is measured after every epoch;
training time excludes validation (pdrun: the sum of the time each rank spends in its
instructions, the slowest rank; DDP: a clock paused while rank 0 validates). Time to accuracy
is the training time at the end of the first epoch whose validation accuracy reaches the target.

The slow link is emulated the same way for all (see ``bench.slow_link``): before sending
``b`` bytes to another worker, a worker sleeps ``b / bandwidth``.

A system whose run fails is reported as failed (its row, and NaN in its figures); the others are
still written.

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
from pdrun.notes import delayed_stable_share
from shared.plan import load_plan
from shared.resolve import resolve_dataset

SYSTEMS = ("pdrun 1f1b", "pdrun 1f1b-flush", "pdrun 2bw", "ddp")
PIPELINES = tuple(s for s in SYSTEMS if s.startswith("pdrun "))


@dataclass(frozen=True)
class Config:
    model: str = "zoo:mnist_cnn"
    data: str = "zoo:mnist5k"
    batch_size: int = 64
    microbatches: int = 4
    epochs: int = 5
    target: float = 0.90
    # The sweep every system runs on the fast link: (optimizer, learning rate); SGD with ``momentum``.
    sweep: tuple[tuple[str, float], ...] = (
        ("sgd", 0.01),
        ("sgd", 0.02),
        ("sgd", 0.05),
        ("adam", 0.001),
        ("adam", 0.002),
    )
    momentum: float = 0.9
    slow_bandwidth: float = 2e7  # bytes/s of the emulated slow link
    fast_bandwidth: float = 1e9  # what the plan assumes without emulation


QUICK = Config(epochs=1, target=0.5, sweep=(("sgd", 0.02), ("adam", 0.002)))


@dataclass
class Curve:
    """Validation accuracy after each epoch against training seconds."""

    system: str
    link: str
    optimizer: str
    lr: float
    samples_per_step: int
    points: list[tuple[float, float]]  # (train seconds, val accuracy)
    command: str

    def time_to(self, target: float) -> float:
        return next((t for t, acc in self.points if acc >= target), math.nan)

    def epochs_to(self, target: float) -> int | None:
        return next((i + 1 for i, (_, acc) in enumerate(self.points) if acc >= target), None)


def best(curves: list[Curve], target: float) -> Curve:
    """The sweep's winner: fewest epochs to ``target`` (never reaching it counts last), then the higher
    final accuracy, then SGD before Adam, then the smaller learning rate."""

    def key(c: Curve) -> tuple[int, float, bool, float]:
        epochs = c.epochs_to(target)
        final = c.points[-1][1] if c.points else 0.0
        return (epochs if epochs is not None else len(c.points) + 1, -final, c.optimizer != "sgd", c.lr)

    return min(curves, key=key)


def pdrun_curve(
    plan: Path,
    schedule: str,
    cfg: Config,
    work: Path,
    link: str,
    bandwidth: float | None,
    setting: tuple[str, float],
) -> Curve:
    optimizer, lr = setting
    metrics = work / f"acc-{link}-{schedule}-{optimizer}{lr:g}.parquet"
    extra = ["--schedule", schedule, "--microbatches", str(cfg.microbatches), "--lr", f"{lr:g}"]
    extra += ["--momentum", f"{cfg.momentum:g}"] if optimizer == "sgd" else ["--optimizer", optimizer]
    extra += ["-q"]
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
    per_step = cfg.batch_size * (1 if schedule == "1f1b" else cfg.microbatches)
    return Curve(f"pdrun {schedule}", link, optimizer, lr, per_step, points, done.cmd)


def ddp_curve(
    cfg: Config, link: str, bandwidth: float | None, stage_of: dict[str, int], setting: tuple[str, float]
) -> Curve:
    optimizer, lr = setting
    train_samples = len(resolve_dataset(cfg.data, {"split": "train"}))
    steps_per_epoch = max(1, train_samples // cfg.batch_size // cfg.microbatches)
    s = Settings(
        model=cfg.model,
        data=cfg.data,
        batch_size=cfg.batch_size,
        microbatches=cfg.microbatches,
        stage_of=stage_of,
        lr=lr,
        momentum=cfg.momentum,
        optimizer=optimizer,
        bandwidth=bandwidth,
        warmup=0,
        eval_data_args={"split": "val"},
        steps=steps_per_epoch * cfg.epochs,
    )
    r = run("ddp", s, 2)
    cmd = f"python -m bench.bench_accuracy  (ddp, {optimizer} lr {lr:g})"
    return Curve("ddp", link, optimizer, lr, s.global_batch, [(t, acc) for t, _, acc in r.evals], cmd)


def _setting(optimizer: str, lr: float, cfg: Config) -> str:
    return f"SGD momentum {cfg.momentum:g} lr {lr:g}" if optimizer == "sgd" else f"{optimizer} lr {lr:g}"


def run_curve(
    system: str,
    plan: Path,
    cfg: Config,
    work: Path,
    link: str,
    bandwidth: float | None,
    setting: tuple[str, float],
) -> Curve:
    """One system's run with ``setting`` (optimizer, learning rate) on ``link``."""
    if system == "ddp":
        return ddp_curve(cfg, link, bandwidth, load_plan(plan).stage_of(), setting)
    return pdrun_curve(plan, system.removeprefix("pdrun "), cfg, work, link, bandwidth, setting)


def bench(work: Path, cfg: Config) -> tuple[Report, list[Curve], list[Curve]]:
    """(the report, the chosen runs on both links, every run of the sweep)."""
    report = Report("time to accuracy on MNIST-5k", "python -m bench.bench_accuracy")
    graph = work / "acc-graph.json"
    cmds = [toolchain.profile(graph, cfg.model, cfg.data, cfg.batch_size).cmd]
    plans: dict[str, Path] = {}
    for link, bandwidth in (("fast", cfg.fast_bandwidth), ("slow", cfg.slow_bandwidth)):
        plans[link] = work / f"acc-plan-{link}.json"
        cmds.append(toolchain.plan(graph, plans[link], 2, bandwidth, "1f1b", 1, straight=True).cmd)
    sweep: list[Curve] = []
    curves: list[Curve] = []
    failed: dict[tuple[str, str], str] = {}  # (system, link) -> why
    links = {"fast": None, "slow": cfg.slow_bandwidth}
    for system in SYSTEMS:
        # Asynchronous 1F1B's arithmetic depends on the split (which layers run stale), and the two links'
        # plans may cut in different places: it sweeps on each. 1F1B-flush and DDP compute what one
        # process computes, and 2BW delays every stage alike, whatever the split: their sweep on the fast
        # link holds for the slow one.
        swept = ("fast", "slow") if system == "pdrun 1f1b" else ("fast",)
        try:
            for link in swept:
                tried = [run_curve(system, plans[link], cfg, work, link, links[link], st) for st in cfg.sweep]
                sweep += tried
                curves.append(best(tried, cfg.target))
            if "slow" not in swept:
                chosen = (curves[-1].optimizer, curves[-1].lr)
                curves.append(run_curve(system, plans["slow"], cfg, work, "slow", cfg.slow_bandwidth, chosen))
        except Exception as exc:  # reported as failed; the other systems still run
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = f"failed: {type(exc).__name__}: {lines[0] if lines else ''}"
            for link in ("fast", "slow"):
                if not any(c.system == system and c.link == link for c in curves):
                    failed[(system, link)] = why
    report.notes.append(
        f"{cfg.model} on {cfg.data}, {cfg.epochs} epochs, target validation accuracy {cfg.target:.0%}. The "
        f"systems step at different sizes (asynchronous 1F1B every "
        f"{cfg.batch_size} samples, 1F1B-flush, 2BW and DDP every {cfg.batch_size * cfg.microbatches}), so each "
        f"runs at its own best setting from the same sweep ({', '.join(_setting(o, lr, cfg) for o, lr in cfg.sweep)}; "
        f"best: fewest epochs to the target, then the higher final accuracy). Adam is there for 2BW, whose "
        f"paper trains with it: a gradient applied one step late under momentum {cfg.momentum:g} is stable only "
        f"below about {delayed_stable_share(cfg.momentum):.3f} of the undelayed step (on a "
        f"quadratic), and 2BW's loss at momentum {cfg.momentum:g} climbs back after a few epochs. 1F1B-flush and DDP train what "
        f"one process trains whatever the split, and 2BW's one-step delay is the same at every stage: they "
        f"sweep on the fast link and the slow link reruns their "
        f"rate; asynchronous 1F1B depends on the split, which the two links' plans may place differently: "
        f"it sweeps on each. The sweep's table shows every run. Slow link: {cfg.slow_bandwidth:g} "
        f"bytes/s emulated by a sleep of bytes/bandwidth before every send (pipelines) or every all-reduce "
        f"bucket (DDP, for the 2(n-1)/n share a ring sends). Plans: {' && '.join(cmds)}"
    )
    rows: list[dict[str, Any]] = []
    for c in curves:
        rows.append(
            {
                "system": c.system,
                "link": c.link,
                "optimizer": c.optimizer,
                "lr": c.lr,
                "samples_per_step": c.samples_per_step,
                "epochs_to_target": c.epochs_to(cfg.target),
                "time_to_target_s": c.time_to(cfg.target),
                "final_accuracy": c.points[-1][1] if c.points else math.nan,
                "train_s": c.points[-1][0] if c.points else math.nan,
                "command": c.command,
            }
        )
    rows += [{"system": system, "link": link, "command": why} for (system, link), why in failed.items()]
    report.tables["time_to_accuracy"] = rows
    by = {(c.system, c.link): c for c in curves}

    def time_to(system: str, link: str) -> float:
        c = by.get((system, link))
        return c.time_to(cfg.target) if c is not None else math.nan

    def ratio_figure(name: str, theirs: str, ours: str, link: str, note: str) -> None:
        a, b = time_to(theirs, link), time_to(ours, link)
        missing = failed.get((ours, link)) or failed.get((theirs, link))
        command = by[(ours, link)].command if (ours, link) in by else report.command
        report.add(
            Figure(
                name,
                a / b if b > 0 else math.nan,
                "x",
                f"{command}  vs  {report.command}",
                note=missing or note,
            )
        )

    at = f"{cfg.target:.0%}"
    for link in ("fast", "slow"):
        for system in PIPELINES:
            ratio_figure(
                f"DDP time to {at} / {system} time to {at} ({link} link, each at its best lr)",
                "ddp",
                system,
                link,
                "> 1: pdrun reaches the target sooner; NaN: one of them never reached it",
            )
        for system in ("pdrun 1f1b", "pdrun 1f1b-flush"):
            ratio_figure(
                f"{system} time to {at} / pdrun 2bw time to {at} ({link} link, each at its best lr)",
                system,
                "pdrun 2bw",
                link,
                "> 1: 2BW reaches the target sooner; NaN: one of them never reached it",
            )
    report.tables["learning_rate_sweep"] = [
        {
            "system": c.system,
            "link": c.link,
            "optimizer": c.optimizer,
            "lr": c.lr,
            "samples_per_step": c.samples_per_step,
            "epochs_to_target": c.epochs_to(cfg.target),
            **{f"epoch {i + 1}": acc for i, (_, acc) in enumerate(c.points)},
        }
        for c in sweep
    ]
    return report, curves, sweep


def main(argv: list[str] | None = None) -> tuple[Report, list[Curve]]:
    work, quick = work_args(__doc__, argv)
    report, curves, _ = bench(work, QUICK if quick else Config())
    # The per-epoch curves of the chosen runs: what the plot draws (bench.plots.accuracy).
    report.tables["curves"] = [
        {
            "system": c.system,
            "link": c.link,
            "optimizer": c.optimizer,
            "lr": c.lr,
            "epoch": i + 1,
            "train_s": t,
            "val_accuracy": a,
        }
        for c in curves
        for i, (t, a) in enumerate(c.points)
    ]
    report.save(work / "bench_accuracy.json")
    return report, curves


if __name__ == "__main__":
    main()
    sys.exit(0)
