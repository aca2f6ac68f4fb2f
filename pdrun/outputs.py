"""Where a run writes: ``--metrics``, ``--trace`` and ``--checkpoint-dir``, checked before any worker starts.

The metrics and the timeline are written at the end of the run and checkpoints during it,
so a path that cannot be written would fail after minutes or hours of training and lose
them. The launcher calls ``check_outputs`` first: each file's directory must exist and take
a new file, and the checkpoint directory is created (as ``mkdir -p`` would) and must take
one too (``shared.outputs``, which pdprof and pdplan check their outputs with as well).
"""

from __future__ import annotations

from pathlib import Path

from pdrun.checkpoint import STEP_DIR
from shared.errors import UserError
from shared.outputs import check_output_file, probe_directory, why


def check_outputs(
    metrics: str | None,
    trace: str | None,
    checkpoint_dir: str | None,
    plan: str | None = None,
    resume: bool = False,
) -> None:
    """Raise ``UserError`` (one line naming the option) unless every output given can be written, none
    over the ``plan`` file the run reads, and a fresh run's checkpoint directory holds no earlier run's."""
    inputs = {"the plan": plan} if plan is not None else {}
    for option, path in (("--metrics", metrics), ("--trace", trace)):
        check_output_file(option, path, inputs)
    if checkpoint_dir is not None:
        _check_dir("--checkpoint-dir", Path(checkpoint_dir))
        if not resume:
            _check_fresh("--checkpoint-dir", Path(checkpoint_dir))


def _check_fresh(option: str, directory: Path) -> None:
    """A run that does not resume must not write beside another run's checkpoints: ``--resume`` takes the
    highest step, so a new run's steps 100 and 200 beside an old run's 600 resumed the old run, silently."""
    earlier = sorted(p.name for p in directory.iterdir() if STEP_DIR.match(p.name) and p.is_dir())
    if earlier:
        shown = ", ".join(earlier[-3:]) + (f" and {len(earlier) - 3} more" if len(earlier) > 3 else "")
        raise UserError(
            f"{option} {directory}: holds an earlier run's checkpoints ({shown}); --resume continues it, or "
            "give an empty directory"
        )


def _check_dir(option: str, directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{option} {directory}: exists and is not a directory") from None
    except OSError as exc:
        raise UserError(f"{option} {directory}: cannot create the directory: {why(exc)}") from None
    probe_directory(option, directory, directory)
