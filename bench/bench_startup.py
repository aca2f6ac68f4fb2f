"""Start-up against the run's length: time from launch to the first step, and peak memory, at --steps 10^2..10^6.

Each rank generates its own instructions as it runs them and validates bounded windows of
the program (shared/schedule.py, shared/schedule_check.py), so neither the time to the
first step nor any process's memory should grow with ``--steps``: the issue's target is
10^6 steps within 1.2x of 10^2 in time and within 5% in peak RSS. Before, every process
built every worker's program for the whole run: 6.5 s to the first step at 1,000 steps,
61 s at 16,000, never at 100,000.

How it is measured: ``pdrun PLAN --steps N --checkpoint-dir D --checkpoint-every K`` runs
as a subprocess in its own process group; the first step is done when the manifest of the
step-K checkpoint appears (K = 1: the first step; the run drains there, which is the same
work at every N). Peak RSS is each process's ``VmHWM`` read from /proc then: the launcher,
and the workers (the forkserver's children). Then the process group is killed. The
"Done when" of issue 15 is the same with K = 20: the step-20 checkpoint at --steps 40
against --steps 1000000.

    python -m bench.bench_startup [--quick] [--work bench/out]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.measure import Report, judged, main_of
from pdrun.plans import cut_plan, traced_for
from shared.plan import save_plan
from shared.spec import RunSpec

SPEC = RunSpec(model="zoo:mnist_cnn", data="zoo:mnist5k")
SCHEDULES = ("1f1b", "1f1b-flush")


@dataclass(frozen=True)
class Config:
    steps: tuple[int, ...] = (10**2, 10**4, 10**6)
    repeats: int = 2  # the best of these: the machine is shared
    done_when: tuple[int, ...] = (40, 10**6)  # --steps of the step-20 checkpoint comparison
    timeout_s: float = 300.0


QUICK = Config(steps=(10**2, 10**6), repeats=1, done_when=(40, 10**6))


@dataclass(frozen=True)
class Startup:
    seconds: float  # launch to the checkpoint's manifest
    launcher_mb: float
    workers_mb: tuple[float, ...]


def make_plan(work: Path) -> Path:
    """The zoo MNIST CNN on 2 stages (cut at its middle layer), 4 microbatches for 1f1b-flush."""
    names = [layer.name for layer in traced_for(SPEC).layers]
    plan = cut_plan(SPEC, [len(names) // 2], batch_size=64, schedule="1f1b-flush", microbatches=4)
    path = work / "plan-startup.json"
    save_plan(plan, path)
    return path


def _tree(root: int) -> dict[int, tuple[int, float]]:
    """pid -> (depth below ``root``, VmHWM in MB) for ``root`` and its descendants (read from /proc)."""
    parent: dict[int, int] = {}
    peak: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        parent[int(entry.name)] = int(fields["PPid"])
        hwm = fields.get("VmHWM", "0 kB").split()[0]
        peak[int(entry.name)] = int(hwm) / 1024
    out: dict[int, tuple[int, float]] = {}
    for pid in parent:
        depth, p = 0, pid
        while p != root and p in parent and depth < 8:
            p, depth = parent[p], depth + 1
        if p == root:
            out[pid] = (depth, peak[pid])
    return out


def startup(plan: Path, schedule: str, steps: int, every: int, work: Path, timeout_s: float) -> Startup:
    """Launch pdrun and wait for its step-``every`` checkpoint; the time and every process's peak RSS then."""
    ck = work / f"ck-{schedule}-{steps}-{every}"
    if ck.exists():
        for p in sorted(ck.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    pdrun = Path(sys.executable).parent / "pdrun"
    cmd = [str(pdrun), str(plan), "--schedule", schedule, "--steps", str(steps), "-q", "--no-val"]
    cmd += ["--checkpoint-dir", str(ck), "--checkpoint-every", str(every)]
    manifest = ck / f"step-{every:06d}" / "manifest.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        while not manifest.exists():
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(
                    f"pdrun exited {proc.returncode} before step {every}: {err.strip()[-300:]}"
                )
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"no step-{every} checkpoint within {timeout_s:.0f} s: {' '.join(cmd)}")
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        tree = _tree(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # The launcher is the root; the workers are the forkserver's children (depth 2).
    workers = tuple(sorted(mb for depth, mb in tree.values() if depth == 2))
    return Startup(seconds, tree.get(proc.pid, (0, 0.0))[1], workers)


def bench(work: Path, cfg: Config) -> Report:
    command = "python -m bench.bench_startup"
    report = Report("Start-up against the run's length", command)
    plan = make_plan(work)
    report.notes.append(
        "zoo:mnist_cnn on zoo:mnist5k, 2 stages of one worker each (cut at the middle layer), batch 64, "
        "1f1b-flush with 4 microbatches a step; time from launch to the first step's checkpoint "
        f"(--checkpoint-every 1), best of {cfg.repeats}; peak RSS (VmHWM) of the launcher and of each "
        "worker at that moment. The machine is shared (see the load average above): start-up time is "
        "mostly imports, tracing and process start, which load slows alike at every --steps."
    )
    rows: list[dict[str, Any]] = []
    for schedule in SCHEDULES:
        best: dict[int, Startup] = {}
        for _ in range(cfg.repeats):
            for steps in cfg.steps:  # interleaved: a load spike hits every length alike
                got = startup(plan, schedule, steps, 1, work, cfg.timeout_s)
                if steps not in best or got.seconds < best[steps].seconds:
                    best[steps] = got
        base = best[cfg.steps[0]]
        for steps in cfg.steps:
            got = best[steps]
            rows.append(
                {
                    "schedule": schedule,
                    "steps": steps,
                    "first_step_s": got.seconds,
                    "x_of_10^2": got.seconds / base.seconds,
                    "launcher_rss_mb": got.launcher_mb,
                    "worker_rss_mb": " / ".join(f"{mb:.0f}" for mb in got.workers_mb),
                    "rss_x_of_10^2": max(
                        [got.launcher_mb / base.launcher_mb]
                        + [a / b for a, b in zip(got.workers_mb, base.workers_mb, strict=False)]
                    ),
                }
            )
        big = best[cfg.steps[-1]]
        ratio = big.seconds / base.seconds
        report.add(
            judged(
                f"time to first step, --steps {cfg.steps[-1]:.0e} / {cfg.steps[0]:.0e}, {schedule}",
                ratio,
                "x",
                command,
                at_most=1.2,
            )
        )
        rss = rows[-1]["rss_x_of_10^2"]
        report.add(
            judged(
                f"peak RSS, --steps {cfg.steps[-1]:.0e} / {cfg.steps[0]:.0e}, {schedule} (largest process ratio)",
                rss,
                "x",
                command,
                at_most=1.05,
            )
        )
    report.tables["startup"] = rows
    done: list[dict[str, Any]] = []
    for schedule in SCHEDULES:
        for steps in cfg.done_when:
            got = startup(plan, schedule, steps, 20, work, cfg.timeout_s)
            done.append({"schedule": schedule, "steps": steps, "step_20_checkpoint_s": got.seconds})
        ratio = done[-1]["step_20_checkpoint_s"] / done[-2]["step_20_checkpoint_s"]
        report.add(
            judged(
                f"step-20 checkpoint, --steps {cfg.done_when[-1]} / {cfg.done_when[0]}, {schedule}",
                ratio,
                "x",
                f"{command} (issue 15's Done when)",
                at_most=1.2,
            )
        )
    report.tables["step_20_checkpoint"] = done
    return report


def main(argv: list[str] | None = None) -> Report:
    return main_of(
        __doc__, argv, "bench_startup", lambda work, quick: bench(work, QUICK if quick else Config())
    )


if __name__ == "__main__":
    rep = main()
    for f in rep.figures:
        print(f"{f.name}: {f.value:.3f}{f.unit} (target {f.target})")
    for name, rows in rep.tables.items():
        print(name)
        for row in rows:
            print("  ", row)
