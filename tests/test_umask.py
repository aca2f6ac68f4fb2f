"""Files others can read: every artifact, table and checkpoint gets the mode ``open()`` would give it.

Written through a temporary file (shared/io.py), which ``mkstemp`` creates 0600; the tools set
0666 less the umask before the rename, so a plan written under umask 0022 is 0644 and one
written under 0077 stays private. Checked through the installed command lines (a real umask
in a real process) and through the checkpoint and Parquet writers.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
import torch

from pdrun import checkpoint
from shared.tables import RUN_METRICS, save_table

BIN = Path(sys.executable).parent
UMASKS = {0o022: 0o644, 0o077: 0o600, 0o002: 0o664}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mask", sorted(UMASKS))
def test_graph_and_plan_from_the_command_lines_honour_the_umask(
    tmp_path: Path, profiles_dir: Path, mask: int
) -> None:
    graph, plan = tmp_path / "graph.json", tmp_path / "plan.json"
    for argv in (
        ["pdprof", "import-pipedream", str(profiles_dir / "alexnet.txt"), "-o", str(graph)],
        ["pdplan", str(graph), "--workers", "2", "--bandwidth", "1e9", "-o", str(plan)],
    ):
        done = subprocess.run(
            [str(BIN / argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            umask=mask,
        )
        assert done.returncode == 0, done.stderr
    assert (mode(graph), mode(plan)) == (UMASKS[mask], UMASKS[mask])


@pytest.mark.parametrize("mask", sorted(UMASKS))
def test_checkpoints_and_metrics_honour_the_umask(tmp_path: Path, mask: int) -> None:
    module = torch.nn.Linear(3, 2)
    with umask(mask):
        files = [
            checkpoint.save_stage(str(tmp_path / "ck"), 1, 0, module, None, 1, "sha256:" + "0" * 64),
            checkpoint.save_rank(str(tmp_path / "ck"), 1, 0, torch.device("cpu")),
        ]
        ck = checkpoint.commit(str(tmp_path / "ck"), 1, 1, "sha256:" + "0" * 64, 1, 1, files, keep=2)
        rows = pd.DataFrame({"step": [0, 1], "loss": [1.0, 0.5]})
        save_table(rows, tmp_path / "run.parquet", RUN_METRICS, {})
    written = [ck / "stage0.pt", ck / "rank0.pt", ck / checkpoint.MANIFEST, tmp_path / "run.parquet"]
    assert [mode(p) for p in written] == [UMASKS[mask]] * len(written)
    assert mode(ck) == 0o777 & ~mask  # the step's directory, as mkdir makes it
