"""A worker that raises or is killed mid-step: every worker stops, pdrun exits non-zero within 30 s
naming the rank and its error, and no process of the run is left behind.

pdrun runs as a real subprocess with three workers over gloo on 127.0.0.1; the failure is injected
with ``PIPEDREAM_FAULT`` (pdrun/faults.py). Every process of the run (launcher, forkserver, workers)
inherits a unique marker in its environment, which is how the test finds any that outlived pdrun.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from pdrun.faults import FAULT_ENV, Fault
from pdrun.plans import cut_plan
from pdrun.transport.shm import SHM_DIR
from shared.errors import UserError
from shared.plan import save_plan
from shared.spec import RunSpec
from shared.tables import RUN_METRICS, load_table

# Each worker builds the dataset (the launcher too, checking the plan, without RANK): recording the
# pid there tells the test which processes were workers.
PID_DATA = """
import os
from pathlib import Path

from shared.resolve import resolve_dataset


def build(pids):
    if "RANK" in os.environ:
        Path(pids, "rank%s.pid" % os.environ["RANK"]).write_text(str(os.getpid()))
    return resolve_dataset("zoo:digits", {})
"""

MARK = "PDRUN_RELIABILITY_TEST_MARK"


def run_pdrun(
    args: list[str], env: dict[str, str], timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], float, str]:
    """Run pdrun; (result, seconds, marker) where every process it started carries the marker."""
    mark = uuid.uuid4().hex
    pdrun = Path(sys.executable).parent / "pdrun"
    t0 = time.monotonic()
    done = subprocess.run(
        [str(pdrun), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", MARK: mark, **env},
    )
    return done, time.monotonic() - t0, mark


def marked_processes(mark: str) -> list[int]:
    """Pids of live processes whose environment holds ``mark`` (read from /proc, no psutil)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def alive(pid: int) -> bool:
    """True when ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pdrun: error")]


def pid_plan(tmp_path: Path, cuts: list[int], **plan: Any) -> Path:
    """tmp_path/plan.json: a resmlp cut at ``cuts`` whose workers write their pids into tmp_path/pids."""
    (tmp_path / "pids").mkdir()
    (tmp_path / "piddata.py").write_text(PID_DATA)
    spec = RunSpec(
        model="zoo:resmlp",
        model_args={"width": 32, "depth": 2},
        data=f"{tmp_path}/piddata.py:build",
        data_args={"pids": str(tmp_path / "pids")},
    )
    path = tmp_path / "plan.json"
    save_plan(cut_plan(spec, cuts, batch_size=16, **plan), path)
    return path


@pytest.fixture
def plan3(tmp_path: Path) -> Path:
    return pid_plan(tmp_path, [3, 6], schedule="1f1b-flush", microbatches=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("raise:1:9", "worker rank 1 failed: InjectedFault: injected fault at unit 9"),
        ("kill:2:9", "worker rank 2 died (signal SIGKILL)"),
    ],
)
def test_a_failed_worker_stops_the_run_within_30s_naming_its_rank_and_leaves_no_process(
    plan3: Path, fault: str, expected: str
) -> None:
    # --timeout 300: the peers blocked on the dead rank must be stopped by pdrun, not by their timeout.
    links = _shm_names()
    done, seconds, mark = run_pdrun(
        [str(plan3), "--steps", "40", "--timeout", "300", "-q", "--no-val"], {"PIPEDREAM_FAULT": fault}
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert seconds < 30, f"pdrun took {seconds:.1f}s to report a failed worker"
    lines = error_lines(done.stderr)
    assert lines == [f"pdrun: error: {expected}"], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    pids = [int(p.read_text()) for p in sorted((plan3.parent / "pids").glob("rank*.pid"))]
    assert len(pids) == 3  # all three workers ran
    assert [p for p in pids if alive(p)] == []
    assert marked_processes(mark) == []  # nor the forkserver, nor anything else pdrun started
    assert _shm_names() - links == set()  # nor a shared-memory link or bell (pdrun/transport/shm.py)


@pytest.mark.timeout(60)
def test_a_peer_that_never_sends_ends_the_run_after_timeout_naming_it(plan3: Path) -> None:
    # Rank 1 stalls (alive, silent) in the forward of unit 9: its neighbours give up after --timeout.
    links = _shm_names()
    done, seconds, mark = run_pdrun(
        [str(plan3), "--steps", "40", "--timeout", "4", "-q", "--no-val"], {"PIPEDREAM_FAULT": "hang:1:9"}
    )
    assert done.returncode == 1 and seconds < 30, done.stderr[-2000:]
    [line] = error_lines(done.stderr)
    assert re.fullmatch(
        r"pdrun: error: worker rank [02] failed: RunError: rank [02]: no (activations|gradients) of unit \d+ "
        r"from rank 1 within 4s.*",
        line,
    ), line
    pids = [int(p.read_text()) for p in sorted((plan3.parent / "pids").glob("rank*.pid"))]
    assert len(pids) == 3 and [p for p in pids if alive(p)] == []  # the stalled rank too
    assert marked_processes(mark) == []
    assert _shm_names() - links == set()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_pdrun_itself_stops_every_worker(plan3: Path, sig: signal.Signals) -> None:
    # SIGTERM (a scheduler, Ctrl-C is alike): pdrun stops its workers and says so. SIGKILL: pdrun
    # cannot, so each worker notices its launcher is gone and stops itself (pdrun/orphan.py).
    mark = uuid.uuid4().hex
    links = _shm_names()
    metrics = plan3.parent / "m.parquet"
    proc = _training(plan3, metrics, {MARK: mark})
    pids_dir = plan3.parent / "pids"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=30)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        assert error_lines(stderr) == ["pdrun: error: stopped by SIGTERM; every worker was stopped"], stderr
        assert "Traceback" not in stderr, stderr
        _kept_what_it_trained(json.loads(stdout), metrics, "SIGTERM", stderr)
    else:
        assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in sorted(pids_dir.glob("rank*.pid"))]
    assert len(pids) == 3 and [p for p in pids if alive(p)] == []
    assert marked_processes(mark) == []
    # SIGKILL: the launcher could not sweep the run's shared-memory links; its orphaned workers did.
    assert _shm_names() - links == set()


def _training(
    plan: Path, metrics: Path, env: dict[str, str] | None = None, preexec: Callable[[], object] | None = None
) -> subprocess.Popen[str]:
    """The installed pdrun on ``plan`` for 100,000 steps, its outputs piped, once its 3 workers train."""
    pdrun = str(Path(sys.executable).parent / "pdrun")
    proc = subprocess.Popen(
        [pdrun, str(plan), "--steps", "100000", "-q", "--no-val", "--metrics", str(metrics)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        preexec_fn=preexec,
    )
    pids_dir = plan.parent / "pids"
    deadline = time.monotonic() + 60
    while len(list(pids_dir.glob("rank*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)  # training
    assert proc.poll() is None, "pdrun ended before it was stopped"
    return proc


def _kept_what_it_trained(summary: dict[str, Any], metrics: Path, sig: str, stderr: str) -> None:
    """A stopped run's summary and metrics: the steps every worker finished, each rank's row of each."""
    steps = summary["steps"]
    assert summary["stopped_by"] == sig and summary["ranks_reported"] == [0, 1, 2], summary
    assert steps >= 1 and summary["final_loss"] is not None and summary["samples"] == steps * 2 * 16
    df, _ = load_table(metrics, RUN_METRICS)
    assert sorted(df["step"].unique()) == list(range(steps))
    assert (df.groupby("step")["rank"].apply(sorted) == pd.Series([[0, 1, 2]] * steps)).all()
    assert f"pdrun: stopped by {sig} after {steps} steps; their metrics in {metrics}" in stderr, stderr


def _long_run(plan: Path, preexec: Callable[[], object]) -> subprocess.Popen[str]:
    """The installed pdrun on ``plan`` for 100,000 steps, its stderr piped, ``preexec`` run in its process."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "pdrun"), str(plan), "--steps", "100000", "-q", "--no-val"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=preexec,
    )


