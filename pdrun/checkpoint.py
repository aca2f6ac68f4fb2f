"""Crash-safe checkpoints: one directory per step, complete only once its manifest is written.

``DIR/step-{step:06d}/`` holds ``stage{s}.pt`` (written by replica 0 of stage ``s``: weights
and optimizer state) and ``rank{r}.pt`` (every rank's RNG state). Each file is written
through a temporary file and a rename. Rank 0 writes ``manifest.json`` last, after every
rank reported its files, listing each with its size and SHA-256: a directory without a
manifest, or whose files do not match it, is an interrupted write and is never loaded.
Files are read back with ``torch.load(..., weights_only=True)``: no code runs from them.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.errors import ArtifactError, UserError
from shared.io import atomic_write_bytes

FORMAT = "pdrun.checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Written:
    """One file of a checkpoint as its writer saw it."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Checkpoint:
    """A complete, verified checkpoint."""

    path: Path
    step: int
    units: int
    optimizer: str | None = None  # whose state it holds (None: a checkpoint from before it was recorded)


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def _write(path: Path, state: dict[str, Any]) -> Written:
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # checked before training (pdrun/outputs.py); the disk may change since
        raise UserError(f"--checkpoint-dir: cannot create {path.parent}: {exc.strerror or exc}") from None
    atomic_write_bytes(path, data)
    return Written(path.name, len(data), hashlib.sha256(data).hexdigest())


def save_stage(
    directory: str,
    step: int,
    stage: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    units: int,
    graph_hash: str,
) -> Written:
    """Write stage ``stage``'s weights and optimizer state after ``step`` steps (``units`` units)."""
    state = {
        "stage": stage,
        "step": step,
        "units": units,
        "graph_hash": graph_hash,
        "model": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else {},
    }
    return _write(step_dir(directory, step) / f"stage{stage}.pt", state)


def save_rank(
    directory: str, step: int, rank: int, device: torch.device, own_steps: int | None = None
) -> Written:
    """Write this rank's random number generator state and its own step count (a replica's is lower)."""
    state: dict[str, Any] = {
        "rank": rank,
        "step": step,
        "own_steps": step if own_steps is None else own_steps,
        "cpu_rng": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device).cpu()
    return _write(step_dir(directory, step) / f"rank{rank}.pt", state)


