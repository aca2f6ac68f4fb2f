"""Reading PipeDream's own profile files (``graph.txt``) into our layer graph.

The format, from PipeDream's profiler: one line per node,
``nodeN -- Desc -- forward_compute_time=ms, backward_compute_time=ms, activation_size=bytes,
parameter_size=bytes`` (``activation_size`` may be a list ``[a; b; c]`` when the layer
returns several tensors), then one tab-indented line per edge, ``\\tnodeA -- nodeB``.
Node ids and every figure are kept; a node whose description starts with ``Input`` is a
model input.
"""

from __future__ import annotations

import re

from shared.errors import ArtifactError
from shared.graph import Edge, LayerGraph, Node
from shared.spec import RunSpec

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_FIGURES = re.compile(
    r"forward_compute_time=(?P<f>[^,]+), backward_compute_time=(?P<b>[^,]+), "
    r"activation_size=(?P<a>\[[^\]]*\]|[^,]+), parameter_size=(?P<p>[^,]+)$"
)


def _number(text: str, source: str, where: str, name: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ArtifactError(source, where, f"{name}: expected a number, got {text.strip()!r}") from None
    if value != value or value < 0 or value == float("inf"):
        raise ArtifactError(
            source, where, f"{name}: expected a finite non-negative number, got {text.strip()!r}"
        )
    return value


def parse_pipedream(text: str, source: str, batch_size: int = 1) -> LayerGraph:
    """Parse a PipeDream profile; ``batch_size`` records the batch it was profiled at (unknown: 1)."""
    nodes: list[Node] = []
    edges: list[Edge] = []
    edge_lines: list[int] = []  # the line of each edge, for messages
    ids: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"line {lineno}"
        if raw.startswith("\t"):
            parts = raw.strip().split(" -- ")
            if len(parts) != 2 or not all(parts):
                raise ArtifactError(
                    source, where, f"expected an edge '\\tnodeA -- nodeB', got {raw.strip()!r}"
                )
            edges.append(Edge(source=parts[0], target=parts[1]))
            edge_lines.append(lineno)
            continue
        head, sep, figures = raw.rpartition(" -- ")
        node_id, sep2, desc = head.partition(" -- ")
        if not sep or not sep2 or not node_id:
            raise ArtifactError(
                source, where, f"expected 'nodeN -- Desc -- {', '.join(f + '=...' for f in _FIELDS)}'"
            )
        match = _FIGURES.match(figures.strip())
        if match is None:
            raise ArtifactError(
                source,
                where,
                f"expected figures {', '.join(f + '=...' for f in _FIELDS)}; got {figures.strip()[:60]!r}",
            )
        act_text = match["a"].strip()
        parts_bytes: list[float] | None = None
        if act_text.startswith("["):
            parts_bytes = [
                _number(p, source, where, "activation_size") for p in act_text[1:-1].split(";") if p.strip()
            ]
            activation = sum(parts_bytes)
        else:
            activation = _number(act_text, source, where, "activation_size")
        if node_id in ids:
            raise ArtifactError(source, where, f"duplicate node id {node_id!r}")
        ids.add(node_id)
        nodes.append(
            Node(
                id=node_id,
                op="input" if desc.startswith("Input") else "pipedream",
                target=desc,
                forward_ms=_number(match["f"], source, where, "forward_compute_time"),
                backward_ms=_number(match["b"], source, where, "backward_compute_time"),
                activation_bytes=activation,
                activation_parts=parts_bytes,
                parameter_bytes=_number(match["p"], source, where, "parameter_size"),
            )
        )
    if not nodes:
        raise ArtifactError(source, "", "no nodes found (expected PipeDream's graph.txt format)")
    by_id = {n.id: n for n in nodes}
    for edge, lineno in zip(edges, edge_lines, strict=True):
        for end in (edge.source, edge.target):
            if end not in by_id:
                raise ArtifactError(
                    source, f"line {lineno}", f"edge {edge.source!r} -- {edge.target!r}: unknown node {end!r}"
                )
        edge.bytes = by_id[edge.source].activation_bytes
    from pydantic import ValidationError

    from shared.artifact import validation_error

    try:
        return LayerGraph(
            source=f"pipedream:{source}",
            spec=RunSpec(),
            batch_size=batch_size,
            device="unknown",
            nodes=nodes,
            edges=edges,
        )
    except ValidationError as exc:
        raise validation_error(source, exc) from None
