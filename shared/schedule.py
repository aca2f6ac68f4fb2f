"""Schedules as data: per-worker lists of typed instructions, with no torch in them.

A *worker* is ``(stage, replica)``; unit ``u`` (a minibatch in 1F1B, a microbatch in
the flushing schedules) goes to replica ``u % replicas[stage]`` of every stage. The
runtime (pdrun) executes each worker's list through a dispatch table; the planner's
simulator executes the same lists with profiled costs. Generators, validation and the
grid drawing live beside these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What one instruction does."""

    FORWARD = "F"  # run the stage forward on unit
    BACKWARD = "B"  # run the stage backward on unit
    SEND_ACT = "SA"  # send unit's activations to peer (a later stage)
    RECV_ACT = "RA"  # receive unit's activations from peer (an earlier stage)
    SEND_GRAD = "SG"  # send unit's input gradients to peer (an earlier stage)
    RECV_GRAD = "RG"  # receive unit's output gradients from peer (a later stage)
    ALLREDUCE = "AR"  # all-reduce gradients among the stage's replicas (unit: the step's last unit)
    STEP = "S"  # optimizer step (unit: the step's last unit)


Worker = tuple[int, int]  # (stage, replica)


@dataclass(frozen=True, order=True)
class Instr:
    """One instruction; ``peer`` is the other worker of a send or receive."""

    kind: Kind
    unit: int
    peer: Worker | None = None

    def __str__(self) -> str:
        # Compact, round-trippable: F3, B3, SA3>1.0, RG3<2.0, AR7, S7
        if self.peer is None:
            return f"{self.kind.value}{self.unit}"
        arrow = ">" if self.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else "<"
        return f"{self.kind.value}{self.unit}{arrow}{self.peer[0]}.{self.peer[1]}"


Program = dict[Worker, list[Instr]]  # the whole schedule: each worker's instructions in order
