"""The benchmark plots (PNG under bench/results/), drawn from the benchmarks' tables only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def throughput(rows: list[dict[str, Any]], path: Path) -> str:
    """Samples/s of every system, pdrun's bars first (a failed run, without a figure, has no bar)."""
    rows = [r for r in rows if _value(r.get("samples_per_s")) > 0]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["system"] for r in rows]
    values = [r["samples_per_s"] for r in rows]
    colors = ["tab:blue" if n.startswith("pdrun") else "tab:gray" for n in names]
    ax.barh(names[::-1], values[::-1], color=colors[::-1])
    for i, v in enumerate(values[::-1]):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax.set_xlabel("samples/s over the median step (higher is better)")
    ax.set_title("Training throughput, same model, split, microbatches and threads")
    return _save(fig, path)


def breakdown(rows: list[dict[str, Any]], path: Path) -> str:
    """Per system and rank: compute against everything else (communication, waiting, overhead)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['system']} r{r['rank']}" for r in rows][::-1]
    left = [0.0] * len(rows)
    parts = (
        ("compute_s", "tab:green", "compute (fwd, bwd, loss, step)"),
        ("comm_wait_s", "tab:orange", "communication and waiting"),
        ("other_s", "tab:gray", "other (framework, bookkeeping)"),
    )
    for key, color, label in parts:
        values = [_value(r.get(key)) for r in rows][::-1]
        ax.barh(labels, values, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("seconds over the timed steps (the same samples for every system)")
    ax.set_title("Where the time goes, per rank")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.4, -0.16), ncol=3)
    return _save(fig, path)


def accuracy(rows: list[dict[str, Any]], target: float, path: Path) -> str:
    """Validation accuracy against training time, one panel per link."""
    links = sorted({r["link"] for r in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.4), sharey=True, squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        for system in sorted({r["system"] for r in rows}):
            mine = [r for r in rows if r["link"] == link and r["system"] == system]
            pts = [(r["train_s"], r["val_accuracy"]) for r in mine]
            # Each system at its own learning rate (bench.bench_accuracy's sweep): the label says which.
            label = (
                f"{system}, {mine[0].get('optimizer', 'sgd')} lr {mine[0]['lr']:g}"
                if mine and "lr" in mine[0]
                else system
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{link} link")
        ax.set_xlabel("training seconds (validation after each epoch)")
    axes[0][0].set_ylabel("validation accuracy")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Time to accuracy, zoo:mnist_cnn on zoo:mnist5k")
    return _save(fig, path)


def prediction(rows: list[dict[str, Any]], path: Path) -> str:
    """The paper's bottleneck figure and the schedule simulation beside the measured time per minibatch."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r["case"] for r in rows]
    y = list(range(len(names)))
    ax.barh(
        [i + 0.27 for i in y],
        [r["predicted_ms"] for r in rows],
        height=0.27,
        label="paper's bottleneck (pdplan)",
    )
    ax.barh(
        y,
        [r.get("simulated_ms", float("nan")) for r in rows],
        height=0.27,
        label="schedule simulated (pdplan)",
    )
    ax.barh([i - 0.27 for i in y], [r["measured_ms"] for r in rows], height=0.27, label="measured (pdrun)")
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per minibatch")
    ax.set_title("Planner's prediction against pdrun's measurement")
    ax.legend(fontsize=8)
    return _save(fig, path)


def planner_speed(rows: list[dict[str, Any]], path: Path) -> str | None:
    """Planner wall time against graph size, when the planner benchmark reports rows with both."""
    pts = [
        (float(r["layers"]), float(r["plan_s"]))
        for r in rows
        if _num(r.get("layers")) and _num(r.get("plan_s"))
    ]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], label="pdplan")
    refs = [(float(r["layers"]), float(r["reference_s"])) for r in rows if _num(r.get("reference_s"))]
    if refs:
        ax.scatter([p[0] for p in refs], [p[1] for p in refs], marker="x", label="paper's optimizer")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("layers in the graph")
    ax.set_ylabel("planner seconds")
    ax.set_title("Planner speed")
    return _save(fig, path)


def _value(value: Any) -> float:
    return float(value) if _num(value) else 0.0


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))
