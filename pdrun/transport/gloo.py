"""Messages over torch.distributed's point-to-point (gloo, or NCCL on GPUs): isend, and receives into known shapes.

A message is a header (the unit number, the weight version it ran on, and two fields
shared memory uses, -1 here) followed by the values' tensors, in an order both ends derive
from the plan. Each is its own isend/irecv with the message's tag; gloo delivers a peer's
messages of one tag in the order they were sent. A receive waits at most ``timeout`` and
then names the peer that never sent, so a broken pipeline fails instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pdrun.transport.interface import PostedRecv, expect_unit
from shared.errors import RunError

# Sends kept pending before the oldest is waited for (see GlooCarrier.reap): a message is a header and
# its values, so this is a few messages.
_KEEP_PENDING = 8


def broken(message: str) -> str | None:
    """ "connection reset" or "connection closed" when gloo's error says the peer's connection broke."""
    for what in ("Connection reset", "Connection closed"):
        if what in message:
            return what.lower()
    return None


class GlooCarrier:
    """This rank's messages through the process group's backend, and its sends still in flight."""

    def __init__(self, rank: int, wire: torch.device, timeout_s: float, kind: str = "gloo") -> None:
        self.rank = rank
        self.kind = kind
        # The backend's device: tensors on another device (CUDA tensors over gloo) go through it.
        self.wire = wire
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.pending: list[tuple[dist.Work, list[torch.Tensor]]] = []

    def hold(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to(self.wire).contiguous() for t in tensors]

    def send(self, held: list[torch.Tensor], dst: int, tag: int) -> None:
        for t in held:
            work = dist.isend(t, dst=dst, tag=tag)
            if work is not None:
                self.pending.append((work, held))
        self.reap()

    def post(self, buffers: Sequence[torch.Tensor], src: int, tag: int, hold: bool = False) -> PostedRecv:
        """Post the receives of a header and ``buffers`` now; ``wait`` for them later.

        gloo moves a message only once its receive is posted (the sender's side waits for the
        receiver's "ready"): a receive posted early lets the transfer run while this worker
        computes, instead of after it asked for the data. ``hold`` changes nothing here.
        """
        header = torch.empty(4, dtype=torch.int64, device=self.wire)
        values = [b.to(self.wire) for b in buffers]
        works = [w for w in (dist.irecv(t, src=src, tag=tag) for t in (header, *values)) if w is not None]
        return PostedRecv(src, tag, values, header, works)

    def wait(self, posted: PostedRecv, unit: int, what: str) -> tuple[int, list[torch.Tensor]]:
        assert posted.header is not None
        self._wait_works(posted.works, time.monotonic() + self.timeout_s, posted.src, unit, what)
        got, version = posted.header[:2].tolist()
        expect_unit(self.rank, got, unit, what, posted.src)
        return version, posted.buffers

    def release(self, unit: int) -> None:
        """Nothing to free: gloo's values are in the receive's own buffers."""

    def _wait_works(self, works: list[dist.Work], deadline: float, src: int, unit: int, what: str) -> None:
        for work in works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                ok = work.wait(timeout=timedelta(seconds=left))
            except RuntimeError as exc:
                first = str(exc).splitlines()[0] if str(exc) else "timeout"
                if broken(first):
                    raise RunError(
                        f"rank {self.rank}: lost rank {src} while waiting for {what} of unit {unit} "
                        f"({broken(first)} by peer)"
                    ) from None
                raise RunError(
                    f"rank {self.rank}: no {what} of unit {unit} from rank {src} within {self.timeout_s:g}s "
                    f"({first})"
                ) from None
            if ok is False:
                raise RunError(
                    f"rank {self.rank}: no {what} of unit {unit} from rank {src} within {self.timeout_s:g}s"
                )

    def reap(self) -> None:
        """Wait for the oldest sends once more than a few are pending, so their tensors can be freed.

        gloo's send works never report ``is_completed()`` before ``wait()`` (checked on torch
        2.13): reaping the completed ones freed nothing, and every message of a program stayed
        referenced until its end, so each new activation came from fresh pages (a page fault
        per 4 KB: ~500 per unit, stage 0's backward ~50% slower, and the heap grew ~2 MB a unit).
        The oldest send has ``_KEEP_PENDING`` newer ones posted after it, so in pdrun's schedules
        its receiver needs nothing this worker has yet to send before it takes it: the wait is
        short, and from the sender thread it does not hold up the worker.
        """
        while len(self.pending) > _KEEP_PENDING:
            work, _ = self.pending.pop(0)
            self._wait_send(work)

    def drain(self) -> None:
        for work, _ in self.pending:
            self._wait_send(work)
        self.pending = []

    def close(self) -> None:
        """Nothing of its own to remove: the process group is the runner's."""

    def _wait_send(self, work: dist.Work) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise RunError(
                f"rank {self.rank}: a send was not received within {self.timeout_s:g}s ({str(exc).splitlines()[0]})"
            ) from None
