"""Hugging Face transformers as they come: traced by torch.export, fed keyword inputs, pipelined.

GPT-2, a Llama-style decoder and BERT, built from small configs with random weights, each go
through ``pdprof | pdplan`` (2 stages) and pdrun with nothing but the model, the data and the
loss named: 1f1b-flush ends with the parameters of one worker running the same plan (float64,
1e-6) and asynchronous 1F1B lowers the loss. GPT-2 keeps its tied embedding (one parameter on both
stages, its gradient summed by pdrun); the Llama case is untied, so both kinds are covered.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from pdplan.cli import main as pdplan_main
from pdprof.cli import main as pdprof_main
from pdrun.partition import partition
from pdrun.stage import build_stage
from shared.errors import SpecError, TraceError
from shared.plan import load_plan
from shared.resolve import causal_lm, resolve_dataset, resolve_model
from shared.spec import ExampleInput, TraceOptions
from shared.tracer import trace
from tests.pipeline_helpers import (
    assert_1f1b_loss_falls,
    assert_pipeline_equals_one_worker,
    one_worker,
    params,
    profile_and_plan,
    run,
)

transformers = pytest.importorskip("transformers")  # the dev install has it (setup.cfg: dev, hf)

CASES = [
    # model, dataset, loss, model arguments, a layer name every block has
    ("zoo:hf_gpt2", "zoo:pydoc_tokens", "causal_lm", (), "attn_c_attn"),  # tied, as GPT-2 is
    ("zoo:hf_llama", "zoo:pydoc_tokens", "causal_lm", ("tie_word_embeddings=False",), "self_attn_q_proj"),
    ("zoo:hf_bert", "zoo:pydoc_lines", None, (), "attention_self_query"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "data", "loss", "args", "block"), CASES)
def test_hugging_face_model_pipelines_as_one_worker_trains(
    tmp_path: Path, model: str, data: str, loss: str | None, args: tuple[str, ...], block: str
) -> None:
    def on_blocks(node: dict[str, Any]) -> None:
        # The cost on the four blocks' layers alone, so the cut falls between two of them whatever the
        # one timed round (--repeats 1) measured: a loaded machine once put all four in stage 1.
        node["forward_ms"] = node["backward_ms"] = 1.0 if node["id"].endswith(block) else 0.0

    plan = profile_and_plan(tmp_path, model, data, loss=loss, args=args, retime=on_blocks)
    assert plan.spec.inputs == ["input_ids", "attention_mask"]
    assert plan.spec.trace.frontend == "export" and plan.spec.trace.output == "logits"
    # Blocks are layers of their own: the cut falls between two of the four, not around one node.
    per_stage = [{n for n in stage.layers if n.endswith(block)} for stage in plan.stages]
    assert all(per_stage) and sum(len(s) for s in per_stage) == 4, per_stage
    assert_pipeline_equals_one_worker(plan)
    assert_1f1b_loss_falls(plan)


def _example(names: list[str], batch: int = 2, length: int = 16) -> TraceOptions:
    return TraceOptions(
        frontend="export", example=[ExampleInput(name=n, shape=[batch, length], dtype="int64") for n in names]
    )


def test_tied_embedding_stays_one_parameter_in_every_stage() -> None:
    model = resolve_model("zoo:hf_gpt2", {"n_layer": 2})
    assert model.lm_head.weight is model.transformer.wte.weight
    traced = trace(model, _example(["input_ids", "attention_mask"]))
    tied = [n for n in traced.module.graph.nodes if n.op == "get_attr" and n.target == "lm_head.weight"]
    assert len(tied) == 1  # one node, read by the embedding's layer and the head's
    readers = [layer.name for layer in traced.layers if tied[0].name in layer.params]
    assert readers == ["transformer_wte", "lm_head"]
    assert traced.module.get_parameter("lm_head.weight") is model.lm_head.weight
    # Cut in two: each stage holds the user's parameter object itself (what identity detection needs).
    from shared.plan import Plan, Stage

    names = [layer.name for layer in traced.layers]
    cut = names.index("transformer_h_1_ln_1")
    plan = Plan(
        graph_hash=traced.structure_hash(),
        batch_size=2,
        world_size=2,
        stages=[Stage(layers=names[:cut], ranks=[0]), Stage(layers=names[cut:], ranks=[1])],
    )
    part = partition(traced, plan)
    stages = [build_stage(traced, part, s) for s in range(2)]
    assert all(s.module.get_parameter("lm_head.weight") is model.lm_head.weight for s in stages)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_exported_graph_computes_what_the_model_computes(mode: str) -> None:
    torch.manual_seed(0)
    model = resolve_model("zoo:hf_gpt2", {"n_layer": 2, "dropout": 0.3}).train(mode == "train")
    traced = trace(model, _example(["input_ids", "attention_mask"]))
    traced.module.train(mode == "train")
    ids = torch.randint(0, 90, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 12:] = 0
    with torch.no_grad():
        torch.manual_seed(1)
        want = model(input_ids=ids, attention_mask=mask).logits
        torch.manual_seed(1)  # the same dropout masks, drawn in the same order
        got = traced.module(ids, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_masks_built_under_vmap_leave_no_garbage_for_the_full_collection() -> None:
    """GPT-2's padding mask is indexed under vmap; export records it as torch's ModIndex, which makes a
    new class (a reference cycle) each call: a first stage's memory grew every step until Python's
    rare full collection. The traced graph indexes with aten.index instead (shared.tracer_export)."""
    model = resolve_model("zoo:hf_gpt2", {"n_layer": 1})
    traced = trace(model, _example(["input_ids", "attention_mask"]))
    ops = [
        n.target
        for m in traced.module.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    ]
    assert torch.ops.higher_order.flat_apply not in ops and torch.ops.aten.index.Tensor in ops
    ids = torch.randint(0, 90, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 12:] = 0
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds stays in gc.garbage, to be looked at
    try:
        for _ in range(5):
            traced.module(ids, mask).sum().backward()
        gc.collect()
        classes = [o for o in gc.garbage if isinstance(o, type)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert classes == []  # before: one VmappedModIndex class per call


def test_t5_encoder_decoder_traces() -> None:
    config = transformers.T5Config(num_layers=2, d_model=32, num_heads=4, d_kv=8, d_ff=64, vocab_size=64)
    model = transformers.T5ForConditionalGeneration(config).eval()
    traced = trace(model, _example(["input_ids", "attention_mask", "decoder_input_ids"]))
    assert traced.options.output == "logits"
    assert any(layer.name.startswith("decoder_block_1") for layer in traced.layers)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids).logits
        got = traced.module.eval()(ids, torch.ones_like(ids), ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_causal_lm_loss_is_what_transformers_computes() -> None:
    model = resolve_model("zoo:hf_gpt2", {"n_layer": 1}).eval()
    fields, labels = resolve_dataset("zoo:pydoc_tokens")[3]
    ids, mask, labels = fields["input_ids"][None], fields["attention_mask"][None], labels[None]
    assert (labels == -100).any()  # some padding, ignored by both
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(causal_lm(out.logits, labels), out.loss)


def _profile_samples(tmp_path: Path, model: str, sample: str) -> Result:
    """pdprof on ``model`` over 16 rows ``x`` of 12 random token ids, each row made a sample by ``sample``."""
    data = tmp_path / "data.py"
    data.write_text(
        "import torch\n"
        "def build():\n"
        "    ids = torch.randint(1, 90, (16, 12), generator=torch.Generator().manual_seed(0))\n"
        f"    return [{sample} for x in ids]\n"
    )
    return CliRunner().invoke(
        pdprof_main,
        [
            "--model",
            model,
            "--data",
            f"{data}:build",
            "--batch-size",
            "4",
            "--repeats",
            "1",
            "--concurrent",
            "1",
        ],
    )


def test_labels_equal_to_the_inputs_with_cross_entropy_is_refused(tmp_path: Path) -> None:
    res = _profile_samples(tmp_path, "zoo:hf_gpt2", "{'input_ids': x, 'labels': x}")
    assert res.exit_code == 2
    assert "--loss causal_lm" in res.output and "'labels'" in res.output
    assert "Traceback" not in res.output


def test_a_field_the_model_does_not_take_is_one_line(tmp_path: Path) -> None:
    res = _profile_samples(tmp_path, "zoo:hf_bert", "{'input_ids': x, 'pixels': x, 'label': x[0] % 3}")
    assert res.exit_code == 2
    assert "'pixels' is not an argument of BertForSequenceClassification.forward" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_dict_samples_map_to_keyword_inputs_in_forward_order(tmp_path: Path) -> None:
    from pdprof.inputs import prepare
    from shared.spec import RunSpec

    model = resolve_model("zoo:hf_bert", {"num_hidden_layers": 1})
    samples = [
        {"attention_mask": torch.ones(8, dtype=torch.int64), "input_ids": torch.arange(8), "labels": 1}
    ]
    spec, data = prepare(RunSpec(model="zoo:hf_bert", data="x"), model, samples * 4, 2)
    assert spec.inputs == ["input_ids", "attention_mask"] and spec.target == "labels"
    (ids, _), label = data[0]
    assert torch.equal(ids, torch.arange(8)) and label == 1
    assert [e.name for e in spec.trace.example] == ["input_ids", "attention_mask"]
    assert spec.trace.example[0].shape == [2, 8]
    with pytest.raises(SpecError, match="no field 'attention_mask'"):
        type(data)([{"input_ids": torch.arange(8), "labels": 1}], ["input_ids", "attention_mask"], "labels")[
            0
        ]


def test_a_float64_run_traces_the_graph_pdprof_profiled_in_float32() -> None:
    # Llama's RMSNorm casts to float32 and back: exported in float64 the graph would have other edges.
    options = _example(["input_ids", "attention_mask"])
    torch.manual_seed(0)
    profiled = trace(resolve_model("zoo:hf_llama", {"num_hidden_layers": 1}), options)
    torch.manual_seed(0)
    model = resolve_model("zoo:hf_llama", {"num_hidden_layers": 1}).to(torch.float64)
    run = trace(model, options)
    assert run.structure_hash() == profiled.structure_hash()
    assert run.module.get_parameter("lm_head.weight") is model.lm_head.weight  # the run's own, in float64
    ids = torch.randint(0, 90, (2, 16))
    with torch.no_grad():
        got = run.module(ids, torch.ones_like(ids))
        want = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert got.dtype == torch.float64
    # The model itself rounds to float32 inside RMSNorm; the float64 graph does not.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_pdprof_sizes_a_hugging_face_model_whose_masks_are_built_under_vmap(tmp_path: Path) -> None:
    # transformers builds GPT-2's attention mask under torch.vmap: a tensor saved there has no
    # storage to reach ("Cannot access storage of BatchedTensorImpl"); pdprof counts it by its bytes.
    out = tmp_path / "graph.json"
    flags = ["--model", "zoo:hf_gpt2", "--model-arg", "n_layer=1", "--data", "zoo:pydoc_tokens"]
    flags += [
        "--loss",
        "causal_lm",
        "--batch-size",
        "4",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--concurrent",
        "1",
    ]
    flags += ["-o", str(out)]
    res = CliRunner().invoke(pdprof_main, flags)
    assert res.exit_code == 0, res.output
    saved = [node["saved_bytes"] for node in json.loads(out.read_text())["nodes"]]
    assert all(b >= 0 for b in saved) and sum(saved) > 0


def test_an_exported_graph_runs_on_the_device_it_is_placed_on() -> None:
    """Export bakes its device into the graph (GPT-2's position ``arange``, its mask's ``to``): a stage
    moved to a GPU must make those tensors there. The meta device stands in for CUDA on this host: moved
    with ``module.to`` alone the graph still makes CPU tensors and fails; with ``set_device`` it runs."""
    from shared.tracer_export import set_device

    model = resolve_model("zoo:hf_gpt2", {"n_layer": 2})
    meta = torch.device("meta")
    ids = torch.ones(2, 16, dtype=torch.int64, device=meta)
    moved = trace(model, _example(["input_ids", "attention_mask"])).module.to(meta)
    with pytest.raises(NotImplementedError):
        moved(ids, ids)
    placed = trace(model, _example(["input_ids", "attention_mask"])).module.to(meta)
    set_device(placed, meta)
    out = placed(ids, ids)
    assert out.device == meta and tuple(out.shape) == (2, 16, model.config.vocab_size)
    devices = {
        a
        for gm in placed.modules()
        if isinstance(gm, torch.fx.GraphModule)
        for n in gm.graph.nodes
        for a in (*n.args, *n.kwargs.values())
        if isinstance(a, torch.device)
    }
    assert devices == {meta}  # there were some (export named the CPU), and every one is the stage's now


def _opt(layerdrop: float) -> torch.nn.Module:
    config = transformers.OPTConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=layerdrop,
    )
    return transformers.OPTForCausalLM(config)


def test_a_model_with_layerdrop_at_zero_traces_and_computes_what_it_computes() -> None:
    """OPT (as BART, Whisper and 40 more) draws torch.rand([]) < layerdrop in training, even at 0, which
    export refused as data-dependent; at 0 no layer is skipped, and the graph keeps every layer."""
    torch.manual_seed(0)
    model = _opt(0.0).train()
    traced = trace(model, _example(["input_ids", "attention_mask"]))
    ids = torch.randint(3, 90, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    want = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(traced.module(ids, mask), want, rtol=1e-5, atol=1e-5)
    assert sum(1 for layer in traced.layers if layer.name.endswith("self_attn_q_proj")) == 2
    assert torch.rand([]).shape == ()  # torch.rand is itself again


def test_a_model_that_drops_layers_at_random_is_refused_in_one_line() -> None:
    with pytest.raises(
        TraceError, match=r"layerdrop is 0.1: LayerDrop skips layers at random.*layerdrop=0.0"
    ):
        trace(_opt(0.1), _example(["input_ids", "attention_mask"]))


def test_cross_entropy_on_token_labels_that_copy_the_inputs_is_refused_despite_padding() -> None:
    """The zoo's token datasets label padding -100: the labels equal the inputs everywhere else."""
    res = CliRunner().invoke(
        pdprof_main,
        ["--model", "zoo:hf_gpt2", "--data", "zoo:pydoc_tokens", "--batch-size", "4", "--concurrent", "1"],
    )
    assert res.exit_code == 2 and "--loss causal_lm" in res.output, res.output


