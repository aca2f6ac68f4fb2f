"""Failure records: each rank writes its first error to ``rank<R>.json``, the launcher reads the cause back.

A worker that fails writes one record (type, first line, whether it is a user error or
the consequence of a peer's lost connection) into the launcher's error directory before it
propagates; when the launch fails, the launcher picks the record that caused the others
(:func:`first_failure`). Writer and reader share this one module, so the record's fields
have one definition.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from shared.errors import PDError, RunError, UserError

# How long a rank that saw a peer vanish waits before it exits: the launcher sees the peer's death first.
PEER_LOST_GRACE_S = 3.0
_PEER_LOST = ("Connection reset", "Connection closed", "Broken pipe", "Connection refused", "lost rank")


def peer_lost(exc: BaseException) -> bool:
    """True when ``exc`` says a peer's connection broke: the peer's failure, seen from here."""
    text = str(exc)
    return any(marker in text for marker in _PEER_LOST)


def joining_failed(rank: int, timeout_s: float, exc: BaseException) -> RunError:
    """The error of a rank whose peers did not all join the process group in time."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RunError(
        f"rank {rank}: a peer did not join the process group within {timeout_s:g}s "
        f"({type(exc).__name__}: {first})"
    )


def record_failure(errdir: str | None, rank: int, exc: BaseException) -> None:
    """Write this rank's first error where the launcher reads it (once: the first error is the cause)."""
    if errdir is None:
        return
    path = Path(errdir, f"rank{rank}.json")
    if path.exists():
        return
    first = str(exc).splitlines()[0] if str(exc) else ""
    record = {
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__name__,
        "message": first,
        "user": isinstance(exc, UserError),
        "ours": isinstance(exc, PDError),
        "peer_lost": peer_lost(exc),
        "traceback": traceback.format_exc() if os.environ.get("PIPEDREAM_DEBUG") == "1" else "",
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def first_failure(errdir: Path, exc: Exception) -> PDError:
    """The failure that caused the others, as one line naming its rank; our user errors keep exit status 2.

    A rank that died without writing its error (killed by a signal, or exited hard) comes first:
    its peers' errors ("connection closed", "no activations from rank R") are its consequences.
    """
    records = []
    for path in errdir.glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    recorded = {int(r["rank"]) for r in records if isinstance(r.get("rank"), int)}
    failures = getattr(exc, "failures", {}) or {}
    silent = [(rank, f) for rank, f in failures.items() if rank not in recorded]
    if silent:
        rank, failure = min(silent, key=lambda kv: (getattr(kv[1], "timestamp", 0), kv[0]))
        return RunError(f"worker rank {rank} died ({_death(failure)})")
    if not records:
        return RunError(f"a worker failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    # A rank that saw its peer's connection break reports a consequence: the cause is elsewhere.
    causes = [r for r in records if not r.get("peer_lost")] or records
    first = min(causes, key=lambda r: r["time"])
    message = f"worker rank {first['rank']} failed: {first['type']}: {first['message']}"
    if first.get("traceback"):
        message += "\n" + first["traceback"]
    return UserError(message) if first.get("user") else RunError(message)


def _death(failure: Any) -> str:
    """How a process ended: "signal SIGKILL" or "exit code 3"."""
    code = getattr(failure, "exitcode", None)
    if isinstance(code, int) and code < 0:
        return f"signal {signal_name(-code)}"
    return f"exit code {code if code is not None else '?'}"


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; the number itself for a signal Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
