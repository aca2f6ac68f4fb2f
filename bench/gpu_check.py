"""``make gpu-check``: profile a zoo model on CUDA, and show how its layers add up to a whole step.

The CUDA path is the same profiler the CPU tests run; only the clock differs (CUDA events,
synchronised before reading) and the figures are then scaled to the whole step
(``pdprof.calibrate``: on a launch-bound GPU the marks themselves cost time). Prints the summary,
the layer sum against the whole step as measured and the factors applied, and the heaviest layers
on stderr, one JSON object on stdout; exits 2 when there is no CUDA device. Whether the calibrated
figures predict a run is ``bench.gpu_pipeline_check``'s test (one worker's time and memory).

    python -m bench.gpu_check [--model zoo:resnet50] [--batch-size 32] [-o graph.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pdprof.profiler import ProfileConfig, profile_spec
from pdprof.report import heaviest, summary_line
from shared.cli import console, parse_kv
from shared.graph import save_graph
from shared.spec import RunSpec


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:resnet50")
    parser.add_argument("--data", default="zoo:synthetic_images")
    parser.add_argument("--data-arg", action="append", default=None, help="default: size=64")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("-o", "--output", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        console.print(f"gpu-check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 2
    spec = RunSpec(
        model=args.model, data=args.data, data_args=parse_kv(args.data_arg or ["size=64"], "--data-arg")
    )
    graph = profile_spec(ProfileConfig(spec, args.batch_size, "cuda", args.warmup, args.repeats)).graph
    if args.output:
        save_graph(graph, args.output)
    console.print(f"{torch.cuda.get_device_name()}: " + summary_line(graph))
    scale = graph.graph["calibration"]
    console.print(
        f"layer sum / whole step as measured {scale['measured_ratio']:.3f}; figures scaled by "
        f"{scale['compute']:.3f} (forward, backward, loss) and {scale['update']:.3f} (updates)"
    )
    console.print(heaviest(graph, 8))
    timing = graph.timing
    assert timing is not None
    json.dump(
        {
            "device": torch.cuda.get_device_name(),
            "model": args.model,
            "batch_size": args.batch_size,
            "layers": len(graph.nodes),
            "step_ms": timing.step_ms,
            "layer_sum_ms": timing.layer_sum_ms,
            "ratio": timing.ratio,
            **graph.graph,
        },
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
