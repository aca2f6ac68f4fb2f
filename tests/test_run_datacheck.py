"""Data checked before any worker starts, and a bad sample during a run named by its index.

Real datasets of the wrong shape or dtype for real zoo models: ``pdrun`` refuses them in one
line naming the data spec, the samples and the layer, with exit status 2, before a worker
exists; a dataset with one sample of another shape in the middle fails at that sample's
unit on the rank that fetched it, naming the sample's index and the data spec.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pdrun.cli import main
from pdrun.data import Units
from pdrun.plans import cut_plan
from shared.plan import save_plan
from shared.resolve import resolve_dataset
from shared.spec import RunSpec

GPT_ARGS = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 98}


def _error(tmp_path: Path, spec: RunSpec, cuts: list[str], *args: str) -> tuple[int, str]:
    path = tmp_path / "plan.json"
    save_plan(cut_plan(spec, cuts, batch_size=8), path)
    res = CliRunner().invoke(main, [str(path), "-q", "--no-val", *args])
    lines = [line for line in res.stderr.splitlines() if line.startswith("pdrun: error")]
    assert len(lines) == 1, res.stderr
    return res.exit_code, lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("spec", "cuts", "says"),
    [
        # 3x32x32 images on the 1-channel MNIST CNN: conv1 refuses them (it runs on rank 0, not rank 1).
        (
            RunSpec(model="zoo:mnist_cnn", data="zoo:synthetic_images", data_args={"image_size": 32}),
            ["fc1"],
            [
                "dataset zoo:synthetic_images: batch 0 (samples ",
                "input float32 (8, 3, 32, 32)",
                "layer 'conv1'",
            ],
        ),
        # float features where GPT wants token ids: the embedding refuses the dtype.
        (
            RunSpec(model="zoo:gpt", model_args=GPT_ARGS, data="zoo:synthetic", data_args={"shape": [16]}),
            ["ln_f"],
            ["dataset zoo:synthetic: batch 0", "layer 'wte' (module wte Embedding)", "Long, Int"],
        ),
        # the right images with a target per pixel row: the loss refuses the pair.
        (
            RunSpec(
                model="zoo:mnist_cnn",
                data="zoo:synthetic",
                data_args={"shape": [1, 28, 28], "target_shape": [3]},
            ),
            ["fc1"],
            ["loss 'cross_entropy' refused the model's output float32 (8, 10) and the target int64 (8, 3)"],
        ),
    ],
)
def test_data_the_model_cannot_take_is_one_line_before_any_worker(
    tmp_path: Path, spec: RunSpec, cuts: list[str], says: list[str]
) -> None:
    code, line = _error(tmp_path, spec, cuts, "--steps", "1")
    assert code == 2, line
    assert "worker rank" not in line, line  # the launcher's check, not a worker's failure
    for part in says:
        assert part in line, line


BROKEN = """
def build():
    return Broken()


class Broken:
    def __len__(self):
        return 32

    def __getitem__(self, i):
        raise KeyError("no such row")
"""


@pytest.mark.timeout(60)
def test_a_dataset_that_cannot_be_read_is_one_line_before_any_worker(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(BROKEN)
    spec = RunSpec(
        model="zoo:resmlp", model_args={"width": 16, "depth": 1}, data=f"{tmp_path}/broken.py:build"
    )
    code, line = _error(tmp_path, spec, ["blocks_0_fc2"], "--steps", "1")
    assert code == 2 and "worker rank" not in line, line
    first = Units(resolve_dataset(spec.data or ""), 8, 0).indices(0)[0]  # the first sample it reads
    assert (
        f"dataset {spec.data}: sample {first} (unit 0): reading it raised KeyError: 'no such row'" in line
    ), line


BAD_SAMPLE = """
import torch

BAD = {bad}


def build():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    return [(x[i][:63] if i == BAD else x[i], y[i]) for i in range(64)]
"""


@pytest.mark.timeout(120)
def test_a_bad_sample_mid_run_is_named_by_index_on_the_rank_that_fetched_it(tmp_path: Path) -> None:
    spec = RunSpec(model="zoo:resmlp", model_args={"width": 16, "depth": 1}, data=f"{tmp_path}/bad.py:build")
    (tmp_path / "bad.py").write_text(BAD_SAMPLE.format(bad=-1))
    order = Units(resolve_dataset(spec.data or ""), 8, 0)
    first = set(order.indices(0).tolist())
    bad = next(i for i in range(64) if i not in first)  # not in batch 0: the launcher's check passes
    unit = next(u for u in range(8) if bad in order.indices(u).tolist())
    (tmp_path / "bad.py").write_text(BAD_SAMPLE.format(bad=bad))
    code, line = _error(tmp_path, spec, ["blocks_0_fc2"], "--steps", "8")
    assert code == 2, line
    # Rank 0 reads the inputs; rank 1 reads only the targets, which are fine.
    assert line.startswith(
        f"pdrun: error: worker rank 0 failed: DataError: dataset {spec.data}: sample {bad} "
    ), line
    assert f"(unit {unit}) is (float32 (63,), int64 ()), but sample " in line, line
    assert "of the same batch is (float32 (64,), int64 ())" in line, line
    assert "stack expects" not in line, line


RAISES_AT = """
import torch


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == {bad}:
            raise ValueError(f"sample {{i}} is corrupt")
        return torch.ones(64) * i, i % 10


def build():
    return Data()
"""


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (BAD_SAMPLE.format(bad=37), "sample 37 is (float32 (63,), int64 ()), but sample "),
        (RAISES_AT.format(bad=37), "sample 37: reading it raised ValueError: sample 37 is corrupt"),
    ],
)
def test_pdprof_names_a_bad_sample_in_one_line(tmp_path: Path, source: str, expected: str) -> None:
    # pdprof read random batches past the first one and met these as "internal error", exit 1.
    from pdprof.cli import main as pdprof_main

    (tmp_path / "d.py").write_text(source)
    data = f"{tmp_path}/d.py:build"
    args = [
        "--model",
        "zoo:resmlp",
        "--model-arg",
        "width=16",
        "--data",
        data,
        "--repeats",
        "8",
        "--warmup",
        "2",
    ]
    res = CliRunner().invoke(pdprof_main, [*args, "--batch-size", "32", "-o", str(tmp_path / "g.json")])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("pdprof: error")]
    assert len(lines) == 1 and lines[0].startswith(f"pdprof: error: dataset {data}: {expected}"), res.stderr
    # A batch larger than the dataset: pdrun would refuse it, so pdprof does, before profiling.
    res = CliRunner().invoke(pdprof_main, [*args, "--batch-size", "65"])
    assert (
        res.exit_code == 2
        and "--batch-size 65: dataset " in res.stderr
        and "64 samples, fewer than one batch" in res.stderr
    )
