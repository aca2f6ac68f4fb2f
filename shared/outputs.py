"""Checking an output path before the work that fills it: a tool that profiles, plans or trains for
minutes must not find at its end that it cannot write, or that it would overwrite its own input.

Each file's directory must exist and take a new file: the probe is a real file created and removed
there, not ``os.access``, since root passes every permission test yet cannot write below a regular
file or on a read-only mount. A device or named pipe (``-o /dev/null``) is written into
(``shared.io``), so it needs only to be writable. An output that is one of the command's inputs (a
plan's ``--metrics plan.json``, pdplan's ``-o graph.json``) is refused: the input was replaced.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from shared.errors import UserError
from shared.io import STDIO, is_special


def check_output_file(
    option: str, path: str | os.PathLike[str] | None, inputs: Mapping[str, str] | None = None
) -> None:
    """Raise ``UserError`` (one line naming ``option``) unless ``path`` (None or ``-``: standard output) can
    be written without overwriting one of ``inputs`` (what each input is, by its path)."""
    if path is None or str(path) == STDIO:
        return
    target = Path(path)
    for what, source in (inputs or {}).items():
        if str(source) != STDIO and _same_file(target, Path(source)):
            raise UserError(f"{option} {target}: is {what}, which this would overwrite; write elsewhere")
    if target.is_dir():
        raise UserError(f"{option} {target}: is a directory; give a file name")
    if is_special(target):
        if not os.access(target, os.W_OK):
            raise UserError(f"{option} {target}: cannot write: permission denied")
        return
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"{option} {target}: directory {parent} {what}; create it or choose another path")
    probe_directory(option, target, parent)


def probe_directory(option: str, shown: Path, directory: Path) -> None:
    """Create and remove a file in ``directory``, as the atomic writes there will (``shared.io``)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".pd-probe-", dir=directory)
    except OSError as exc:
        raise UserError(f"{option} {shown}: cannot write in {directory}: {why(exc)}") from None
    os.close(fd)
    os.unlink(tmp)


def why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)  # hard links and symlinks included
        return a.resolve() == b.resolve()  # two outputs not written yet
    except OSError:
        return False
