"""``make gpu-check``: profile a zoo model on CUDA and check the layer sum against a whole step.

The CUDA path is the same profiler the CPU tests run; only the clock differs (CUDA events,
synchronised before reading). Prints the summary and the heaviest layers on stderr and one
JSON object on stdout; exits 1 when the layer sum is off the whole step by more than 15%,
2 when there is no CUDA device.

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
    console.print(heaviest(graph, 8))
    timing = graph.timing
    assert timing is not None and timing.ratio is not None
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
    return 0 if 0.85 <= timing.ratio <= 1.15 else 1


if __name__ == "__main__":
    sys.exit(main())
