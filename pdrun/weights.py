"""Weight versions of one stage, for PipeDream's weight stashing and vertical sync.

From the paper (Harlap et al., SOSP 2019, section 3.3): "Weight stashing maintains
multiple versions of the weights, one for each active minibatch. Each stage processes a
minibatch using the latest version of weights available in the forward pass. After
completing the forward pass, PipeDream stores the weights used for that minibatch. The
same weight version is then used to compute the weight update and upstream weight
gradient in the minibatch's backward pass."

Version ``v`` of a stage is its weights after ``v`` optimizer steps. A forward *acquires*
a version (tensors holding the weights, shared by every unit that runs on the same
version) and its backward *releases* it; the autograd graph built on them is what the
backward differentiates, so the backward sees exactly the forward's weights while the
optimizer keeps updating the live ones.

The latest version is copied lazily. Its tensors first share the live parameters' memory
(``p.data``: the same storage under a version counter of its own); only when a step is
about to overwrite that memory while a unit still holds the version do the live
parameters move to a fresh copy, leaving the old memory to the version. So a stage whose
every backward comes before the next step (the last stage, one worker) never copies its
weights, and an earlier stage copies them once per step, not once per version acquired. A
backward's gradients move onto the live weights rather than being copied. With vertical sync a unit names the version the
input stage used, and this stage must still hold it: every pre-step version is kept until
no later unit can ask for it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from shared.errors import RunError
from shared.schedule_more import two_bw_version

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
        self.aliased: int | None = None  # the version whose tensors share the live parameters' memory

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
            # Not a copy yet: the live memory, under its own version counter (before_step copies).
            self.versions[number] = {n: p.data.requires_grad_(p.requires_grad) for n, p in self.live.items()}
            self.aliased = number
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
                live.grad = tensor.grad  # the version's gradient is dropped below: move, not copy
            else:
                live.grad.add_(tensor.grad)
            tensor.grad = None
        self.refs[number] -= 1
        self._prune()

    def before_step(self) -> None:
        """Keep the version the step replaces wherever a unit holds it, or (vertical sync) may name it."""
        if not self.stash:
            return
        latest = self.latest
        if self.aliased == latest and latest in self.versions:
            if self.refs[latest] > 0 or self.history:
                # The step writes the live memory in place: the live weights move to a copy and the
                # version keeps the memory its units' autograd graphs saved.
                with torch.no_grad():
                    for p in self.live.values():
                        p.data = p.data.clone()
            else:
                del self.versions[latest]  # nobody holds it, and it would change under the step
        elif self.history and latest not in self.versions:
            self.versions[latest] = {
                n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.live.items()
            }
            self.max_held = max(self.max_held, len(self.versions))
        self.aliased = None

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

    def pinned(self, unit: int) -> int | None:
        """The version the schedule itself fixes for global ``unit`` (2BW), or None: the latest."""
        return None


class TwoWeightVersions(WeightVersions):
    """PipeDream-2BW's double-buffered weights: unit u of step t runs on version ``max(0, t - 1)``.

    Narayanan et al. (ICML'21, section 3.1): "W(t+1) = W(t) - nu * grad f(W(t-1))". A step's
    gradients are taken on the version one older than the latest (``two_bw_version``) and,
    accumulated on the live parameters by :meth:`release`, update the latest. Before each step
    the latest is kept (the next step's units will run on it) and after it every older version
    no unit holds is dropped: two versions at most, the latest and the one before, never
    PipeDream's one per unit in flight. A run resumed from a checkpoint (which holds the latest
    weights only) starts as training does, its first step's units on the weights it resumed from.
    """

    def __init__(self, module: nn.Module, microbatches: int) -> None:
        super().__init__(module, stash=True, history=True)
        self.microbatches = microbatches
        self.start: int | None = None  # the version this process started from (0, or a resumed step)

    def pinned(self, unit: int) -> int:
        if self.start is None:
            self.start = self.latest
        return max(self.start, two_bw_version(unit, self.microbatches))

    def stepped(self) -> None:
        # Units not forwarded yet belong to later steps: none will name a version before the new latest's parent.
        self.floor = self.latest
        super().stepped()


def fingerprint(params: Params) -> float:
    """A number that changes whenever the weights do: what a test compares between forward and backward."""
    total = 0.0
    for i, t in enumerate(params.values()):
        d = t.detach().double()
        total += float(d.sum()) + (i + 1) * float((d * d).sum())
    return total
