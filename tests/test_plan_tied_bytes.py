"""Parameters several layers read are counted once in the layer graph, and the planner charges a copy to
every stage that holds one: what pdrun's stage modules really hold.

A new user's ALBERT (one transformer layer run at every depth) profiled at 692 KiB of parameters for a
298 KiB model, and a tied Llama's data-parallel plan charged its embedding twice in the all-reduce: pdprof
counted a tensor at every layer that read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from pdprof.profiler import ProfileConfig, profile_spec
from pdrun.partition import partition
from pdrun.plans import cut_plan, traced_for
from pdrun.stage import build_stage
from shared.graph import LayerGraph
from shared.spec import RunSpec

SHARED = '''
import torch
import torch.nn.functional as F
from torch import nn


class Shared(nn.Module):
    """ALBERT's pattern (one block at every depth) and a tied embedding read again as the head."""

    def __init__(self, vocab=98, width=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.block = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.block(h))
        return F.linear(h, self.emb.weight)


def build():
    return Shared()
'''


def _bytes(module: nn.Module) -> int:
    """What the module holds: each parameter and buffer once."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSpec, LayerGraph]:
    folder: Path = tmp_path_factory.mktemp("shared")
    (folder / "shared.py").write_text(SHARED)
    spec = RunSpec(model=f"{folder}/shared.py:build", data="zoo:pydoc_text", data_args={"block_size": 8})
    spec = spec.model_copy(update={"loss": "causal_lm"})
    return spec, profile_spec(ProfileConfig(spec, batch_size=4, warmup=0, repeats=1)).graph


def test_a_parameter_read_by_several_layers_counts_once(profiled: tuple[RunSpec, LayerGraph]) -> None:
    spec, graph = profiled
    model = traced_for(spec).module
    assert sum(n.parameter_bytes for n in graph.nodes) == _bytes(model)  # was 3 blocks and 2 embeddings
    ties = sorted((size, layers) for layers, size in graph.ties())
    blocks = ["block", "block_1", "block_2"]
    # The embedding (read again as the head) and the block's weight and bias, each with its readers.
    assert ties == [(24 * 4, blocks), (24 * 24 * 4, blocks), (98 * 24 * 4, ["emb", "emb_weight"])]


@pytest.mark.parametrize("cut", [["block_1"], ["mid"], ["block_2"], ["block_1", "block_2"]])
def test_each_stage_is_charged_what_its_module_holds(
    profiled: tuple[RunSpec, LayerGraph], cut: list[str]
) -> None:
    # The stage that reads a tied tensor its first reader's stage owns holds a copy of it (pdrun.tied).
    spec, graph = profiled
    plan = cut_plan(spec, cut, batch_size=4)
    traced = traced_for(spec)
    part = partition(traced, plan)
    for s, stage in enumerate(plan.stages):
        held = _bytes(build_stage(traced, part, s).module)
        assert graph.held_parameter_bytes(stage.layers) == held, (s, stage.layers)
