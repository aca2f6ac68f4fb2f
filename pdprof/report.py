"""A layer graph for a person: a rich table of layers, the totals and the heaviest layers."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from shared.graph import LayerGraph, Node


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; binary units, as memory is counted."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop always returns


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _total_ms(node: Node) -> float:
    return node.forward_ms + node.backward_ms


def summary_line(graph: LayerGraph) -> str:
    """One line: layers, edges, summed times, and how the sum compares with a whole step."""
    fwd = sum(n.forward_ms for n in graph.nodes)
    bwd = sum(n.backward_ms for n in graph.nodes)
    params = sum(n.parameter_bytes for n in graph.nodes)
    line = (
        f"[bold]pdprof[/]: {len(graph.nodes)} layers, {len(graph.edges)} edges, batch {graph.batch_size}, "
        f"forward {_ms(fwd)} ms + backward {_ms(bwd)} ms, parameters {human_bytes(params)}"
    )
    t = graph.timing
    if t is not None and t.step_ms is not None and t.ratio is not None:
        line += f"; layer sum / whole step = {_ms(t.layer_sum_ms or 0)} / {_ms(t.step_ms)} ms = {t.ratio:.3f}"
    return line


def _header(graph: LayerGraph, name: str) -> str:
    spec = graph.spec
    what = spec.model or "imported profile"
    parts = [f"{name}: {what}", f"batch {graph.batch_size}", f"device {graph.device}"]
    if graph.threads is not None:
        parts.append(f"{graph.threads} thread(s)")
    if graph.timing is not None:
        parts.append(f"{graph.timing.repeats} repeats")
    parts.append(f"torch {graph.writer.torch}" if graph.source == "pdprof" else graph.source)
    return ", ".join(parts)


# Columns shown only when the console is wide enough (a narrow terminal keeps the numbers readable).
_WIDE_ONLY = {"kind", "target", "output shape"}
WIDE_COLUMNS = 150


def layers_table(graph: LayerGraph, name: str, order: str = "graph", wide: bool = True) -> Table:
    """Every layer with its times, share of the total time and sizes; ``wide`` adds kind, target, shape."""
    total = sum(_total_ms(n) for n in graph.nodes) or 1.0
    nodes = list(graph.nodes)
    if order == "time":
        nodes.sort(key=_total_ms, reverse=True)
    table = Table(title=_header(graph, name), title_justify="left", show_footer=True)
    fwd = sum(n.forward_ms for n in graph.nodes)
    bwd = sum(n.backward_ms for n in graph.nodes)
    columns = [
        ("layer", f"{len(graph.nodes)} layers", "left"),
        ("kind", "", "left"),
        ("target", "", "left"),
        ("fwd ms", _ms(fwd), "right"),
        ("bwd ms", _ms(bwd), "right"),
        ("share", "100.0%", "right"),
        ("activation", human_bytes(sum(n.activation_bytes for n in graph.nodes)), "right"),
        ("params", human_bytes(sum(n.parameter_bytes for n in graph.nodes)), "right"),
        ("saved", human_bytes(sum(n.saved_bytes for n in graph.nodes)), "right"),
        ("output shape", "", "left"),
    ]
    keep = [i for i, (header, _, _) in enumerate(columns) if wide or header not in _WIDE_ONLY]
    for i in keep:
        header, footer, justify = columns[i]
        table.add_column(header, footer=footer, justify=justify, no_wrap=header != "target")  # type: ignore[arg-type]
    for n in nodes:
        target = n.target if len(n.target) <= 40 else n.target[:37] + "..."
        cells = [
            n.id,
            n.op,
            target,
            _ms(n.forward_ms),
            _ms(n.backward_ms),
            f"{100 * _total_ms(n) / total:.1f}%",
            human_bytes(n.activation_bytes),
            human_bytes(n.parameter_bytes),
            human_bytes(n.saved_bytes),
            "" if n.output_shape is None else str(n.output_shape),
        ]
        table.add_row(*(cells[i] for i in keep))
    return table


def heaviest(graph: LayerGraph, top: int) -> Table:
    """The ``top`` layers by forward + backward time."""
    total = sum(_total_ms(n) for n in graph.nodes) or 1.0
    table = Table(title=f"heaviest {min(top, len(graph.nodes))} layers", title_justify="left")
    for header in ("layer", "fwd+bwd ms", "share"):
        table.add_column(header, justify="left" if header == "layer" else "right")
    for n in sorted(graph.nodes, key=_total_ms, reverse=True)[:top]:
        table.add_row(n.id, _ms(_total_ms(n)), f"{100 * _total_ms(n) / total:.1f}%")
    return table


def timing_note(graph: LayerGraph) -> Text:
    t = graph.timing
    if t is None:
        return Text(f"no timing record ({graph.source}); figures as given by the source")
    text = f"timing: {t.method}; warm-up {t.warmup}, repeats {t.repeats}"
    if t.step_ms is not None and t.ratio is not None:
        text += f"; layer sum {_ms(t.layer_sum_ms or 0)} ms vs whole step {_ms(t.step_ms)} ms (ratio {t.ratio:.3f})"
    return Text(text)


def render(
    graph: LayerGraph, name: str, top: int = 5, order: str = "graph", wide: bool = True
) -> RenderableType:
    """The whole report: the layers, the timing note and the heaviest layers."""
    parts: list[RenderableType] = [layers_table(graph, name, order, wide), timing_note(graph)]
    if top > 0:
        parts.append(heaviest(graph, top))
    return Group(*parts)
