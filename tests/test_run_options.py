"""pdrun's options do what they say or say why not: outputs checked before training, units per step, batch size.

Outputs: a ``--metrics``, ``--trace`` or ``--checkpoint-dir`` that cannot be written is one line
and exit 2 before any worker starts (tests run as root, which passes every permission check, so
"unwritable" is a path below a regular file, which nobody can create). Units per step:
``--microbatches`` on 1F1B is said to be unused, a flush ``--schedule`` on a 1F1B plan pipelines its units
in flight and says so. A plan whose ``batch_size`` was edited away from the profiled one is
refused by pdrun and by ``pdplan validate``. Usage errors are one line in all three tools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pdplan.cli import main as pdplan_main
from pdprof.cli import main as pdprof_main
from pdrun.cli import main as pdrun_main
from pdrun.plans import cut_plan
from shared.errors import UserError
from shared.plan import Plan, save_plan
from tests.test_run_flush import RESMLP

BIN = Path(sys.executable).parent


def _plan(tmp_path: Path, **kwargs: object) -> Path:
    path = tmp_path / "plan.json"
    save_plan(cut_plan(RESMLP, [6], batch_size=16, **kwargs), path)  # type: ignore[arg-type]
    return path


def _ran(plan: Path, *args: str) -> Result:
    """``pdrun PLAN ARGS --no-val -q`` in process, which must succeed."""
    res = CliRunner().invoke(pdrun_main, [str(plan), *args, "--no-val", "-q"])
    assert res.exit_code == 0, res.output
    return res


def _said(stderr: str, text: str) -> list[str]:
    """The lines of ``stderr`` that contain ``text``."""
    return [line for line in stderr.splitlines() if text in line]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("option", "target", "expected"),
    [
        ("--metrics", "missing/m.parquet", r"--metrics {t}: directory {d} does not exist"),
        ("--trace", "afile/t.json", r"--trace {t}: directory {d} is not a directory"),
        ("--metrics", "adir", r"Invalid value for '--metrics': File '{t}' is a directory."),  # click's
        ("--checkpoint-dir", "afile/ck", r"--checkpoint-dir {t}: cannot create the directory: "),
        ("--checkpoint-dir", "afile", r"Invalid value for '--checkpoint-dir': Directory '{t}' is a file."),
    ],
)
def test_an_output_that_cannot_be_written_fails_before_training(
    tmp_path: Path, option: str, target: str, expected: str
) -> None:
    plan = _plan(tmp_path)
    (tmp_path / "afile").write_text("a regular file: nothing can be created below it, not even by root\n")
    (tmp_path / "adir").mkdir()
    path = tmp_path / target
    t0 = time.monotonic()
    # 3,000 steps: found after the run it would be minutes; here it must come before any worker starts.
    res = CliRunner().invoke(pdrun_main, [str(plan), "--steps", "3000", option, str(path), "-q"])
    seconds = time.monotonic() - t0
    assert res.exit_code == 2, res.output
    [line] = _error_lines(res.stderr)
    assert line.startswith("pdrun: error: " + expected.format(t=path, d=path.parent)), line
    assert seconds < 5, f"{seconds:.1f} s: the outputs were not checked first"
    assert res.stdout == ""


def test_a_missing_checkpoint_dir_is_created_up_front(tmp_path: Path) -> None:
    from pdrun.outputs import check_outputs

    check_outputs(str(tmp_path / "m.parquet"), None, str(tmp_path / "a" / "b" / "ck"))
    assert (tmp_path / "a" / "b" / "ck").is_dir()
    assert [p.name for p in (tmp_path / "a" / "b" / "ck").iterdir()] == []  # the probe is gone
    assert not (tmp_path / "m.parquet").exists()
    (tmp_path / "afile").write_text("x\n")
    with pytest.raises(UserError, match=r"--checkpoint-dir .*afile: exists and is not a directory$"):
        check_outputs(None, None, str(tmp_path / "afile"))  # what click does not see: a library call


@pytest.mark.timeout(60)
def test_an_unwritable_checkpoint_dir_is_one_line_from_the_installed_pdrun(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    (tmp_path / "afile").write_text("x\n")
    done = subprocess.run(
        [
            str(BIN / "pdrun"),
            str(plan),
            "--steps",
            "3000",
            "--checkpoint-dir",
            str(tmp_path / "afile" / "ck"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"pdrun: error: --checkpoint-dir {tmp_path / 'afile' / 'ck'}: cannot create the directory: Not a directory"
    ]


@pytest.mark.timeout(120)
def test_microbatches_on_1f1b_is_not_used_and_said(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    left = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    res = _ran(plan, "--steps", "4", "--microbatches", "4")
    # torch elastic's log folders go in one the run removes: each run left a /tmp/torchelastic_* behind.
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) - left == set()
    assert json.loads(res.stdout)["units"] == 4  # a step per unit, as 1f1b says
    assert _said(res.stderr, "--microbatches") == [
        "pdrun: --microbatches 4 is not used: 1f1b takes an optimizer step after every unit "
        "(--schedule 1f1b-flush or gpipe accumulates several units per step)"
    ]


@pytest.mark.timeout(120)
def test_1f1b_on_a_flush_plan_says_that_a_step_is_one_unit(tmp_path: Path) -> None:
    plan = _plan(tmp_path, schedule="1f1b-flush", microbatches=4)
    res = _ran(plan, "--schedule", "1f1b", "--steps", "4")
    assert json.loads(res.stdout)["units"] == 4  # not the plan's 4 x 4
    assert _said(res.stderr, "a step is one unit") == [
        "pdrun: --schedule 1f1b on a 1f1b-flush plan of 4 microbatches per step: 1f1b takes an optimizer step "
        "after every unit, so a step is one unit here (--steps counts units)"
    ]


@pytest.mark.timeout(120)
def test_vertical_sync_off_1f1b_is_said_and_no_note_comes_before_a_refusal(tmp_path: Path) -> None:
    plan = _plan(tmp_path, schedule="1f1b-flush", microbatches=2)
    res = _ran(plan, "--vertical-sync", "--steps", "2")
    assert "predicted_for" not in json.loads(res.stdout)  # the run is still the plan's own
    assert _said(res.stderr, "vertical") == [
        "pdrun: --vertical-sync is not used: it applies to 1f1b's stashed weight versions, and 1f1b-flush keeps "
        "one version on every stage"
    ]
    # A chunked plan run with --schedule 1f1b is refused; the note on how 1f1b would count its steps came
    # first, for a run that never started.
    four = cut_plan(RESMLP, [3, 6, 9], batch_size=16, schedule="1f1b-flush", microbatches=4)
    stages = [st.model_copy(update={"ranks": [r]}) for st, r in zip(four.stages, [0, 1, 0, 1], strict=True)]
    update = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "stages": stages, "world_size": 2}
    chunked = tmp_path / "chunked.json"
    save_plan(Plan.model_validate(four.model_copy(update=update).model_dump()), chunked)
    res = CliRunner().invoke(
        pdrun_main, [str(chunked), "--schedule", "1f1b", "--steps", "2", "--no-val", "-q"]
    )
    assert res.exit_code == 2
    assert _error_lines(res.stderr) == [
        f"pdrun: error: {chunked}: virtual_stages: 1f1b runs 1 model chunk per worker, the plan has 2 (4 stages "
        "as chunks of 2 workers); plan again with pdplan --schedule 1f1b, as a plan's stages are its chunks"
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("extra", "units", "note"), [([], 6, True), (["--microbatches", "3"], 9, False)])
def test_a_flush_schedule_on_a_1f1b_plan_fills_the_pipeline_and_says_so(
    tmp_path: Path, extra: list[str], units: int, note: bool
) -> None:
    # A 2-stage plan with its first stage replicated: one unit per stage, rounded up to a multiple of 2
    # replicas, is 2. With one unit per step (the 1f1b plan's), the two replicas would take turns.
    plan = _plan(tmp_path, replicas=[2, 1])
    res = CliRunner().invoke(
        pdrun_main, [str(plan), "--schedule", "1f1b-flush", "--steps", "3", "--no-val", "-q", *extra]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["steps"] == 3 and summary["units"] == units
    said = [line for line in res.stderr.splitlines() if "microbatches per step" in line]
    assert said == (
        [
            "pdrun: --schedule 1f1b-flush on a 1f1b plan: 2 microbatches per step (one per stage at least, "
            "a multiple of each stage's replicas, to fill its pipeline); --microbatches M to choose"
        ]
        if note
        else []
    )


def _edited(tmp_path: Path, data: dict[str, object], batch_size: int) -> Path:
    data = {**data, "batch_size": batch_size}
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_a_plan_whose_batch_size_was_edited_is_refused_by_pdrun(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    data = json.loads(plan.read_text())
    data["input_shape"] = [16, 64]  # as pdprof records it: the profiled batch of the digits' 64 features
    ok = _edited(tmp_path, data, 16)
    res = CliRunner().invoke(pdrun_main, [str(ok), "--steps", "2", "--no-val", "-q"])
    assert res.exit_code == 0, res.output
    bad = _edited(tmp_path, data, 32)
    res = CliRunner().invoke(pdrun_main, [str(bad), "--steps", "2", "--no-val", "-q"])
    assert res.exit_code == 2
    [line] = _error_lines(res.stderr)
    assert line.startswith(
        f"pdrun: error: {bad}: batch_size: 32, but the graph was profiled at 16 samples per unit "
        "(input_shape [16, 64])"
    ), line


def test_pdplan_validate_refuses_a_plan_whose_batch_size_was_edited(
    tmp_path: Path, profiles_dir: Path
) -> None:
    graph = tmp_path / "alexnet.json"
    res = CliRunner().invoke(
        pdprof_main, ["import-pipedream", str(profiles_dir / "alexnet.txt"), "-o", str(graph)]
    )
    assert res.exit_code == 0, res.output
    plan = tmp_path / "plan.json"
    res = CliRunner().invoke(
        pdplan_main, [str(graph), "--workers", "4", "--bandwidth", "1e9", "-o", str(plan)]
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(pdplan_main, ["validate", str(plan), "--graph", str(graph)])
    assert res.exit_code == 0, res.output
    data = json.loads(plan.read_text())
    size = data["batch_size"]
    bad = _edited(tmp_path, data, size * 2)
    res = CliRunner().invoke(pdplan_main, ["validate", str(bad), "--graph", str(graph)])
    assert res.exit_code == 2
    [line] = _error_lines(res.stderr)
    assert line.startswith(
        f"pdplan: error: {bad}: batch_size: {size * 2}, but the graph was profiled at {size} samples per unit"
    ), line


def test_batch_of_shape_reads_every_input_tensor() -> None:
    from shared.plan import batch_of_shape

    assert batch_of_shape([16, 1, 28, 28]) == 16
    assert batch_of_shape([[8, 12], [8, 12, 4]]) == 8  # tuple inputs
    assert batch_of_shape({"input_ids": [4, 32], "mask": [4, 32]}) == 4
    assert batch_of_shape(None) is None and batch_of_shape([]) is None
    assert batch_of_shape([[8, 3], [4, 3]]) is None  # disagreeing tensors say nothing


@pytest.mark.parametrize(
    ("tool", "argv"),
    [
        ("pdrun", ["plan.json", "--steps", "-1"]),
        ("pdplan", ["graph.json", "--workers", "4", "--bandwidth", "1e9", "--memory", "x"]),
        ("pdprof", ["import-pipedream", "--bogus"]),
    ],
)
def test_a_usage_error_is_one_line(tool: str, argv: list[str]) -> None:
    done = subprocess.run(
        [str(BIN / tool), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith(f"{tool}: error: ") and "Usage:" not in done.stderr
    assert line.endswith("--help)"), line  # where the usage is


NO_SPLIT = """
import torch


