"""A replicated stage's gradient sum through the process group: one asynchronous all-reduce per bucket.

Each bucket's gradients are copied into one flat tensor on the backend's device and
all-reduced in the replicas' group while the backward goes on (pdrun/overlap.py says when);
``total`` waits for it. Every replica starts the same buckets in the same order: a
collective's order is the only thing the replicas agree on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class GlooSum:
    """Bucket sums among the replicas in ``group`` (None: the whole world), through its all-reduce."""

    def __init__(self, group: Any, wire: torch.device, kind: str = "gloo") -> None:
        self.group = group
        self.wire = wire
        self.kind = kind
        self.replicas = dist.get_world_size(group)
        self.flights: dict[int, tuple[torch.Tensor, Any]] = {}  # by bucket: its flat gradients, the work

    def start(self, k: int, parts: Sequence[torch.Tensor]) -> None:
        flat = torch.cat(list(parts)).to(self.wire)
        self.flights[k] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def total(self, k: int) -> torch.Tensor:
        flat, work = self.flights.pop(k)
        work.wait()
        return flat

    def next_step(self) -> None:
        """Nothing to turn over: each bucket's all-reduce is its own."""
