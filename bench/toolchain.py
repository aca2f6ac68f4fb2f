"""The three tools as the benchmarks call them: ``pdprof``, ``pdplan`` and ``pdrun`` as subprocesses.

The benchmarks drive the command lines a user types, so what they measure is what a user
gets; each call returns the exact command, which RESULTS.md prints so that any figure can
be reproduced by hand.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import RunError


def tool(name: str) -> list[str]:
    """The console script beside this interpreter (the venv's), else ``python -m name``: a Python
    with the tree on PYTHONPATH and no install, as on a GPU host whose own torch runs ``make gpu-check``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", name]


def pretty(cmd: list[str]) -> str:
    """The command as a user would type it in the repository (tools by name, paths relative)."""
    bindir = str(Path(sys.executable).parent) + "/"
    cwd = os.getcwd() + "/"
    return " ".join(shlex.quote(a.replace(bindir, "").replace(cwd, "")) for a in cmd)


@dataclass
class Call:
    """A finished tool call: its command line, what it printed and how long it took."""

    cmd: str
    stdout: str
    seconds: float


def call(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Call:
    """Run a tool; a failure becomes a ``RunError`` carrying the last lines it printed."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env or {}))
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env, check=False
        )
    except subprocess.TimeoutExpired:
        raise RunError(f"{pretty(cmd)}: no answer within {timeout_s:.0f} s") from None
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RunError(f"{pretty(cmd)}: exit status {done.returncode}: {tail}")
    return Call(pretty(cmd), done.stdout, seconds)


def profile(
    out: Path,
    model: str,
    data: str,
    batch_size: int,
    model_args: dict[str, Any] | None = None,
    data_args: dict[str, Any] | None = None,
    timeout_s: float = 300,
    extra: list[str] | None = None,
) -> Call:
    """``pdprof`` -> ``out`` (a layer graph); ``extra``: more pdprof options."""
    cmd = [*tool("pdprof"), "--model", model, "--data", data, "--batch-size", str(batch_size), *(extra or [])]
    for k, v in (model_args or {}).items():
        cmd += ["--model-arg", f"{k}={v}"]
    for k, v in (data_args or {}).items():
        cmd += ["--data-arg", f"{k}={v}"]
    return call([*cmd, "-o", str(out)], timeout_s)


def plan(
    graph: Path,
    out: Path,
    workers: int,
    bandwidth: float,
    schedule: str = "1f1b",
    microbatches: int = 1,
    straight: bool = False,
    timeout_s: float = 120,
    latency: float | None = None,
    blocking_sends: str | None = None,
    extra: list[str] | None = None,
) -> Call:
    """``pdplan`` -> ``out`` (a stage plan); ``blocking_sends``: auto (pdplan's default), yes or no;
    ``extra``: more pdplan options."""
    cmd = [*tool("pdplan"), str(graph), "--workers", str(workers), "--bandwidth", f"{bandwidth:.4g}"]
    cmd += ["--schedule", schedule, "--microbatches", str(microbatches)]
    if latency is not None:
        cmd += ["--latency", f"{latency:.3g}"]
    if straight:
        cmd.append("--straight")
    if blocking_sends is not None:
        cmd += ["--blocking-sends", blocking_sends]
    return call([*cmd, *(extra or []), "-o", str(out)], timeout_s)


def link(size: int = 1 << 20, timeout_s: float = 120) -> tuple[Call, float, float]:
    """``pdrun link``: (the call, bandwidth in bytes/s, latency in seconds) between two local workers."""
    done = call([*tool("pdrun"), "link", "--size", str(size)], timeout_s)
    result = json.loads(done.stdout)
    return done, float(result["bandwidth_bytes_per_s"]), float(result["latency_s"])


def pdrun(
    plan_path: Path,
    metrics: Path,
    steps: int | None = None,
    epochs: int | None = None,
    extra: list[str] | None = None,
    bandwidth: float | None = None,
    timeout_s: float = 600,
) -> tuple[Call, dict[str, Any]]:
    """``pdrun`` -> (the call, its JSON summary); per-step figures land in ``metrics``."""
    cmd = [*tool("pdrun"), str(plan_path), "--metrics", str(metrics)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if epochs is not None:
        cmd += ["--epochs", str(epochs)]
    cmd += extra or []
    env = {"PIPEDREAM_EMULATE_BANDWIDTH": f"{bandwidth:g}"} if bandwidth else None
    done = call(cmd, timeout_s, env)
    if env:
        done.cmd = f"PIPEDREAM_EMULATE_BANDWIDTH={bandwidth:g} {done.cmd}"
    try:
        summary = json.loads(done.stdout) if done.stdout.strip() else {}
    except json.JSONDecodeError:
        summary = {}
    return done, summary
