"""Where a run writes: ``--metrics``, ``--trace`` and ``--checkpoint-dir``, checked before any worker starts.

The metrics and the timeline are written at the end of the run and checkpoints during it,
so a path that cannot be written would fail after minutes or hours of training and lose
them. The launcher calls ``check_outputs`` first: each file's directory must exist and take
a new file, and the checkpoint directory is created (as ``mkdir -p`` would) and must take
one too. The probe is a real file created and removed there, not ``os.access``: root passes
every permission test, yet cannot write below a regular file or on a read-only mount.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from shared.errors import UserError
from shared.io import is_special


def check_outputs(metrics: str | None, trace: str | None, checkpoint_dir: str | None) -> None:
    """Raise ``UserError`` (one line naming the option) unless every output given can be written."""
    for option, path in (("--metrics", metrics), ("--trace", trace)):
        if path is not None:
            _check_file(option, Path(path))
    if checkpoint_dir is not None:
        _check_dir("--checkpoint-dir", Path(checkpoint_dir))


def _check_file(option: str, target: Path) -> None:
    if target.is_dir():
        raise UserError(f"{option} {target}: is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"{option} {target}: directory {parent} {what}; create it or choose another path")
    if is_special(target):  # a device or named pipe is written into (shared.io), not renamed over
        if not os.access(target, os.W_OK):
            raise UserError(f"{option} {target}: cannot write: permission denied")
        return
    _probe(option, target, parent)


def _check_dir(option: str, directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{option} {directory}: exists and is not a directory") from None
    except OSError as exc:
        raise UserError(f"{option} {directory}: cannot create the directory: {_why(exc)}") from None
    _probe(option, directory, directory)


def _probe(option: str, shown: Path, directory: Path) -> None:
    """Create and remove a file in ``directory``, as the atomic writes there will (shared/io.py)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pdrun-probe-", dir=directory)
    except OSError as exc:
        raise UserError(f"{option} {shown}: cannot write in {directory}: {_why(exc)}") from None
    os.close(fd)
    os.unlink(tmp)


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
