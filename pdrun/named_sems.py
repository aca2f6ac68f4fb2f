"""The launcher's named semaphores: their names removed from /dev/shm as soon as every worker holds them.

torch's elastic launcher gives each worker a ``SimpleQueue`` for its result and all of them
one ``Event``: nine POSIX semaphores for two workers, eleven for three. Under forkserver or
spawn, multiprocessing names each one (``/dev/shm/sem.mp-*``) so that a child can open it,
and removes the name when the object is collected, or through its resource tracker when the
launcher dies. A SIGKILL of the whole process group kills the tracker too, and the names
stay in /dev/shm for good; a SIGKILL of the launcher alone leaves the tracker to remove
them with a "leaked semaphore objects" warning.

A semaphore outlives its name as long as a process has it open, and a worker opens every
one while it unpickles its arguments, before its entrypoint runs. So each worker, on
entering ``entry``, drops a marker file; once all of this machine's workers have, the
launcher unlinks the names, tells the tracker, and cancels the finalizer that would unlink
them again. From then on nothing of theirs is left for a kill to leak; before (the seconds
a worker takes to start) the old behaviour holds. A worker makes none of its own
(``no_named_locks``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing import resource_tracker, synchronize, util
from pathlib import Path
from typing import Any

POLL_S = 0.05
# What a SemLock registers to remove its name (multiprocessing.synchronize, CPython 3.8 and later).
_SEM_CLEANUP = getattr(synchronize.SemLock, "_cleanup", None)


def entry(plan_json: str, cfg: Any, errdir: str) -> Any:
    """What the launcher starts on every rank: say it holds the semaphores, then be the worker."""
    Path(errdir, f"started-{os.environ.get('LOCAL_RANK', '0')}").touch()
    no_named_locks()
    from pdrun.runner import worker_entry

    return worker_entry(plan_json, cfg, errdir)


def no_named_locks() -> None:
    """Keep this process from naming semaphores of its own that a kill would leak.

    torch.fx's Interpreter (the worker's sample forward) builds a disabled tqdm bar, and tqdm's
    first bar makes a multiprocessing RLock for its write lock: one named semaphore per worker.
    A thread lock serves it as well here (a worker's bars, if any, are written by its threads).
    """
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _finalizers() -> dict[Any, Any]:
    """multiprocessing's registry of pending finalizers (a SemLock's removes its name)."""
    registry: dict[Any, Any] = util._finalizer_registry  # type: ignore[attr-defined]
    return registry


def _semaphore_finalizers(exclude: set[Any]) -> list[tuple[Any, str]]:
    if _SEM_CLEANUP is None:
        return []  # another multiprocessing: leave its semaphores to it
    found = []
    for key, fin in list(_finalizers().items()):
        if key in exclude or getattr(fin, "_callback", None) is not _SEM_CLEANUP:
            continue
        args = getattr(fin, "_args", ())
        if args and isinstance(args[0], str):
            found.append((fin, args[0]))
    return found


def _unlink(found: list[tuple[Any, str]]) -> None:
    from _multiprocessing import sem_unlink

    for fin, name in found:
        with suppress(OSError):
            sem_unlink(name)
        with suppress(Exception):
            resource_tracker.unregister(name, "semaphore")
        fin.cancel()


@contextmanager
def unlinked_once_started(errdir: str, workers: int) -> Iterator[None]:
    """While the launch runs: once ``workers`` markers are in ``errdir``, unlink this launch's semaphores."""
    before = set(_finalizers())
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_S):
            if len(list(Path(errdir).glob("started-*"))) >= workers:
                _unlink(_semaphore_finalizers(before))
                return

    thread = threading.Thread(target=watch, name="pdrun-sem-unlink", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
