"""Several machines, shown on one: two launchers as two nodes train as one launcher does.

``pdrun PLAN --nnodes 2 --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT`` started twice on this
host is what two machines run (docs/pdrun.md). The transport is chosen per pair of ranks, by
node (the launcher's group), never by host: ranks of one node pass their messages through
shared memory, ranks of different nodes over gloo, though both nodes share this host; a
replicated stage sums through shared memory only when all its replicas are on one node. In
float64 the losses of every step equal those of the same plan under a single launcher.
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


# Two workers per node: ranks 0, 1 on node 0 and 2, 3 on node 1. Per rank, per peer it messaged, what
# carried them, and per replicated rank what summed its gradients.
# [1, 2, 1]: stage 1's replicas (ranks 1, 2) straddle the nodes; stage 0 sends unit u to replica u % 2.
SPLIT = (
    {
        "0": {"1": "shm", "2": "gloo"},
        "1": {"0": "shm", "3": "gloo"},
        "2": {"0": "gloo", "3": "shm"},
        "3": {"1": "gloo", "2": "shm"},
    },
    {"1": "gloo", "2": "gloo"},
)
# [2, 2]: each stage's replicas on one node; replica r of stage 0 sends to replica r of stage 1.
PER_NODE = (
    {"0": {"2": "gloo"}, "1": {"3": "gloo"}, "2": {"0": "gloo"}, "3": {"1": "gloo"}},
    {"0": "shm", "1": "shm", "2": "shm", "3": "shm"},
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("cuts", "replicas", "schedule", "carried"),
    [([4, 8], [1, 2, 1], "1f1b", SPLIT), ([6], [2, 2], "1f1b-flush", PER_NODE)],
    ids=["replicas-across-nodes", "replicas-within-nodes"],
)
def test_two_launchers_as_two_nodes_train_as_one(
    tmp_path: Path,
    cuts: list[int],
    replicas: list[int],
    schedule: str,
    carried: tuple[dict[str, dict[str, str]], dict[str, str]],
) -> None:
    plan = tmp_path / "plan.json"
    save_plan(
        cut_plan(RESMLP, cuts, batch_size=16, replicas=replicas, schedule=schedule, microbatches=2), plan
    )  # type: ignore[arg-type]

    one = subprocess.run(
        [str(PDRUN), str(plan), *ARGS, "--metrics", str(tmp_path / "one.parquet")],
        capture_output=True,
        text=True,
        timeout=400,
        env=_env(),
    )
    assert one.returncode == 0, one.stderr
    alone = json.loads(one.stdout)
    assert set(alone["transport"].values()) == {"shm"}  # one launcher: one node, every pair and sum in memory
    links, sums = carried
    assert alone["links"] == {rank: dict.fromkeys(peers, "shm") for rank, peers in links.items()}
    assert alone["replica_sum"] == dict.fromkeys(sums, "shm")

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
    outs = [p.communicate(timeout=400) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err for _, err in outs]
    summary = json.loads(outs[0][0])
    assert outs[1][0] == ""  # rank 0's node reports for the job
    assert summary["world_size"] == 4 and summary["steps"] == 6
    # Within a node shared memory, across nodes gloo: chosen by node, though both are on this host.
    assert summary["links"] == links
    assert summary["replica_sum"] == sums
    assert set(summary["transport"].values()) == {"mixed"}  # every rank used both
    assert _losses(tmp_path / "node0.parquet") == _losses(tmp_path / "one.parquet")
    assert len(_losses(tmp_path / "one.parquet")) >= 6  # a loss per step at least: the comparison counts


@pytest.mark.timeout(120)
def test_a_node_whose_peer_never_comes_is_one_line_within_its_timeout(tmp_path: Path) -> None:
    # c10d's own join timeout (600 s) ruled before: a lone node waited 10 minutes in silence, then said
    # "internal error: RendezvousTimeoutError" with no reason.
    plan = tmp_path / "plan.json"
    save_plan(cut_plan(RESMLP, [6], batch_size=16), plan)
    endpoint = f"127.0.0.1:{_free_port()}"
    argv = [str(PDRUN), str(plan), "--nnodes", "2", "--rdzv-endpoint", endpoint, "--timeout", "5", *ARGS]
    res = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=100)
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"pdrun: error: --nnodes 2: the nodes did not all join at {endpoint} within about 5s (RendezvousTimeoutError"
    ), res.stderr
