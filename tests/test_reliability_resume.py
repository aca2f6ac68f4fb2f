"""Resume after a crash: for the flushing schedules the resumed run's per-step losses equal an
uninterrupted run's bit for bit; for 1f1b the run resumes and trains.

The model has dropout, so equality also needs each rank's random generator restored; the
optimizers carry state (momentum, Adam's moments), so it needs the optimizer state too. The
crash is real: pdrun runs as a subprocess and ``PIPEDREAM_FAULT`` kills a worker with SIGKILL
mid-step, or after it wrote its checkpoint files but before the checkpoint was complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdrun.cli import main
from pdrun.plans import cut_plan
from shared.plan import save_plan
from shared.spec import RunSpec
from shared.tables import RUN_METRICS, load_table
from tests.test_reliability_failures import error_lines, marked_processes, run_pdrun

DROPOUT_MODEL = """
from torch import nn


def build():
    return nn.Sequential(
        nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 10),
    )
"""

M = 2  # microbatches per step


def make_plan(tmp_path: Path, schedule: str, replicas: list[int] | None = None) -> Path:
    (tmp_path / "dropnet.py").write_text(DROPOUT_MODEL)
    spec = RunSpec(model=f"{tmp_path}/dropnet.py:build", data="zoo:digits")
    path = tmp_path / f"{schedule}.json"
    microbatches = 1 if schedule == "1f1b" else M
    plan = cut_plan(spec, [3], batch_size=8, schedule=schedule, microbatches=microbatches, replicas=replicas)  # type: ignore[arg-type]
    save_plan(plan, path)
    return path


def train(plan: Path, *args: str) -> dict[str, object]:
    """One in-process pdrun; its JSON summary."""
    res = CliRunner().invoke(main, [str(plan), "-q", "--no-val", *args])
    assert res.exit_code == 0, res.output
    summary: dict[str, object] = json.loads(res.stdout)
    return summary


def losses(metrics: Path) -> dict[int, float]:
    """Step -> loss of the last stage (the only one that has a loss)."""
    df, _ = load_table(metrics, RUN_METRICS)
    last = df[df["stage"] == df["stage"].max()]
    return {int(s): float(v) for s, v in zip(last["step"], last["loss"], strict=True)}


def complete(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if (p / "manifest.json").is_file())


@pytest.mark.timeout(150)
def test_flush_resume_after_a_kill_mid_step_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    plan, ck = make_plan(tmp_path, "1f1b-flush"), tmp_path / "ck"
    opts = ["--dtype", "float64", "--momentum", "0.9", "--lr", "0.05"]
    train(plan, "--steps", "10", "--metrics", str(tmp_path / "full.parquet"), *opts)
    full = losses(tmp_path / "full.parquet")
    assert sorted(full) == list(range(10))

    # Checkpoints after steps 3 and 6; rank 1 is killed in the forward of step 7's second unit.
    args = [
        str(plan),
        "--steps",
        "10",
        "-q",
        "--no-val",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "3",
    ]
    done, seconds, mark = run_pdrun([*args, *opts], {"PIPEDREAM_FAULT": f"kill:1:{6 * M + 1}"})
    assert done.returncode == 1 and error_lines(done.stderr) == [
        "pdrun: error: worker rank 1 died (signal SIGKILL)"
    ]
    assert seconds < 30 and marked_processes(mark) == []
    assert complete(ck) == ["step-000003", "step-000006"]

    summary = train(
        plan,
        "--steps",
        "4",
        "--resume",
        "--checkpoint-dir",
        str(ck),
        "--metrics",
        str(tmp_path / "resumed.parquet"),
        *opts,
    )
    # The summary counts what this invocation ran (4 steps), after the checkpoint's 6; the metrics' steps continue.
    assert summary["resumed_from_step"] == 6 and summary["steps"] == 4 and summary["units"] == 4 * M
    resumed = losses(tmp_path / "resumed.parquet")
    assert sorted(resumed) == [6, 7, 8, 9]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bit for bit
    # The resumed run checkpointed at its end, and only the last two complete checkpoints are kept.
    assert complete(ck) == ["step-000006", "step-000010"]


@pytest.mark.timeout(150)
def test_gpipe_killed_while_checkpointing_resumes_from_the_previous_checkpoint_exactly(
    tmp_path: Path,
) -> None:
    plan, ck = make_plan(tmp_path, "gpipe"), tmp_path / "ck"
    opts = ["--optimizer", "adam", "--lr", "0.003"]  # float32
    train(plan, "--steps", "9", "--metrics", str(tmp_path / "full.parquet"), *opts)
    full = losses(tmp_path / "full.parquet")

    # Rank 1 dies after writing its files of step 6's checkpoint, before rank 0 writes the manifest.
    args = [
        str(plan),
        "--steps",
        "9",
        "-q",
        "--no-val",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "3",
    ]
    done, _, mark = run_pdrun([*args, *opts], {"PIPEDREAM_FAULT": "checkpoint-kill:1:6"})
    assert done.returncode == 1 and "worker rank 1 died (signal SIGKILL)" in done.stderr
    assert marked_processes(mark) == []
    assert complete(ck) == ["step-000003"]
    assert (ck / "step-000006" / "stage1.pt").is_file()  # written, but the checkpoint is not complete

    res = CliRunner().invoke(
        main,
        [
            str(plan),
            "-q",
            "--no-val",
            "--steps",
            "6",
            "--resume",
            "--checkpoint-dir",
            str(ck),
            "--metrics",
            str(tmp_path / "resumed.parquet"),
            *opts,
        ],
    )
    assert res.exit_code == 0, res.output
    assert "skipping incomplete checkpoint step-000006: no manifest (interrupted while writing)" in res.stderr
    assert json.loads(res.stdout)["resumed_from_step"] == 3
    resumed = losses(tmp_path / "resumed.parquet")
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bit for bit


@pytest.mark.timeout(150)
def test_1f1b_drains_at_each_checkpoint_and_resumes_like_the_run_that_was_not_stopped(tmp_path: Path) -> None:
    # 1f1b drains its pipeline at a checkpoint, so stashed weight versions never need saving; a run
    # that resumes then equals one that ran through with the same --checkpoint-every. Stage 0 (with
    # dropout) has two replicas, each stepping once per two units and drawing its own dropout masks.
    plan = make_plan(tmp_path, "1f1b", replicas=[2, 1])
    opts = ["--checkpoint-every", "2", "--lr", "0.05"]
    train(
        plan,
        "--steps",
        "8",
        "--checkpoint-dir",
        str(tmp_path / "a"),
        "--metrics",
        str(tmp_path / "full.parquet"),
        *opts,
    )
    full = losses(tmp_path / "full.parquet")
    assert sum(full[s] for s in (6, 7)) < sum(full[s] for s in (0, 1))  # it trains

    ck = tmp_path / "b"
    train(plan, "--steps", "4", "--checkpoint-dir", str(ck), *opts)
    summary = train(
        plan,
        "--steps",
        "4",
        "--resume",
        "--checkpoint-dir",
        str(ck),
        "--metrics",
        str(tmp_path / "resumed.parquet"),
        *opts,
    )
    assert summary["resumed_from_step"] == 4 and summary["checkpoint_steps"] == [6, 8]
    resumed = losses(tmp_path / "resumed.parquet")
    assert sorted(resumed) == [4, 5, 6, 7]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)


@pytest.mark.timeout(120)
def test_a_resumed_run_counts_only_the_steps_and_units_it_trained(tmp_path: Path) -> None:
    # Resumed at step 6 for 2 more steps: the summary and its one line say 2 steps (and the units and samples
    # of those), resumed from step 6; before the fix they said 8 steps, the checkpoint's counted in. Its
    # samples/s is of those 2 steps too (before an earlier fix, a 2bw run resumed at step 8 of 10 claimed
    # 3257 samples/s against ~900).
    plan, ck = make_plan(tmp_path, "1f1b-flush"), tmp_path / "ck"
    train(plan, "--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "3")
    metrics = tmp_path / "resumed.parquet"
    resume = [str(plan), "--no-val", "--steps", "2", "--resume", "--checkpoint-dir", str(ck)]
    res = CliRunner().invoke(main, [*resume, "--metrics", str(metrics)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["resumed_from_step"] == 6 and summary["steps"] == 2
    assert summary["units"] == 2 * M and summary["samples"] == 2 * M * 8
    [line] = [ln for ln in res.stderr.splitlines() if " steps of " in ln]  # type: ignore[attr-defined]
    assert line.startswith("pdrun: 2 steps of 1f1b-flush on 2 workers (resumed from step 6), final loss "), (
        line
    )
    assert sorted(losses(metrics)) == [6, 7]  # the metrics' steps are the training's: they continue from 6
    # A fresh run into the same directory is refused: its checkpoints beside these made --resume pick the
    # higher step of the two runs, silently (a new user's new run of 200 steps resumed the old one's 600).
    res = CliRunner().invoke(main, [str(plan), "--no-val", "--steps", "2", "--checkpoint-dir", str(ck)])
    assert res.exit_code == 2, res.output
    assert error_lines(res.stderr) == [
        f"pdrun: error: --checkpoint-dir {ck}: holds an earlier run's checkpoints (step-000006, "
        "step-000008); --resume continues it, or give an empty directory"
    ]
    # Resumed with another optimizer: its state cannot be loaded (a worker failed with KeyError 'momentum'
    # once, after the launch); one line naming both, before any worker starts.
    res = CliRunner().invoke(main, [*resume, "--optimizer", "adam"])
    assert res.exit_code == 2, res.output
    assert error_lines(res.stderr) == [
        f"pdrun: error: --optimizer adam: the checkpoint {ck}/step-000008 holds sgd's state; resume with --optimizer sgd"
    ]
    rate, wall = summary["samples_per_s"], summary["train_s"]
    assert isinstance(rate, float) and isinstance(wall, float)
    assert rate * wall == pytest.approx(2 * M * 8, rel=1e-9)  # 2 steps of M units of batch 8


@pytest.mark.timeout(120)
def test_a_resumed_run_labels_its_validation_by_the_training_epoch(tmp_path: Path) -> None:
    # One epoch, then one more resumed: the second pass is epoch 1, as in a run of two epochs (it said 0
    # again, the resumed run's first segment). A --steps run's pass names the data's epoch it reached.
    plan, ck = make_plan(tmp_path, "1f1b-flush"), tmp_path / "ck"

    def validated(*args: str) -> list[int]:
        res = CliRunner().invoke(main, [str(plan), "-q", "--checkpoint-dir", str(ck), *args])
        assert res.exit_code == 0, res.output
        return [entry["epoch"] for entry in json.loads(res.stdout)["validation"]]

    assert validated("--epochs", "1") == [0]
    assert validated("--epochs", "2", "--resume") == [1, 2]
    per_epoch = 1438 // 8 // M  # zoo:digits' 1,438 training samples: 89 steps of M units of 8
    assert validated("--steps", str(per_epoch), "--resume") == [3]
    # Resumed mid-epoch, --epochs 1 finishes that epoch: it ran an epoch's length from the checkpoint and
    # validated mid-epoch 5, labelled 5, with nothing at the end of epoch 4.
    res = CliRunner().invoke(
        main, [str(plan), "-q", "--checkpoint-dir", str(ck), "--steps", "30", "--resume"]
    )
    assert res.exit_code == 0, res.output
    finish = CliRunner().invoke(
        main, [str(plan), "-q", "--checkpoint-dir", str(ck), "--epochs", "1", "--resume"]
    )
    assert finish.exit_code == 0, finish.output
    summary = json.loads(finish.stdout)
    assert summary["steps"] == per_epoch - 30
    assert [(e["epoch"], e["step"]) for e in summary["validation"]] == [(4, 5 * per_epoch)]  # steps done