def commit(
    directory: str,
    step: int,
    units: int,
    graph_hash: str,
    stages: int,
    world_size: int,
    files: list[Written],
    keep: int,
    optimizer: str | None = None,
) -> Path:
    """Mark step ``step``'s checkpoint complete (rank 0, once every rank wrote); prune older ones."""
    path = step_dir(directory, step)
    manifest = {
        "format": FORMAT,
        "step": step,
        "units": units,
        "graph_hash": graph_hash,
        "stages": stages,
        "world_size": world_size,
        "files": [{"file": w.file, "bytes": w.bytes, "sha256": w.sha256} for w in sorted(files, key=_key)],
        "optimizer": optimizer,  # whose state the stage files hold: another optimizer cannot load it
    }
    atomic_write_bytes(path / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    _prune(Path(directory), step, keep)
    return path


def _key(w: Written) -> str:
    return w.file


def _steps(directory: Path) -> list[tuple[int, Path]]:
    """Step directories, newest first."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _prune(directory: Path, newest: int, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints (0: all); drop interrupted ones older than ``newest``."""
    complete = 0
    for step, path in _steps(directory):
        if step > newest:
            continue  # left by an earlier, longer run: not ours to judge
        if (path / MANIFEST).is_file():
            complete += 1
            if keep and complete > keep:
                shutil.rmtree(path, ignore_errors=True)
        elif step < newest:
            shutil.rmtree(path, ignore_errors=True)


def latest(
    directory: str, graph_hash: str, stages: int, world_size: int
) -> tuple[Checkpoint | None, list[str]]:
    """The newest complete checkpoint in ``directory`` and why newer ones were passed over.

    A checkpoint of another model or pipeline shape is the user's mistake and raises
    ``ArtifactError``; an incomplete or damaged one is skipped (a crash while writing).
    """
    skipped: list[str] = []
    for step, path in _steps(Path(directory)):
        why = _incomplete(path, step, graph_hash, stages, world_size)
        if why is None:
            manifest = json.loads((path / MANIFEST).read_text())
            optimizer = manifest.get("optimizer")
            held = optimizer if isinstance(optimizer, str) else None
            return Checkpoint(path, step, int(manifest["units"]), held), skipped
        skipped.append(f"{path.name}: {why}")
    return None, skipped


def _incomplete(path: Path, step: int, graph_hash: str, stages: int, world_size: int) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is one."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (interrupted while writing)"
    try:
        manifest = json.loads(mpath.read_text())
        files = {f["file"]: (int(f["bytes"]), str(f["sha256"])) for f in manifest["files"]}
        units = int(manifest["units"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({type(exc).__name__})"
    if manifest.get("format") != FORMAT or manifest.get("step") != step or units < 0:
        return f"manifest is not {FORMAT} of step {step}"
    if manifest.get("graph_hash") != graph_hash:
        raise ArtifactError(
            str(mpath), "graph_hash", f"a checkpoint of another model, expected {graph_hash[:19]}..."
        )
    if manifest.get("stages") != stages or manifest.get("world_size") != world_size:
        raise ArtifactError(
            str(mpath),
            "stages",
            f"a checkpoint of {manifest.get('stages')} stages on {manifest.get('world_size')} ranks; "
            f"the plan has {stages} on {world_size}",
        )
    wanted = {f"stage{s}.pt" for s in range(stages)} | {f"rank{r}.pt" for r in range(world_size)}
    if missing := sorted(wanted - set(files)):
        return f"manifest lists no {missing[0]}"
    for name, (size, digest) in sorted(files.items()):
        try:
            data = (path / name).read_bytes()
        except OSError:
            return f"{name} is missing"
        if len(data) != size:
            return f"{name} has {len(data)} bytes, the manifest says {size} (truncated)"
        if hashlib.sha256(data).hexdigest() != digest:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def _read(path: Path, device: torch.device) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        # weights_only refuses any pickle that would build an object or call a function.
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArtifactError(str(path), "", f"not a checkpoint file of tensors ({first[:200]})") from None
    if not isinstance(state, dict):
        raise ArtifactError(str(path), "", "not a checkpoint file (expected a dictionary)")
    return state


def load_stage(
    ck: Path,
    stage: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    graph_hash: str,
) -> None:
    """Restore stage ``stage``'s weights and optimizer state from checkpoint directory ``ck``."""
    path = ck / f"stage{stage}.pt"
    state = _read(path, device)
    if state.get("graph_hash") != graph_hash:
        raise ArtifactError(
            str(path), "graph_hash", f"a checkpoint of another model, expected {graph_hash[:19]}..."
        )
    try:
        module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArtifactError(str(path), "model", f"not a checkpoint of this stage ({first[:200]})") from None


def load_rank(ck: Path, rank: int, device: torch.device) -> int:
    """Restore this rank's random number generator state from ``ck``; returns its own step count."""
    path = ck / f"rank{rank}.pt"
    state = _read(path, torch.device("cpu"))
    try:
        torch.set_rng_state(state["cpu_rng"])
        if device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        return int(state["own_steps"])
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise ArtifactError(str(path), "cpu_rng", f"expected a random generator state ({exc})") from None


def resume_point(
    directory: str, graph_hash: str, stages: int, world_size: int, optimizer: str | None = None
) -> tuple[Checkpoint, list[str]]:
    """The checkpoint ``--resume`` starts from; ``UserError`` when there is none, or when it holds another
    ``optimizer``'s state (which the workers could not load: KeyError 'momentum' in a worker, once)."""
    ck, skipped = latest(directory, graph_hash, stages, world_size)
    if ck is None:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise UserError(f"--resume: no complete checkpoint in {directory}{why}")
    if optimizer is not None and ck.optimizer is not None and ck.optimizer != optimizer:
        raise UserError(
            f"--optimizer {optimizer}: the checkpoint {ck.path} holds {ck.optimizer}'s state; resume with "
            f"--optimizer {ck.optimizer}"
        )
    return ck, skipped
