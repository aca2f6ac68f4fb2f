"""Shared-memory links between workers on one host: what goes in comes out, in order, and nothing is left behind."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from pdrun.shm import SLOTS, ShmLinks
from shared.errors import RunError


def _pair(timeout_s: float = 5.0) -> tuple[ShmLinks, ShmLinks]:
    job = f"test-{uuid.uuid4().hex[:8]}"
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
            seq, gen = sender.put(payload, dst=1, tag=1)
            assert (seq, gen) == (unit, 0)
            out = [
                torch.empty(4, 5, 5, 3),
                torch.empty(2, dtype=torch.int64),
                torch.empty((), dtype=torch.bool),
                torch.empty(0),
            ]
            receiver.take(seq, gen, out, src=0, tag=1)
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
        for (seq, gen), want in zip([(0, 0), (0, 1), (1, 1)], [small, large, small], strict=True):
            out = [torch.empty_like(want)]
            receiver.take(seq, gen, out, 0, 2)
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
