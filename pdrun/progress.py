"""The progress bar: steps done, the last loss and the recent throughput, drawn by one worker of the last stage."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from pdrun.config import RunConfig

RATE_STEPS = 20  # the steps the bar's throughput is taken over
# Off a terminal (a batch job's log, CI, ``2> run.log``) rich draws the bar once, when the run ends: a
# 100,000-step run's log said nothing for hours. There the bar also prints a plain line at the first step
# and then every this many seconds.
LOG_EVERY_S = 30.0


class Progress:
    """A rich progress bar with loss and throughput, drawn by one worker of the last stage.

    It shows the loss of the last step in which the drawing worker ran a unit, and the throughput of
    its last :data:`RATE_STEPS` steps: one step's own rate swings with whatever that step met (a GPT's
    bar read 1,518 samples/s at the end of a run whose summary measured 2,537), and the summary's
    figure is the rate over many steps.
    """

    def __init__(
        self, cfg: RunConfig, show: bool, total: int, log_every_s: float = LOG_EVERY_S, replicas: int = 1
    ) -> None:
        """A bar of ``total`` steps, if ``show`` and ``--quiet`` was not given; it draws from :meth:`start`.

        Off a terminal it also prints a line at the first step and every ``log_every_s`` seconds after.
        The drawing worker is one of its stage's ``replicas``, which share the units: the bar shows the
        run's rate, its own times that (it showed half the closing line's on a stage of 2 replicas)."""
        self.replicas = replicas
        self.bar: Any = None
        self.task: Any = None
        self.total = total
        self.log_every_s: float | None = None  # None: on a terminal, where the bar itself redraws
        self.logged_at = -math.inf
        self.info = ""  # what the bar shows: the last step that had a loss
        self.recent: deque[tuple[float, float]] = deque(maxlen=RATE_STEPS)  # (samples, seconds) a step
        if not (show and cfg.progress):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        from shared.cli import rich_console

        self.bar = Bar(
            TextColumn("[bold]pdrun"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=rich_console(),
            transient=False,
        )
        if not self.bar.console.is_terminal:
            self.log_every_s = log_every_s

    def start(self) -> None:
        """Draw from now on (the worker is built: the elapsed time is the run's)."""
        if self.bar is not None:
            self.task = self.bar.add_task("train", total=self.total, info="")
            self.bar.start()

    def step(self, row: dict[str, Any]) -> None:
        """One step done; ``row`` is the worker's metrics row of it."""
        if self.bar is None:
            return
        # A replica of the last stage can run no unit in a step (a flushing schedule with fewer units
        # per step than the stage has replicas): its row's loss is NaN, and the bar keeps the last real one.
        self.recent.append((row["samples_per_s"] * row["wall_s"], row["wall_s"]))
        if not math.isnan(row["loss"]):
            rate = self.replicas * sum(n for n, _ in self.recent) / max(sum(t for _, t in self.recent), 1e-9)
            self.info = f"loss {row['loss']:.4f}  {rate:.0f} samples/s"
        self.bar.update(self.task, advance=1, info=self.info)
        now = time.monotonic()
        if self.log_every_s is not None and now - self.logged_at >= self.log_every_s:
            self.logged_at = now
            task = self.bar.tasks[0]
            self.bar.console.print(
                f"pdrun: step {int(task.completed):,}/{self.total:,}  {self.info}  {task.elapsed or 0.0:.0f} s",
                markup=False,
            )

    def validated(self, entry: dict[str, Any]) -> None:
        """Print one epoch's validation loss and accuracy above the bar."""
        if self.bar is not None and entry["count"]:
            acc = entry["correct"] / entry["scored"] if entry["scored"] else 0.0
            self.bar.console.print(
                f"epoch {entry['epoch']}: val loss {entry['loss_sum'] / entry['count']:.4f}, accuracy {acc:.2%}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
