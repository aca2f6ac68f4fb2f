"""Several machines, shown on one: two launchers as two nodes train as one launcher does.

``pdrun PLAN --nnodes 2 --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT`` started twice on this
host is what two machines run (docs/pdrun.md). Between nodes the values go over gloo: shared
memory is for ranks of one launcher only, never chosen because two nodes happen to share a host.
In float64 the losses of every step equal those of the same plan under a single launcher.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdrun.plans import cut_plan
from shared.plan import save_plan
from shared.tables import RUN_METRICS, load_table
from tests.test_run_flush import RESMLP

PDRUN = Path(sys.executable).parent / "pdrun"
ARGS = ["--steps", "6", "--dtype", "float64", "--lr", "0.1", "--no-val", "-q"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _losses(path: Path) -> list[tuple[int, int, float]]:
    df, _ = load_table(path, RUN_METRICS)
    rows = df[df["loss"].notna()]
    return [(int(r.step), int(r.rank), float(r.loss)) for r in rows.itertuples()]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("cuts", "replicas", "schedule"),
    [([6], [1, 1], "1f1b"), ([], [2], "1f1b-flush")],
    ids=["2-stage", "2-replica"],
)
def test_two_launchers_as_two_nodes_train_as_one(
    tmp_path: Path, cuts: list[int], replicas: list[int], schedule: str
) -> None:
    plan = tmp_path / "plan.json"
    save_plan(
        cut_plan(RESMLP, cuts, batch_size=16, replicas=replicas, schedule=schedule, microbatches=2), plan
    )  # type: ignore[arg-type]

    one = subprocess.run(
        [str(PDRUN), str(plan), *ARGS, "--metrics", str(tmp_path / "one.parquet")],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
    )
    assert one.returncode == 0, one.stderr
    assert set(json.loads(one.stdout)["transport"].values()) == {"shm"}  # one host, one launcher

    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                str(PDRUN),
                str(plan),
                *ARGS,
                "--metrics",
                str(tmp_path / f"node{n}.parquet"),
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--rdzv-endpoint",
                endpoint,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err for _, err in outs]
    summary = json.loads(outs[0][0])
    assert outs[1][0] == ""  # rank 0's node reports for the job
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert set(summary["transport"].values()) == {"gloo"}  # across nodes, never shared memory
    assert _losses(tmp_path / "node0.parquet") == _losses(tmp_path / "one.parquet")
    assert len(_losses(tmp_path / "one.parquet")) >= 6  # a loss per step at least: the comparison counts
