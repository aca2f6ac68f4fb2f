"""Point-to-point messages between workers: isend for sends, receives into buffers of known shape.

A message is a header (the unit number, the weight version it ran on, and where its values
are) followed by the values' tensors, in an order both ends derive from the plan; between
ranks on one host's CPU the whole message goes through shared memory instead (``pdrun.shm``:
the values through a link's slots, the header through its bell), without gloo. Sends are posted from a helper thread where a core is spare,
else by the worker itself; their handles are kept until done. A receive waits at most
``timeout`` and then names the peer that never sent, so a broken pipeline fails instead of
hanging.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdrun.shm import Lease, ShmLinks
from shared.errors import RunError

# Sends kept pending before the oldest is waited for (see Comm.reap): a message is a header and its
# values, so this is a few messages.
_KEEP_PENDING = 8

TAG_ACT = 1
TAG_GRAD = 2
TAG_VAL = 3

# Benchmarks only: an emulated slow link. With this set to B (bytes/s), every send first sleeps
# bytes / B, the same emulation bench/slow_link.py applies to the baselines (docs/benchmarks.md).
EMULATE_BANDWIDTH_ENV = "PIPEDREAM_EMULATE_BANDWIDTH"


def emulated_bandwidth() -> float | None:
    """The emulated link's bytes/s from the environment, or None (no emulation)."""
    value = os.environ.get(EMULATE_BANDWIDTH_ENV, "")
    try:
        bandwidth = float(value) if value else 0.0
    except ValueError:
        return None
    return bandwidth if bandwidth > 0 else None


def _broken(message: str) -> str | None:
    """ "Connection reset" or "Connection closed" when gloo's error says the peer's connection broke."""
    for what in ("Connection reset", "Connection closed"):
        if what in message:
            return what.lower()
    return None


@dataclass
class PostedRecv:
    """A message's receives, posted and not yet waited for: the header's buffer first, then the values'."""

    src: int
    tensors: list[torch.Tensor]
    works: list[dist.Work]
    tag: int = 0
    via_shm: bool = False  # through shared memory: the header from a bell, the values from a slot
    hold: bool = False  # shared memory: use the values in their slot until ``Comm.release`` of the unit


