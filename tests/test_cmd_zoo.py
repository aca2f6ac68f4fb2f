"""``pdprof zoo``: the listing a user reads (stderr) and a script parses (stdout, --json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pdprof.cli import main

PDPROF = Path(sys.executable).parent / "pdprof"

TORCHVISION_COUNTS = {
    "vgg16": 138_357_544,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "mobilenet_v2": 3_504_872,
    "alexnet": 61_100_840,
    "inception_v3": 27_161_264,
}


def test_zoo_json_reports_the_papers_models_with_exact_parameter_counts() -> None:
    proc = subprocess.run(
        [str(PDPROF), "zoo", "--json"], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)  # stdout is the JSON alone
    assert listing["format"] == "pdprof.zoo/1"
    models = {m["name"]: m for m in listing["models"]}
    for name, count in TORCHVISION_COUNTS.items():
        assert models[name]["parameters"] == count
        assert models[name]["input"].startswith("float32 (N, 3,")
    assert {"s2vt", "gnmt", "gpt", "resmlp", "mnist_cnn"} <= set(models)
    # The small arguments really are small, and the GPT default is GPT-2 small without tied embeddings.
    assert all(m["small_parameters"] < m["parameters"] for m in models.values())
    assert models["gpt"]["arguments"]["n_layer"] == 12 and models["gpt"]["parameters"] > 124_000_000
    datasets = {d["name"]: d for d in listing["datasets"]}
    for m in models.values():
        assert m["dataset"] in datasets
    assert datasets["mnist5k"]["samples"] == {"train": 4000, "val": 1000}
    assert datasets["mnist5k"]["input"] == {"shape": [1, 28, 28], "dtype": "float32"}
    assert datasets["cmudict"]["input"] == [
        {"shape": [16], "dtype": "int64"},
        {"shape": [17], "dtype": "int64"},
    ]
    assert datasets["pydoc_text"]["target"] == {"shape": [64], "dtype": "int64"}


def test_zoo_table_goes_to_stderr_and_leaves_stdout_empty() -> None:
    result = CliRunner().invoke(main, ["zoo"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    for text in ("vgg16", "138,357,544", "inception_v3", "27,161,264", "cmudict", "video_captions"):
        assert text in result.stderr
    # A dict sample's fields, each named (the keyword datasets of the Hugging Face models): not "?".
    assert "input_ids int64 (32,)" in result.stderr.replace("\n", " ")
