"""A worker's per-step metrics rows, kept as columns of machine numbers.

A worker records one row per optimizer step (``pdrun.worker``) and hands them all to rank 0 at
the end of the run (``pdrun.runner``), so the rows live for the whole run. As Python dicts they
took about 0.8 KB a step: 800 MB per worker over a million steps, before pickling them for the
gather. As columns (``array('d')`` for floats, ``array('q')`` for integers) a step takes 8 bytes
per field, about 0.15 KB. Reading them back gives dicts again, one at a time, so the metrics
table and the summary read them as before.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

# The fields that count (steps, ranks, versions held): integers in the metrics table too.
INT_FIELDS = ("step", "rank", "stage", "replica", "versions")


class StepRows(Sequence[dict[str, Any]]):
    """Rows of one schema, the first row's fields; :data:`INT_FIELDS` integers, the rest floats."""

    def __init__(self) -> None:
        self.columns: dict[str, array[Any]] = {}

    def append(self, row: Mapping[str, Any]) -> None:
        if not self.columns:
            self.columns = {k: array("q" if k in INT_FIELDS else "d") for k in row}
        if row.keys() != self.columns.keys():
            raise ValueError(f"step row fields {sorted(row)} differ from {sorted(self.columns)}")
        for k, v in row.items():
            self.columns[k].append(v)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def _row(self, i: int) -> dict[str, Any]:
        return {k: col[i] for k, col in self.columns.items()}

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self._row(j) for j in range(len(self))[i]]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._row(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._row(i) for i in range(len(self)))
