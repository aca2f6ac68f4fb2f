"""Measuring the link between two workers, to plan with the bandwidth the run will see.

The planner takes the bandwidth of each level as given; a wrong figure makes every
prediction wrong (on this host two gloo processes on 127.0.0.1 move about 2.7 GB/s, not
the 1 GB/s one might guess). ``pdrun link`` starts two processes on this machine, joins
them the way pdrun's workers on one host are joined (shared memory, pdrun/transport/shm.py, where
``--transport auto`` would use it; else the backend), and times round trips of a small and
a large message, with each receive posted before its message is sent (as pdrun's workers
post theirs) and, through shared memory, the values read where they arrive (as pdrun's
workers use them in place). Half a round trip is the one-way time of a
size; the latency is the small message's one-way time and the bandwidth the large
message's extra bytes over its extra time.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException, spawn

from pdrun.transport.choose import launcher_tag
from pdrun.transport.shm import ShmLinks, host_supports
from shared.errors import RunError

SMALL = 8  # bytes: one float64, the latency probe


@dataclass(frozen=True)
class Link:
    """One-way seconds per message size, and the latency and bandwidth they imply."""

    sizes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    latency_s: float
    bandwidth: float  # bytes/s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _work(work: dist.Work | None) -> dist.Work:
    if work is None:  # only when this rank is outside the group, which two ranks never are
        raise RunError("pdrun link: the backend returned no work for a point-to-point message")
    return work


def shm_usable(backend: str) -> bool:
    """Whether pdrun's workers on this host would pass messages through shared memory (pdrun.transport.choose)."""
    return backend == "gloo" and host_supports()


# Bytes of source buffers the shared-memory probe rotates through: more than a last-level cache, so
# that each message is copied from memory, as a freshly computed activation mostly is, not from a
# cache still warm from the last round trip (which measured ~50 GB/s here instead of ~30).
_COLD_BYTES = 64 << 20


def cold_sources(like: torch.Tensor, trips: int) -> list[torch.Tensor]:
    """Buffers like ``like`` to send from in turn: ``_COLD_BYTES`` of them, never more than ``trips``.

    The cap matters for the latency probe: its 8 bytes would otherwise ask for millions of
    tensors (a minute of start-up) that no round trip sends.
    """
    count = min(trips, max(1, _COLD_BYTES // (like.numel() * like.element_size())))
    return [torch.rand_like(like) for _ in range(count)]


def _shm_round_trips(links: ShmLinks, rank: int, buf: torch.Tensor, repeats: int) -> list[float]:
    """Round trips through shared-memory links: values into a slot, the header through the bell.

    Each end reads what it received where it lies before it answers, as a stage's first layer
    reads its input (or a backward its incoming gradient) in place: a message has arrived when
    its bytes have crossed to the receiver's core, which is where a pipeline pays for them.
    """
    peer, times = 1 - rank, []
    sources = cold_sources(buf, repeats + 2)
    count = len(sources)
    out_tag, in_tag = (1, 2) if rank == 0 else (2, 1)
    for i in range(repeats + 2):  # two warm-up round trips
        start = time.perf_counter()
        if rank == 1:
            _receive(links, peer, in_tag, buf, i)
        slot, gen = links.put([sources[i % count]], peer, out_tag)
        links.ring([i, 0, slot, gen], peer, out_tag)
        if rank == 0:
            _receive(links, peer, in_tag, buf, i)
            if i >= 2:
                times.append(time.perf_counter() - start)
    return times


def _receive(links: ShmLinks, peer: int, tag: int, like: torch.Tensor, i: int) -> None:
    _, _, slot, gen = links.listen(peer, tag, "link probe", i)
    got, lease = links.take(slot, gen, [like], peer, tag, hold=True)
    got[0].sum()  # read in place, as the next layer will
    if lease is not None:
        lease.release()


def _worker(
    rank: int, port: int, sizes: list[int], repeats: int, backend: str, shm: bool, out: dict[int, float]
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    # Named after the measuring process as a launcher's links are (``-l<pid>-``), so that a sweep or
    # leak check of other runs' leftovers tells these, still in use, from a dead run's.
    links = ShmLinks(f"link-{launcher_tag(os.getppid())}-{port}", rank, 60.0) if shm else None
    try:
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
            if links is not None:
                times = _shm_round_trips(links, rank, buf, repeats)
            else:
                times = _backend_round_trips(rank, buf, repeats)
            if rank == 0:
                out[size] = statistics.median(times) / 2
    finally:
        if links is not None:
            links.close()
        dist.destroy_process_group()


def _backend_round_trips(rank: int, buf: torch.Tensor, repeats: int) -> list[float]:
    """Round trips over the process group's backend, each receive posted before the peer can answer."""
    peer, times = 1 - rank, []
    back = torch.empty_like(buf)
    for i in range(repeats + 2):  # two warm-up round trips
        if rank == 0:
            incoming = _work(dist.irecv(back, peer, tag=2))
            start = time.perf_counter()
            _work(dist.isend(buf, peer, tag=1)).wait()
            incoming.wait()
            if i >= 2:
                times.append(time.perf_counter() - start)
        else:
            _work(dist.irecv(back, peer, tag=1)).wait()
            _work(dist.isend(back, peer, tag=2)).wait()
    return times


def measure(size: int = 4 << 20, repeats: int = 20, backend: str = "gloo", shm: bool = False) -> Link:
    """Time two processes on this machine exchanging ``SMALL`` and ``size``-byte messages (``shm``: through
    shared-memory links, as pdrun's workers on one host do)."""
    if size <= SMALL:
        raise RunError(f"--size: expected more than {SMALL} bytes, got {size}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [SMALL, size]
    with multiprocessing.get_context("spawn").Manager() as manager:
        out = manager.dict()
        try:
            spawn(_worker, args=(_free_port(), sizes, repeats, backend, shm, out), nprocs=2, join=True)  # type: ignore[no-untyped-call]
        except ProcessRaisedException as exc:
            raise RunError(
                f"pdrun link: a probe process failed: {str(exc).strip().splitlines()[-1]}"
            ) from None
        times = tuple(float(out[s]) for s in sizes)
    extra = times[1] - times[0]
    bandwidth = (size - SMALL) / extra if extra > 0 else float("inf")
    return Link(tuple(sizes), times, times[0], bandwidth)
