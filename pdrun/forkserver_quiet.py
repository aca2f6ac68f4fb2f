"""Imported first by the forkserver, and by nothing else: a stopped run's forkserver says nothing.

A terminal's Ctrl-C goes to every process of the group. CPython's forkserver ignores SIGINT only after
it has imported its preload (torch: seconds), so a Ctrl-C in a run's first seconds printed a 25-50 line
KeyboardInterrupt traceback from inside torch's import, and once a C++ abort (exit 134), after pdrun's
own one line. The launcher stops the workers; the forkserver has nothing to do on Ctrl-C. Its children
inherit the ignored SIGINT, and each worker takes SIGINT back first thing (``pdrun.runner.worker_entry``).

A worker forked while the launcher is stopping finds the run's named semaphores already removed
(``pdrun.named_sems``) and fails to unpickle them: CPython's forkserver printed that
``FileNotFoundError`` traceback a second after pdrun had exited. Only that failure is kept quiet.
"""

from __future__ import annotations

import signal
import sys
import traceback
from types import TracebackType

signal.signal(signal.SIGINT, signal.SIG_IGN)

_default_hook = sys.excepthook


def _quiet_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    frames = traceback.extract_tb(tb)
    if issubclass(kind, FileNotFoundError) and any(
        f.name == "_rebuild" or f.name == "__setstate__" for f in frames
    ):
        return  # a semaphore of a run that is stopping (module doc)
    _default_hook(kind, value, tb)


sys.excepthook = _quiet_hook
