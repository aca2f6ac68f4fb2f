"""Shared-memory links between workers on one host: what goes in comes out, in order, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from pdrun.transport import launcher_tag, shm
from pdrun.transport.shm import RING, SLOTS, ShmLinks
from shared.errors import RunError


def _pair(timeout_s: float = 5.0) -> tuple[ShmLinks, ShmLinks]:
    # Named after this live process as a launcher's links are (``-l<pid>-``): a leak check running
    # beside this test under pytest-xdist (test_reliability_failures) does not take them for a leak.
    job = f"test-{launcher_tag(os.getpid())}-{uuid.uuid4().hex[:8]}"
    return ShmLinks(job, 0, timeout_s), ShmLinks(job, 1, timeout_s)


def _names(job: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"pdrun-{job}-*"))


def test_values_of_every_dtype_and_layout_arrive_in_order() -> None:
    sender, receiver = _pair()
    try:
        for unit in range(3 * SLOTS):  # round the ring three times, the receiver one message behind at most
            acts = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
            payload = [
                acts,
                torch.tensor([unit, -unit], dtype=torch.int64),
                torch.tensor(True),
                torch.zeros(0),
            ]
            slot, gen = sender.put(payload, dst=1, tag=1)
            assert (slot, gen) == (0, 0)  # the receiver freed it: the lowest slot again
            out = [
                torch.empty(4, 5, 5, 3),
                torch.empty(2, dtype=torch.int64),
                torch.empty((), dtype=torch.bool),
                torch.empty(0),
            ]
            got_out, lease = receiver.take(slot, gen, out, src=0, tag=1)
            assert got_out is out and lease is None  # copied (no hold asked for), the slot freed
            for got, want in zip(out, payload, strict=True):
                assert torch.equal(got, want)
        assert _names(sender.job) == []  # the receiver removed the name once it had mapped the link
    finally:
        sender.close()


def test_a_larger_message_starts_a_new_generation() -> None:
    sender, receiver = _pair()
    try:
        small, large = torch.arange(10.0), torch.arange(1000.0)
        assert sender.put([small], 1, 2) == (0, 0)
        assert sender.put([large], 1, 2) == (0, 1)  # a new file, with larger slots
        assert sender.put([small], 1, 2) == (1, 1)
        for (slot, gen), want in zip([(0, 0), (0, 1), (1, 1)], [small, large, small], strict=True):
            out = [torch.empty_like(want)]
            receiver.take(slot, gen, out, 0, 2)
            assert torch.equal(out[0], want)
    finally:
        sender.close()


def test_a_full_ring_times_out_naming_the_peer_and_close_removes_the_names() -> None:
    sender, _ = _pair(timeout_s=0.2)
    for _ in range(SLOTS):
        sender.put([torch.ones(3)], 1, 1)
    assert len(_names(sender.job)) == 1
    with pytest.raises(RunError, match="rank 1 took no message"):
        sender.put([torch.ones(3)], 1, 1)  # nobody reads: every slot still holds an unread message
    sender.close()
    assert _names(sender.job) == []


def test_a_missing_link_is_one_clear_error() -> None:
    _, receiver = _pair()
    with pytest.raises(RunError, match="cannot map rank 0's shared-memory link"):
        receiver.take(0, 0, [torch.empty(3)], 0, 1)


def test_a_link_that_would_not_fit_in_dev_shm_is_refused_clearly() -> None:
    # Filling tmpfs would kill the writer with SIGBUS: a link takes at most half of what is free.
    stat = os.statvfs("/dev/shm")
    too_big = stat.f_bavail * stat.f_frsize  # two slots of this could never fit in half of it
    sender, _ = _pair()
    with pytest.raises(RunError, match="too little for two"):
        sender._create(1, 1, too_big, 0)
    assert _names(sender.job) == []


def test_held_values_are_used_in_place_until_released_and_at_most_half_the_ring_is_held() -> None:
    sender, receiver = _pair(timeout_s=0.5)
    try:
        sent = [torch.full((2, 3), float(i)) for i in range(SLOTS)]
        leases, views = [], []
        for i, t in enumerate(sent):  # a GPipe stage: every forward before any backward
            slot, gen = sender.put([t], 1, 1)
            out = [torch.empty(2, 3)]
            got, lease = receiver.take(slot, gen, out, 0, 1, hold=True)
            assert torch.equal(got[0], t)
            if i < SLOTS // 2:
                assert lease is not None and got[0] is not out[0]  # a view of the slot: no copy
                leases.append(lease)
                views.append(got[0])
            else:
                assert lease is None and got is out  # half the ring held: copied, so the sender goes on
        link = receiver.inp[(0, 1)]
        assert int(link.full.sum()) == SLOTS // 2
        for _ in range(SLOTS // 2):  # the sender only finds the free half, and never overwrites a held slot
            slot, _ = sender.put([torch.zeros(2, 3)], 1, 1)
            assert slot >= SLOTS // 2
        for view, t in zip(views, sent, strict=False):
            assert torch.equal(view, t)
        # Each held value is its own tensor to autograd: freeing a slot or changing one input in place
        # must not look like a change of another that a backward saved.
        before = [v._version for v in views[1:]]
        views[0].mul_(1.0)
        assert [v._version for v in views[1:]] == before
        with pytest.raises(RunError, match="rank 1 took no message"):
            sender.put([torch.zeros(2, 3)], 1, 1)
        leases[3].release()
        assert sender.put([torch.ones(2, 3)], 1, 1)[0] == 3  # the freed slot is the one reused
    finally:
        sender.close()


def test_headers_come_through_the_bell_in_order_and_wake_a_sleeping_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm, "_LIVENESS_S", 30.0)  # unless woken, a receiver sleeps 30 s between checks
    sender, receiver = _pair()
    try:
        for n in range(2 * RING + 3):  # round the bell's ring twice
            sender.ring([n, n + 1, n % SLOTS, 0], dst=1, tag=2)
            assert receiver.listen(0, 2, "activations", n) == [n, n + 1, n % SLOTS, 0]
        assert _names(sender.job) == []  # both ends have the bell mapped: the second removed its name
        # A receiver asleep on the bell wakes when the header is posted (futex), not at its next check.
        late = threading.Timer(0.05, lambda: sender.ring([7, 0, -1, -1], 1, 2))
        start = time.monotonic()
        late.start()
        assert receiver.listen(0, 2, "gradients", 7) == [7, 0, -1, -1]
        assert time.monotonic() - start < 1.0
        late.join()
    finally:
        sender.close()
        receiver.close()
    assert _names(sender.job) == []


def test_a_silent_sender_is_named_after_the_timeout_and_a_dead_one_at_once() -> None:
    sender, receiver = _pair(timeout_s=0.3)
    try:
        with pytest.raises(RunError, match=r"rank 1: no gradients of unit 5 from rank 0 within 0\.3s"):
            receiver.listen(0, 2, "gradients", 5)
        gone = subprocess.Popen(["true"])
        gone.wait()  # reaped: its pid runs no more
        receiver.pids[0] = gone.pid
        receiver.timeout_s = 60.0
        start = time.monotonic()
        with pytest.raises(RunError, match="rank 1: lost rank 0 while waiting for activations of unit 5"):
            receiver.listen(0, 1, "activations", 5)
        assert time.monotonic() - start < 5.0
        for n in range(RING):  # nobody listens: the bell fills, and the sender then names the receiver
            sender.ring([n, 0, -1, -1], 1, 3)
        sender.timeout_s = 0.2
        with pytest.raises(RunError, match="rank 1 took no message"):
            sender.ring([RING, 0, -1, -1], 1, 3)
    finally:
        sender.close()
        receiver.close()
