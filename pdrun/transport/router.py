"""The worker's one transport: every message goes to its peer's carrier, every bucket sum to the stage's.

The worker posts receives, waits for them, sends, releases what a unit received, and sums
its replicas' gradients, without knowing what carries them: ``pdrun/transport/choose.py``
gave each peer a carrier (shared memory within a node, gloo across) and the stage its sum.
Sends are posted from a helper thread where a core is spare, else by the worker itself.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdrun.transport.gloo import broken
from pdrun.transport.interface import Carrier, PostedRecv, ReplicaSum
from shared.errors import RunError

# Benchmarks only: an emulated slow link. With this set to B (bytes/s), every send first sleeps
# bytes / B, the same emulation bench/slow_link.py applies to the baselines (docs/benchmarks.md).
EMULATE_BANDWIDTH_ENV = "PIPEDREAM_EMULATE_BANDWIDTH"

# (stage, its replicas' ranks, their process group, the buckets' (elements, dtype)) -> their sum
SumOf = Callable[[int | str, Sequence[int], Any, list[tuple[int, torch.dtype]]], ReplicaSum]


def emulated_bandwidth() -> float | None:
    """The emulated link's bytes/s from the environment, or None (no emulation)."""
    value = os.environ.get(EMULATE_BANDWIDTH_ENV, "")
    try:
        bandwidth = float(value) if value else 0.0
    except ValueError:
        return None
    return bandwidth if bandwidth > 0 else None


class Transport:
    """This worker's messages and replica sums, routed per peer; the time they take is the worker's to count."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        wire: torch.device,
        timeout_s: float,
        carriers: dict[int, Carrier],
        sum_of: SumOf,
        send_thread: bool = True,
    ) -> None:
        self.rank = rank
        self.device = device
        self.wire = wire  # the backend's device: where a header is made, and collectives run
        self.timeout_s = timeout_s
        self.carriers = carriers  # by peer rank: every peer this rank may message has one
        self.sum_of = sum_of
        self.send_thread = send_thread  # shared.host.send_thread_pays: else the worker posts its own sends
        self.bandwidth = emulated_bandwidth()
        self.poster: _Poster | None = None  # started with the first send
        self.used: dict[int, str] = {}  # peer -> what carried the messages to or from it
        self.summed: str | None = None  # what summed this stage's replicas' gradients, if anything did
        self.tie_summed: str | None = None  # what summed its tied parameters' gradients, if it holds any

    def _carrier(self, peer: int) -> Carrier:
        carrier = self.carriers.get(peer)
        if carrier is None:
            raise RunError(f"rank {self.rank}: no carrier to rank {peer} (world of {len(self.carriers) + 1})")
        self.used.setdefault(peer, carrier.kind)
        return carrier

    def _distinct(self) -> list[Carrier]:
        return list({id(c): c for c in self.carriers.values()}.values())

    def header(self, unit: int, version: int) -> torch.Tensor:
        """A message's header: the unit, the weight version, and two fields a carrier may fill in."""
        return torch.tensor([unit, version, -1, -1], dtype=torch.int64, device=self.wire)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        """Post a message (its header first); its tensors stay referenced until the peer has them."""
        carrier = self._carrier(dst)
        held = carrier.hold(tensors)
        if self.bandwidth is not None:
            # The emulated link blocks the sender, as the baselines' emulation does (docs/benchmarks.md).
            time.sleep(sum(t.numel() * t.element_size() for t in held) / self.bandwidth)
            carrier.send(held, dst, tag)
            return
        if not self.send_thread:
            carrier.send(held, dst, tag)
            return
        if self.poster is None:
            self.poster = _Poster(self)
        self.poster.put(held, dst, tag)

    def post(self, buffers: Sequence[torch.Tensor], src: int, tag: int, hold: bool = False) -> PostedRecv:
        """Start receiving a message from ``src`` into ``buffers`` now (its transfer may run while this
        worker computes); ``wait`` for it later. With ``hold`` the values may stay where they arrived,
        instead of being copied into ``buffers``, until ``release`` of the unit."""
        return self._carrier(src).post(buffers, src, tag, hold)

    def wait(self, posted: PostedRecv, unit: int, what: str) -> tuple[int, list[torch.Tensor]]:
        """Wait at most the timeout for a posted receive; returns (version, values on this worker's device)."""
        version, values = self._carrier(posted.src).wait(posted, unit, what)
        return version, [t.to(self.device) for t in values]

    def recv(
        self, buffers: Sequence[torch.Tensor], src: int, tag: int, unit: int, what: str
    ) -> tuple[int, list[torch.Tensor]]:
        """Receive a message now: ``post`` and ``wait``."""
        return self.wait(self.post(buffers, src, tag), unit, what)

    def release(self, unit: int) -> None:
        """``unit`` is done with what it received (its backward has run): a carrier may reuse its room."""
        for carrier in self._distinct():
            carrier.release(unit)

    def replica_sum(
        self, stage: int, ranks: Sequence[int], group: Any, buckets: list[tuple[int, torch.dtype]]
    ) -> ReplicaSum:
        """The sum of ``buckets`` over stage ``stage``'s replicas ``ranks`` (every replica asks together)."""
        made = self.sum_of(stage, ranks, group, buckets)
        self.summed = made.kind
        return made

    def tie_sum(
        self, name: str, ranks: Sequence[int], group: Any, buckets: list[tuple[int, torch.dtype]]
    ) -> ReplicaSum:
        """The sum of ``buckets`` over the ranks of the stages that hold tied parameters (``pdrun.tied``),
        named ``name``: shared memory where a replicated stage's sum would take it, else the group's
        all-reduce (every one of ``ranks`` asks together)."""
        made = self.sum_of(name, ranks, group, buckets)
        self.tie_summed = made.kind
        return made

    def drain(self) -> None:
        """Wait for every send in flight (end of a program)."""
        if self.poster is not None:
            self.poster.join(self.timeout_s)
        for carrier in self._distinct():
            carrier.drain()

    def close(self) -> None:
        for carrier in self._distinct():
            carrier.close()


