"""A replicated stage's gradient all-reduce, overlapped with the backward that completes it.

One flat all-reduce after the backward left the whole collective on the critical path: on
2 CPU cores a replicated MNIST CNN stage spent 3.7 ms a step in it (0.8 MB of gradients,
gloo's ring exchanging halves over loopback), as long as half its backward. As DDP does,
the parameters are cut into buckets in reverse order (the backward finishes the last
layers' gradients first), and a bucket's all-reduce starts, asynchronously, as soon as
the backward has accumulated all of its gradients; the earlier layers' backward runs
while the transport's sum (gloo's threads, or the replicas of one node through a file they
share: pdrun/transport/) moves it. The worker's ALLREDUCE instruction starts what is left
and waits for all of it.

Every replica starts the same buckets, of the same sizes, in the same order (bucket k only
after bucket k-1): a collective's order is the only thing the replicas agree on. A bucket
is started early only in the backward of the unit its ALLREDUCE instruction names, the
last gradient accumulation before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pdrun.transport import ReplicaSum
from pdrun.weights import Params

# A bucket closes once it holds this many bytes (DDP's first bucket is 1 MB; a pipeline
# stage's share of a model is smaller, and more buckets give the backward more to overlap).
BUCKET_BYTES = 256 * 1024


@dataclass
class _Bucket:
    names: list[str]
    ready: set[str] = field(default_factory=set)


class OverlappedAllReduce:
    """Buckets of a stage's parameters, reduced among its replicas during the backward."""

    def __init__(
        self,
        live: dict[str, nn.Parameter],
        average: bool,
        sum_of: Callable[[list[tuple[int, torch.dtype]]], ReplicaSum],
    ) -> None:
        """``sum_of``: given the buckets' sizes, their sum over the replicas (``pdrun.transport``)."""
        self.live = live
        self.average = average
        self.buckets: list[_Bucket] = []
        size = 0
        for name in reversed([n for n, p in live.items() if p.requires_grad]):
            if not self.buckets or size >= BUCKET_BYTES:
                self.buckets.append(_Bucket([]))
                size = 0
            self.buckets[-1].names.append(name)
            p = live[name]
            size += p.numel() * p.element_size()
        self.bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b.names}
        first = [live[b.names[0]] for b in self.buckets]
        self.sum = sum_of(
            [
                (sum(live[n].numel() for n in b.names), p.dtype)
                for b, p in zip(self.buckets, first, strict=True)
            ]
        )
        self.size = self.sum.replicas  # what an average divides by
        self.started = 0  # buckets[:started] have their sum in flight
        self.handles: list[Any] = []
        self._pending_grads: dict[str, torch.Tensor] = {}  # gradients the armed backward completed

    def arm(self, params: Params) -> None:
        """Start buckets as this backward completes their gradients (``params``: the tensors it differentiates)."""
        self.disarm()
        for name, tensor in params.items():
            if name in self.bucket_of and tensor.requires_grad:
                hook = tensor.register_post_accumulate_grad_hook(self._hook(name))  # type: ignore[no-untyped-call]
                self.handles.append(hook)

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, name: str) -> Any:
        def ready(tensor: torch.Tensor) -> None:
            bucket = self.buckets[self.bucket_of[name]]
            bucket.ready.add(name)
            if tensor.grad is not None:
                # The gradient as accumulated now: the worker moves it onto the live weights later.
                self._pending_grads[name] = tensor.grad
            self._start_ready()

        return ready

    def _start_ready(self) -> None:
        while self.started < len(self.buckets):
            bucket = self.buckets[self.started]
            if len(bucket.ready) < len(bucket.names):
                return
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        parts = []
        for n in bucket.names:
            g = self._pending_grads.get(n)
            if g is None:
                g = self.live[n].grad
            parts.append((g if g is not None else torch.zeros_like(self.live[n])).reshape(-1))
        self.sum.start(self.started, parts)
        self.started += 1

    def finish(self) -> None:
        """Start every bucket not yet started (from the live gradients), wait for all, write them back."""
        self.disarm()
        # The backward's gradients are on the live weights by now (WeightVersions.release), summed
        # with any accumulated before it: the buckets still to start take those.
        self._pending_grads = {}
        while self.started < len(self.buckets):
            self._start(self.buckets[self.started])
        for k, bucket in enumerate(self.buckets):
            flat = self.sum.total(k).to(self.live[bucket.names[0]].device)
            if self.average:
                flat /= self.size
            offset = 0
            for n in bucket.names:
                p = self.live[n]
                numel = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset : offset + numel].view_as(p))
                offset += numel
            bucket.ready.clear()
        self.started = 0
        self.sum.next_step()
