"""Plans made by hand in code: cut a traced model's layers into consecutive stages.

What tests, benchmarks and quick experiments use instead of the planner: the layers in
topological order, cut at the given positions, each stage on its own ranks.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from shared.errors import PlanError
from shared.plan import Plan, Schedule, Stage
from shared.resolve import resolve_model
from shared.spec import RunSpec
from shared.tracer import TracedModel, trace


def traced_for(spec: RunSpec, seed: int = 0) -> TracedModel:
    """The model of ``spec``, built with ``seed`` and traced with the spec's options."""
    if spec.model is None:
        raise PlanError("spec.model: no model to trace")
    torch.manual_seed(seed)
    return trace(resolve_model(spec.model, spec.model_args), spec.trace)


def cut_plan(
    spec: RunSpec,
    cuts: list[int] | list[str],
    *,
    batch_size: int,
    schedule: Schedule = "1f1b",
    microbatches: int = 1,
    replicas: list[int] | None = None,
    in_flight: int | None = None,
    vertical_sync: bool = False,
) -> Plan:
    """A plan whose stage ``i`` starts at ``cuts[i-1]`` (a layer index or name) in topological order."""
    traced = traced_for(spec)
    names = [layer.name for layer in traced.layers]
    points = [names.index(c) if isinstance(c, str) else c for c in cuts]
    bounds = [0, *points, len(names)]
    if any(a >= b for a, b in pairwise(bounds)):
        raise PlanError(f"cuts: {cuts} must increase strictly inside 1..{len(names) - 1}")
    replicas = replicas or [1] * (len(bounds) - 1)
    if len(replicas) != len(bounds) - 1:
        raise PlanError(f"replicas: {len(replicas)} counts for {len(bounds) - 1} stages")
    stages: list[Stage] = []
    rank = 0
    for i, n in enumerate(replicas):
        stages.append(
            Stage(layers=names[bounds[i] : bounds[i + 1]], replicas=n, ranks=list(range(rank, rank + n)))
        )
        rank += n
    noam = -(-rank // replicas[0])
    return Plan(
        graph_hash=traced.structure_hash(),
        spec=spec,
        batch_size=batch_size,
        schedule=schedule,
        microbatches=microbatches,
        in_flight=in_flight or noam,
        vertical_sync=vertical_sync,
        world_size=rank,
        stages=stages,
    )
