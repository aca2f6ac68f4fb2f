"""Weight versions of one stage, for PipeDream's weight stashing and vertical sync.

From the paper (Harlap et al., SOSP 2019, section 3.3): "Weight stashing maintains
multiple versions of the weights, one for each active minibatch. Each stage processes a
minibatch using the latest version of weights available in the forward pass. After
completing the forward pass, PipeDream stores the weights used for that minibatch. The
same weight version is then used to compute the weight update and upstream weight
gradient in the minibatch's backward pass."

Version ``v`` of a stage is its weights after ``v`` optimizer steps. A forward *acquires*
a version (a detached copy of the weights, shared by every unit that runs on the same
version) and its backward *releases* it; the autograd graph built on the copy is what the
backward differentiates, so the backward sees exactly the forward's weights while the
optimizer keeps updating the live ones. With vertical sync a unit names the version the
input stage used, and this stage must still hold it: every pre-step version is kept until
no later unit can ask for it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from shared.errors import RunError

Params = dict[str, torch.Tensor]


class WeightVersions:
    """The live parameters of a stage and the stashed versions its in-flight units hold."""

    def __init__(self, module: nn.Module, stash: bool, history: bool = False) -> None:
        self.live: dict[str, nn.Parameter] = dict(module.named_parameters())
        self.stash = stash  # False: every unit runs on the live parameters (flushing schedules, or testing)
        self.history = history  # vertical sync: keep versions that later units may still name
        self.latest = 0
        self.versions: dict[int, Params] = {}
        self.refs: Counter[int] = Counter()
        self.floor = 0  # versions below this are never named again (vertical sync)
        self.max_held = 0

    def acquire(self, number: int | None = None) -> tuple[int, Params]:
        """A version for a forward: the latest, or ``number`` (vertical sync)."""
        if not self.stash:
            return self.latest, dict(self.live)
        number = self.latest if number is None else number
        if number > self.latest:
            raise RunError(
                f"weight version {number} asked for, but this stage has only reached {self.latest}"
            )
        if number not in self.versions:
            if number != self.latest:
                raise RunError(f"weight version {number} is no longer stashed (latest {self.latest})")
            self.versions[number] = {
                n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.live.items()
            }
        if self.history:
            self.floor = max(self.floor, number)
        self.refs[number] += 1
        self.max_held = max(self.max_held, len(self.versions))
        return number, self.versions[number]

    def release(self, number: int, params: Params) -> None:
        """After a backward: move its gradient onto the live weights and drop versions no one holds."""
        if not self.stash:
            return
        for name, tensor in params.items():
            if tensor.grad is None:
                continue
            live = self.live[name]
            if live.grad is None:
                live.grad = tensor.grad.clone()
            else:
                live.grad.add_(tensor.grad)
            tensor.grad = None
        self.refs[number] -= 1
        self._prune()

    def before_step(self) -> None:
        """With vertical sync, the version about to be replaced may still be named by a later unit."""
        if self.stash and self.history and self.latest not in self.versions:
            self.versions[self.latest] = {
                n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.live.items()
            }
            self.max_held = max(self.max_held, len(self.versions))

    def stepped(self) -> None:
        self.latest += 1
        self._prune()

    def _prune(self) -> None:
        for number in list(self.versions):
            if self.refs[number] > 0 or number == self.latest:
                continue
            if self.history and number >= self.floor:
                continue
            del self.versions[number]
            del self.refs[number]

    def held(self) -> int:
        return len(self.versions)


def fingerprint(params: Params) -> float:
    """A number that changes whenever the weights do: what a test compares between forward and backward."""
    total = 0.0
    for i, t in enumerate(params.values()):
        d = t.detach().double()
        total += float(d.sum()) + (i + 1) * float((d * d).sum())
    return total
