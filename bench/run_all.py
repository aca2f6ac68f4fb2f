"""``make bench``: every benchmark in one run, then bench/RESULTS.md and the plots in bench/results/.

Runs, in order: pdrun against the alternatives (``bench.bench_runtime``), the planner's
prediction against pdrun's measurement (``bench.bench_predict``), the memory model against
pdrun's measured peaks (``bench.bench_memory``), time to accuracy
(``bench.bench_accuracy``), start-up against the run's length (``bench.bench_startup``), and
the planner's and profiler's own benchmarks (``bench.bench_planner``, ``bench.bench_profiler``)
when they are present; the command lines' own start-up (``bench.bench_cli``) takes a round before
the first and one after each, so its rounds are spread over the run. A benchmark that fails is reported in RESULTS.md with its error; the
others still run. Artifacts (graphs, plans, run metrics) go to ``bench/out/``.

    python -m bench.run_all            # the full run (about 10-15 minutes on 2 CPU cores)
    python -m bench.run_all --quick    # a few steps of everything: checks the harness, not the figures
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import bench_cli, host, plots, reproduce
from bench.measure import COVERAGE, FAMILY_COVERAGE, JUDGED_FIGURES, Figure, Report, band_factor, judged
from shared.cli import console
from shared.io import atomic_write_bytes

HERE = Path(__file__).resolve().parent
RESULTS_MD = HERE / "RESULTS.md"
PLOTS = HERE / "results"
FIGURES_JSON = PLOTS / "figures.json"  # this run's figures, for the next run's comparison (bench.reproduce)

# The other benchmarks: how to run them within the time budget (their own command lines).
EXTERNAL = {
    "bench_planner": ["python", "-m", "bench.bench_planner"],
    # --schedule auto against the paper-cost plan on three profiles (deterministic; ~5 min here).
    "bench_planner_auto": ["python", "-m", "bench.bench_planner", "--auto"],
    "bench_profiler": [
        "python",
        "-m",
        "bench.bench_profiler",
        "--model",
        "zoo:mnist_cnn",
        "--data",
        "zoo:synthetic",
        "--data-arg",
        "shape=(1,28,28)",
        "--batch-size",
        "64",
    ],
}


def _run_internal(name: str, fn: Callable[[], Report], log: list[str]) -> Report | None:
    console.rule(f"[bold]{name}")
    t0 = time.perf_counter()
    try:
        report = fn()
    except Exception as exc:  # one benchmark's failure must not lose the others
        log.append(f"- `{name}` failed after {time.perf_counter() - t0:.0f} s: {type(exc).__name__}: {exc}")
        console.print(f"[red]{name} failed[/]: {exc}", markup=True)
        if os.environ.get("PIPEDREAM_DEBUG") == "1":
            traceback.print_exc()
        return None
    log.append(f"- `{name}`: {time.perf_counter() - t0:.0f} s")
    return report


def _run_external(name: str, cmd: list[str], timeout_s: float, log: list[str]) -> dict[str, Any] | None:
    module = cmd[cmd.index("-m") + 1]  # bench_planner_auto is bench.bench_planner --auto
    if importlib.util.find_spec(module) is None:
        log.append(f"- `{name}`: not present in this checkout, skipped")
        return None
    console.rule(f"[bold]{name}")
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        done = subprocess.run(
            [sys.executable, *cmd[1:]],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.append(f"- `{name}` did not finish within {timeout_s:.0f} s")
        return None
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-2:])
        log.append(f"- `{name}` failed (exit status {done.returncode}) after {seconds:.0f} s: {tail}")
        return None
    log.append(f"- `{name}`: {seconds:.0f} s")
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        data = {"output": done.stdout.strip()[-2000:]}
    return {"command": " ".join(cmd), "result": data}


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        return (
            f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"
        )
    return str(value).replace("|", "\\|")


def _table(rows: list[dict[str, Any]], skip: tuple[str, ...] = ()) -> list[str]:
    if not rows:
        return ["(no rows)"]
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in skip]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def _figures(reports: list[Report]) -> list[str]:
    out = ["| figure | value | noise | target | met | reproduce with |", "|---|---|---|---|---|---|"]
    for rep in reports:
        for f in rep.figures:
            met = "-" if f.meets is None else ("yes" if f.meets else "**no**")
            value = f"{_fmt(f.value)}{f.unit}"
            noise = "-" if f.noise is None else f"±{f.noise * 100:.1f}%"
            out.append(f"| {f.name} | {value} | {noise} | {f.target or '-'} | {met} | `{f.command}` |")
    return out


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict):
        return [kv for k, v in data.items() for kv in _flatten(v, f"{prefix}{k}.")]
    if isinstance(data, list):
        if data and all(isinstance(x, dict) for x in data):
            return [(prefix.rstrip("."), f"{len(data)} rows")]
        return [(prefix.rstrip("."), data)]
    return [(prefix.rstrip("."), data)]


def _external_section(name: str, ext: dict[str, Any] | None) -> list[str]:
    if ext is None:
        return []
    out = [f"## {name}", "", f"Reproduce: `{ext['command']}`", ""]
    result = ext["result"]
    if isinstance(result, list) and result and all(isinstance(x, dict) for x in result):
        return [*out, *_table(result), ""]
    out += ["| field | value |", "|---|---|"]
    out += [f"| {k} | {_fmt(v)} |" for k, v in _flatten(result) if not isinstance(v, (dict,))]
    if isinstance(result, dict):
        for key, value in result.items():
            if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
                out += ["", f"{key}:", "", *_table(value)]
    return [*out, ""]


def external_figures(name: str, ext: dict[str, Any] | None) -> Report | None:
    """The figures the planner's and the profiler's benchmarks report, for the summary table."""
    if ext is None:
        return None
    rep = Report(name, ext["command"])
    result = ext["result"]
    if name == "bench_planner" and isinstance(result, list):
        for row in result:
            if not isinstance(row, dict) or not isinstance(row.get("plan_s"), (int, float)):
                continue
            target = row.get("target_s")
            rep.add(
                judged(
                    f"planner seconds: {row.get('case')} ({row.get('layers')} layers)",
                    float(row["plan_s"]),
                    " s",
                    f"{ext['command']} --only {row.get('case')}",
                    at_most=float(target) if target is not None else None,
                )
            )
            if isinstance(row.get("faster"), (int, float)):
                rep.add(
                    Figure(
                        f"paper's optimizer time / ours: {row.get('case')}",
                        float(row["faster"]),
                        "x",
                        f"{ext['command']} --only {row.get('case')}",
                    )
                )
    if name == "bench_profiler" and isinstance(result, dict):
        for i, run in enumerate(result.get("runs") or []):
            if isinstance(run, dict) and isinstance(run.get("ratio"), (int, float)):
                ratio = float(run["ratio"])
                rep.add(
                    judged(
                        f"pdprof layer sum / whole step, {result.get('model')} (run {i + 1})",
                        ratio,
                        "",
                        ext["command"],
                        at_least=0.85,
                        at_most=1.15,
                    )
                )
    return rep


def _with_figures(
    reports: dict[str, Report | None], external: dict[str, dict[str, Any] | None]
) -> list[Report]:
    """Every report that ran, the external benchmarks' figures among them."""
    done = [r for r in reports.values() if r is not None]
    return done + [r for r in (external_figures(n, e) for n, e in external.items()) if r is not None]


