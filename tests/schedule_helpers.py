"""A schedule generator that wraps another, for tests that inject a fault into one worker's stream."""

from __future__ import annotations

from shared.schedule import Pipeline, Schedule


class Wrapped(Schedule):
    """``inner``'s generator under ``inner``'s name: a subclass overrides ``compute`` or ``program`` to break it.

    Everything that sizes a program (units per step, period, fill, which lengths it takes) is
    ``inner``'s, so that window validation cuts the wrapped program where it cuts ``inner``'s.
    """

    def __init__(self, inner: Schedule) -> None:
        self.inner = inner
        self.name = inner.name
        self.trains = inner.trains

    def units_per_step(self, pipe: Pipeline) -> int:
        return self.inner.units_per_step(pipe)

    def period(self, pipe: Pipeline) -> int:
        return self.inner.period(pipe)

    def fill(self, pipe: Pipeline) -> int:
        return self.inner.fill(pipe)

    def check_units(self, pipe: Pipeline, units: int) -> None:
        self.inner.check_units(pipe, units)
