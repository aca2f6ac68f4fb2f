"""What a stopped run keeps: the steps it trained, in the metrics, the trace and the summary.

A run ends early when pdrun is told to stop: Ctrl-C (SIGINT, to every process of the terminal's job, or
to pdrun alone, which passes it on) or a scheduler's SIGTERM (torch elastic passes it on too). Before,
every worker died with its rows: the rows reach rank 0 only at the end (``pdrun.runner``), so an hour's
run stopped at minute 59 left no metrics, no trace and no summary.

Now each worker, as the signal unwinds it (``KeyboardInterrupt``, or :class:`Stopping` for SIGTERM,
which would otherwise kill it where it stands), writes what it measured so far beside the launcher's
failure records (:func:`keep`), and the launcher reads them back once torch elastic has stopped every
worker (:func:`kept`). They are cut to the steps every rank finished (:func:`common_steps`): a rank
stopped mid-step, or one a step ahead of its neighbours, would otherwise give a last step that only
some stages trained. A worker blocked in a receive unwinds when its peer's connection closes; one that
torch elastic had to kill (after its 30 s grace) keeps nothing, and the run's figures are then its
other ranks'.
"""

from __future__ import annotations

import bisect
import os
import pickle
import signal
from array import array
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from pdrun.failures import signal_name
from pdrun.result import WorkerResult
from pdrun.step_rows import StepRows
from shared.errors import RunError


class Stopped(RunError):
    """pdrun ended by a signal, with what its workers had trained (by rank, cut to the steps all finished);
    its exit status is the shell's for that signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, results: list[WorkerResult]) -> None:
        self.exit_code = 128 + signum
        self.signum = signum
        self.results = results
        super().__init__(f"stopped by {signal_name(signum)}; every worker was stopped")


class Stopping(BaseException):
    """SIGTERM in a worker: unwinds it as Ctrl-C's ``KeyboardInterrupt`` does (not an ``Exception``)."""


STOPS = (KeyboardInterrupt, Stopping)
_FILE = "stopped-rank{}.pkl"
_folder: list[str] = []  # where this worker's launcher reads what it kept (none under torchrun)


def signal_of(stop: BaseException) -> int:
    """The signal behind one of :data:`STOPS`."""
    return int(stop.args[0]) if isinstance(stop, Stopping) else int(signal.SIGINT)


def arm(folder: str | None) -> None:
    """In a worker: SIGINT and SIGTERM unwind it (:data:`STOPS`), and :func:`keep` writes into ``folder``
    (None: nowhere; under torchrun there is no launcher of ours to read it).

    Only the first: Ctrl-C reaches a worker twice, from the terminal and again from the launcher, and the
    second, landing while the first unwinds, cut short the building of what it keeps (rank 0 kept nothing
    in one run in three of the test). A worker that stops is on its way out; the launcher's SIGKILL after
    its grace still ends one that hangs there.
    """
    _folder[:] = [folder] if folder is not None else []

    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopping(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def keep(result: WorkerResult) -> None:
    """Write a stopping worker's result for the launcher: the rows of the steps it finished."""
    if not _folder:
        return
    rows = _whole_rows(result.rows)
    # A step is finished when its row is written (the counter may have moved just before the signal).
    steps = min(result.steps, int(rows[-1]["step"]) + 1) if len(rows) else (result.resumed_from or 0)
    path = Path(_folder[0]) / _FILE.format(result.rank)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(replace(result, rows=rows, steps=steps), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _whole_rows(rows: Sequence[dict[str, Any]]) -> StepRows:
    """The rows with every column as long as the shortest: the signal may land between two appends."""
    out = StepRows()
    if isinstance(rows, StepRows):
        n = min((len(col) for col in rows.columns.values()), default=0)
        out.columns = {k: array(col.typecode, col[:n]) for k, col in rows.columns.items()}
    else:
        for row in rows:
            out.append(row)
    return out


def common_steps(results: list[WorkerResult], units_per_step: int) -> list[WorkerResult]:
    """Every result cut to the steps all of them finished: their rows, steps and units."""
    steps = min((r.steps for r in results), default=0)
    return [replace(r, rows=_cut(r.rows, steps), steps=steps, units=steps * units_per_step) for r in results]


def _cut(rows: Sequence[dict[str, Any]], steps: int) -> StepRows:
    """The rows of steps before ``steps`` (a rank's rows come in step order)."""
    whole = _whole_rows(rows)
    n = bisect.bisect_left(whole.columns["step"], steps) if whole.columns else 0
    whole.columns = {k: col[:n] for k, col in whole.columns.items()}
    return whole


def kept(folder: str | os.PathLike[str], units_per_step: int) -> list[WorkerResult]:
    """The results the stopped workers wrote into ``folder``, by rank, cut to :func:`common_steps`."""
    results: list[WorkerResult] = []
    for path in sorted(Path(folder).glob(_FILE.format("*"))):
        try:
            with open(path, "rb") as f:
                loaded = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError):
            continue  # killed mid-write (the .tmp is not read; this is for a file cut short another way)
        if isinstance(loaded, WorkerResult):
            results.append(loaded)
    return common_steps(sorted(results, key=lambda r: r.rank), units_per_step)
