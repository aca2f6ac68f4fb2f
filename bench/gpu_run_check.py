"""pdrun on CUDA: a 1-stage and a 2-stage plan through the same launcher and worker the CPU tests run.

Only the device differs (``RunConfig.device="cuda"``: NCCL, workers started with spawn).
With fewer GPUs than ranks, the ranks share a GPU and talk over gloo through host memory
(NCCL refuses two ranks on one device). Each plan trains 10 steps of 1f1b-flush in float64;
the parameters must equal sequential training on the CPU within 1e-6, then a short 1f1b
run reports throughput. Prints one JSON object; exits 1 on a mismatch, 2 without CUDA.

    python -m bench.gpu_run_check
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Literal

import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.metrics import summary
from pdrun.plans import cut_plan
from shared.cli import console
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.spec import RunSpec

SPEC = RunSpec(model="zoo:resmlp", model_args={"width": 256, "depth": 4}, data="zoo:digits")
BATCH, MICRO, STEPS = 32, 4, 10


def sequential_cpu() -> dict[str, torch.Tensor]:
    """10 steps of plain SGD on batches of BATCH x MICRO samples, in pdrun's data order."""
    assert SPEC.model is not None and SPEC.data is not None
    torch.manual_seed(0)
    model = resolve_model(SPEC.model, SPEC.model_args).double()
    data = resolve_dataset(SPEC.data, SPEC.data_args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = resolve_loss(SPEC.loss)
    batch = BATCH * MICRO
    per_epoch = len(data) // batch
    for step in range(STEPS):
        epoch, b = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        idx = order[b * batch : (b + 1) * batch]
        x = torch.stack([data[int(i)][0] for i in idx]).double()
        y = torch.stack([torch.as_tensor(data[int(i)][1]) for i in idx])
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def check(stages: int, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    cuts = [] if stages == 1 else [7]
    backend: Literal["gloo"] | None = None if torch.cuda.device_count() >= stages else "gloo"
    plan = cut_plan(SPEC, cuts, batch_size=BATCH, schedule="1f1b-flush", microbatches=MICRO)
    cfg = RunConfig(
        steps=STEPS,
        lr=0.1,
        momentum=0.9,
        dtype="float64",
        device="cuda",
        backend=backend,
        record=True,
        validate=False,
    )
    t0 = time.perf_counter()
    results = launch(plan, cfg)
    assert results is not None
    got: dict[str, torch.Tensor] = {}
    for r in results:
        if r.replica == 0:
            got.update(r.params)
    diff = max((got[k].double() - want[k]).abs().max().item() for k in want)
    fast = cut_plan(SPEC, cuts, batch_size=BATCH, schedule="1f1b")
    speed = launch(fast, RunConfig(steps=200, lr=0.05, device="cuda", backend=backend, validate=True))
    assert speed is not None
    s = summary(speed, fast)
    return {
        "stages": stages,
        "backend": backend or "nccl",
        "max_param_diff_vs_cpu": diff,
        "equal": diff <= 1e-6,
        "seconds": time.perf_counter() - t0,
        "1f1b_samples_per_s": s["samples_per_s"],
        "1f1b_final_loss": s["final_loss"],
        "1f1b_val_accuracy": s.get("val_accuracy"),
    }


def main() -> int:
    if not torch.cuda.is_available():
        console.print(f"gpu-run-check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 2
    want = sequential_cpu()
    rows = [check(1, want), check(2, want)]
    for row in rows:
        console.print(
            f"{row['stages']} stage(s) over {row['backend']}: max |param - cpu| = "
            f"{row['max_param_diff_vs_cpu']:.2e}, 1f1b {row['1f1b_samples_per_s']:.0f} samples/s"
        )
    json.dump(
        {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "runs": rows},
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
