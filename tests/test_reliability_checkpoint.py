"""Checkpoint files on their own: complete only with a manifest that matches every file, older
complete ones used when a newer one is damaged, pruning to --keep, and no code run from a file."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from pdrun import checkpoint
from pdrun.cli import main
from pdrun.plans import cut_plan
from shared.errors import ArtifactError, UserError
from shared.plan import save_plan
from tests.test_run_flush import RESMLP

HASH = "sha256:" + "ab" * 32


def write(directory: Path, step: int, seed: int = 0, keep: int = 0) -> dict[str, torch.Tensor]:
    """A complete two-stage, two-rank checkpoint of step ``step``; returns stage 1's weights."""
    torch.manual_seed(seed)
    files = []
    for s in (0, 1):
        module = nn.Linear(3, 2)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        module(torch.randn(4, 3)).sum().backward()
        opt.step()
        files.append(checkpoint.save_stage(str(directory), step, s, module, opt, step * 2, HASH))
        files.append(checkpoint.save_rank(str(directory), step, s, torch.device("cpu")))
    checkpoint.commit(str(directory), step, step * 2, HASH, 2, 2, files, keep)
    return {k: v.clone() for k, v in module.state_dict().items()}


def latest_step(directory: Path) -> tuple[int | None, list[str]]:
    ck, skipped = checkpoint.latest(str(directory), HASH, 2, 2)
    return (ck.step if ck else None), skipped


def test_a_checkpoint_counts_only_when_its_manifest_matches_every_file(tmp_path: Path) -> None:
    write(tmp_path, 3)
    want = write(tmp_path, 6, seed=1)
    manifest = json.loads((tmp_path / "step-000006" / "manifest.json").read_text())
    assert manifest["format"] == "pdrun.checkpoint/1" and manifest["units"] == 12
    assert [f["file"] for f in manifest["files"]] == ["rank0.pt", "rank1.pt", "stage0.pt", "stage1.pt"]
    assert latest_step(tmp_path) == (6, [])

    # The newest is loaded: weights and optimizer state back into a fresh module.
    module = nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    checkpoint.load_stage(tmp_path / "step-000006", 1, module, opt, torch.device("cpu"), HASH)
    assert all(torch.equal(module.state_dict()[k], want[k]) for k in want)
    assert opt.state_dict()["state"][0]["momentum_buffer"] is not None

    stage1 = tmp_path / "step-000006" / "stage1.pt"
    data = stage1.read_bytes()
    stage1.write_bytes(data[: len(data) // 2])  # a kill mid-write without the atomic rename
    assert latest_step(tmp_path) == (
        3,
        [f"step-000006: stage1.pt has {len(data) // 2} bytes, the manifest says {len(data)} (truncated)"],
    )

    stage1.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert latest_step(tmp_path)[1] == ["step-000006: stage1.pt does not match its SHA-256 in the manifest"]

    stage1.unlink()
    assert latest_step(tmp_path)[1] == ["step-000006: stage1.pt is missing"]

    (tmp_path / "step-000006" / "manifest.json").unlink()  # files written, manifest not yet
    assert latest_step(tmp_path) == (3, ["step-000006: no manifest (interrupted while writing)"])

    (tmp_path / "step-000003" / "manifest.json").write_text("{not json")
    assert latest_step(tmp_path)[0] is None
    with pytest.raises(UserError, match=r"--resume: no complete checkpoint in .*step-000006: no manifest"):
        checkpoint.resume_point(str(tmp_path), HASH, 2, 2)


def test_a_checkpoint_of_another_model_or_pipeline_is_refused(tmp_path: Path) -> None:
    write(tmp_path, 2)
    with pytest.raises(
        ArtifactError, match=r"step-000002/manifest.json: graph_hash: a checkpoint of another model"
    ):
        checkpoint.latest(str(tmp_path), "sha256:" + "cd" * 32, 2, 2)
    with pytest.raises(
        ArtifactError, match=r"stages: a checkpoint of 2 stages on 2 ranks; the plan has 3 on 3"
    ):
        checkpoint.latest(str(tmp_path), HASH, 3, 3)
    module = nn.Linear(5, 5)  # another stage's shapes
    with pytest.raises(ArtifactError, match=r"stage0.pt: model: not a checkpoint of this stage"):
        checkpoint.load_stage(tmp_path / "step-000002", 0, module, None, torch.device("cpu"), HASH)


def test_keep_prunes_old_complete_checkpoints_and_leftovers_of_crashes(tmp_path: Path) -> None:
    write(tmp_path, 2, keep=2)
    (tmp_path / "step-000003").mkdir()  # a crash while writing step 3: files, no manifest
    (tmp_path / "step-000003" / "stage0.pt").write_bytes(b"partial")
    write(tmp_path, 4, keep=2)
    write(tmp_path, 6, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000006"]
    write(tmp_path, 8, keep=0)  # 0 keeps all
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000006", "step-000008"]


class Payload:
    """Unpickling this runs a shell command: what a malicious checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_file_with_code_in_it_is_refused_without_running_it(tmp_path: Path) -> None:
    write(tmp_path, 1)
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"model": Payload(marker)}, protocol=2)  # torch.load's own protocol
    # The payload is real: plain unpickling in another process runs it.
    subprocess.run(
        [sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"],
        input=evil,
        check=True,
    )
    assert marker.exists()
    marker.unlink()

    # Make the file part of a consistent checkpoint, so that only the loader stands in the way.
    ck = tmp_path / "step-000001"
    (ck / "stage0.pt").write_bytes(evil)
    manifest = json.loads((ck / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["file"] == "stage0.pt":
            f["bytes"], f["sha256"] = len(evil), hashlib.sha256(evil).hexdigest()
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert latest_step(tmp_path) == (1, [])
    with pytest.raises(ArtifactError, match=r"stage0.pt: not a checkpoint file of tensors"):
        checkpoint.load_stage(ck, 0, nn.Linear(3, 2), None, torch.device("cpu"), HASH)
    (ck / "rank1.pt").write_bytes(evil)
    with pytest.raises(ArtifactError, match=r"rank1.pt: not a checkpoint file of tensors"):
        checkpoint.load_rank(ck, 1, torch.device("cpu"))
    assert not marker.exists()


def test_random_state_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(5)
    checkpoint.save_rank(str(tmp_path), 1, 0, torch.device("cpu"))
    want = torch.rand(3)
    torch.manual_seed(99)
    checkpoint.load_rank(tmp_path / "step-000001", 0, torch.device("cpu"))
    assert torch.equal(torch.rand(3), want)


def test_resume_without_a_complete_checkpoint_is_one_line_before_any_worker_starts(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    save_plan(cut_plan(RESMLP, [6], batch_size=16), plan)
    ck = tmp_path / "ck"
    (ck / "step-000004").mkdir(parents=True)  # a crash before its manifest
    res = CliRunner().invoke(main, [str(plan), "--steps", "2", "--resume", "--checkpoint-dir", str(ck)])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"pdrun: error: --resume: no complete checkpoint in {ck} (step-000004: no manifest (interrupted while writing))"
    ]
