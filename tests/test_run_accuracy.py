"""Validation accuracy of a causal LM (``--loss causal_lm``): next-token hits over the tokens its loss scores.

Its labels are its inputs, and the loss scores the logits at t against the label at t + 1 with
-100 left out; the accuracy counts the same pairs. Scored position by position instead, GPT-2's
accuracy measured how often it predicts the token it was given. (Per-token accuracy of targets
already shifted, zoo:gpt's, is tests/test_run_val_accuracy.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.metrics import summary
from pdrun.worker import _correct
from shared.resolve import resolve_dataset
from tests.pipeline_helpers import profile_and_plan


def test_next_token_hits_by_hand() -> None:
    logits = torch.nn.functional.one_hot(torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]]), 4).to(torch.float64)
    labels = torch.tensor([[9, 0, 1, 2], [9, 3, 0, -100]])
    # Row 0: [0, 1, 2] against [0, 1, 2]: 3 of 3. Row 1: [3, 3, 1] against [3, 0, -100]: 1 of 2.
    assert _correct(logits, labels, next_token=True) == (4, 5)
    # Position by position (logits at t against the label at t): 1 of 7, not what the loss scores.
    assert _correct(logits, labels) == (1, 7)


@pytest.mark.timeout(300)
def test_gpt2_accuracy_is_per_next_token_without_padding(tmp_path: Path) -> None:
    # GPT-2 with next-token labels and -100 at the padding: the 522%.
    pytest.importorskip("transformers")  # the dev install has it (setup.cfg: dev, hf)
    plan = profile_and_plan(
        tmp_path, "zoo:hf_gpt2", "zoo:pydoc_tokens", loss="causal_lm", args=("n_layer=2",)
    )
    results = launch(plan, RunConfig(steps=2, seed=0, lr=1e-3, optimizer="adam", timeout_s=240.0))
    assert results is not None
    (entry,) = next(r for r in results if r.stage == len(plan.stages) - 1).validation
    assert plan.spec.data is not None
    val = resolve_dataset(plan.spec.data, {**plan.spec.data_args, "split": "val"})
    by_hand = sum(int(val[i][1][1:].ne(-100).sum()) for i in range(len(val)))
    assert entry["scored"] == by_hand > entry["count"]
    got = summary(results, plan)["val_accuracy"]
    assert 0 <= got <= 1 and got == entry["correct"] / by_hand