def write_results(
    reports: dict[str, Report | None],
    external: dict[str, dict[str, Any] | None],
    log: list[str],
    plot_files: dict[str, str],
    quick: bool,
    seconds: float,
    load: tuple[float, float],
    previous: list[dict[str, Any]] | None = None,
    previous_host: str | None = None,
) -> str:
    done = _with_figures(reports, external)
    machine = host.describe()
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` (`python -m bench.run_all{' --quick' if quick else ''}`) on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC in {seconds / 60:.1f} minutes: {platform.machine()}, "
        f"{machine}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, torch {_torch_version()}. Every figure "
        "is a ratio or a value measured side by side in this one run; the command after each reproduces it. "
        "How each is measured, and how the slow link is emulated: docs/benchmarks.md.",
        "",
        f"Load average (1 min) at the start {load[0]:.1f} and at the end {load[1]:.1f}, on {os.cpu_count()} cores: "
        + (
            "above the core count, so other jobs shared the machine and the timings are noisier."
            if max(load) > (os.cpu_count() or 1)
            else "within the core count at both ends (the benchmarks' own workers included)."
        ),
        "",
    ]
    if quick:
        lines += [
            "**A `--quick` run: a few steps of each benchmark. These numbers check the harness; they are "
            "not the figures.**",
            "",
        ]
    lines += [
        "## The figures",
        "",
        f"Noise: the band a later `make bench` lands within {COVERAGE:.4%} of the time if its rounds scatter "
        f"as this run's did, so that all {JUDGED_FIGURES} judged figures do {FAMILY_COVERAGE:.0%} of the time "
        f"(Bonferroni): {band_factor(3):.1f} times the range of the rounds behind a figure (the median of "
        f"three), {band_factor(3, 'best'):.1f} times for a ratio of each side's best of three (a ratio's "
        "rounds: each round's pair side by side), over its value; a later `make bench` reproduces a figure "
        "when it lands within it (`bench.reproduce`, the section after this table).",
        "",
        *_figures(done),
        "",
    ]
    figures = [f for rep in done for f in rep.figures]
    if previous is not None:
        lines += [
            "## Against the previous make bench",
            "",
            "Each figure this run shares with the one before it (`bench/results/figures.json` as it was), "
            "and whether it landed within the larger of the two runs' stated noises.",
            "",
            *([warning, ""] if (warning := reproduce.host_line(previous_host, machine)) else []),
            *reproduce.markdown(reproduce.compare(previous, reproduce.figure_records(figures))),
            "",
        ]
    for key, rep in reports.items():
        if rep is None:
            continue
        lines += [f"## {rep.title}", "", f"Reproduce: `{rep.command}`", ""]
        lines += [f"{n}" for n in rep.notes] + [""]
        for name, rows in rep.tables.items():
            if name == "curves":
                continue
            lines += [f"{name.replace('_', ' ')}:", "", *_table(rows), ""]
        for plot in rep.plots:
            lines += [f"![{key}](results/{plot})", ""]
    for name, ext in external.items():
        lines += _external_section(name, ext)
    if "planner" in plot_files:
        lines += [f"![planner speed](results/{plot_files['planner']})", ""]
    lines += ["## The run", "", *log, ""]
    return "\n".join(lines)


def _cli_report(cli: bench_cli.Rounds, work: Path) -> Report:
    report = cli.report("one before the first benchmark and one after each")
    report.save(work / "bench_cli.json")
    return report


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of everything (checks the harness)")
    parser.add_argument("--work", default="bench/out", help="where artifacts go")
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only these: runtime predict memory accuracy startup cli planner planner_auto profiler",
    )
    args = parser.parse_args(argv)
    from bench import bench_accuracy, bench_memory, bench_predict, bench_runtime, bench_startup

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    PLOTS.mkdir(parents=True, exist_ok=True)
    wanted = set(
        args.only
        or [
            "runtime",
            "predict",
            "memory",
            "accuracy",
            "startup",
            "cli",
            "planner",
            "planner_auto",
            "profiler",
        ]
    )
    quick = ["--quick"] if args.quick else []
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    log: list[str] = []
    reports: dict[str, Report | None] = {}
    plot_files: dict[str, str] = {}
    # The command lines' start-up: a round now and one after each benchmark, spread over the run.
    cli = (
        bench_cli.Rounds(work, bench_cli.QUICK if args.quick else bench_cli.Config())
        if "cli" in wanted
        else None
    )
    between = cli.take if cli is not None else (lambda: None)
    between()

    if "runtime" in wanted:
        rep = _run_internal("bench_runtime", lambda: bench_runtime.main(["--work", str(work), *quick]), log)
        if rep is not None:
            rep.plots.append(plots.throughput(rep.tables["throughput"], PLOTS / "throughput.png"))
            rep.plots.append(plots.breakdown(rep.tables["where_time_goes"], PLOTS / "where_time_goes.png"))
        reports["runtime"] = rep
        between()
    if "predict" in wanted:
        rep = _run_internal("bench_predict", lambda: bench_predict.main(["--work", str(work), *quick]), log)
        if rep is not None:
            rep.plots.append(plots.prediction(rep.tables["prediction"], PLOTS / "prediction.png"))
        reports["predict"] = rep
        between()
    if "memory" in wanted:
        reports["memory"] = _run_internal(
            "bench_memory", lambda: bench_memory.main(["--work", str(work), *quick]), log
        )
        between()
    if "accuracy" in wanted:
        acc = _run_internal(
            "bench_accuracy", lambda: bench_accuracy.main(["--work", str(work), *quick])[0], log
        )
        if acc is not None:
            cfg = bench_accuracy.QUICK if args.quick else bench_accuracy.Config()
            acc.plots.append(plots.accuracy(acc.tables["curves"], cfg.target, PLOTS / "time_to_accuracy.png"))
        reports["accuracy"] = acc
        between()
    if "startup" in wanted:
        reports["startup"] = _run_internal(
            "bench_startup", lambda: bench_startup.main(["--work", str(work), *quick]), log
        )
        between()
    external: dict[str, dict[str, Any] | None] = {}
    for name, cmd in EXTERNAL.items():
        if name.removeprefix("bench_") not in wanted:
            continue
        if name == "bench_planner_auto":
            cmd = [*cmd, "--only", "vgg16"] if args.quick else cmd
        timeout_s = 120 if args.quick else 900 if name == "bench_planner_auto" else 300
        external[name] = _run_external(name, cmd, timeout_s, log)
        between()
    if cli is not None:
        reports["cli"] = _run_internal("bench_cli", lambda: _cli_report(cli, work), log)
    planner = external.get("bench_planner")
    if planner is not None and isinstance(planner["result"], list):
        rows = [r for r in planner["result"] if isinstance(r, dict)]
        made = plots.planner_speed(rows, PLOTS / "planner_speed.png")
        if made:
            plot_files["planner"] = made

    seconds = time.perf_counter() - t0
    load = (load_start, os.getloadavg()[0])
    previous = None if args.quick else reproduce.load(FIGURES_JSON)
    previous_host = reproduce.load_host(FIGURES_JSON)
    text = write_results(
        reports, external, log, plot_files, args.quick, seconds, load, previous, previous_host
    )
    atomic_write_bytes(RESULTS_MD, text.encode("utf-8"))
    # A --quick run's figures are not the figures: the next full run compares with the last full one.
    if not args.quick:
        reproduce.save(
            [f for rep in _with_figures(reports, external) for f in rep.figures],
            FIGURES_JSON,
            host.describe(),
        )
    console.print(
        f"bench: {seconds / 60:.1f} minutes; results in {os.path.relpath(RESULTS_MD)}, "
        f"plots in {os.path.relpath(PLOTS)}/"
    )
    failed = [line for line in log if "failed" in line or "did not finish" in line]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
