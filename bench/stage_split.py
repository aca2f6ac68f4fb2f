"""The plan's split as ``nn.Module`` stages, so a baseline runs exactly the stages pdrun runs.

Each stage is an fx ``GraphModule`` cut from the traced model: its inputs are the values
produced by earlier stages and still needed at or after it, its outputs the values needed
by later stages (skip connections pass through the stages they jump over, so every stage
reads only its predecessor's outputs, as ``torch.distributed.pipelining`` requires).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from shared.errors import PlanError
from shared.tracer import TracedModel


@dataclass
class StageModules:
    """The stage modules in pipeline order, and the value names crossing each boundary."""

    modules: list[fx.GraphModule]
    boundaries: list[list[str]]  # boundaries[k]: what stage k sends to stage k+1


def _consumers(traced: TracedModel) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {layer.name: [] for layer in traced.layers}
    for layer in traced.layers:
        for src in layer.inputs:
            users[src].append(layer.name)
    return users


def split_stages(traced: TracedModel, stage_of: dict[str, int]) -> StageModules:
    """Cut ``traced`` into one module per stage index of ``stage_of`` (layer name -> stage)."""
    names = [layer.name for layer in traced.layers]
    missing = [n for n in names if n not in stage_of]
    if missing:
        raise PlanError(f"plan: stages: layer {missing[0]!r} of the traced model is in no stage")
    n_stages = max(stage_of[n] for n in names) + 1
    order = {n: i for i, n in enumerate(names)}
    users = _consumers(traced)
    last = n_stages - 1
    # The model's outputs are read "by" the last stage.
    for out in traced.outputs:
        users[out].append("__output__")
    owner = dict(stage_of)
    owner["__output__"] = last

    def live_after(k: int) -> list[str]:
        live = {v for v in names if owner[v] <= k and any(owner[u] > k for u in users[v])}
        return sorted(live, key=order.__getitem__)

    boundaries = [live_after(k) for k in range(last)]
    out_node = next(n for n in traced.module.graph.nodes if n.op == "output")
    modules = [_build_stage(traced, names, owner, boundaries, k, last, out_node) for k in range(n_stages)]
    return StageModules(modules, boundaries)


def _build_stage(
    traced: TracedModel,
    names: list[str],
    owner: dict[str, int],
    boundaries: list[list[str]],
    k: int,
    last: int,
    out_node: fx.Node,
) -> fx.GraphModule:
    """Stage ``k``: placeholders for what crosses into it, its own nodes, what crosses out."""
    nodes = traced.fx_nodes()
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    if k > 0:
        for v in boundaries[k - 1]:
            env[v] = g.placeholder(v)
    for name in names:
        if owner[name] != k:
            continue
        node = nodes[name]
        if node.op == "placeholder" and k > 0:
            raise PlanError(f"plan: stages[{k}]: the model input {name!r} must be in stage 0")
        env[name] = g.node_copy(node, lambda n: env[n.name])
    if k < last:
        outs = [env[v] for v in boundaries[k]]
        g.output(outs[0] if len(outs) == 1 else tuple(outs))
    else:
        g.output(fx.map_arg(out_node.args[0], lambda n: env[n.name]))
    g.lint()
    return fx.GraphModule(traced.module, g, f"stage{k}")


def stage_parameters(stages: StageModules) -> list[list[nn.Parameter]]:
    """Each stage's parameters (the same objects as the traced model's)."""
    return [list(m.parameters()) for m in stages.modules]


def run_sequential(stages: StageModules, *inputs: Any) -> Any:
    """Run the stages one after the other in one process: the model's forward, for checking the cut."""
    value: Any = inputs
    for module in stages.modules:
        value = module(*value) if isinstance(value, tuple) else module(value)
    return value
