"""``pdrun PLAN`` end to end: summary, metrics, timeline, checkpoints, resume, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pdrun.cli import main
from pdrun.plans import cut_plan
from shared.plan import save_plan
from shared.spec import RunSpec
from shared.tables import RUN_METRICS, load_table
from tests.test_run_flush import RESMLP


def _plan(tmp_path: Path, spec: RunSpec = RESMLP, **kwargs: object) -> Path:
    plan = cut_plan(spec, [6], batch_size=16, **kwargs)  # type: ignore[arg-type]
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    return path


@pytest.mark.timeout(120)
def test_run_writes_summary_metrics_timeline_and_checkpoints(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    ck = tmp_path / "ck"
    args = [
        "--steps",
        "4",
        "--lr",
        "0.1",
        "--metrics",
        str(tmp_path / "m.parquet"),
        "--trace",
        str(tmp_path / "t.json"),
        "--checkpoint-dir",
        str(ck),
        "-q",
    ]
    # The plan comes on standard input, as in `pdplan ... | pdrun -`.
    res = CliRunner().invoke(main, ["-", *args], input=plan.read_text())
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["steps"] == 4 and summary["units"] == 4 and summary["samples"] == 64
    assert 0 < summary["final_loss"] < 10 and summary["samples_per_s"] > 0
    assert 0 <= summary["val_accuracy"] <= 1 and summary["validation"][0]["step"] == 4
    assert summary["artifacts"]["metrics"] == str(tmp_path / "m.parquet")

    df, meta = load_table(tmp_path / "m.parquet", RUN_METRICS)
    assert meta["schedule"] == "1f1b"
    for col in ("step", "loss", "rank", "stage", "samples_per_s", "compute_s", "comm_s", "idle_s"):
        assert col in df.columns
    assert len(df) == 8 and sorted(set(df["rank"])) == [0, 1]
    assert df[df["stage"] == 0]["loss"].isna().all() and df[df["stage"] == 1]["loss"].notna().all()
    assert (df["compute_s"] > 0).all() and (df["samples_per_s"] > 0).all()

    trace = json.loads((tmp_path / "t.json").read_text())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in boxes} == {0, 1}
    names0 = [e["name"] for e in boxes if e["pid"] == 0]
    assert names0[:2] == ["F0", "SA0>1.0"] and names0.count("S3") == 1
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in boxes)

    states = [torch.load(ck / "step-000004" / f"stage{s}.pt", weights_only=True) for s in (0, 1)]
    assert [st["units"] for st in states] == [4, 4]
    assert "stem.weight" in states[0]["model"] and "head.weight" in states[1]["model"]
    assert not set(states[0]["model"]) & set(states[1]["model"])

    # Resume: two more steps continue from the checkpoints (units 4 and 5); the summary counts those two.
    res = CliRunner().invoke(
        main, [str(plan), "--steps", "2", "--checkpoint-dir", str(ck), "--resume", "-q", "--no-val"]
    )
    assert res.exit_code == 0, res.output
    resumed = json.loads(res.stdout)
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 2 and resumed["units"] == 2
    assert torch.load(ck / "step-000006" / "stage1.pt", weights_only=True)["units"] == 6


def _error(res: object) -> str:
    out: str = res.stderr  # type: ignore[attr-defined]
    lines = [line for line in out.splitlines() if line.startswith("pdrun: error")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.timeout(60)
def test_bad_plans_fail_with_one_line_and_exit_2(tmp_path: Path) -> None:
    path = _plan(tmp_path)
    data = json.loads(path.read_text())
    runner = CliRunner()

    data["graph_hash"] = "sha256:" + "0" * 64
    (tmp_path / "hash.json").write_text(json.dumps(data))
    res = runner.invoke(main, [str(tmp_path / "hash.json"), "--steps", "1"])
    assert res.exit_code == 2 and "graph_hash" in _error(res)

    data = json.loads(path.read_text())
    data["stages"][1]["layers"].remove("head")
    (tmp_path / "missing.json").write_text(json.dumps(data))
    res = runner.invoke(main, [str(tmp_path / "missing.json"), "--steps", "1"])
    assert res.exit_code == 2 and "'head' is in no stage" in _error(res)

    res = runner.invoke(main, [str(path), "--steps", "1", "--nproc-per-node", "1"])
    line = _error(res)
    assert (
        res.exit_code == 2 and "stages[1].ranks" in line and "'blocks_0_fc2'" in line and "provides 1" in line
    )


FLAKY_DATA = '''
import os
import torch
from torch.utils.data import Dataset


class Flaky(Dataset):
    """Digits-sized random data; rank 0 fails after a few batches, or rank 1 hangs."""

    def __init__(self, mode):
        self.mode = mode
        self.calls = 0
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 64, generator=g)
        self.y = torch.randint(0, 10, (256,), generator=g)

    def __len__(self):
        return 256

    def __getitem__(self, i):
        self.calls += 1
        rank = os.environ.get("RANK")
        if self.mode == "fail" and rank == "0" and self.calls > 60:
            raise ValueError("sample %d is corrupt" % i)
        if self.mode == "hang" and rank == "1" and self.calls > 40:
            import time
            time.sleep(600)
        return self.x[i], self.y[i]


def build(mode="fail"):
    return Flaky(mode)
'''


@pytest.mark.timeout(90)
def test_worker_failure_and_peer_timeout_are_reported_with_the_rank(tmp_path: Path) -> None:
    (tmp_path / "flaky.py").write_text(FLAKY_DATA)
    runner = CliRunner()
    spec = RunSpec(
        model="zoo:resmlp", model_args={"width": 32, "depth": 2}, data=f"{tmp_path}/flaky.py:build"
    )
    path = _plan(tmp_path, spec)
    res = runner.invoke(main, [str(path), "--steps", "8", "-q"])
    line = _error(res)
    # The dataset's own error mid-run is the data's: exit 2, naming the data, the sample and the unit.
    assert res.exit_code == 2, line
    assert f"worker rank 0 failed: DataError: dataset {spec.data}: sample " in line, line
    assert "reading it raised ValueError: sample" in line and "corrupt" in line, line

    data = json.loads(path.read_text())
    data["spec"]["data_args"] = {"mode": "hang"}
    (tmp_path / "hang.json").write_text(json.dumps(data))
    res = runner.invoke(main, [str(tmp_path / "hang.json"), "--steps", "8", "-q", "--timeout", "3"])
    line = _error(res)
    assert res.exit_code == 1 and "worker rank 0 failed: RunError" in line and "from rank 1 within 3s" in line


@pytest.mark.timeout(150)
def test_under_torchrun_each_process_is_one_worker(tmp_path: Path) -> None:
    # torchrun sets RANK/WORLD_SIZE/MASTER_ADDR: pdrun then runs as that one worker; rank 0 reports.
    plan = _plan(tmp_path)
    pdrun = Path(sys.executable).parent / "pdrun"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(pdrun),
        str(plan),
        "--steps",
        "2",
        "-q",
        "--no-val",
        "--metrics",
        str(tmp_path / "m.parquet"),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=140, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    # The workers' own lines come first, torchrun's summary of the failure last: keep both.
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    summary = json.loads(done.stdout)  # one JSON document: only rank 0 printed
    assert summary["steps"] == 2 and summary["world_size"] == 2
    df, _ = load_table(tmp_path / "m.parquet", RUN_METRICS)
    assert sorted(set(df["rank"])) == [0, 1]


@pytest.mark.timeout(180)
def test_the_closing_line_sets_the_measured_rate_beside_the_prediction(tmp_path: Path) -> None:
    # A new user saw "the plan predicted 98029" beside 10,018 measured and no word on how far apart they were.
    from pdplan.cli import main as pdplan_main
    from pdprof.cli import main as pdprof_main

    graph, plan = tmp_path / "g.json", tmp_path / "p.json"
    prof = ["--model", "zoo:resmlp", "--model-arg", "width=32", "--data", "zoo:digits", "--batch-size", "16"]
    assert CliRunner().invoke(pdprof_main, [*prof, "--repeats", "4", "-o", str(graph)]).exit_code == 0
    planned = [
        "--workers",
        "2",
        "--bandwidth",
        "1e9",
        "--schedule",
        "1f1b-flush",
        "--straight",
        "-o",
        str(plan),
    ]
    assert CliRunner().invoke(pdplan_main, [str(graph), *planned]).exit_code == 0
    res = CliRunner().invoke(main, [str(plan), "--steps", "20", "--no-val"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    ratio = summary["steady_samples_per_s"] / summary["predicted_samples_per_s"]
    [line] = [ln for ln in res.stderr.splitlines() if " steps of " in ln]
    assert (
        f", the plan predicted {summary['predicted_samples_per_s']:.0f} (measured / predicted {ratio:.2f})"
        in line
    )
    # A tiny model's sub-millisecond units run well below the prediction: the run says why.
    unit = 16 / summary["predicted_samples_per_s"]
    said = [ln for ln in res.stderr.splitlines() if "pdrun's own work per instruction" in ln]
    assert len(said) == (1 if ratio < 0.8 and unit < 2e-3 else 0), res.stderr


def test_a_short_units_note_only_where_the_run_measured_well_below_a_sub_millisecond_prediction() -> None:
    from pdrun.metrics import short_step_note

    def note(predicted: float, measured: float, batch: int = 32) -> str | None:
        return short_step_note(
            {"predicted_samples_per_s": predicted, "steady_samples_per_s": measured}, batch
        )

    said = note(113_846, 42_084)  # the README's MLP: 0.28 ms a unit predicted, 0.76 measured
    assert said is not None and said.startswith("note: a unit took 0.76 ms where the plan predicted 0.28:")
    assert note(113_846, 100_000) is None  # within 0.8 of the prediction
    assert note(10_000, 2_000) is None  # 3.2 ms units: pdrun's own work is not what is missing there
    assert note(0.0, 2_000) is None  # no prediction (an edited plan)


@pytest.mark.timeout(120)
def test_a_full_disk_at_the_end_still_prints_the_summary_and_writes_what_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The metrics cannot be written (the disk filled during the run): before, the error ended pdrun there,
    # and the summary and the trace after it were lost with the run's figures.
    import errno

    from shared import tables
    from shared.io import atomic_write_bytes

    plan = _plan(tmp_path)
    metrics, trace = tmp_path / "m.parquet", tmp_path / "t.json"

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full(path: str, data: bytes) -> None:  # the Parquet write only; the trace's goes through
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", no_space)
            write(path, data)

    write = atomic_write_bytes
    monkeypatch.setattr(tables, "atomic_write_bytes", full)
    res = CliRunner().invoke(
        main, [str(plan), "--steps", "2", "-q", "--no-val", "--metrics", str(metrics), "--trace", str(trace)]
    )
    assert res.exit_code == 2, res.output
    assert _error(res) == f"pdrun: error: {metrics}: cannot write: No space left on device"
    summary = json.loads(res.stdout)
    assert summary["steps"] == 2 and summary["final_loss"] is not None
    assert summary["artifacts"]["metrics"] is None and summary["artifacts"]["trace"] == str(trace)
    assert json.loads(trace.read_text())["traceEvents"] and not metrics.exists()
