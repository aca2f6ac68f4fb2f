"""Where a run writes: ``--metrics``, ``--trace`` and ``--checkpoint-dir``, checked before any worker starts.

The metrics and the timeline are written at the end of the run and checkpoints during it,
so a path that cannot be written would fail after minutes or hours of training and lose
them. The launcher calls ``check_outputs`` first: each file's directory must exist and take
a new file, and the checkpoint directory is created (as ``mkdir -p`` would) and must take
one too (``shared.outputs``, which pdprof and pdplan check their outputs with as well).
"""

from __future__ import annotations

from pathlib import Path

from shared.errors import UserError
from shared.outputs import check_output_file, probe_directory, why


def check_outputs(
    metrics: str | None, trace: str | None, checkpoint_dir: str | None, plan: str | None = None
) -> None:
    """Raise ``UserError`` (one line naming the option) unless every output given can be written, none
    over the ``plan`` file the run reads."""
    inputs = {"the plan": plan} if plan is not None else {}
    for option, path in (("--metrics", metrics), ("--trace", trace)):
        check_output_file(option, path, inputs)
    if checkpoint_dir is not None:
        _check_dir("--checkpoint-dir", Path(checkpoint_dir))


def _check_dir(option: str, directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{option} {directory}: exists and is not a directory") from None
    except OSError as exc:
        raise UserError(f"{option} {directory}: cannot create the directory: {why(exc)}") from None
    probe_directory(option, directory, directory)
