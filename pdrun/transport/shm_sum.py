"""A replicated stage's gradient sum through shared memory, when all its replicas are on one node.

gloo's all-reduce over loopback cost a replicated MNIST CNN stage on 2 cores 1.5-3.7 ms of
CPU a step for 0.8 MB of gradients (a ring of TCP transfers, each a wake-up of gloo's
threads), time the backward lost to it even when overlapped (pdrun/overlap.py, gloo_sum.py). Here the
replicas of a stage map one file: each bucket of gradients is copied into the replica's own
region as the backward completes it, a counter says so, and at the ALLREDUCE instruction
every replica sums the bucket's regions in rank order, the same sum everywhere, so the
replicas stay identical.

The file: one int64 counter per replica (the buckets it has published, over all steps),
then two sets of regions, used by alternate steps: a replica that starts step t+1 has
summed every bucket of step t, which needed every peer's step t; so every peer has
finished reading step t-1, whose regions step t+1 reuses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pdrun.transport.shm import SHM_DIR, aligned, map_shared
from shared.errors import RunError


class ShmSum:
    """Bucket sums among the replicas ``ranks`` of stage ``stage`` (or the ranks of a tie's stages, ``stage``
    then the group's name, ``pdrun.tied``); every one of them constructs it together."""

    kind = "shm"

    def __init__(
        self,
        job: str,
        stage: int | str,
        ranks: Sequence[int],
        rank: int,
        buckets: Sequence[tuple[int, torch.dtype]],  # (elements, dtype) per bucket
        timeout_s: float,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.ranks, self.me, self.timeout_s = list(ranks), list(ranks).index(rank), timeout_s
        self.replicas = len(self.ranks)
        self.buckets = list(buckets)
        self.offsets: list[int] = []
        total = 0
        for numel, dtype in self.buckets:
            self.offsets.append(total)
            total += aligned(numel * dtype.itemsize)
        self.region_bytes = total
        n = len(self.ranks)
        self.start_bytes = aligned(8 * n)
        size = self.start_bytes + 2 * n * total
        path = SHM_DIR / f"pdrun-{job}-reduce-{stage}"
        self.mem = map_shared(path, size)  # every replica maps the same file; new: no bucket published
        dist.barrier(group=group)  # every replica has it mapped: the name can go
        path.unlink(missing_ok=True)
        self.published = self.mem[: 8 * n].view(torch.int64)
        self.step = 0

    def _region(self, replica: int, k: int) -> torch.Tensor:
        numel, dtype = self.buckets[k]
        parity = self.step % 2
        start = self.start_bytes + (parity * len(self.ranks) + replica) * self.region_bytes + self.offsets[k]
        return self.mem[start : start + numel * dtype.itemsize].view(dtype)

    def start(self, k: int, parts: Sequence[torch.Tensor]) -> None:
        """Bucket ``k``'s gradients of this replica (flattened parts, in order), for its peers to add."""
        torch.cat(list(parts), out=self._region(self.me, k))
        self.published[self.me] = self.step * len(self.buckets) + k + 1

    def total(self, k: int) -> torch.Tensor:
        """The sum of bucket ``k`` over the replicas, once each has published it."""
        want = self.step * len(self.buckets) + k + 1
        deadline = time.monotonic() + self.timeout_s
        pause = 10e-6
        while not bool((self.published >= want).all()):
            if time.monotonic() > deadline:
                late = [r for r, v in zip(self.ranks, self.published.tolist(), strict=True) if v < want]
                raise RunError(
                    f"rank {self.ranks[self.me]}: no gradients from replica rank {late[0]} "
                    f"within {self.timeout_s:g}s"
                )
            time.sleep(pause)
            pause = min(2 * pause, 200e-6)  # short waits stay short; long ones poll rarely
        out = self._region(0, k).clone()
        for r in range(1, len(self.ranks)):
            out += self._region(r, k)
        return out

    def next_step(self) -> None:
        self.step += 1
