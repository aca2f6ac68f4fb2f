"""Reading artifacts from a file or standard input and writing them atomically.

A tool's input is a path or ``-`` (standard input, so that ``pdprof | pdplan | pdrun``
works); its output goes to standard output or to ``-o FILE``. Files are written to a
temporary file beside the target and renamed over it, so a reader never sees half a
file and a crash never destroys what was there before. The file gets the mode a plain
``open()`` would give it (0666 less the umask), so others read a plan as they would any file.
A target that is not a regular file (``-o /dev/null``, a named pipe) is written into, not
renamed over: a rename replaced the device node with a file (as root, ``/dev/null`` itself). A
symbolic link keeps pointing where it did: the file it names is the one replaced.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

from shared.errors import ArtifactError, UserError

STDIO = "-"


def display_name(source: str | os.PathLike[str]) -> str:
    """How a source is named in messages: ``<stdin>`` for ``-``."""
    return "<stdin>" if str(source) == STDIO else str(source)


def read_bytes(source: str | os.PathLike[str], what: str) -> bytes:
    """Read ``source`` (a path or ``-``); ``what`` names the expected content for errors."""
    if str(source) == STDIO:
        if sys.stdin is None:  # started with standard input closed (`cmd <&-`)
            raise UserError(f"expected {what} on standard input, but it is closed: pass a file instead")
        if sys.stdin.isatty():
            raise UserError(
                f"expected {what} on standard input, but it is a terminal: "
                f"pass a file, or pipe one in (e.g. `pdprof ... | pdplan ...`)"
            )
        return sys.stdin.buffer.read()
    path = Path(source)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(str(path), "", f"no such file (expected {what})") from None
    except IsADirectoryError:
        raise ArtifactError(str(path), "", f"is a directory (expected {what})") from None
    except OSError as exc:
        raise ArtifactError(str(path), "", f"cannot read: {exc.strerror} (expected {what})") from None


def read_text(source: str | os.PathLike[str], what: str) -> str:
    """Read ``source`` as UTF-8 text (a leading byte-order mark, as some editors write, is skipped)."""
    data = read_bytes(source, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ArtifactError(
            display_name(source), "", f"not UTF-8 text at byte {exc.start} (expected {what})"
        ) from None


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    target = Path(path)
    if is_special(target):
        _write_into(target, data)
        return
    if target.is_symlink():
        target = target.resolve()  # replace the file the link names, not the link
    parent = target.parent
    if not parent.is_dir():
        raise UserError(f"{target}: cannot write: directory {parent} does not exist")
    if target.is_dir():
        raise UserError(f"{target}: cannot write: it is a directory (give a file name)")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:  # a read-only or full directory: the user's to fix, in one line
        raise UserError(f"{target}: cannot write: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            # mkstemp creates 0600; what replaces the target gets the mode open() would give it.
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.strerror:
            raise UserError(f"{target}: cannot write: {exc.strerror}") from None
        raise


def is_special(path: Path) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a directory: a device, a FIFO, a socket."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _write_into(target: Path, data: bytes) -> None:
    """Write ``data`` into an existing device or named pipe (a pipe blocks until it has a reader)."""
    try:
        with open(target, "wb") as fh:
            fh.write(data)
    except OSError as exc:
        raise UserError(f"{target}: cannot write: {exc.strerror or type(exc).__name__}") from None


def current_umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc) where that is possible."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # elsewhere: set and restore (briefly stricter, never looser)
    os.umask(mask)
    return mask


def write_output(text: str, out: str | os.PathLike[str] | None) -> None:
    """Write ``text`` to ``out`` atomically, or to standard output when ``out`` is None or ``-``."""
    if out is None or str(out) == STDIO:
        sys.stdout.write(text)
        if not text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        return
    atomic_write_bytes(out, text.encode("utf-8") if text.endswith("\n") else (text + "\n").encode("utf-8"))
