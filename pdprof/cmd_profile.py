"""``pdprof profile`` (the default command): a model spec becomes a layer graph and a profile table."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shared.cli import console, parse_kv, rich_console
from shared.io import write_output
from shared.outputs import check_output_file
from shared.spec import RunSpec, TraceOptions

if TYPE_CHECKING:  # types only: their modules import torch, which `pdprof profile --help` must not wait for
    from pdprof.profiler import ProfileResult, Statistic
    from pdprof.update import OptimizerName
    from shared.layout import MemoryFormat


def _concurrent(value: str | int) -> int | None:
    """``--concurrent``: a count of at least 1, or ``auto`` (None: pdprof.profiler.auto_concurrent)."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"{value!r}: expected a count of at least 1, or auto")
    return n


@contextmanager
def _progress_bar() -> Iterator[Progress]:
    real = rich_console()
    bar = Progress(
        TextColumn("[bold]pdprof[/] {task.description:<8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=real,
        transient=True,
        # A bar only on a terminal: into a log file or a pipe a live display leaves blank lines.
        disable=not real.is_terminal,
    )
    with bar:
        yield bar


@click.command("profile")
@click.option(
    "--model",
    "model",
    required=True,
    metavar="SPEC",
    help="zoo:NAME, package.module:callable or path/to/file.py:callable returning an nn.Module.",
)
@click.option(
    "--data",
    "data",
    required=True,
    metavar="SPEC",
    help="A dataset spec (same forms) giving (input, target) pairs; the first batch is profiled.",
)
@click.option(
    "--batch-size", required=True, type=click.IntRange(min=1), help="Samples per batch (minibatch)."
)
@click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda[:N]", help="Where to run.")
@click.option(
    "--model-arg", "model_args", multiple=True, metavar="K=V", help="Keyword argument for the model callable."
)
@click.option(
    "--data-arg", "data_args", multiple=True, metavar="K=V", help="Keyword argument for the dataset callable."
)
@click.option(
    "--loss",
    default="cross_entropy",
    show_default=True,
    metavar="SPEC",
    help="cross_entropy, causal_lm (next-token, labels = inputs), mse, or a callable spec loss(output, target).",
)
@click.option(
    "--depth",
    type=click.IntRange(min=1),
    default=None,
    help="Keep every module this deep (1 = the model's direct children) as one layer.",
)
@click.option(
    "--leaf-module",
    "leaf_modules",
    multiple=True,
    metavar="NAME",
    help="Keep modules of this class (name or module.QualName) as single layers; repeatable.",
)
@click.option(
    "--warmup", default=4, show_default=True, type=click.IntRange(min=0), help="Untimed rounds first."
)
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(min=1), help="Timed rounds.")
@click.option(
    "--statistic",
    type=click.Choice(["mean", "median"]),
    default="mean",
    show_default=True,
    help="How the rounds become a layer's figure: mean (a run's rate pays every round's cost) or median.",
)
@click.option(
    "--threads", default=1, show_default=True, type=click.IntRange(min=1), help="torch CPU threads."
)
@click.option(
    "--steady-malloc/--no-steady-malloc",
    default=True,
    show_default=True,
    help="CPU: fix glibc malloc's mmap/trim thresholds so figures repeat from run to run.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "adam"]),
    default="sgd",
    show_default=True,
    help="The optimizer whose step is timed per layer (update_ms): the one pdrun will run.",
)
@click.option(
    "--momentum",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="SGD momentum, as pdrun's --momentum.",
)
@click.option(
    "--concurrent",
    default="auto",
    show_default=True,
    callback=lambda ctx, param, value: _concurrent(value),
    metavar="N|auto",
    help="CPU: profile beside N-1 sibling processes training the same model, as N workers on this host will "
    "run; auto: as many as this host's cores hold at --threads each, at most 8 (on a GPU, 1).",
)
@click.option(
    "--memory-format",
    type=click.Choice(["auto", "contiguous", "channels-last"]),
    default="auto",
    show_default=True,
    help="The activations' layout, as pdrun's --memory-format (auto: channels-last for float32 CNNs on CPU).",
)
@click.option(
    "-o", "--output", "out", default=None, metavar="FILE", help="Write the graph here (default: stdout)."
)
@click.option("--table", "table", default=None, metavar="FILE", help="Write the raw samples here (Parquet).")
def profile(
    model: str,
    data: str,
    batch_size: int,
    device: str,
    model_args: tuple[str, ...],
    data_args: tuple[str, ...],
    loss: str,
    depth: int | None,
    leaf_modules: tuple[str, ...],
    warmup: int,
    repeats: int,
    statistic: Statistic,
    threads: int,
    steady_malloc: bool,
    optimizer: OptimizerName,
    momentum: float,
    concurrent: int | None,
    memory_format: MemoryFormat,
    out: str | None,
    table: str | None,
) -> None:
    """Profile a model: per layer forward/backward time, activation, parameter and saved bytes.

    \b
    Examples:
      pdprof --model zoo:resmlp --data zoo:digits --batch-size 64 -o graph.json
      pdprof --model my_model.py:build --data my_data.py:train --batch-size 32 --table profile.parquet
      pdprof --model zoo:resnet50 --data zoo:synthetic_images --batch-size 8 --leaf-module Bottleneck \\
        | pdplan - --workers 4 --bandwidth 1e9
    """
    spec = RunSpec(
        model=model,
        model_args=parse_kv(model_args, "--model-arg"),
        data=data,
        data_args=parse_kv(data_args, "--data-arg"),
        loss=loss,
        trace=TraceOptions(depth=depth, leaf_modules=list(leaf_modules)),
    ).anchored(".")  # file paths recorded absolute: the graph and its plans work from any directory
    # Before the profile, which takes minutes on a real model: an output it cannot write, or that would
    # overwrite the model's or the data's own file or the other output, is one line now.
    sources = {f"the {what} file": text.split(":")[0] for what, text in (("model", model), ("data", data))}
    check_output_file("-o", out, {**sources, "the --table output": table or "-"})
    check_output_file("--table", table, sources)
    from pdprof.profiler import ProfileConfig, profile_spec
    from pdprof.report import summary_line
    from shared.graph import graph_json
    from shared.tables import PROFILE_TABLE, save_table

    config = ProfileConfig(
        spec,
        batch_size,
        device,
        warmup,
        repeats,
        threads,
        steady_malloc,
        optimizer,
        momentum,
        concurrent,
        memory_format,
        statistic,
    )
    with _progress_bar() as bar:
        task = bar.add_task("loading", total=None)

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total)

        result: ProfileResult = profile_spec(config, progress)
    if table is not None:
        save_table(result.table, table, PROFILE_TABLE, result.table_meta)
    write_output(graph_json(result.graph), out)
    console.print(
        summary_line(result.graph) + (f" -> {out}" if out else "") + (f", table -> {table}" if table else "")
    )
