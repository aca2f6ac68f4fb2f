"""What the three command lines share: the group with a default command, errors, the console.

Each tool is a click group whose bare form runs its main command (``pdplan graph.json``
means ``pdplan plan graph.json``), with ``--version``, ``--debug`` and one place where
our errors become one line on stderr and an exit status. Human output goes to stderr
through rich; machine output (JSON) goes to stdout, so pipes stay clean.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import click

from shared.errors import EXIT_USAGE, PDError, Terminated, exit_code_for
from shared.version import __version__

if TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """The rich console, built (and rich imported, ~50 ms) on first use: ``--help`` and a plan need none."""

    _real: Console | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def real(self) -> Console:
        """The console itself, for rich objects that take one (``Progress(console=...)`` enters it)."""
        if _LazyConsole._real is None:
            from rich.console import Console

            # stderr: the human channel. stdout is kept for JSON.
            _LazyConsole._real = Console(stderr=True, highlight=False, soft_wrap=True)
        if not sys.stderr.isatty():
            # Off a terminal (logs, CI, pipes) rich would assume 80 columns and wrap tables into
            # unreadable slivers; 120 keeps them whole, and COLUMNS, when set, says otherwise (a new user's
            # COLUMNS=250 was ignored, and pdplan show cut layer names to "model_…"). Read at every use:
            # the console outlives a CliRunner's COLUMNS (the tests'), and a width fixed by whichever
            # command came first would decide every later one's tables. On a terminal rich measures it.
            columns = os.environ.get("COLUMNS", "")
            _LazyConsole._real.width = int(columns) if columns.isdigit() else 120
        return _LazyConsole._real


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


_lazy = _LazyConsole()
console = cast("Console", _lazy)


def rich_console() -> Console:
    """The real console, built on first use: hand this, not ``console``, to a rich object that takes one."""
    return _lazy.real()


def say(line: str) -> None:
    """One plain line for a person on stderr (no markup), without loading rich for it."""
    click.echo(line, err=True)


_GROUP_FLAGS = {"--debug"}
_GROUP_EXITS = {"--help", "-h", "--version"}


class ToolGroup(click.Group):
    """A click group that runs ``default_command`` when the first word is not a subcommand."""

    def __init__(
        self,
        *args: Any,
        default_command: str | None = None,
        lazy: dict[str, tuple[str, str]] | None = None,
        before: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.default_command = default_command
        # name -> ("module:attr", short help). Imported only when run: most commands import
        # torch (~2 s), which `--version`, `--help` and pdplan must not pay.
        self.lazy = dict(lazy or {})
        # name -> "module:function", called with the command's arguments before its module is
        # imported: work that can run beside that import (pdrun run starts its forkserver).
        self.before = dict(before or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self.commands[cmd_name] = _load(self.lazy[cmd_name][0])
        return self.commands.get(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else None
        if name in self.before and name not in self.commands:
            _load(self.before[name])(args[1:])
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in self.list_commands(ctx))
        rows = [
            (
                name,
                self.commands[name].get_short_help_str(limit)
                if name in self.commands
                else self.lazy[name][1],
            )
            for name in self.list_commands(ctx)
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        i = 0
        while i < len(args) and args[i] in _GROUP_FLAGS:
            i += 1
        if self.default_command is not None:
            rest = args[i:]
            bare_exit = len(rest) == 1 and rest[0] in _GROUP_EXITS
            if not bare_exit and (not rest or rest[0] not in self.list_commands(ctx)):
                if not rest and sys.stdin.isatty():
                    pass  # `pdplan` alone at a terminal: show the group's help below
                else:
                    args.insert(i, self.default_command)
        return super().parse_args(ctx, args)

    def main(  # type: ignore[override]
        self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # Started as a script's background job (`pdrun plan.json &`), which the shell runs with SIGINT
            # ignored: `kill -INT` did nothing until torch's launcher set its own handler, seconds in, and a
            # run stopped during its start-up went on to the end. Ctrl-C and `kill -INT` stop us at any time.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if args is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # The command line itself (not a test's CliRunner): SIGTERM during pdrun's start-up ended it with
            # no word (status 143, empty stderr); now one line, with what it was doing cleaned up. torch's
            # launcher sets its own handler once it runs, and stops the workers (pdrun.stopped).
            signal.signal(signal.SIGTERM, _terminated)
        debug = "--debug" in argv or os.environ.get("PIPEDREAM_DEBUG") == "1"
        if "--debug" in argv:
            # A group flag, taken anywhere: the one-line errors say "rerun with --debug", and a user adds
            # it at the end, where the command's own options would refuse it.
            argv = ["--debug", *(a for a in argv if a != "--debug")]
        name = prog_name or self.name or "tool"
        try:
            return super().main(argv, prog_name=name, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            say(f"{name}: aborted")
            sys.exit(130)
        except click.ClickException as exc:
            # One line, as every other error: the usage is one --help away, and the line says which.
            hint = ""
            if isinstance(exc, click.UsageError) and exc.ctx is not None:
                hint = f" (see {exc.ctx.command_path} --help)"
            message = " ".join(exc.format_message().split())
            say(f"{name}: error: {message}{hint}")
            sys.exit(exc.exit_code)
        except PDError as exc:
            if debug:
                traceback.print_exc()
            say(f"{name}: error: {exc}")
            sys.exit(exc.exit_code)
        except BrokenPipeError:
            # `pdplan show | head`: the reader left; that is not our error.
            sys.stderr.close()
            sys.exit(0)
        except KeyboardInterrupt:
            say(f"{name}: interrupted")
            sys.exit(130)
        except Exception as exc:  # the last line of defence: one line, no traceback
            if debug:
                traceback.print_exc()
            first = str(exc).splitlines()[0] if str(exc) else ""
            say(
                f"{name}: internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)"
            )
            sys.exit(exit_code_for(exc))


def _load(where: str) -> Any:
    """The object ``module:attr`` names, its module imported now."""
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)


def tool_group(
    name: str,
    help_text: str,
    default_command: str | None,
    lazy: dict[str, tuple[str, str]] | None = None,
    before: dict[str, str] | None = None,
) -> ToolGroup:
    """Build a tool's top-level group with ``--version``, ``--debug`` and its lazily imported commands."""

    @click.group(
        name=name,
        cls=ToolGroup,
        default_command=default_command,
        lazy=lazy,
        before=before,
        help=help_text,
        context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    )
    @click.version_option(__version__, "--version", prog_name=name, message="%(prog)s %(version)s")
    @click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
    def group(debug: bool) -> None:
        if debug:
            os.environ["PIPEDREAM_DEBUG"] = "1"

    assert isinstance(group, ToolGroup)
    return group


def parse_kv(pairs: Sequence[str], option: str) -> dict[str, Any]:
    """``("depth=3", "name=x")`` -> ``{"depth": 3, "name": "x"}``; values are Python literals or strings."""
    import ast

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise click.BadParameter(
                f"expected key=value with a Python name as key, got {pair!r}", param_hint=option
            )
        try:
            out[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            # Not a Python literal (or one too deep or too long to read): the text itself.
            out[key.strip()] = value
    return out


__all__ = ["EXIT_USAGE", "ToolGroup", "console", "parse_kv", "say", "tool_group"]