def data():
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x[:, :10].argmax(1))
"""


def test_validation_that_cannot_run_is_said_not_skipped_quietly(tmp_path: Path) -> None:
    """Validation is on by default, on the dataset's split='val': a dataset callable without split has none."""
    (tmp_path / "nosplit.py").write_text(NO_SPLIT)
    spec = RESMLP.model_copy(update={"data": f"{tmp_path / 'nosplit.py'}:data", "data_args": {}})
    plan = tmp_path / "plan.json"
    save_plan(cut_plan(spec, [], batch_size=16), plan)
    res = CliRunner().invoke(pdrun_main, [str(plan), "--steps", "2", "-q"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)  # the keys are there, null: a script reading them does not fail
    assert (summary["validation"], summary["val_loss"], summary["val_accuracy"]) == ([], None, None)
    assert "pdrun: note: no validation:" in res.stderr and "takes no split argument" in res.stderr
    quiet = CliRunner().invoke(pdrun_main, [str(plan), "--steps", "2", "-q", "--no-val"])
    assert quiet.exit_code == 0 and "no validation" not in quiet.stderr


def test_the_summary_gives_the_steady_rate_and_the_steps_it_leaves_out(tmp_path: Path) -> None:
    """Issue 17: a short run's first steps (its start's costs) must not hide its rate."""
    import pandas as pd

    from bench.measure import pdrun_timing

    plan, metrics = _plan(tmp_path), tmp_path / "m.parquet"
    res = CliRunner().invoke(pdrun_main, [str(plan), "--steps", "20", "--no-val", "--metrics", str(metrics)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["steady_from_step"] == 2  # a tenth of 20 steps, numbered as the metrics number them
    assert sorted(pd.read_parquet(metrics)["step"].unique())[2] == 2
    t = pdrun_timing(metrics, 2)
    assert summary["steady_samples_per_s"] == pytest.approx(t.samples / t.seconds, rel=1e-9)
    assert summary["steady_samples_per_s"] > summary["samples_per_s"]  # the first steps were the slow ones
    assert f"({summary['steady_samples_per_s']:.0f} after the first 2)" in res.stderr
    one = CliRunner().invoke(pdrun_main, [str(plan), "--steps", "1", "--no-val"])
    single = json.loads(one.stdout)
    assert (
        single["steady_from_step"] == 0 and "after the first" not in one.stderr and "1 step of" in one.stderr
    )
    assert single["steady_samples_per_s"] == pytest.approx(single["samples_per_s"], rel=1e-9)


def test_a_plan_whose_cluster_is_not_its_ranks_runs_and_says_so(tmp_path: Path) -> None:
    # A hand-edited plan: its cluster still says 4 workers, its stages 2 ranks. pdrun runs the ranks
    # (pdplan validate refuses the plan) and says before training that the predictions are the cluster's.
    from shared.plan import Cluster, Level

    plan = cut_plan(RESMLP, [5], batch_size=8).model_copy(
        update={"cluster": Cluster(levels=[Level(workers=2, bandwidth=1e9), Level(workers=2, bandwidth=1e8)])}
    )
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    res = CliRunner().invoke(pdrun_main, [str(path), "--steps", "2", "--no-val", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["steps"] == 2
    assert res.stderr.startswith("pdrun: note: "), res.stderr
    assert (
        "plan.json: cluster.levels: 2 x 2 = 4 workers but world_size is 2; this run has 2 ranks" in res.stderr
    ), res.stderr
    save_plan(plan.model_copy(update={"cluster": None}), path)
    quiet = CliRunner().invoke(pdrun_main, [str(path), "--steps", "1", "--no-val", "-q"])
    assert quiet.exit_code == 0 and "cluster.levels" not in quiet.stderr


@pytest.mark.timeout(120)
def test_a_schedule_that_does_not_fit_the_plans_chunks_is_one_line_before_any_worker(tmp_path: Path) -> None:
    """A hand-edited schedule and an overriding --schedule are checked against the plan's chunk placement:
    zb-v's V puts chunk 1 of worker 0 at stages[3], interleaved-1f1b at stages[2], and a zb-v plan run as
    interleaved-1f1b deadlocked until the peer timeout (120 s)."""
    four = cut_plan(RESMLP, [3, 6, 9], batch_size=16, schedule="1f1b-flush", microbatches=4)
    stages = [st.model_copy(update={"ranks": [r]}) for st, r in zip(four.stages, [0, 1, 1, 0], strict=True)]
    zb_v = four.model_copy(
        update={"schedule": "zb-v", "virtual_stages": 2, "stages": stages, "world_size": 2}
    )
    path = tmp_path / "zb-v.json"
    save_plan(Plan.model_validate(zb_v.model_dump()), path)
    res = CliRunner().invoke(pdrun_main, [str(path), "--schedule", "interleaved-1f1b", "--steps", "1", "-q"])
    assert res.exit_code == 2
    assert _error_lines(res.stderr) == [
        f"pdrun: error: {path} (run as interleaved-1f1b): stages[2].ranks: rank 1 of stage 2 (layers "
        "'blocks_0_fc2' .. 'blocks_1_fc1' (3)) also runs stage 1; a rank runs the chunks of one worker stage, chunk c of worker w at "
        "stages[c * S + w] (stage 2 is chunk 1 of worker stage 0)"
    ]
    flat = _plan(tmp_path, schedule="1f1b-flush", microbatches=4)
    data = json.loads(flat.read_text())
    edited = _edited(tmp_path, {**data, "schedule": "zb-v"}, data["batch_size"])
    for argv in ([str(edited)], ["schedule", str(edited)]):
        res = CliRunner().invoke(pdrun_main, [*argv, "--steps", "1", "-q"] if argv[0] != "schedule" else argv)
        assert res.exit_code == 2
        assert _error_lines(res.stderr) == [
            f"pdrun: error: {edited}: virtual_stages: zb-v runs 2 model chunks per worker, the plan has 1 "
            "(2 stages as chunks of 2 workers); plan again with pdplan --schedule zb-v --virtual-stages 2, as a "
            "plan's stages are its chunks"
        ]


def test_a_refused_microbatch_count_names_the_plan_file_or_the_option(tmp_path: Path) -> None:
    # A 2bw plan hand-edited to 1 microbatch, and a good one run with --microbatches 1: the same refusal,
    # each naming where the 1 came from (before, neither named a file or an option).
    good = _plan(tmp_path, schedule="2bw", microbatches=2)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**json.loads(good.read_text()), "microbatches": 1}))
    why = "2bw accumulates a step over at least as many microbatches as a stage holds units in flight, 2 here"
    for argv, where in (
        ([str(edited)], f"{edited}: microbatches: "),
        ([str(good), "--microbatches", "1"], "--microbatches 1: "),
    ):
        res = CliRunner().invoke(pdrun_main, [*argv, "--steps", "2", "--no-val", "-q"])
        assert res.exit_code == 2, res.output
        assert _error_lines(res.stderr) == [_error_lines(res.stderr)[0]]
        assert res.stderr.startswith(f"pdrun: error: {where}{why}"), res.stderr
