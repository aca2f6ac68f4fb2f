"""Failure records (pdrun/failures.py): what a rank writes is what the launcher reads back as the run's cause."""

from __future__ import annotations

import json
from pathlib import Path

from pdrun.failures import first_failure, joining_failed, peer_lost, record_failure
from shared.errors import RunError, UserError


def test_the_cause_wins_over_the_peers_that_lost_their_connection_to_it(tmp_path: Path) -> None:
    # Rank 0 saw its connection to rank 1 break first, in time; rank 1's own error is the cause.
    record_failure(str(tmp_path), 0, RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    record_failure(str(tmp_path), 1, RunError("rank 1: no activations of unit 9 from rank 2 within 4s"))
    record_failure(str(tmp_path), 1, RuntimeError("a later error of rank 1"))  # only the first is kept
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["peer_lost"] and first["type"] == "RuntimeError" and not first["user"]
    got = first_failure(tmp_path, RuntimeError("the launcher's own message"))
    assert type(got) is RunError
    assert (
        str(got) == "worker rank 1 failed: RunError: rank 1: no activations of unit 9 from rank 2 within 4s"
    )


def test_a_user_error_keeps_its_kind_and_only_its_first_line(tmp_path: Path) -> None:
    record_failure(str(tmp_path), 3, UserError("dataset: sample 4 has 3 fields\nmore detail"))
    got = first_failure(tmp_path, RuntimeError("child failed"))
    assert isinstance(got, UserError)
    assert str(got) == "worker rank 3 failed: UserError: dataset: sample 4 has 3 fields"


def test_no_record_says_the_launchers_first_line(tmp_path: Path) -> None:
    got = first_failure(tmp_path, RuntimeError("child failed\ntraceback follows"))
    assert type(got) is RunError and str(got) == "a worker failed: child failed"
    record_failure(None, 0, RuntimeError("no error directory: nothing written"))
    assert list(tmp_path.iterdir()) == []


def test_joining_failed_names_the_rank_and_the_timeout() -> None:
    err = joining_failed(2, 30.0, TimeoutError("wait timeout after 30000ms\nstack"))
    assert (
        str(err)
        == "rank 2: a peer did not join the process group within 30s (TimeoutError: wait timeout after 30000ms)"
    )
    assert not peer_lost(err) and peer_lost(RuntimeError("Broken pipe"))
