"""torch.nn containers open into their layers: TransformerEncoder/Decoder, Sequential, ModuleList.

torch.nn modules are otherwise leaves of the trace. A container opens by default, its layers
(``TransformerEncoderLayer``: one leaf each, its fast path untraced) become layers of the graph,
and ``--leaf-module`` closes it again. The encoder classifier of the zoo then pipelines as the
Hugging Face models do: 1f1b-flush equal to one worker, 1F1B with a falling loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdprof.inputs import model_call, prepare
from shared.resolve import resolve_dataset, resolve_model
from shared.spec import RunSpec, TraceOptions
from shared.tracer import trace
from tests.pipeline_helpers import assert_1f1b_loss_falls, assert_pipeline_equals_one_worker, profile_and_plan


def _encoder_classifier() -> tuple[nn.Module, RunSpec, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = resolve_model("zoo:transformer_encoder", {"num_layers": 3, "d_model": 32})
    run = RunSpec(model="zoo:transformer_encoder", data="zoo:pydoc_lines")
    spec, data = prepare(run, model, resolve_dataset("zoo:pydoc_lines"), 4)
    samples = [data[i][0] for i in range(4)]
    inputs = tuple(torch.stack([s[k] for s in samples]) for k in range(2))
    assert (inputs[1] == 0).any()  # padding: the key padding mask matters
    return model, spec, inputs


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_transformer_encoder_opens_into_its_layers(mode: str) -> None:
    model, spec, inputs = _encoder_classifier()
    model.train(mode == "train")
    traced = trace(model, spec.trace)
    modules = [layer.target for layer in traced.layers if layer.op == "call_module"]
    assert modules == [
        "embed",
        "pos",
        "encoder.layers.0",
        "encoder.layers.1",
        "encoder.layers.2",
        "encoder.norm",
        "head",
    ]
    with torch.no_grad():
        want = model_call(model, spec)(*inputs)
        got = traced.module.train(mode == "train")(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_leaf_module_closes_a_container_again() -> None:
    model, spec, inputs = _encoder_classifier()
    options = spec.trace.model_copy(update={"leaf_modules": ["TransformerEncoder"]})
    traced = trace(model, options)
    modules = [layer.target for layer in traced.layers if layer.op == "call_module"]
    assert modules == ["embed", "pos", "encoder", "head"]
    with torch.no_grad():
        torch.testing.assert_close(traced.module(*inputs), model_call(model, spec)(*inputs))


class Seq2Seq(nn.Module):
    """nn.TransformerDecoder over a memory from a Sequential, with a ModuleList of heads."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 4)])

    def forward(self, tgt: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        memory = self.stem(src)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        h = self.decoder(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
        return sum(head(h) for head in self.heads)  # type: ignore[return-value]


def test_decoder_sequential_and_module_list_open() -> None:
    torch.manual_seed(0)
    model = Seq2Seq()
    traced = trace(model, TraceOptions())
    modules = [layer.target for layer in traced.layers if layer.op == "call_module"]
    assert modules == [
        "stem.0",
        "stem.1",
        "stem.2",
        "decoder.layers.0",
        "decoder.layers.1",
        "heads.0",
        "heads.1",
    ]
    tgt, src = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    torch.testing.assert_close(traced.module(tgt, src), model(tgt, src), rtol=1e-6, atol=1e-6)
    closed = trace(model, TraceOptions(leaf_modules=["TransformerDecoder"]))
    assert "decoder" in [layer.target for layer in closed.layers]


@pytest.mark.timeout(600)
def test_encoder_classifier_pipelines_as_one_worker_trains(tmp_path: Path) -> None:
    plan = profile_and_plan(tmp_path, "zoo:transformer_encoder", "zoo:pydoc_lines")
    assert plan.spec.inputs == ["input_ids", "attention_mask"] and plan.spec.trace.frontend == "fx"
    per_stage = [{n for n in stage.layers if n.startswith("encoder_layers_")} for stage in plan.stages]
    assert all(per_stage) and sum(len(s) for s in per_stage) == 4, per_stage
    assert_pipeline_equals_one_worker(plan)
    assert_1f1b_loss_falls(plan)
