"""``make gpu-check``, the command lines: ``pdprof --device cuda``, ``pdplan``, ``pdrun --device cuda``.

Per model: pdprof times it with CUDA events; pdplan plans one worker, two as it chooses and two as a
straight pipeline (a stage each); pdrun trains each plan on this GPU, one worker over NCCL and two
sharing the GPU over gloo (NCCL refuses two ranks on one device).
Reported beside each run: the planner's simulated time per minibatch and pdrun's measured (after
``--warmup`` steps; only the one-worker run has the GPU to itself as the plan assumed), and each stage's
predicted peak memory against its measured (``torch.cuda``'s allocated peak, ``pdrun.peak``). Prints
one JSON object on stdout, progress on stderr. Exits 1 when a command fails, a one-worker run's time
per minibatch is off its prediction by more than 15%, or a stage's memory by more than 20% (the
bands of issue 17); 2 without CUDA.

    python -m bench.gpu_pipeline_check [--out gpu-out] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import toolchain
from bench.measure import pdrun_timing
from shared.cli import console
from shared.errors import RunError
from shared.plan import load_plan


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    data: str
    batch_size: int
    model_args: dict[str, Any] = field(default_factory=dict)
    data_args: dict[str, Any] = field(default_factory=dict)
    loss: str | None = None


TIME_BAND, MEMORY_BAND = 0.15, 0.20

CASES = (
    Case("resnet18", "zoo:resnet18", "zoo:synthetic_images", 32),
    Case("gpt-4x256", "zoo:gpt", "zoo:pydoc_text", 32, model_args={"n_layer": 4, "n_head": 4, "n_embd": 256}),
    # Traced with torch.export, whose graph names the device it was exported on (shared.tracer_export).
    Case("hf-gpt2", "zoo:hf_gpt2", "zoo:pydoc_tokens", 32, model_args={"n_layer": 4}, loss="causal_lm"),
)


def run_plan(
    case: Case, graph: Path, workers: int, straight: bool, out: Path, steps: int, warmup: int, device: str
) -> dict[str, Any]:
    """Plan ``graph`` for ``workers`` on this GPU and train the plan: predictions beside measurements.
    ``straight``: one stage a worker, so activations cross between the ranks (pdplan --straight)."""
    tag = f"{case.name}-{workers}w" + ("-straight" if straight else "")
    plan_path, metrics = out / f"plan-{tag}.json", out / f"run-{tag}.parquet"
    planned = toolchain.plan(graph, plan_path, workers, 1e10, schedule="1f1b", straight=straight)
    plan = load_plan(plan_path)
    extra = ["--device", device, "--no-val", "-q", "--lr", "0.01"]
    if workers > 1:
        extra += ["--backend", "gloo"]  # the ranks share this one GPU
    done, summary = toolchain.pdrun(plan_path, metrics, steps=steps + warmup, extra=extra)
    timing = pdrun_timing(metrics, warmup)
    measured = timing.seconds_per_minibatch(plan.batch_size)
    simulated = plan.predicted.simulated_time_per_minibatch_s if plan.predicted else None
    memory = [
        {
            "stage": m["stage"],
            "predicted_mb": m["predicted_bytes"] / 1e6 if m["predicted_bytes"] else None,
            "measured_mb": max(m["measured_bytes"].values(), default=math.nan) / 1e6,
            "measured_over_predicted": m["measured_over_predicted"],
        }
        for m in summary.get("memory", [])
    ]
    row = {
        "case": case.name,
        "workers": workers,
        "straight": straight,
        "plan": " | ".join(f"{len(st.layers)} layers x{st.replicas}" for st in plan.stages),
        "schedule": plan.schedule,
        "simulated_ms": simulated * 1000 if simulated else None,
        "measured_ms": measured * 1000,
        "simulated_over_measured": simulated / measured if simulated and measured > 0 else None,
        "final_loss": summary.get("final_loss"),
        "transport": summary.get("transport"),
        "memory": memory,
        "command": f"{planned.cmd} && {done.cmd}",
    }
    ratio = row["simulated_over_measured"]
    mem = ", ".join(f"stage {m['stage']} {m['measured_over_predicted'] or math.nan:.2f}" for m in memory)
    console.print(
        f"{tag}: {row['plan']}, {plan.schedule}; simulated {row['simulated_ms'] or math.nan:.2f} ms, "
        f"measured {row['measured_ms']:.2f} ms per minibatch ({ratio or math.nan:.2f}); "
        f"memory measured/predicted: {mem}"
    )
    return row


def check(case: Case, out: Path, steps: int, warmup: int, device: str) -> dict[str, Any]:
    graph = out / f"graph-{case.name}.json"
    prof = toolchain.profile(
        graph,
        case.model,
        case.data,
        case.batch_size,
        case.model_args,
        case.data_args,
        extra=["--device", device, *(["--loss", case.loss] if case.loss else [])],
    )
    doc = json.loads(graph.read_text())
    measured = (doc["graph"].get("calibration") or {}).get("measured_ratio")
    console.print(
        f"{case.name}: profiled on {device} in {prof.seconds:.1f} s; layer sum / whole step {measured}"
    )
    return {
        "case": case.name,
        "profile_s": prof.seconds,
        "layer_sum_over_step_as_measured": measured,
        "profile_command": prof.cmd,
        "runs": [
            run_plan(case, graph, w, straight, out, steps, warmup, device)
            for w, straight in ((1, False), (2, False), (2, True))
        ],
    }


def misses(row: dict[str, Any]) -> list[str]:
    """What of ``row`` is outside its band: time for one worker (the GPU its own), memory always."""
    out = []
    ratio = row["simulated_over_measured"]
    if row["workers"] == 1 and (ratio is None or abs(ratio - 1) > TIME_BAND):
        out.append(f"simulated / measured time {ratio}")
    for m in row["memory"]:
        r = m["measured_over_predicted"]
        if r is None or abs(r - 1) > MEMORY_BAND:
            out.append(f"stage {m['stage']} memory measured / predicted {r}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-out"))
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    parser.add_argument(
        "--case", action="append", choices=[c.name for c in CASES], help="only these (default: every case)"
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: try this script without a GPU"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        console.print(
            f"gpu-pipeline-check: no CUDA device here (torch {torch.__version__}); nothing to check"
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    for case in CASES:
        if args.case and case.name not in args.case:
            continue
        try:
            rows.append(check(case, args.out, args.steps, args.warmup, args.device))
        except RunError as exc:  # say which case, and go on with the others
            console.print(f"{case.name}: {exc}")
            failed.append({"case": case.name, "error": str(exc)})
    outside = [
        f"{run['case']} on {run['workers']} worker(s): {miss}"
        for c in rows
        for run in c["runs"]
        for miss in misses(run)
    ]
    for line in outside:
        console.print(f"outside its band: {line}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    json.dump({"device": name, "cases": rows, "failed": failed, "outside": outside}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 1 if failed or outside else 0


if __name__ == "__main__":
    sys.exit(main())
