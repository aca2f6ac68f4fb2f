"""Command-line start-up: the wall time of each tool's ``--help`` and of planning AlexNet, from a shell.

Every call in a shell pipeline (``pdprof | pdplan | pdrun``) pays its command's imports before it
does anything, so each command imports only what it needs when it needs it (tests/test_cli_imports.py
checks the import sets). The targets (issue 19, point 4): ``--help`` of each tool under 0.3 s, and
``pdplan`` on PipeDream's published AlexNet profile (4 workers at 1 GB/s) under 0.5 s. Before, planning
AlexNet took 1.45 s, 1.4 s of it imports.

How it is measured: each command runs as a subprocess, launch to exit, ``OMP_NUM_THREADS=1``; a round
runs every command ``runs`` times, the commands interleaved (a load spike hits them alike), and keeps
each command's median; the figure is the median of the rounds, its noise their spread. Run alone, the
rounds come back to back; ``make bench`` takes one before its first benchmark and one after each, so
their spread counts the host's drift over the run (:class:`Rounds`).

    python -m bench.bench_cli [--quick] [--work bench/out]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.measure import Report, judged, main_of, spread

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
PACKAGES = ("pdprof", "pdplan", "pdrun", "shared")


@dataclass(frozen=True)
class Config:
    rounds: int = 3
    runs: int = 7  # per command and round: its median is the round's figure


QUICK = Config(rounds=1, runs=2)


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]
    at_most: float  # seconds


def _tool(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def cases(work: Path) -> list[Case]:
    """The three ``--help`` calls and the AlexNet plan (its graph imported here, once, from profiles/).

    Our packages' bytecode is written first, as a regular install (or a first run without
    ``PYTHONDONTWRITEBYTECODE``, which the Makefile sets) leaves it: the figure is a command's start-up,
    not the compiling of sources edited since."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *(str(ROOT / p) for p in PACKAGES)],
        check=True,
        capture_output=True,
    )
    graph = work / "graph-alexnet.json"
    subprocess.run(
        [_tool("pdprof"), "import-pipedream", str(PROFILES / "alexnet.txt"), "-o", str(graph)],
        check=True,
        capture_output=True,
        env=_env(),
    )
    plan = ["--workers", "4", "--bandwidth", "1e9", "-o", str(work / "plan-alexnet-cli.json")]
    return [
        Case("pdprof --help", [_tool("pdprof"), "--help"], 0.3),
        Case("pdplan --help", [_tool("pdplan"), "--help"], 0.3),
        Case("pdrun --help", [_tool("pdrun"), "--help"], 0.3),
        Case("pdplan on AlexNet (PipeDream's profile, 4 workers)", [_tool("pdplan"), str(graph), *plan], 0.5),
    ]


def wall_s(argv: list[str]) -> float:
    """Launch to exit of one command; a failure is an error, not a fast figure."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, env=_env(), timeout=60)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-300:]}")
    return seconds


class Rounds:
    """Rounds of every command, each taken when asked, and the report made from them.

    ``make bench`` takes one round before its first benchmark and one after each (``bench.run_all``), so
    a figure's rounds are spread over the half hour of the run: this host's start-up times drift by a
    third between runs minutes apart (``pdplan --help`` 0.056 s in one run, 0.084 s in the next, each
    run's three back-to-back rounds within 4% of each other), and a noise band drawn from rounds taken
    in one stretch says nothing of that. A failure is kept and raised by :meth:`report`, so one bad
    round does not stop the benchmarks it was taken between."""

    def __init__(self, work: Path, cfg: Config) -> None:
        self.work, self.cfg = work, cfg
        self.todo: list[Case] | None = None
        self.rounds: dict[str, list[float]] = {}
        self.error: Exception | None = None

    def take(self) -> None:
        """One round: every command ``cfg.runs`` times, the commands interleaved; each one's median kept."""
        if self.error is not None:
            return
        try:
            if self.todo is None:
                self.todo = cases(self.work)
                self.rounds = {c.name: [] for c in self.todo}
            runs: dict[str, list[float]] = {c.name: [] for c in self.todo}
            for _ in range(self.cfg.runs):
                for c in self.todo:  # interleaved: a load spike hits every command alike
                    runs[c.name].append(wall_s(c.argv))
        except Exception as exc:  # reported by report(), with the benchmarks around it still run
            self.error = exc
            return
        for name, times in runs.items():
            self.rounds[name].append(statistics.median(times))

    def report(self, spread_over: str) -> Report:
        """The figures: each command's median over the rounds, its noise their spread. ``spread_over`` says
        when the rounds were taken, for the report's note."""
        if self.error is not None:
            raise self.error
        if self.todo is None:
            raise RuntimeError("no round was taken")
        report = Report("Command-line start-up", "python -m bench.bench_cli")
        rows = []
        for c in self.todo:
            taken = self.rounds[c.name]
            value = statistics.median(taken)
            shown = " ".join(Path(a).name if a.startswith("/") else a for a in c.argv)
            report.add(
                judged(
                    f"wall time, {c.name}",
                    value,
                    " s",
                    shown,
                    at_most=c.at_most,
                    noise=spread(taken, value),
                )
            )
            rows.append(
                {"command": shown, "median_s": value, "rounds_s": " ".join(f"{v:.3f}" for v in taken)}
            )
        report.tables["cli"] = rows
        count = len(self.rounds[self.todo[0].name])
        report.notes.append(
            f"Launch to exit of each command as a subprocess, {self.cfg.runs} runs a round, the commands "
            f"interleaved, median per round; the figure is the median of {count} rounds, {spread_over}. "
            "Targets: --help under 0.3 s, planning AlexNet under 0.5 s (issue 19)."
        )
        return report


def bench(work: Path, cfg: Config) -> Report:
    """The rounds back to back, as ``python -m bench.bench_cli`` runs them (``make bench`` spreads them)."""
    rounds = Rounds(work, cfg)
    for _ in range(cfg.rounds):
        rounds.take()
    return rounds.report("taken back to back")


def main(argv: list[str] | None = None) -> Report:
    return main_of(__doc__, argv, "bench_cli", lambda work, quick: bench(work, QUICK if quick else Config()))


if __name__ == "__main__":
    rep = main()
    for f in rep.figures:
        print(f"{f.name}: {f.value:.3f}{f.unit} (target {f.target})")