def _own_group_taking_sigint() -> None:
    """As a terminal's job: its own process group, SIGINT at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setsid()


@pytest.mark.timeout(90)
def test_sigint_stops_a_run_started_with_sigint_ignored(plan3: Path) -> None:
    # A script's background job (`pdrun plan.json &`) starts with SIGINT ignored, and the workers inherited
    # that: `kill -INT` on pdrun then left them training until the launcher's grace ran out (20 s measured).
    pids_dir = plan3.parent / "pids"
    proc = _long_run(plan3, lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while len(list(pids_dir.glob("rank*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # training
    assert proc.poll() is None, "pdrun ended before it was stopped"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=40)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - sent < 10, f"{time.monotonic() - sent:.1f} s from SIGINT to exit"
    pids = [int(p.read_text()) for p in sorted(pids_dir.glob("rank*.pid"))]
    assert len(pids) == 3 and [p for p in pids if alive(p)] == []


@pytest.mark.timeout(90)
def test_sigint_during_start_up_stops_a_run_started_with_sigint_ignored(plan3: Path) -> None:
    # `pdrun plan.json & ... kill -INT $!` in a script, a second in: pdrun still ignored SIGINT (its shell's
    # setting for background jobs) until torch's launcher set a handler, and the run went on to its end, rc 0.
    proc = _long_run(plan3, lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    # Starting (checks, the forkserver; no worker yet), past the CLI's first line, which takes SIGINT back:
    # before it, in Python's and click's imports, the shell's SIG_IGN still holds.
    time.sleep(2.0)
    assert proc.poll() is None and not list((plan3.parent / "pids").glob("rank*.pid"))
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=40)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - sent < 10, f"{time.monotonic() - sent:.1f} s from SIGINT to exit"
    assert [line for line in stderr.splitlines() if line.strip()] == ["pdrun: aborted"], stderr


@pytest.mark.timeout(90)
def test_sigterm_during_start_up_is_one_line(plan3: Path) -> None:
    # A second in, before torch's launcher had a handler: pdrun ended with 143 and an empty stderr.
    proc = _long_run(plan3, lambda: None)
    time.sleep(2.0)  # past the CLI's first line, which sets the handler; no worker yet
    assert proc.poll() is None and not list((plan3.parent / "pids").glob("rank*.pid"))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=40)
    assert proc.returncode == 143, stderr
    assert [line for line in stderr.splitlines() if line.strip()] == ["pdrun: error: stopped by SIGTERM"], (
        stderr
    )


@pytest.mark.timeout(90)
def test_ctrl_c_keeps_the_metrics_of_the_steps_trained(plan3: Path) -> None:
    # A terminal's Ctrl-C: SIGINT to pdrun and every worker at once. Each worker unwinds and leaves its rows
    # for the launcher (pdrun/stopped.py); before, they died with them: no metrics, no summary.
    metrics = plan3.parent / "m.parquet"
    proc = _training(plan3, metrics, preexec=_own_group_taking_sigint)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=40)
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == "pdrun: aborted" and "Traceback" not in stderr, stderr
    _kept_what_it_trained(json.loads(stdout), metrics, "SIGINT", stderr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_s", [0.5, 1.2])
def test_ctrl_c_while_the_workers_start_is_one_line(plan3: Path, after_s: float) -> None:
    # Ctrl-C (SIGINT to the whole group) while the forkserver imported torch printed a 25-50 line
    # KeyboardInterrupt traceback from it, and once a C++ abort (exit 134), after pdrun's own line.
    proc = _long_run(plan3, _own_group_taking_sigint)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)  # every writer of the pipe gone: the forkserver too
    assert proc.returncode == 130, stderr
    assert [line for line in stderr.splitlines() if line.strip()] == ["pdrun: aborted"], stderr


def _shm_names() -> set[str]:
    """The shared-memory files of runs whose launcher is gone: a leak. Another test's run, still going
    beside this one under pytest-xdist, names its files after its live launcher (``-l<pid>-``)."""
    names = set()
    for path in SHM_DIR.glob("pdrun-*"):
        launcher = re.search(r"-l(\d+)-", path.name)
        if launcher is None or not alive(int(launcher.group(1))):
            names.add(path.name)
    return names


def test_a_malformed_fault_spec_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "explode:1")
    with pytest.raises(UserError, match="PIPEDREAM_FAULT='explode:1': expected KIND:RANK:AT"):
        Fault.from_environ()
    monkeypatch.setenv(FAULT_ENV, "kill:2:9")
    assert Fault.from_environ() == Fault("kill", 2, 9)
