"""Messages between workers of one node through shared memory: no gloo, a copy in, out only when needed.

Over gloo's loopback TCP a 1.6 MB activation took 1.2-2 ms in a busy 2-stage pipeline on
2 cores (0.35 ms idle): the bytes go through the kernel twice, in chunks, each a wake-up of
gloo's threads. Here a link from one worker to another (one per tag) is a file in
``/dev/shm`` holding a ring of slots, mapped by both, and a *bell*: a second small file
with the link's headers in order and a futex word (pdrun/transport/futex.py). The sender copies a
message's values into a free slot, writes the header (unit, weight version, slot,
generation), counts it posted and wakes the receiver, which sleeps on the word in the
kernel when the header is not there yet. Even a 32-byte header over gloo took ~0.14 ms
to be seen by a receiver on a busy host, each message a handshake between gloo threads of
two processes that had to be scheduled.

The receiver either copies the slot out into its buffers and frees it at once, or *holds*
it: the values are used where they lie, as the unit's input or incoming gradient, and the
slot is freed when the unit's backward is done (``Lease.release``). Holding saves the
second copy, which sat on the critical path of every round trip between stages (a 1.6 MB
copy is 0.2-0.5 ms on this VM). A receiver holds at most half the slots of a link and
copies the rest, so a sender is never more than half a ring from a free slot however long
the receiver keeps its units (GPipe's forwards all come before their backwards).

A message larger than the slots (the first message sizes them; a last, partial batch is
smaller) starts a new generation of the link, a new file with larger slots, and the header
names the generation too: the receiver, reading in order, has then read everything the old
one held (slots it still holds stay mapped until released).

The slots' file: a control block (slot bytes, slots, then one flag per slot: 1 while it
holds a message the receiver has not freed), then the slots. The sender creates it before
its first header; the receiver maps it on the first header that names a slot, then removes
the name (the mapping stays). A bell is created by whichever end comes first (a new one is
zeros: nothing posted) and its name removed by both at the end. Counts and flags are plain
stores, published in order on x86 only: other hosts use gloo (pdrun/transport/choose.py).
A receiver waiting for a header checks every 0.1 s that the sender's process still runs,
so a dead peer is named at once rather than after the timeout.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from pdrun.orphan import running
from pdrun.transport import futex
from pdrun.transport.interface import PostedRecv, expect_unit
from shared.errors import RunError

SLOTS = 16  # messages in a link at once (fewer where /dev/shm is small); a receiver holds at most half
_ALIGN = 64  # every tensor starts on a cache line, so a slot's bytes view as any dtype
_FIELDS = 2  # int64 slot_bytes, int64 slots; then the slots' flags


def _control_bytes(slots: int) -> int:
    return aligned(8 * (_FIELDS + slots))


def aligned(n: int) -> int:
    """``n`` rounded up to a whole number of cache lines."""
    return -(-n // _ALIGN) * _ALIGN


SHM_DIR = Path("/dev/shm")


def host_supports() -> bool:
    """Whether links can run here: a ``/dev/shm``, and an x86 CPU, whose stores stay in order (module doc)."""
    return platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir()


def _path(job: str, src: int, dst: int, tag: int, gen: int) -> Path:
    return SHM_DIR / f"pdrun-{job}-{src}-{dst}-{tag}-{gen}"


def map_shared(path: Path, size: int) -> torch.Tensor:
    """``size`` bytes of the file ``path``, mapped shared; created (all zeros) if it is not there yet.

    Every process that maps a file this way sees the same bytes, whichever came first: a
    second ``ftruncate`` to the same size changes nothing.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def run_job(run_id: str, node: str, master_port: int) -> str:
    """The links' name for one node's ranks of one run: they derive it alike, no other run shares its port.

    ``node`` tells the nodes of a run apart (two may share a host, and a multi-node run's id is
    the same on every node): a sweep of one node's leftovers leaves another's links alone.
    """
    return f"{run_id}-{node}-{master_port}"


def remove_run_links(run_id: str, node: str) -> None:
    """Remove every link of ``node``'s ranks of the run ``run_id`` still named (a killed worker's)."""
    for path in SHM_DIR.glob(f"pdrun-{run_id}-{node}-*"):
        path.unlink(missing_ok=True)


