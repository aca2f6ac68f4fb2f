"""The transport's interface: what carries messages between two ranks, and what sums a stage's replicas.

A ``Carrier`` moves whole messages (a header, then the values' tensors) between this rank
and the peers it was chosen for: gloo (``pdrun/transport/gloo.py``, torch.distributed's
point-to-point) or shared memory (``pdrun/transport/shm.py``, ranks of one node). A
``ReplicaSum`` adds a replicated stage's gradient buckets over its replicas: gloo's
all-reduce (``gloo_sum.py``) or a file the replicas of one node map (``shm_sum.py``).
``pdrun/transport/choose.py`` picks them, per pair of ranks, once; the worker talks only
to ``pdrun.transport.Transport``, which routes each message to its peer's carrier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shared.errors import RunError

TAG_ACT = 1
TAG_GRAD = 2
TAG_VAL = 3

GLOO = "gloo"  # what the summary calls torch.distributed's point-to-point (its backend: gloo, or nccl)
SHM = "shm"


@dataclass
class PostedRecv:
    """A message's receive, posted and not yet waited for."""

    src: int
    tag: int
    buffers: list[torch.Tensor]  # where the values go (the carrier may hand back others, ``hold``)
    header: torch.Tensor | None = None  # gloo: the header's buffer; shared memory: None (it comes by bell)
    works: list[Any] = field(default_factory=list)  # gloo: the receives in flight
    hold: bool = False  # the values may stay where they arrived until the unit's ``release``


class Carrier(Protocol):
    """Messages between this rank and some of its peers, one way of carrying them."""

    kind: str  # "gloo" (or the backend's name) or "shm": what the run's summary reports per pair

    def hold(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What a send keeps of ``tensors`` (the header first) until it is posted."""
        ...

    def send(self, held: list[torch.Tensor], dst: int, tag: int) -> None:
        """Post the message ``held`` (header, values) to ``dst``; may return before ``dst`` has it."""
        ...

    def post(self, buffers: Sequence[torch.Tensor], src: int, tag: int, hold: bool) -> PostedRecv:
        """Start receiving the next message from ``src`` into ``buffers``; ``wait`` finishes it."""
        ...

    def wait(self, posted: PostedRecv, unit: int, what: str) -> tuple[int, list[torch.Tensor]]:
        """(the message's weight version, its values), at most the timeout later; checks its unit."""
        ...

    def release(self, unit: int) -> None:
        """The values of ``unit`` held where they arrived are no longer used."""
        ...

    def drain(self) -> None:
        """Wait until every message posted is delivered (the end of a program)."""
        ...

    def close(self) -> None:
        """Remove what this rank made for the carrier (files); mappings in use stay valid."""
        ...


class ReplicaSum(Protocol):
    """The sum over a stage's replicas of each bucket of gradients, every replica calling in the same order."""

    kind: str
    replicas: int  # what an average divides by

    def start(self, k: int, parts: Sequence[torch.Tensor]) -> None:
        """Bucket ``k``'s gradients of this replica (flattened, in order): its sum may start now."""
        ...

    def total(self, k: int) -> torch.Tensor:
        """The sum of bucket ``k`` over the replicas (started before), once every replica's is in."""
        ...

    def next_step(self) -> None:
        """Every bucket of this step is summed: the next ``start`` belongs to the next step."""
        ...


def expect_unit(rank: int, got: int, unit: int, what: str, src: int) -> None:
    """RunError unless a message from ``src`` belongs to ``unit``: both ends run the same order."""
    if got != unit:
        raise RunError(f"rank {rank}: expected {what} of unit {unit} from rank {src}, got unit {got}")