class _Poster:
    """A thread that posts this worker's sends, in the order they were asked for.

    gloo writes a message into the socket inside ``isend`` when the receiver is already
    waiting for it, so posting a send costs the sender as long as copying the message (an
    800 KB activation gradient: ~9% of the last stage's time on the 2-stage CNN, py-spy).
    From this thread the copy overlaps the worker's next forward or backward (``isend``
    releases the GIL), as PipeDream's runtime sent from helper threads. One thread keeps the
    order: messages to a peer arrive in the order both ends expect.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.queue: queue.Queue[tuple[list[torch.Tensor], int, int]] = queue.Queue()
        self.error: tuple[BaseException, int] | None = None  # the first failure and its destination
        threading.Thread(target=self._loop, name="pdrun-send", daemon=True).start()

    def put(self, held: list[torch.Tensor], dst: int, tag: int) -> None:
        self._raise()
        self.queue.put((held, dst, tag))

    def join(self, timeout_s: float) -> None:
        """Wait until every send asked for is posted (its completion is the carrier's ``drain``)."""
        done = self.queue.all_tasks_done
        with done:
            if not done.wait_for(lambda: self.queue.unfinished_tasks == 0, timeout_s):
                raise RunError(f"rank {self.transport.rank}: sends not posted within {timeout_s:g}s")
        self._raise()

    def _loop(self) -> None:
        while True:
            held, dst, tag = self.queue.get()
            try:
                if self.error is None:
                    self.transport.carriers[dst].send(held, dst, tag)
            except BaseException as exc:  # reported to the worker's thread at its next send or drain
                self.error = (exc, dst)
            finally:
                self.queue.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            exc, dst = self.error
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            why = broken(first)
            if why:
                raise RunError(
                    f"rank {self.transport.rank}: lost rank {dst} while sending to it ({why} by peer)"
                )
            raise RunError(f"rank {self.transport.rank}: a send to rank {dst} failed ({first})")
