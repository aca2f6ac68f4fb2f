"""Validation accuracy is per prediction: per sample for class targets, per token for sequence targets."""

from __future__ import annotations

import pytest
import torch

from pdrun.config import RunConfig
from pdrun.data import datasets
from pdrun.launch import launch
from pdrun.metrics import summary
from pdrun.plans import cut_plan
from pdrun.worker import _correct
from shared.resolve import resolve_model
from shared.spec import RunSpec
from tests.test_run_flush import pipeline_params

GPT = RunSpec(
    model="zoo:gpt",
    model_args={"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 98},
    data="zoo:pydoc_text",
    data_args={"block_size": 16},
)


def test_token_targets_score_every_token_but_the_ignored() -> None:
    logits = torch.zeros(2, 3, 5, dtype=torch.float64)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 1.0  # predicts 1, 2, 3
    logits[1, 0, 4] = logits[1, 1, 4] = logits[1, 2, 4] = 1.0  # predicts 4, 4, 4
    target = torch.tensor([[1, 0, 3], [4, -100, -100]])
    assert _correct(logits, target) == (3, 4)  # hits: (0,0), (0,2), (1,0); 4 tokens scored
    classes = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert _correct(classes, torch.tensor([1, 1, 1])) == (2, 3)


@pytest.mark.timeout(180)
def test_gpt_val_accuracy_is_the_token_accuracy_of_the_trained_model() -> None:
    # Before the fix a sequence model's hits (tokens) were divided by samples: pdrun showed 1460% on zoo:gpt.
    plan = cut_plan(GPT, [20], batch_size=16, schedule="1f1b-flush", microbatches=2)
    results = launch(plan, RunConfig(steps=3, lr=0.01, dtype="float64", record=True))
    assert results is not None
    got = summary(results, plan)["val_accuracy"]
    assert GPT.model is not None
    model = resolve_model(GPT.model, GPT.model_args).to(torch.float64)
    model.load_state_dict(pipeline_params(results), strict=False)
    model.eval()
    _, val = datasets(GPT)
    assert val is not None
    hits = tokens = 0
    with torch.no_grad():
        for i in range(len(val)):
            x, y = val[i]
            pred = model(x.unsqueeze(0)).argmax(-1)[0]
            hits += int((pred == y).sum())
            tokens += y.numel()
    assert 0.0 < got < 1.0
    assert got == pytest.approx(hits / tokens, abs=1e-12)