class Comm:
    """This worker's sends in flight and the time spent communicating."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        timeout_s: float,
        wire: torch.device | None = None,
        send_thread: bool = True,
        shm: ShmLinks | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        # The backend's device: tensors on another device (CUDA tensors over gloo) go through it.
        self.wire = wire or device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.pending: list[tuple[dist.Work, list[torch.Tensor]]] = []
        self.bandwidth = emulated_bandwidth()
        self.send_thread = send_thread  # send_thread_pays: else the worker posts its own sends
        self.shm = shm
        self.poster: _Poster | None = None  # started with the first send
        self.leases: dict[int, list[Lease]] = {}  # by unit: slots whose values it uses in place

    def header(self, unit: int, version: int) -> torch.Tensor:
        """The unit, the weight version, and where the values are: (-1, -1) over gloo, where they
        follow the header; through shared memory the send fills in the slot and generation."""
        return torch.tensor([unit, version, -1, -1], dtype=torch.int64, device=self.wire)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        """Post the sends; the tensors stay referenced until the peer has them."""
        held = list(tensors) if self.shm is not None else [t.to(self.wire).contiguous() for t in tensors]
        if self.bandwidth is not None:
            # The emulated link blocks the sender, as the baselines' emulation does (docs/benchmarks.md).
            time.sleep(sum(t.numel() * t.element_size() for t in held) / self.bandwidth)
            self._post(held, dst, tag)
            return
        if not self.send_thread:
            self._post(held, dst, tag)
            return
        if self.poster is None:
            self.poster = _Poster(self)
        self.poster.put(held, dst, tag)

    def _post(self, held: list[torch.Tensor], dst: int, tag: int) -> None:
        if self.shm is not None:
            # The values into a slot of the link, the header (naming the slot) through its bell.
            slot, gen = self.shm.put(held[1:], dst, tag) if len(held) > 1 else (-1, -1)
            unit, version = held[0][:2].tolist()
            self.shm.ring([unit, version, slot, gen], dst, tag)
            return
        for t in held:
            work = dist.isend(t, dst=dst, tag=tag)
            if work is not None:
                self.pending.append((work, held))
        self.reap()

    def recv(
        self, buffers: Sequence[torch.Tensor], src: int, tag: int, unit: int, what: str
    ) -> tuple[int, list[torch.Tensor]]:
        """Receive a header and ``buffers``; returns (version, buffers). Checks the unit is the one expected."""
        return self.wait(self.post(buffers, src, tag), unit, what)

    def post(self, buffers: Sequence[torch.Tensor], src: int, tag: int, hold: bool = False) -> PostedRecv:
        """Post the receives of a header and ``buffers`` now; ``wait`` for them later.

        gloo moves a message only once its receive is posted (the sender's side waits for the
        receiver's "ready"): a receive posted early lets the transfer run while this worker
        computes, instead of after it asked for the data. With ``hold``, values that come
        through shared memory may stay in their slot, instead of being copied into ``buffers``,
        until the caller's ``release`` of the unit.
        """
        if self.shm is not None:
            # Nothing to post: the header comes through the link's bell, naming the slot of the values.
            no_header = torch.empty(0)  # it comes through the bell; the values keep their place after it
            return PostedRecv(src, [no_header, *buffers], [], tag, via_shm=True, hold=hold)
        header = torch.empty(4, dtype=torch.int64, device=self.wire)
        out = [header, *(b.to(self.wire) for b in buffers)]
        works = [w for w in (dist.irecv(t, src=src, tag=tag) for t in out) if w is not None]
        return PostedRecv(src, out, works, tag)

    def wait(self, posted: PostedRecv, unit: int, what: str) -> tuple[int, list[torch.Tensor]]:
        """Wait at most ``timeout`` for a posted receive; returns (version, buffers)."""
        src, out = posted.src, posted.tensors
        values = out[1:]
        if posted.via_shm:
            assert self.shm is not None
            got, version, slot, gen = self.shm.listen(src, posted.tag, what, unit)
        else:
            self._wait_works(posted.works, time.monotonic() + self.timeout_s, src, unit, what)
            got, version = out[0][:2].tolist()
        if got != unit:
            raise RunError(
                f"rank {self.rank}: expected {what} of unit {unit} from rank {src}, got unit {got}"
            )
        if posted.via_shm and values:
            assert self.shm is not None
            if slot < 0:
                raise RunError(
                    f"rank {self.rank}: {what} of unit {unit} from rank {src} came without its values"
                )
            values, lease = self.shm.take(slot, gen, values, src, posted.tag, hold=posted.hold)
            if lease is not None:
                self.leases.setdefault(unit, []).append(lease)
        return version, [t.to(self.device) for t in values]

    def release(self, unit: int) -> None:
        """Free the slots whose values ``unit`` used in place (its backward is done)."""
        for lease in self.leases.pop(unit, ()):
            lease.release()

    def _wait_works(self, works: list[dist.Work], deadline: float, src: int, unit: int, what: str) -> None:
        for work in works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                ok = work.wait(timeout=timedelta(seconds=left))
            except RuntimeError as exc:
                first = str(exc).splitlines()[0] if str(exc) else "timeout"
                if _broken(first):
                    raise RunError(
                        f"rank {self.rank}: lost rank {src} while waiting for {what} of unit {unit} "
                        f"({_broken(first)} by peer)"
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
        """Wait for every send in flight (end of a program)."""
        if self.poster is not None:
            self.poster.join(self.timeout_s)
        for work, _ in self.pending:
            self._wait_send(work)
        self.pending = []

    def _wait_send(self, work: dist.Work) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise RunError(
                f"rank {self.rank}: a send was not received within {self.timeout_s:g}s ({str(exc).splitlines()[0]})"
            ) from None


class _Poster:
    """A thread that posts this worker's sends, in the order they were asked for.

    gloo writes a message into the socket inside ``isend`` when the receiver is already
    waiting for it, so posting a send costs the sender as long as copying the message (an
    800 KB activation gradient: ~9% of the last stage's time on the 2-stage CNN, py-spy).
    From this thread the copy overlaps the worker's next forward or backward (``isend``
    releases the GIL), as PipeDream's runtime sent from helper threads. One thread keeps the
    order: messages to a peer arrive in the order both ends expect.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.queue: queue.Queue[tuple[list[torch.Tensor], int, int]] = queue.Queue()
        self.error: tuple[BaseException, int] | None = None  # the first failure and its destination
        threading.Thread(target=self._loop, name="pdrun-send", daemon=True).start()

    def put(self, held: list[torch.Tensor], dst: int, tag: int) -> None:
        self._raise()
        self.queue.put((held, dst, tag))

    def join(self, timeout_s: float) -> None:
        """Wait until every send asked for is posted (its completion is ``Comm.drain``'s to wait for)."""
        done = self.queue.all_tasks_done
        with done:
            if not done.wait_for(lambda: self.queue.unfinished_tasks == 0, timeout_s):
                raise RunError(f"rank {self.comm.rank}: sends not posted within {timeout_s:g}s")
        self._raise()

    def _loop(self) -> None:
        while True:
            held, dst, tag = self.queue.get()
            try:
                if self.error is None:
                    self.comm._post(held, dst, tag)
            except BaseException as exc:  # reported to the worker's thread at its next send or drain
                self.error = (exc, dst)
            finally:
                self.queue.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            exc, dst = self.error
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            why = _broken(first)
            if why:
                raise RunError(f"rank {self.comm.rank}: lost rank {dst} while sending to it ({why} by peer)")
            raise RunError(f"rank {self.comm.rank}: a send to rank {dst} failed ({first})")
