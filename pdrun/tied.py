"""Tied parameters: one parameter that several stages hold, kept one parameter by summing its gradient.

A model may use one tensor in several layers (GPT-2's token embedding is also its output
projection). When a plan puts those layers on different stages, each stage holds its own
copy. As Megatron-LM does with its embedding group (Shoeybi et al., 2019; Narayanan et al.,
SC'21, "the input embedding and output layer share weights ... we all-reduce the gradients
of these shared weights across the first and last stages"), the ranks of the stages that
hold a tied parameter form a process group of their own and sum its gradient every step,
before the optimizer step, so every copy takes the same update from the same gradient: the
gradient one process computes for the one parameter.

A tie is found by identity: the same ``nn.Parameter`` object read by layers of several
stages in the traced model (whatever its qualified names), so every rank, tracing the same
model, derives the same ties in the same order without the plan recording them.

Replicas: a replicated stage has already reduced its gradients among its replicas (the
ALLREDUCE instruction comes before STEP), so each of its ``r`` ranks holds the stage's
gradient; each contributes ``1/r`` of it to the tie's sum, which then counts each stage once.

[Note: tied parameters under 1f1b] Every rank of a tie steps once per unit, in unit order,
so the k-th sum of every copy adds the gradients of unit k, and the copies stay identical
after every step. With weight stashing each stage's part of that gradient is taken at the
version its own forward of unit k used: the first stage's is ``in_flight - 1`` versions older
than the last stage's, as for any other weight of the first stage (with vertical sync both
use the input stage's version). The sum is a blocking collective: the later stage waits at
its step for the earlier stage's backward of the same unit, which costs 1f1b the overlap
between them. A replicated stage steps once per round of its replicas, so under 1f1b a tie
may span unreplicated stages only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pdrun.partition import Partition
from pdrun.transport.interface import ReplicaSum
from pdrun.transport.router import Transport
from shared.errors import PlanError
from shared.plan import Plan
from shared.ties import parameter_reads
from shared.tracer import TracedModel


@dataclass(frozen=True)
class Tie:
    """One parameter held by several stages: its qualified names as each of them reads it."""

    names: tuple[tuple[int, tuple[str, ...]], ...]  # (stage, its names for the parameter), stages in order

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.names)

    def label(self) -> str:
        """How messages name the tie: ``wte.weight (stage 0) = lm_head.weight (stage 2)``."""
        return " = ".join(f"{names[0]} (stage {s})" for s, names in self.names)


def find_ties(traced: TracedModel, part: Partition) -> list[Tie]:
    """Every parameter that layers of more than one stage read, in the order the model first reads them."""
    held: dict[int, dict[int, list[str]]] = {}  # id(parameter) -> stage -> names
    for s, layers in enumerate(part.layers):
        for _, name, p in parameter_reads(traced, layers):
            names = held.setdefault(id(p), {}).setdefault(s, [])
            if name not in names:
                names.append(name)
    return [
        Tie(tuple((s, tuple(names)) for s, names in sorted(stages.items())))
        for stages in held.values()
        if len(stages) > 1
    ]


def check_ties(plan: Plan, ties: list[Tie], source: str = "plan") -> None:
    """Refuse what the tie sum cannot keep exact: under 1f1b, a tie over a replicated stage."""
    if plan.schedule != "1f1b":
        return
    for tie in ties:
        for s in tie.stages:
            if plan.stages[s].replicas > 1:
                raise PlanError(
                    f"{source}: stages[{s}].replicas: tied parameter {tie.label()} spans stage {s} with "
                    f"{plan.stages[s].replicas} replicas, which under 1f1b steps once per round of its replicas "
                    "while the other stages step every unit; use one replica there or a flush schedule"
                )


# Per group of stages: its sum over their ranks (``pdrun.transport``: through shared memory where the
# ranks share a node, as a replicated stage's gradients are summed, else gloo's all-reduce: over
# loopback gloo took 0.5-0.6 ms a step for the 4 x 64 GPT-2's embedding, which the planner's link
# figure put at 0.1 ms), this rank's weight (1/replicas), and per tie the copies this rank holds
# (one, or under interleaved-1f1b one per chunk of the rank that reads the tie).
Share = tuple[ReplicaSum, float, list[list[nn.Parameter]]]


class TiedGradients:
    """This rank's share of the ties: per group of stages, its tied parameters and the group's sum."""

    def __init__(self, groups: list[Share]) -> None:
        self.groups = groups

    def sum(self) -> None:
        """Sum every tied gradient over the stages that hold it (before the optimizer step).

        The copies one rank holds add up here first; the group's sum adds the other ranks'.
        """
        for total, weight, ties in self.groups:
            grads = [_local_sum(copies) for copies in ties]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if weight != 1.0:
                flat.mul_(weight)
            total.start(0, [flat])
            summed = total.total(0)
            total.next_step()
            offset = 0
            for copies in ties:
                n = copies[0].numel()
                for p in copies:
                    g = summed[offset : offset + n].view_as(p).to(p.device)
                    p.grad = g if len(copies) == 1 else g.clone()  # a rank's copies keep grads of their own
                offset += n


def _local_sum(copies: list[nn.Parameter]) -> torch.Tensor:
    """The gradient of a tie's copies on this rank: the one copy's as it is, or several added up."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in copies]
    return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)


def tied_gradients(
    plan: Plan, ties: list[Tie], held: dict[int, nn.Module], comm: Transport
) -> TiedGradients | None:
    """Make every tie's process group (every rank must call this, in the same order) and this rank's share.

    The ties whose stages are the same share one group and one flat all-reduce. ``held`` maps
    each stage this rank holds to its module (one stage; an interleaved rank, each chunk by its
    virtual stage); a tie's parameters are found there by the names it records for that stage.
    """
    by_stages: dict[tuple[int, ...], list[Tie]] = {}
    for tie in ties:
        by_stages.setdefault(tie.stages, []).append(tie)
    live = {s: dict(module.named_parameters()) for s, module in held.items()}
    mine: list[Share] = []
    for stages, group_ties in by_stages.items():
        ranks = sorted({r for s in stages for r in plan.stages[s].ranks})
        group = dist.new_group(ranks)
        here = [s for s in stages if s in held]
        if not here:
            continue
        copies = []
        for tie in group_ties:
            names = dict(tie.names)
            held_by = [live[s][next(n for n in names[s] if n in live[s])] for s in here]
            # Two chunks of a rank built from one traced model may hold one tensor (pdrun.build_worker):
            # its gradient already has both chunks' parts, so it is one copy, once.
            copies.append(list({id(p): p for p in held_by}.values()))
        bucket = (sum(c[0].numel() for c in copies), copies[0][0].dtype)
        total = comm.tie_sum("tie-" + "-".join(map(str, stages)), ranks, group, [bucket])
        mine.append((total, 1.0 / plan.stages[here[0]].replicas, copies))
    return TiedGradients(mine) if mine else None