def _offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each tensor starts in a slot, and the bytes the message takes."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += aligned(t.numel() * t.element_size())
    return offsets, end


def _alias(mem: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``like`` over ``mem``'s bytes from ``start``: its own tensor, not a view.

    Views share their base's version counter: a slot freed (a flag written) or another
    unit's input changed in place would then look, to autograd, like a change of every held
    input it saved for a backward.
    """
    t = torch.empty(0, dtype=like.dtype)
    return t.set_(mem.untyped_storage(), start // like.element_size(), like.shape, like.stride())


class _Link:
    def __init__(self, path: Path, mem: torch.Tensor, gen: int) -> None:
        self.path = path
        self.gen = gen
        self.mem = mem  # uint8, the whole file
        fields = mem[: 8 * _FIELDS].view(torch.int64)
        self.slot_bytes = int(fields[0])
        self.slots = int(fields[1])
        flags = mem.numpy()[8 * _FIELDS : 8 * (_FIELDS + self.slots)]
        self.full: np.ndarray = flags.view(np.int64)  # per slot: 1 while it holds a message not yet freed
        self.start = _control_bytes(self.slots)
        self.held = 0  # receiver: slots it holds for later release

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        start = self.start + index * self.slot_bytes
        return self.mem[start : start + nbytes]


class Lease:
    """A slot whose values a receiver uses in place; ``release`` frees it for the sender."""

    def __init__(self, link: _Link, index: int) -> None:
        self.link, self.index = link, index

    def release(self) -> None:
        self.link.full[self.index] = 0
        self.link.held -= 1


RING = 64  # headers a sender may be ahead of its receiver on one link
_BELL_FIELDS = 8  # int64: posted, futex word (low half), taken, sender mapped, receiver mapped; then headers
_POSTED, _TAKEN, _WORD = 0, 2, 2  # the futex word is int32 number 2, the low half of int64 number 1
_MAPPED = 3  # + 0 (sender) or 1 (receiver): that end has the bell mapped
_LIVENESS_S = 0.1  # how often a waiting receiver checks that its sender still runs


class _Bell:
    """The headers of one link, in order, and a futex word a receiver sleeps on until the next one."""

    def __init__(self, path: Path, receiver: bool) -> None:
        self.path = path
        size = 8 * (_BELL_FIELDS + 4 * RING)
        self.mem = map_shared(path, size)  # either end may come first; a new bell: nothing posted
        self.words: np.ndarray = self.mem.numpy().view(np.int64)
        self.word32: np.ndarray = self.mem.numpy().view(np.int32)
        self.address = self.mem.data_ptr() + 4 * _WORD
        self.count = 0  # headers this end has posted (sender) or taken (receiver)
        # The second end to map the bell removes its name, so that a killed run leaves nothing behind.
        self.words[_MAPPED + receiver] = 1
        if self.words[_MAPPED + (not receiver)]:
            path.unlink(missing_ok=True)

    def entry(self, n: int) -> np.ndarray:
        start = _BELL_FIELDS + 4 * (n % RING)
        return self.words[start : start + 4]


class ShmLinks:
    """This worker's shared-memory links, to and from its peers of the node.

    Values go through the links' slots, headers through their bells: no message between two
    workers of the node touches gloo. ``pids`` (rank -> process id) lets a waiting receiver
    tell a dead sender from a slow one.
    """

    def __init__(self, job: str, rank: int, timeout_s: float, pids: Mapping[int, int] | None = None) -> None:
        self.job, self.rank, self.timeout_s = job, rank, timeout_s
        self.pids = dict(pids or {})
        self.out: dict[tuple[int, int], _Link] = {}
        self.inp: dict[tuple[int, int], _Link] = {}
        self.bells: dict[tuple[int, int, int], _Bell] = {}
        self.created: list[Path] = []

    def _bell(self, src: int, dst: int, tag: int) -> _Bell:
        bell = self.bells.get((src, dst, tag))
        if bell is None:
            path = SHM_DIR / f"pdrun-{self.job}-{src}-{dst}-{tag}-bell"
            bell = self.bells[(src, dst, tag)] = _Bell(path, receiver=dst == self.rank)
            self.created.append(path)
        return bell

    def ring(self, header: Sequence[int], dst: int, tag: int) -> None:
        """Post a message's header (unit, version, slot, generation) to ``dst`` and wake it."""
        bell = self._bell(self.rank, dst, tag)
        n = bell.count
        self._await_receiver(lambda: n - int(bell.words[_TAKEN]) < RING, dst)
        bell.entry(n)[:] = header
        # x86 keeps stores in order: a receiver that sees the count also sees the header and the values.
        bell.words[_POSTED] = n + 1
        bell.word32[_WORD] = (n + 1) & 0x7FFFFFFF
        bell.count = n + 1
        futex.wake(bell.address)

    def listen(self, src: int, tag: int, what: str, unit: int) -> list[int]:
        """The next header from ``src``: wait for it, asleep, at most the timeout."""
        bell = self._bell(src, self.rank, tag)
        n = bell.count
        deadline = time.monotonic() + self.timeout_s
        while True:
            word = int(bell.word32[_WORD])  # read before the count: a post in between changes it
            if int(bell.words[_POSTED]) > n:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunError(
                    f"rank {self.rank}: no {what} of unit {unit} from rank {src} within {self.timeout_s:g}s"
                )
            pid = self.pids.get(src)
            if pid is not None and not running(pid):
                raise RunError(f"rank {self.rank}: lost rank {src} while waiting for {what} of unit {unit}")
            futex.wait(bell.address, word, min(left, _LIVENESS_S))
        header = [int(v) for v in bell.entry(n)]
        bell.words[_TAKEN] = n + 1
        bell.count = n + 1
        return header

    def put(self, payload: list[torch.Tensor], dst: int, tag: int) -> tuple[int, int]:
        """Copy ``payload`` into the link to ``dst``: (the slot it is in, the link's generation)."""
        offsets, nbytes = _offsets(payload)
        link = self.out.get((dst, tag))
        if link is None or nbytes > link.slot_bytes:
            gen = 0 if link is None else link.gen + 1
            link = self.out[(dst, tag)] = self._create(dst, tag, max(nbytes, _ALIGN), gen)
        index = self._free_slot(link, dst)
        out = link.slot(index, nbytes)
        for t, offset in zip(payload, offsets, strict=True):
            n = t.numel() * t.element_size()
            out[offset : offset + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        link.full[index] = 1
        return index, link.gen

    def _await_receiver(self, ready: Callable[[], bool], dst: int) -> None:
        """Return once ``ready()`` (the receiver has freed room), polling; fail after the timeout."""
        deadline = None
        while not ready():
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                raise RunError(f"rank {self.rank}: rank {dst} took no message for {self.timeout_s:g}s")
            time.sleep(50e-6)

    def _free_slot(self, link: _Link, dst: int) -> int:
        """The lowest free slot, waiting for the receiver to free one.

        The lowest, not the next round the ring: a receiver that keeps up frees each slot before the
        next message, so one or two slots carry every message and stay in the caches and mapped,
        where a rotation would touch all of them (a page fault per 4 KB on each end on first use:
        a 4 MB message took 2.5 ms one way instead of 0.8).
        """
        self._await_receiver(lambda: bool((link.full == 0).any()), dst)
        return int(np.argmin(link.full))  # the first 0

    def take(
        self, index: int, gen: int, buffers: list[torch.Tensor], src: int, tag: int, hold: bool = False
    ) -> tuple[list[torch.Tensor], Lease | None]:
        """The values of the message in slot ``index`` of generation ``gen`` from ``src``.

        With ``hold`` (and fewer than half the link's slots held already) they are views of
        the slot, shaped like ``buffers``, and the slot stays taken until the lease returned
        is released; else they are copied into ``buffers`` and the slot is freed now.
        """
        link = self.inp.get((src, tag))
        if link is None or link.gen != gen:
            link = self.inp[(src, tag)] = self._open(src, tag, gen)
        offsets, nbytes = _offsets(buffers)
        data = link.slot(index, nbytes)
        if hold and link.held < link.slots // 2 and all(b.is_contiguous() for b in buffers):
            base = link.start + index * link.slot_bytes
            views = [_alias(link.mem, base + o, b) for b, o in zip(buffers, offsets, strict=True)]
            link.held += 1
            return views, Lease(link, index)
        for b, o in zip(buffers, offsets, strict=True):
            n = b.numel() * b.element_size()
            if b.is_contiguous():
                b.reshape(-1).view(torch.uint8).copy_(data[o : o + n])
            else:
                flat = torch.empty(b.shape, dtype=b.dtype)
                flat.reshape(-1).view(torch.uint8).copy_(data[o : o + n])
                b.copy_(flat)
        link.full[index] = 0
        return buffers, None

    def close(self) -> None:
        """Remove the names of this worker's links and bells (mappings in use stay valid)."""
        for path in self.created:
            path.unlink(missing_ok=True)

    def _create(self, dst: int, tag: int, slot_bytes: int, gen: int) -> _Link:
        path = _path(self.job, self.rank, dst, tag, gen)
        # A tmpfs that fills up kills the writer with SIGBUS: take at most half of what is free (fewer
        # slots for large messages), and say so clearly when not even two fit.
        stat = os.statvfs(path.parent)
        free = stat.f_bavail * stat.f_frsize
        slots = min(SLOTS, (free // 2 - _control_bytes(SLOTS)) // slot_bytes)
        if slots < 2:
            raise RunError(
                f"rank {self.rank}: {path.parent} has {free / 1e6:.0f} MB free, too little for two "
                f"{slot_bytes / 1e6:.1f} MB messages to rank {dst}; enlarge it or run with --transport gloo"
            )
        size = _control_bytes(slots) + slots * slot_bytes
        tmp = path.with_name(path.name + ".new")
        with open(tmp, "wb") as f:
            f.truncate(size)  # zeros: every slot free
        mem = torch.from_file(str(tmp), shared=True, size=size, dtype=torch.uint8)
        mem[: 8 * _FIELDS].view(torch.int64)[:] = torch.tensor([slot_bytes, slots])
        os.replace(tmp, path)  # complete before the receiver can see it
        self.created.append(path)
        return _Link(path, mem, gen)

    def _open(self, src: int, tag: int, gen: int) -> _Link:
        path = _path(self.job, src, self.rank, tag, gen)
        try:
            size = path.stat().st_size
            mem = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            raise RunError(
                f"rank {self.rank}: cannot map rank {src}'s shared-memory link {path} ({exc})"
            ) from None
        path.unlink(missing_ok=True)
        return _Link(path, mem, gen)


class ShmCarrier:
    """The transport's carrier over shared-memory links: a message's values through a slot, its header by bell."""

    kind = "shm"

    def __init__(self, links: ShmLinks) -> None:
        self.links = links
        self.leases: dict[int, list[Lease]] = {}  # by unit: slots whose values it uses in place

    def hold(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)  # copied into a slot when posted, from where they are

    def send(self, held: list[torch.Tensor], dst: int, tag: int) -> None:
        # The values into a slot of the link, the header (naming the slot) through its bell.
        slot, gen = self.links.put(held[1:], dst, tag) if len(held) > 1 else (-1, -1)
        unit, version = held[0][:2].tolist()
        self.links.ring([unit, version, slot, gen], dst, tag)

    def post(self, buffers: Sequence[torch.Tensor], src: int, tag: int, hold: bool = False) -> PostedRecv:
        """Nothing to post: the header comes through the link's bell, naming the slot of the values.

        With ``hold`` the values may stay in their slot, instead of being copied into
        ``buffers``, until ``release`` of the unit.
        """
        return PostedRecv(src, tag, list(buffers), hold=hold)

    def wait(self, posted: PostedRecv, unit: int, what: str) -> tuple[int, list[torch.Tensor]]:
        src, values = posted.src, posted.buffers
        got, version, slot, gen = self.links.listen(src, posted.tag, what, unit)
        expect_unit(self.links.rank, got, unit, what, src)
        if not values:
            return version, values
        if slot < 0:
            raise RunError(
                f"rank {self.links.rank}: {what} of unit {unit} from rank {src} came without its values"
            )
        values, lease = self.links.take(slot, gen, values, src, posted.tag, hold=posted.hold)
        if lease is not None:
            self.leases.setdefault(unit, []).append(lease)
        return version, values

    def release(self, unit: int) -> None:
        """Free the slots whose values ``unit`` used in place (its backward is done)."""
        for lease in self.leases.pop(unit, ()):
            lease.release()

    def drain(self) -> None:
        """Nothing in flight: a message is in its slot and bell once ``send`` returns."""

    def close(self) -> None:
        self.links.close()
