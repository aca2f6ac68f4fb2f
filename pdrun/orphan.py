"""Workers end with their launcher: a worker whose ``pdrun`` was killed stops itself.

The launcher stops its workers itself when a worker fails or when it is interrupted, but a
launcher killed with SIGKILL cannot; its workers (children of the forkserver, not of the
launcher) would train on, unseen. A daemon thread in each worker checks twice a second that
the launcher still runs, and kills the worker when it does not, after removing what the
launcher would have (the run's shared-memory links).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.5


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): existence is all we can tell
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def die_with(pid: int, cleanup: Callable[[], None] | None = None) -> threading.Thread:
    """Start watching ``pid``; this process runs ``cleanup`` and kills itself once ``pid`` has ended."""

    def watch() -> None:
        while running(pid):
            time.sleep(POLL_S)
        if cleanup is not None:
            with contextlib.suppress(OSError):
                cleanup()  # what the launcher would have removed (its shared-memory links)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="pdrun-launcher-watch", daemon=True)
    thread.start()
    return thread
