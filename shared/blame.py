"""Naming where a refused schedule value came from: the option that set it, or the plan file's field.

A schedule's refusal (``shared.schedule``'s ``ScheduleError``) starts with the plan field it is about
(``microbatches: 2bw accumulates ...``); the command line knows whether that value is the plan's or an option's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from shared.schedule import ScheduleError


@contextmanager
def naming_source(given: Mapping[str, object], source: str | None) -> Iterator[None]:
    """Re-raise a schedule's refusal (``field: why``) naming where the value came from: the option in
    ``given`` that set it (``--microbatches 1: why``), else the plan file ``source`` (None: no plan)."""
    try:
        yield
    except ScheduleError as exc:
        field, _, why = str(exc).partition(": ")
        if field in given:
            where = f"--{field} {given[field]}: {why}"
        else:
            where = str(exc) if source is None else f"{source}: {exc}"
        raise ScheduleError(where, exc.grid, exc.worker, exc.index) from None
