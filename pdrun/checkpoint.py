"""Per-stage checkpoints: each stage's weights and optimizer state, written atomically.

``DIR/stage{s}.pt`` holds ``{"stage", "units", "graph_hash", "model", "optimizer"}``; it is
written by replica 0 of the stage (replicas are identical) through a temporary file and a
rename, and read back with ``weights_only=True``.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import nn

from shared.errors import ArtifactError
from shared.io import atomic_write_bytes


def path_of(directory: str, stage: int) -> Path:
    return Path(directory) / f"stage{stage}.pt"


def save(
    directory: str,
    stage: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    units: int,
    graph_hash: str,
) -> None:
    """Write stage ``stage``'s state after ``units`` units."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    state = {
        "stage": stage,
        "units": units,
        "graph_hash": graph_hash,
        "model": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else {},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path_of(directory, stage), buf.getvalue())


def load(
    directory: str,
    stage: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    graph_hash: str,
) -> int:
    """Restore stage ``stage`` from ``directory``; returns the units already trained (0 without a checkpoint)."""
    path = path_of(directory, stage)
    if not path.is_file():
        return 0
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        if state.get("graph_hash") != graph_hash:
            raise ArtifactError(
                str(path), "graph_hash", f"a checkpoint of another model, expected {graph_hash[:19]}..."
            )
        module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        return int(state["units"])
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArtifactError(str(path), "model", f"not a checkpoint of this stage ({first})") from None
