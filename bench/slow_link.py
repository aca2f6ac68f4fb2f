"""The emulated slow link between workers: a delay of bytes / bandwidth on every transfer.

Every system pays the same price for the same bytes. Before a worker sends a tensor to
another worker it sleeps ``bytes / bandwidth`` seconds, as if its link carried nothing else
for that long; the receiver simply waits for the data, as it would on a real slow link.
Pipelines pay it on each activation and gradient they send (``torch.distributed.pipelining``
through its point-to-point batching function, pdrun through its communication layer, which
reads the same bandwidth from ``PIPEDREAM_EMULATE_BANDWIDTH``); DDP pays it in a gradient
communication hook, for the bytes a ring all-reduce sends from each worker:
``2 (n - 1) / n`` times the bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ENV_VAR = "PIPEDREAM_EMULATE_BANDWIDTH"


def delay_s(nbytes: float, bandwidth: float | None) -> float:
    """Seconds that ``nbytes`` take on a link of ``bandwidth`` bytes/s (0 without emulation)."""
    if not bandwidth or nbytes <= 0:
        return 0.0
    return nbytes / bandwidth


def pay(nbytes: float, bandwidth: float | None) -> None:
    """Sleep for the time ``nbytes`` take on the emulated link."""
    seconds = delay_s(nbytes, bandwidth)
    if seconds > 0:
        time.sleep(seconds)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def patch_pipelining(bandwidth: float | None) -> None:
    """Make ``torch.distributed.pipelining`` pay the link for every tensor it sends."""
    if not bandwidth:
        return
    from torch.distributed.pipelining import schedules

    original: Callable[..., Any] = schedules._batch_p2p

    def batch_p2p(p2p_ops: list[dist.P2POp], desc: str | None = None) -> Any:
        sent = sum(tensor_bytes(op.tensor) for op in p2p_ops if op.op is dist.isend)
        pay(sent, bandwidth)
        return original(p2p_ops, desc=desc)

    schedules._batch_p2p = batch_p2p


def ddp_hook(bandwidth: float | None, world: int) -> Callable[[Any, Any], Any]:
    """A DDP communication hook: pay the link for this worker's share of a ring all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state: Any, bucket: Any) -> Any:
        pay(2 * (world - 1) / world * tensor_bytes(bucket.buffer()), bandwidth)
        return allreduce_hook(state, bucket)

    # DDP checks the hook's annotations; under postponed evaluation they would be strings.
    bucket_type: Any = dist.GradBucket  # type: ignore[attr-defined]
    hook.__annotations__ = {
        "state": object,
        "bucket": bucket_type,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook
