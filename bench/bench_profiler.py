"""How good are pdprof's figures? Layer sum vs whole step, and two runs per layer, for one model.

Profiles the model twice in this process (default: zoo ResNet-50, batch 8, CPU, one thread),
then prints, as one JSON object on stdout (and a short table on stderr):

- for each run, the sum of per-layer forward+backward medians, the directly timed training
  step (forward + loss + backward) and their ratio (the issue asks for 0.85..1.15);
- over layers above ``--min-ms`` (1 ms), how far the two runs' per-layer figures are apart:
  the largest relative difference and how many layers agree within 10%.

    python -m bench.bench_profiler                        # ResNet-50, batch 8 (a few minutes)
    python -m bench.bench_profiler --model zoo:mnist_cnn --data zoo:mnist5k --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from pdprof.cli import main as _cli  # noqa: F401 - the same imports a pdprof run has
from pdprof.profiler import ProfileConfig, profile_spec
from shared.cli import parse_kv
from shared.graph import LayerGraph
from shared.spec import RunSpec

console = Console(stderr=True, highlight=False)


def _rel(x: float, y: float) -> float:
    return abs(x - y) / min(x, y) if min(x, y) > 0 else float("inf")


def agreement(a: LayerGraph, b: LayerGraph, min_ms: float, per_layer: bool = False) -> dict[str, Any]:
    """The relative difference of the two runs for every figure above ``min_ms`` in either run:
    each layer's forward and backward apart, or (``per_layer``) each layer's forward + backward."""
    diffs: list[tuple[str, float, float, float]] = []
    for na, nb in zip(a.nodes, b.nodes, strict=True):
        if per_layer:
            x, y = na.forward_ms + na.backward_ms, nb.forward_ms + nb.backward_ms
            if max(x, y) > min_ms:
                diffs.append((na.id, x, y, _rel(x, y)))
            continue
        for phase in ("forward_ms", "backward_ms"):
            x, y = getattr(na, phase), getattr(nb, phase)
            if max(x, y) > min_ms:
                diffs.append((f"{na.id}.{phase[:-3]}", x, y, _rel(x, y)))
    worst = sorted(diffs, key=lambda d: d[3], reverse=True)
    return {
        "figures_compared": len(diffs),
        "within_10pct": sum(d[3] <= 0.10 for d in diffs),
        "max_rel_diff": worst[0][3] if worst else 0.0,
        "worst": [{"figure": d[0], "run1_ms": d[1], "run2_ms": d[2], "rel_diff": d[3]} for d in worst[:5]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:resnet50")
    parser.add_argument("--model-arg", action="append", default=[])
    parser.add_argument("--data", default="zoo:synthetic_images")
    parser.add_argument(
        "--data-arg", action="append", default=None, help="default for the default data: size=64"
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-ms", type=float, default=1.0)
    args = parser.parse_args()

    spec = RunSpec(
        model=args.model,
        model_args=parse_kv(args.model_arg, "--model-arg"),
        data=args.data,
        data_args=parse_kv(args.data_arg if args.data_arg is not None else ["size=64"], "--data-arg")
        if args.data_arg is not None or args.data == "zoo:synthetic_images"
        else {},
    )
    config = ProfileConfig(spec, args.batch_size, args.device, args.warmup, args.repeats, args.threads)
    runs: list[LayerGraph] = []
    result: dict[str, Any] = {
        "model": args.model,
        "batch_size": args.batch_size,
        "device": args.device,
        "threads": args.threads,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "runs": [],
    }
    for i in range(2):
        start = time.perf_counter()
        graph = profile_spec(config).graph
        timing = graph.timing
        assert timing is not None
        runs.append(graph)
        result["runs"].append(
            {
                "layer_sum_ms": timing.layer_sum_ms,
                "step_ms": timing.step_ms,
                "ratio": timing.ratio,
                "method": timing.method,
                "seconds": time.perf_counter() - start,
                **graph.graph,
            }
        )
        console.print(
            f"run {i + 1}: layer sum {timing.layer_sum_ms:.1f} ms, step {timing.step_ms:.1f} ms, "
            f"ratio {timing.ratio:.3f} ({time.perf_counter() - start:.0f} s)"
        )
    result["layers"] = len(runs[0].nodes)
    result["agreement"] = agreement(runs[0], runs[1], args.min_ms)
    result["layer_agreement"] = agreement(runs[0], runs[1], args.min_ms, per_layer=True)

    table = Table(
        title=f"{args.model} batch {args.batch_size}: figures above {args.min_ms} ms, run 1 vs run 2"
    )
    for column in ("figure", "run 1 ms", "run 2 ms", "difference"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for row in result["agreement"]["worst"]:
        table.add_row(
            row["figure"], f"{row['run1_ms']:.2f}", f"{row['run2_ms']:.2f}", f"{100 * row['rel_diff']:.1f}%"
        )
    console.print(table)
    agree = result["agreement"]
    layers = result["layer_agreement"]
    console.print(
        f"{agree['within_10pct']} of {agree['figures_compared']} figures (forward, backward) and "
        f"{layers['within_10pct']} of {layers['figures_compared']} layers (forward + backward) above "
        f"{args.min_ms} ms agree within 10%; worst {100 * agree['max_rel_diff']:.1f}% and {100 * layers['max_rel_diff']:.1f}%"
    )
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
