"""Epochs to 96% on MNIST-5k: asynchronous 1f1b against sequential training, same recipe and data order.

Sequential training is pdrun with a 1-stage plan (one worker, nothing in flight: plain SGD,
as tests/test_run_stash.py checks); the pipelines are 2 and 4 stages of zoo:mnist_cnn under
1f1b (weight stashing, 1 and 3 steps of staleness at stage 0) and 1f1b with vertical sync.
Prints one JSON object with the validation accuracy after each epoch and the first epoch at
96% or more.

    python -m bench.mnist_epochs [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.metrics import summary
from pdrun.plans import cut_plan
from shared.cli import console
from shared.spec import RunSpec

MNIST = RunSpec(model="zoo:mnist_cnn", model_args={"channels": 16}, data="zoo:mnist5k")
RUNS: list[tuple[str, list[str], bool]] = [
    ("sequential (1 stage)", [], False),
    ("1f1b, 2 stages", ["conv2"], False),
    ("1f1b, 4 stages", ["pool1", "conv2", "flatten"], False),
    ("1f1b, 4 stages, vertical sync", ["pool1", "conv2", "flatten"], True),
]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--target", type=float, default=0.96)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name, cuts, vsync in RUNS:
        plan = cut_plan(MNIST, cuts, batch_size=64, schedule="1f1b", vertical_sync=vsync)
        cfg = RunConfig(epochs=args.epochs, lr=0.05, momentum=0.9, weight_decay=5e-4, lr_schedule="cosine")
        t0 = time.perf_counter()
        results = launch(plan, cfg)
        assert results is not None
        acc = [e["val_accuracy"] for e in summary(results, plan)["validation"]]
        first = next((i + 1 for i, a in enumerate(acc) if a >= args.target), None)
        rows.append(
            {
                "run": name,
                "stages": len(plan.stages),
                "in_flight": plan.in_flight,
                "val_accuracy": acc,
                "first_epoch_at_target": first,
                "seconds": time.perf_counter() - t0,
            }
        )
        console.print(
            f"{name}: " + " ".join(f"{a:.1%}" for a in acc) + f"  (>= {args.target:.0%} at epoch {first})"
        )
    json.dump(
        {
            "model": MNIST.model,
            "data": MNIST.data,
            "target": args.target,
            "recipe": "sgd lr 0.05 momentum 0.9 wd 5e-4 cosine, batch 64",
            "runs": rows,
        },
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
