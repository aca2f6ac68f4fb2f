"""The common shape of our JSON artifacts: a versioned format, the writer, strict loading.

Each artifact is a pydantic model. Loading parses the JSON, validates every field and
turns the first failure into one ``ArtifactError`` line that names the file, the field
path (``stages[1].replicas``) and what was expected.
"""

from __future__ import annotations

import functools
import json
import os
import re
from importlib import metadata
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import ArtifactError
from shared.io import atomic_write_bytes, display_name, read_text
from shared.version import __version__


@functools.cache
def _torch_version() -> str | None:
    # importlib.metadata, not `import torch`: pdplan must not pay torch's import time. Once per
    # process: it reads the installed packages' metadata (3 ms a call), and pdplan's schedule search
    # makes a plan, each with its writer, for every candidate (42 calls, 0.13 s, on AlexNet).
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


class Writer(BaseModel):
    """Which versions wrote an artifact."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    toolchain: str = __version__
    torch: str | None = Field(default_factory=_torch_version)


class Strict(BaseModel):
    """Base of every artifact part: unknown fields are typos, and typos are errors."""

    # No NaN or infinity in any float field: JSON has no spelling for them (pydantic would
    # write null), so an artifact holding one could be saved but never loaded again. Each model's
    # validator is built when it is first used, not when its module is imported: pdplan imports
    # models it never validates (spec, run settings), and building them all took ~50 ms of its start-up.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True)


A = TypeVar("A", bound=BaseModel)


def checked_shape(value: Any) -> Any:
    """``value`` if it is a recorded shape (pdprof's ``shape_of``): a list of whole numbers, lists or dicts of
    such shapes, or null for what is no tensor; else ``ValueError`` (a hand-edited ``"input_shape":
    "garbage"`` passed every check, and ``[32.0, 20]`` too, since the field took anything)."""

    def ok(v: Any) -> bool:
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return True
        if isinstance(v, list):
            return all(ok(x) for x in v)
        return isinstance(v, dict) and all(isinstance(k, str) and ok(x) for k, x in v.items())

    if not (value is None or isinstance(value, (list, dict))) or not ok(value):
        raise ValueError(
            f"expected a shape: a list of whole numbers, or lists or objects of such (got {_short(value)})"
        )
    return value


_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def field_path(loc: tuple[int | str, ...]) -> str:
    """``('stages', 1, 'replicas')`` -> ``stages[1].replicas``; odd keys are quoted: ``graph["a b"]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(part):
            out += f".{part}" if out else part
        else:
            # A key from the file may hold a newline or anything else: JSON-quote it so the
            # error stays one printable line.
            out += f"[{json.dumps(part)}]"
    return out or "(top level)"


# A model validator's message starts with the field it is about: "stages[1].ranks: ...".
_LEADING_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*): (.+)$", re.S)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(path: str, exc: ValidationError) -> ArtifactError:
    """The first error of a pydantic ``ValidationError`` as one clear line."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        lead = _LEADING_FIELD.match(msg)
        if lead is not None:
            # The validator named a field below the object it checked: use it as the path.
            prefix = field_path(loc)
            inner = lead.group(1)
            where = inner if prefix == "(top level)" else f"{prefix}.{inner}"
            return ArtifactError(path, where, _one_line(lead.group(2)))
    if err["type"] == "missing":
        return ArtifactError(path, field_path(loc), "required field is missing")
    if err["type"] == "extra_forbidden":
        return ArtifactError(path, field_path(loc), "unknown field (a typo?)")
    got = "" if err["type"].startswith("value_error") else f" (got {_short(err.get('input'))})"
    return ArtifactError(path, field_path(loc), _one_line(f"{msg}{got}"))


def _one_line(text: str) -> str:
    """Error text on one line, whatever the input it quotes."""
    return " ".join(text.split()) if ("\n" in text or "\r" in text) else text


def parse_json(text: str, source: str, what: str) -> Any:
    """Parse ``text`` as JSON or fail naming the line and column."""
    if not text.strip():
        raise ArtifactError(source, "", f"empty input (expected {what} as JSON)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            source, "", f"not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg} (expected {what})"
        ) from None
    except RecursionError:
        raise ArtifactError(source, "", f"JSON nested too deeply to read (expected {what})") from None
    except ValueError as exc:  # an integer of more than 4300 digits (Python's guard against slow parsing)
        reason = " ".join(str(exc).split(":")[0].split())
        raise ArtifactError(source, "", f"not readable JSON: {reason} (expected {what})") from None


def check_format(data: Any, source: str, expected: str) -> None:
    """Fail early and plainly when the JSON is not this artifact at all."""
    if not isinstance(data, dict):
        raise ArtifactError(source, "", f"expected a JSON object ({expected}), got {type(data).__name__}")
    fmt = data.get("format")
    if fmt is None:
        raise ArtifactError(source, "format", f"required field is missing (expected {expected!r})")
    if fmt != expected:
        name = expected.split("/")[0]
        if isinstance(fmt, str) and fmt.split("/")[0] == name:
            raise ArtifactError(
                source,
                "format",
                f"version {fmt!r} is not supported by this toolchain (expected {expected!r})",
            )
        raise ArtifactError(source, "format", f"expected {expected!r}, got {_short(fmt)}")


def validate_data(cls: type[A], data: Any, source: str) -> A:
    """Validate parsed JSON against ``cls``, or raise one ``ArtifactError``.

    Strictly: a hand-edited ``"batch_size": "64"`` or ``"replicas": true`` is refused, not read as 64
    or 1 (pydantic's lax mode would coerce both without a word); a whole number is still a valid float.
    """
    try:
        return cls.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_error(source, exc) from None


def load_json_artifact(cls: type[A], source: str | os.PathLike[str], fmt: str, what: str) -> A:
    """Read, parse and validate an artifact from a path or ``-``."""
    name = display_name(source)
    data = parse_json(read_text(source, what), name, what)
    check_format(data, name, fmt)
    return validate_data(cls, data, name)


def dump_json(model: BaseModel) -> str:
    """An artifact as indented JSON, stable field order, ending in a newline."""
    return model.model_dump_json(indent=2, by_alias=True) + "\n"


def save_json_artifact(model: BaseModel, path: str | os.PathLike[str]) -> None:
    """Write an artifact atomically."""
    atomic_write_bytes(path, dump_json(model).encode("utf-8"))
