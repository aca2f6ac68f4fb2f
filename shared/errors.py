"""Our exception types and the one table that maps them to exit statuses.

Every error a user can cause derives from ``UserError`` and ends the tool with exit
status 2 and one line; a failure of the run itself (a worker died, a peer timed out)
is a ``RunError`` with exit status 1. Library code raises these and never exits.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class PDError(Exception):
    """Base of every error the toolchain reports as one line."""

    exit_code = EXIT_FAILURE


class UserError(PDError):
    """Bad input: a file, a field, an option or a spec the user gave us."""

    exit_code = EXIT_USAGE


class ArtifactError(UserError):
    """An artifact failed to load or validate: names the file, the field and what was expected."""

    def __init__(self, path: str, field: str, expected: str) -> None:
        self.path = path
        self.field = field
        self.expected = expected
        where = f"{path}: {field}" if field else path
        super().__init__(f"{where}: {expected}")


class SpecError(UserError):
    """A model, dataset or loss spec that cannot be resolved."""


class TraceError(UserError):
    """A model torch.fx cannot trace, with the construct and the option that avoids it."""


class DataError(UserError):
    """A dataset the model cannot take: names the data spec, the sample and the layer or the batching."""


class PlanError(UserError):
    """A plan that does not fit its graph, its model or the launcher."""


class RunError(PDError):
    """The distributed run failed: a worker raised, died or timed out."""


class Terminated(RunError):
    """SIGTERM (a scheduler, ``kill``) before torch's launcher took it over: one line, the shell's status 143."""

    exit_code = 143

    def __init__(self) -> None:
        super().__init__("stopped by SIGTERM")


def exit_code_for(exc: BaseException) -> int:
    """The exit status a tool ends with after ``exc``."""
    if isinstance(exc, PDError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return EXIT_FAILURE
