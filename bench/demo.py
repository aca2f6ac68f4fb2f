"""``make demo``: the three tools as one shell pipeline on the built-in CNN and MNIST-5k, then a summary.

Runs ``pdprof ... | tee graph.json | pdplan - ... | tee plan.json | pdrun - ...`` on this CPU with
two workers, and prints what a new user wants to know: the accuracy reached, the throughput, the
planner's predicted time per minibatch beside the measured one, and where every artifact went.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from rich.table import Table

from shared.cli import console


def _bin(name: str) -> str:
    # The console scripts live beside this interpreter in the venv.
    return str(Path(sys.executable).with_name(name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo-out", help="where the artifacts go")
    parser.add_argument("--model", default="zoo:mnist_cnn")
    parser.add_argument("--data", default="zoo:mnist5k")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bandwidth", default="1e8", help="bytes/s between the two workers, as planned for")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--train-args",
        default="--optimizer sgd --lr 0.05 --momentum 0.9 --weight-decay 5e-4 --lr-schedule cosine",
        help="pdrun's training options",
    )
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graph, table, plan = out / "graph.json", out / "profile.parquet", out / "plan.json"
    metrics, summary = out / "run.parquet", out / "summary.json"
    q = shlex.quote
    pipeline = (
        f"{q(_bin('pdprof'))} --model {q(args.model)} --data {q(args.data)} --batch-size {args.batch_size} "
        f"--momentum 0.9 --concurrent {args.workers} --table {q(str(table))} | tee {q(str(graph))} | "
        f"{q(_bin('pdplan'))} - --workers {args.workers} --bandwidth {q(args.bandwidth)} | tee {q(str(plan))} | "
        f"{q(_bin('pdrun'))} - --epochs {args.epochs} {args.train_args} --metrics {q(str(metrics))} > {q(str(summary))}"
    )
    console.rule("[bold]PipeDream demo: pdprof | pdplan | pdrun")
    console.print(pipeline.replace(str(Path(sys.executable).parent) + "/", ""), markup=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], env=env, check=False)
    if done.returncode != 0:
        console.print(f"[red]demo failed[/]: the pipeline exited with status {done.returncode}")
        return done.returncode

    result = json.loads(summary.read_text())
    plan_data = json.loads(plan.read_text())
    predicted = plan_data.get("predicted") or {}
    # A unit is one minibatch of the profiled batch size, so its measured time is batch / throughput.
    rate = result.get("samples_per_s")
    if isinstance(rate, (int, float)) and rate > 0:
        result["time_per_minibatch_s"] = args.batch_size / rate
    _print_summary(result, plan_data, predicted, out)
    return 0


def _fmt(value: object, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:.{digits}f}{unit}"


def _print_summary(
    result: dict[str, object], plan: dict[str, object], predicted: dict[str, object], out: Path
) -> None:
    stages = plan.get("stages") or []
    assert isinstance(stages, list)
    shape = " | ".join(f"{len(s['layers'])} layers x{s['replicas']}" for s in stages)
    table = Table(title="demo summary", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("plan", f"{plan.get('schedule')}: {len(stages)} stage(s) [{shape}]")
    table.add_row("validation accuracy", _fmt(result.get("val_accuracy"), "%", 100.0, 1))
    table.add_row("final loss", _fmt(result.get("final_loss"), digits=4))
    table.add_row("throughput", _fmt(result.get("samples_per_s"), " samples/s", digits=1))
    table.add_row(
        "predicted time per minibatch",
        _fmt(predicted.get("simulated_time_per_minibatch_s"), " ms", 1000.0)
        + " (the plan's schedule simulated)",
    )
    table.add_row("measured time per minibatch", _fmt(result.get("time_per_minibatch_s"), " ms", 1000.0))
    table.add_row(
        "paper's bottleneck figure",
        _fmt(predicted.get("time_per_minibatch_s"), " ms", 1000.0) + " (slowest stage's compute alone)",
    )
    table.add_row(
        "predicted speedup over data parallel", _fmt(predicted.get("speedup_over_data_parallel"), "x")
    )
    for name in ("graph.json", "profile.parquet", "plan.json", "run.parquet", "summary.json"):
        table.add_row(name, str(out / name))
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
