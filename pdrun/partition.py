"""Which values cross which stage boundary: the plan applied to the traced model's layers.

A stage owns the layers the plan gives it. A value (a layer's output) crosses from the
stage that computes it straight to every later stage that reads it, so a skip connection
from stage 0 to stage 2 is one edge 0 -> 2, not a relay through stage 1. The model's
output is read by the last stage, which computes the loss.

Chunked schedules (interleaved-1f1b, zb-v) run a chain of chunks: each chunk receives from the
one before it and sends to the one after (``shared.plan.chunk_route``). A value read several
chunks later, a residual stream or a Hugging Face model's attention mask read by every block,
is relayed: every chunk in between receives it and sends it on unchanged (its stage module
returns the received value as one of its outputs), and its gradient comes back the same way,
added at each relaying chunk to what that chunk's own layers give the value (nothing: the
chunk passes it through). Megatron-LM and torch.distributed.pipelining leave such values to
the user's model code; here the traced graph says which they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import PlanError
from shared.plan import Plan, chunk_route
from shared.tracer import TracedModel


@dataclass(frozen=True)
class Partition:
    """The plan's stages over the traced layers, with every crossing value named."""

    stages: int
    owner: dict[str, int]  # layer -> stage
    layers: tuple[tuple[str, ...], ...]  # per stage, its layers in topological order
    sends: dict[tuple[int, int], tuple[str, ...]]  # (producer, consumer) -> values, topological order
    input_stage_of: dict[str, int]  # model input (placeholder) -> the stage reading it from the batch

    @property
    def last(self) -> int:
        return self.stages - 1

    def receives(self, stage: int) -> list[tuple[int, tuple[str, ...]]]:
        """(producer, values) for every stage that sends to ``stage``, producers in order."""
        return sorted((a, names) for (a, b), names in self.sends.items() if b == stage)

    def consumers(self, stage: int) -> list[tuple[int, tuple[str, ...]]]:
        """(consumer, values) for every stage ``stage`` sends to, consumers in order."""
        return sorted((b, names) for (a, b), names in self.sends.items() if a == stage)

    def edges(self) -> set[tuple[int, int]]:
        return set(self.sends)

    def reads_input(self, stage: int) -> bool:
        return stage in self.input_stage_of.values()


def partition(traced: TracedModel, plan: Plan, source: str = "plan") -> Partition:
    """Apply ``plan`` to ``traced``; raises ``PlanError`` naming the stage and layer that do not fit."""
    names = [layer.name for layer in traced.layers]
    known = set(names)
    owner: dict[str, int] = {}
    for s, stage in enumerate(plan.stages):
        for name in stage.layers:
            if name not in known:
                raise PlanError(
                    f"{source}: stages[{s}].layers: layer {name!r} is not in the traced model "
                    f"(its layers start {', '.join(names[:3])}, ...); was the plan made for another model?"
                )
            owner[name] = s
    # The planner sets the model's inputs aside; they always belong to the first stage.
    for layer in traced.layers:
        if layer.op == "input" and layer.name not in owner:
            owner[layer.name] = 0
    missing = [n for n in names if n not in owner]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise PlanError(f"{source}: stages: layer {missing[0]!r}{more} is in no stage; every layer needs one")
    expected = traced.structure_hash()
    if plan.graph_hash != expected:
        raise PlanError(
            f"{source}: graph_hash: the plan was made for another graph ({plan.graph_hash[:19]}...), "
            f"the traced model is {expected[:19]}...; re-run pdprof and pdplan on this model"
        )
    sends: dict[tuple[int, int], list[str]] = {}
    last = len(plan.stages) - 1

    def cross(value: str, a: int, b: int) -> None:
        for hop in chunk_route(plan.virtual_stages > 1, a, b):  # (a, b), or a chunked plan's hops
            if value not in sends.setdefault(hop, []):
                sends[hop].append(value)

    for layer in traced.layers:
        b = owner[layer.name]
        for src in layer.inputs:
            a = owner[src]
            if a > b:
                raise PlanError(
                    f"{source}: stages[{b}]: not convex: layer {layer.name!r} (stage {b}) reads "
                    f"{src!r} from the later stage {a}; stages must follow the data flow"
                )
            if a < b:
                cross(src, a, b)
    for out in traced.outputs:
        a = owner[out]
        if a < last:
            cross(out, a, last)
    order = {n: i for i, n in enumerate(names)}
    per_stage = tuple(tuple(n for n in names if owner[n] == s) for s in range(len(plan.stages)))
    for s, layers in enumerate(per_stage):
        if not layers:
            raise PlanError(f"{source}: stages[{s}]: has no layer of the traced model")
    return Partition(
        stages=len(plan.stages),
        owner=owner,
        layers=per_stage,
        sends={k: tuple(sorted(v, key=order.__getitem__)) for k, v in sends.items() if v},
        input_stage_of={layer.name: owner[layer.name] for layer in traced.layers if layer.op == "input"},
    )


def check_ranks(plan: Plan, world_size: int, source: str = "plan") -> None:
    """Refuse a plan that needs more ranks than the launcher provides."""
    if plan.world_size == world_size:
        return
    for s, stage in enumerate(plan.stages):
        for rank in stage.ranks:
            if rank >= world_size:
                raise PlanError(
                    f"{source}: stages[{s}].ranks: stage {s} (layer {stage.layers[0]!r}) needs rank {rank}, "
                    f"but the launcher provides {world_size} worker(s); plan world_size={plan.world_size}"
                )
    raise PlanError(
        f"{source}: world_size: the plan needs {plan.world_size} workers, the launcher provides {world_size}"
    )
