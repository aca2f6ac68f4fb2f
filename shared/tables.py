"""The Parquet artifacts: the profile table (``pdprof.table/1``) and run metrics (``pdrun.metrics/1``).

Each is a table with required columns of known kinds; the artifact's own description
(format, writer, specs) travels as JSON in the Parquet schema metadata under ``pipedream``.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from shared.artifact import Writer
from shared.errors import ArtifactError
from shared.io import atomic_write_bytes, display_name, read_bytes
from shared.version import FORMAT_METRICS, FORMAT_TABLE

META_KEY = b"pipedream"


@dataclass(frozen=True)
class TableFormat:
    """A Parquet artifact: its format name and required columns with their kinds."""

    name: str
    what: str
    columns: dict[str, str]  # column -> "int", "float" or "str"
    non_negative: tuple[str, ...] = ()  # numeric columns that must be >= 0 (and not NaN)
    finite: tuple[str, ...] = ()  # float columns that must hold no NaN or infinity


PROFILE_TABLE = TableFormat(
    FORMAT_TABLE,
    "a profile table (pdprof.table/1, Parquet)",
    {"layer": "str", "phase": "str", "repeat": "int", "ms": "float"},
    non_negative=("repeat", "ms"),
    finite=("ms",),
)
RUN_METRICS = TableFormat(
    FORMAT_METRICS,
    "run metrics (pdrun.metrics/1, Parquet)",
    {"step": "int", "loss": "float"},
    # The loss may be NaN or infinite: a diverged run is recorded as it happened.
    non_negative=("step",),
)

_KIND_CHECK: dict[str, Callable[[Any], bool]] = {
    "int": pd.api.types.is_integer_dtype,
    "float": pd.api.types.is_numeric_dtype,
    "str": lambda d: pd.api.types.is_string_dtype(d) or pd.api.types.is_object_dtype(d),
}


def _check_columns(df: pd.DataFrame, fmt: TableFormat, source: str) -> None:
    duplicated = [str(c) for c in df.columns[df.columns.duplicated()]]
    if duplicated:
        raise ArtifactError(source, _column_field(duplicated[0]), "column appears more than once")
    for column, kind in fmt.columns.items():
        if column not in df.columns:
            raise ArtifactError(source, f"columns.{column}", f"required column is missing ({fmt.name})")
        values = df[column]
        if not _KIND_CHECK[kind](values.dtype):
            raise ArtifactError(source, f"columns.{column}", f"expected {kind} values, got {values.dtype}")
        if kind == "str":
            bad = ~values.map(lambda v: isinstance(v, str)).astype(bool)
            if bad.any():
                row = int(bad.to_numpy().nonzero()[0][0])
                raise ArtifactError(
                    source, f"columns.{column}[{row}]", f"expected a string, got {_short(values.iloc[row])}"
                )
    for column in fmt.finite:
        numbers = df[column].to_numpy(dtype="float64")
        bad_rows = (~np.isfinite(numbers)).nonzero()[0]
        if len(bad_rows):
            row = int(bad_rows[0])
            raise ArtifactError(
                source, f"columns.{column}[{row}]", f"expected a finite number, got {numbers[row]}"
            )
    for column in fmt.non_negative:
        numbers = df[column].to_numpy(dtype="float64")
        bad_rows = (~(numbers >= 0)).nonzero()[0]
        if len(bad_rows):
            row = int(bad_rows[0])
            raise ArtifactError(
                source, f"columns.{column}[{row}]", f"expected a number >= 0, got {numbers[row]}"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def table_bytes(df: pd.DataFrame, fmt: TableFormat, meta: dict[str, Any]) -> bytes:
    """Serialise ``df`` with its description in the schema metadata."""
    _check_columns(df, fmt, "<table being written>")
    description = {"format": fmt.name, "writer": Writer().model_dump(), **meta}
    table = pa.Table.from_pandas(df, preserve_index=False)
    merged = dict(table.schema.metadata or {})
    merged[META_KEY] = json.dumps(description, default=str).encode("utf-8")
    table = table.replace_schema_metadata(merged)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def save_table(
    df: pd.DataFrame, path: str | os.PathLike[str], fmt: TableFormat, meta: dict[str, Any]
) -> None:
    """Write a Parquet artifact atomically."""
    atomic_write_bytes(path, table_bytes(df, fmt, meta))


def load_table(source: str | os.PathLike[str], fmt: TableFormat) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read and validate a Parquet artifact; returns the table and its description."""
    name = display_name(source)
    data = read_bytes(source, fmt.what)
    try:
        parquet = pq.ParquetFile(io.BytesIO(data))
        schema = parquet.schema_arrow
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise ArtifactError(
            name, "", f"not a readable Parquet file ({_reason(exc)}); expected {fmt.what}"
        ) from None
    seen: set[str] = set()
    for column in schema.names:
        if column in seen:
            raise ArtifactError(name, _column_field(column), "column appears more than once")
        seen.add(column)
    # The description first: a file that is not this artifact is named as such before its data is read.
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ArtifactError(
            name, "metadata.pipedream", f"missing: not written by this toolchain ({fmt.name})"
        )
    try:
        description = json.loads(raw)
    except (ValueError, RecursionError):
        raise ArtifactError(
            name, "metadata.pipedream", f"not valid JSON (expected {fmt.name}'s description)"
        ) from None
    if not isinstance(description, dict) or description.get("format") != fmt.name:
        got = description.get("format") if isinstance(description, dict) else description
        raise ArtifactError(name, "metadata.pipedream.format", f"expected {fmt.name!r}, got {_short(got)}")
    try:
        df = parquet.read().to_pandas()
    except Exception as exc:  # damaged data pages, a damaged pandas block in the metadata, an odd column
        raise ArtifactError(
            name, "", f"cannot read the table's columns ({_reason(exc)}); expected {fmt.what}"
        ) from None
    _check_columns(df, fmt, name)
    return df, description


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 160 else text[:157] + "..."
    return text or type(exc).__name__


def _column_field(column: object) -> str:
    """``columns.ms``; a name with odd characters is JSON-quoted so the message stays one line."""
    text = str(column)
    return f"columns.{text}" if text.isidentifier() else f"columns[{json.dumps(text)}]"
