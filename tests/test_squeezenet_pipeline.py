"""A SqueezeNet-style CNN as a user brings it: ``pdprof | pdplan`` (2 stages) ``| pdrun``, nothing else named.

Every conv of zoo:squeezenet is followed by ``ReLU(inplace=True)``. Planned from its measured
profile, the cut falls wherever the costs put it; pinned by the profile (all the time on one Fire
module's squeeze conv and on its ReLU), it falls between the two, so stage 1 modifies in place the
value it received (the issue's ``a view of a leaf Variable ... in-place operation``). Either way
1f1b-flush ends with the parameters of one worker running the same plan (float64, 1e-6) and
asynchronous 1F1B lowers the loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.pipeline_helpers import assert_1f1b_loss_falls, assert_pipeline_equals_one_worker, profile_and_plan

MODEL_ARGS = ("width=0.25", "num_classes=10", "image_size=32", "dropout=0.0")
# 3x32x32 images, 10 random classes; 8 samples, one microbatch, so every step sees them all and the
# loss falls step by step as they are learnt by heart.
DATA_ARGS = ("image_size=32", "num_classes=10", "size=8")
SQUEEZE = "features_3_squeeze"


def _pin_after_squeeze(node: dict[str, Any]) -> None:
    """All the cost on the squeeze conv and its in-place ReLU: the only balanced cut parts them."""
    cost = 1.0 if node["id"] in (SQUEEZE, f"{SQUEEZE}_activation") else 0.0
    node["forward_ms"], node["backward_ms"] = cost, cost


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pinned", [False, True], ids=["measured", "cut-before-inplace-relu"])
def test_squeezenet_pipelines_as_one_worker_trains(tmp_path: Path, pinned: bool) -> None:
    plan = profile_and_plan(
        tmp_path,
        "zoo:squeezenet",
        "zoo:synthetic_images",
        args=MODEL_ARGS,
        data_args=DATA_ARGS,
        retime=_pin_after_squeeze if pinned else None,
    )
    if pinned:
        assert plan.stages[0].layers[-1] == SQUEEZE, plan.stages[0].layers[-3:]
        assert plan.stages[1].layers[0] == f"{SQUEEZE}_activation", plan.stages[1].layers[:3]
    assert_pipeline_equals_one_worker(plan)
    assert_1f1b_loss_falls(plan, steps=24)
