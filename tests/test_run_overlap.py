"""The replicas' all-reduce starts in buckets during the backward and leaves the gradients intact.

One process in a gloo group of one: the all-reduce is then the identity, so the gradients
after ``finish`` must equal plain autograd's, and what is checked is when each bucket starts.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from pdrun.overlap import BUCKET_BYTES, OverlappedAllReduce
from pdrun.transport.gloo_sum import GlooSum
from pdrun.transport.shm import SHM_DIR
from pdrun.transport.shm_sum import ShmSum
from pdrun.weights import WeightVersions
from shared.errors import RunError


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _gloo_sum(buckets: list[tuple[int, torch.dtype]]) -> GlooSum:
    return GlooSum(None, torch.device("cpu"))  # the world: a group of one


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 128 KB, 1 MB and 20 KB of weights: two buckets, the last two layers' first.
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _reference(x: torch.Tensor) -> dict[str, torch.Tensor]:
    model = _model()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stash", [False, True])
def test_buckets_start_during_the_backward_in_reverse_order(group_of_one: None, stash: bool) -> None:
    x = torch.randn(32, 64)
    model = _model()
    versions = WeightVersions(model, stash=stash)
    reducer = OverlappedAllReduce(versions.live, True, _gloo_sum)
    names = [n for n, _ in model.named_parameters()]
    assert [n for b in reducer.buckets for n in b.names] == names[::-1]
    for b in reducer.buckets[:-1]:
        assert sum(versions.live[n].numel() * 4 for n in b.names) >= BUCKET_BYTES
    assert [b.names for b in reducer.buckets] == [names[:1:-1], names[1::-1]]

    # Not armed: a backward starts nothing.
    version, params = versions.acquire()
    functional_call(model, params, (x,)).square().mean().backward()
    assert reducer.started == 0
    versions.release(version, params)
    model.zero_grad(set_to_none=True)

    version, params = versions.acquire()
    started_at: list[int] = []
    # The first layer's weight gradient is among the last the backward accumulates: by then
    # the buckets of the later layers are in flight.
    params["0.weight"].register_post_accumulate_grad_hook(lambda _: started_at.append(reducer.started))
    reducer.arm(params)
    functional_call(model, params, (x,)).square().mean().backward()
    reducer.disarm()
    assert started_at == [1]
    assert reducer.started == 2  # every gradient was complete when the backward ended
    versions.release(version, params)
    reducer.finish()
    want = _reference(x)
    for n, p in versions.live.items():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)
    assert reducer.started == 0 and not reducer.handles


def test_finish_reduces_what_the_backward_left(group_of_one: None) -> None:
    # An all-reduce after backwards that were not armed (earlier microbatches of a flush) reduces
    # the accumulated gradients at finish, and a parameter without one gets zeros.
    x = torch.randn(32, 64)
    model = _model()
    versions = WeightVersions(model, stash=False)
    reducer = OverlappedAllReduce(versions.live, True, _gloo_sum)
    (model[2](torch.relu(model[0](x)))).square().mean().backward()  # the last layer is not used
    reducer.finish()
    assert torch.equal(model[4].weight.grad, torch.zeros_like(model[4].weight))
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


def test_a_replica_that_never_sums_is_named_after_the_timeout(group_of_one: None) -> None:
    # The shared-memory sum (all replicas on one host) waits for every replica's bucket, then names the late one.
    job = f"test-{uuid.uuid4().hex[:8]}"
    local = ShmSum(job, 0, [0, 1], 0, [(3, torch.float32)], timeout_s=0.2, group=None)
    assert not list(SHM_DIR.glob(f"pdrun-{job}-*"))  # mapped, then its name removed
    local.start(0, [torch.ones(3)])
    with pytest.raises(RunError, match=r"no gradients from replica rank 1 within 0\.2s"):
        local.total(0)