def test_token_ids_past_the_vocabulary_are_named_before_the_model_runs() -> None:
    res = CliRunner().invoke(
        pdprof_main,
        [
            "--model",
            "zoo:hf_gpt2",
            "--model-arg",
            "vocab_size=50",
            "--data",
            "zoo:pydoc_tokens",
            "--loss",
            "causal_lm",
            "--batch-size",
            "4",
            "--concurrent",
            "1",
        ],
    )
    assert res.exit_code == 2, res.output
    assert "input_ids go up to" in res.output and "vocabulary has 50 tokens (config.vocab_size)" in res.output


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_gpt2_runs_the_chunked_schedules_its_causal_mask_relayed(tmp_path: Path, schedule: str) -> None:
    # transformers' GPT-2 builds one causal mask that every block reads: on 2 x 2 chunks it goes from the
    # first chunk to blocks in the third and fourth, so pdplan refused both chunked schedules until
    # pdrun relayed such values along the chain of chunks. Planned from the CLI, the relay is in the
    # partition, and the run ends with one worker's parameters (float64, 1e-6), the tie included.
    graph, plan_path = tmp_path / "graph.json", tmp_path / "plan.json"
    flags = (
        "--model zoo:hf_gpt2 --data zoo:pydoc_tokens --loss causal_lm --batch-size 4 --warmup 0 --repeats 1"
    )
    res = CliRunner().invoke(pdprof_main, [*flags.split(), "--concurrent", "1", "-o", str(graph)])
    assert res.exit_code == 0, res.output
    doc = json.loads(graph.read_text())
    for node in doc["nodes"]:  # the blocks alone cost, so each chunk holds one of the four
        node["forward_ms"] = node["backward_ms"] = 1.0 if node["id"].endswith("attn_c_attn") else 0.0
    graph.write_text(json.dumps(doc))
    args = [str(graph), "--workers", "2", "--bandwidth", "1e9", "--straight", "--schedule", schedule]
    res = CliRunner().invoke(pdplan_main, [*args, "--microbatches", "4", "-o", str(plan_path)])
    assert res.exit_code == 0, res.output
    plan = load_plan(plan_path)
    assert plan.virtual_stages == 2 and len(plan.stages) == 4
    part = partition(trace(resolve_model(plan.spec.model or "", plan.spec.model_args), plan.spec.trace), plan)
    assert all(b == a + 1 for a, b in part.sends)
    relayed = {n for (a, b), names in part.sends.items() for n in names if part.owner[n] < a}
    assert relayed, part.sends  # the mask, at least, passes through a chunk that does not make it
    piped = run(plan, steps=3, dtype="float64", lr=0.05, momentum=0.9)
    flat = one_worker(plan).model_copy(update={"schedule": "1f1b-flush", "virtual_stages": 1})
    single = run(flat, steps=3, dtype="float64", lr=0.05, momentum=0.9)
    got, want = params(piped), params(single)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert (got[name] - value).abs().max().item() <= 1e-6, name
    losses = [row["loss"] for r in single for row in r.rows]
    assert losses[-1] < losses[0]
