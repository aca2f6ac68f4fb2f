"""Nothing left behind: a run killed with SIGKILL leaves no semaphore in /dev/shm and no warning.

torch's launcher hands its workers multiprocessing semaphores, which forkserver names in
/dev/shm (pdrun/named_sems.py). The test reads the names the launcher has mapped from
/proc/PID/maps, so it judges only this run's, whatever else runs on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_reliability_failures import MARK, alive, marked_processes, pid_plan

SHM = Path("/dev/shm")


@pytest.fixture
def plan2(tmp_path: Path) -> Path:
    return pid_plan(tmp_path, [6])


def mapped_semaphores(pids: list[int]) -> set[int]:
    """Inodes of the named semaphores ``pids`` have open, from /proc/PID/maps.

    glibc maps a semaphore under the temporary name it created it as (``/dev/shm/sem.XXXXXX
    (deleted)``) before linking it to its real name: the inode is what ties the two.
    """
    inodes = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/sem."):
                inodes.add(int(fields[4]))
    return inodes


def semaphores_left(inodes: set[int]) -> list[str]:
    """The names in /dev/shm of any of ``inodes``, removed once found (a failed test leaks nothing either)."""
    left = []
    for path in SHM.glob("sem.*"):
        try:
            if path.stat().st_ino in inodes:
                left.append(path.name)
                path.unlink()
        except OSError:
            continue  # removed meanwhile
    return left


def _workers(plan: Path) -> list[int]:
    return [int(p.read_text()) for p in (plan.parent / "pids").glob("rank*.pid")]


def _start(plan: Path, args: list[str]) -> tuple[subprocess.Popen[str], str]:
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "pdrun"), str(plan), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", MARK: mark},
        start_new_session=True,  # its own process group, to be killed whole
    )
    return proc, mark


def _training(plan: Path, proc: subprocess.Popen[str], ck: Path | None = None) -> None:
    """Wait until both workers train (and, with ``ck``, a checkpoint was completed)."""
    pids = plan.parent / "pids"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        started = len(list(pids.glob("rank*.pid"))) == 2
        if started and (ck is None or list(ck.glob("step-*/manifest.json"))):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(0.5)
    assert proc.poll() is None, "pdrun ended before it was killed"


def _gone(mark: str, plan: Path) -> None:
    deadline = time.monotonic() + 15
    while marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(mark) == []
    pids = _workers(plan)
    assert len(pids) == 2 and [p for p in pids if alive(p)] == []


@pytest.mark.timeout(150)
def test_sigkill_of_the_process_group_during_checkpoints_leaves_no_semaphore(
    plan2: Path, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    # A checkpoint at every step: the kill falls while one is being written, or next to one.
    proc, mark = _start(
        plan2, ["--steps", "2000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "-q", "--no-val"]
    )
    try:
        _training(plan2, proc, ck)
        held = mapped_semaphores([proc.pid, *_workers(plan2)])
        assert len(held) >= 9, "the launcher holds no named semaphores: nothing tested"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _gone(mark, plan2)
    assert semaphores_left(held) == []


@pytest.mark.timeout(150)
def test_sigkill_of_the_launcher_alone_prints_no_leak_warning(plan2: Path) -> None:
    proc, mark = _start(plan2, ["--steps", "2000", "-q", "--no-val"])
    try:
        _training(plan2, proc)
        held = mapped_semaphores([proc.pid, *_workers(plan2)])
        proc.send_signal(signal.SIGKILL)  # the workers stop themselves (pdrun/orphan.py)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _gone(mark, plan2)
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr
    assert semaphores_left(held) == []
