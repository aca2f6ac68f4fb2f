"""The layer graph artifact (``pdprof.graph/1``): the model's layers as a DAG with their costs.

Stored as networkx node-link JSON (``nodes`` and ``edges``), so
``networkx.node_link_graph(data, edges="edges")`` reads it as it is. A node is a layer
with its median forward and backward time, output activation bytes, parameter bytes
and the bytes it holds for backward; an edge is a tensor flowing between two layers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from shared.artifact import Strict, Writer, checked_shape, dump_json, load_json_artifact, save_json_artifact
from shared.spec import RunSpec, artifact_folder
from shared.version import FORMAT_GRAPH

if TYPE_CHECKING:
    import networkx as nx

# Node kinds. An "input" node is a model input: the planner zeroes it and puts it in stage 0.
NodeOp = Literal["input", "call_module", "call_function", "call_method", "get_attr", "group", "pipedream"]


class Node(Strict):
    """One layer and its profiled figures (times per minibatch of the profiled batch size)."""

    id: str = Field(min_length=1)
    op: NodeOp = "call_module"
    target: str = Field(default="", description="module path, function name or PipeDream description")
    forward_ms: float = Field(ge=0, allow_inf_nan=False)
    backward_ms: float = Field(ge=0, allow_inf_nan=False)
    update_ms: float = Field(
        default=0, ge=0, allow_inf_nan=False, description="the optimizer step over the layer's parameters"
    )
    activation_bytes: float = Field(ge=0, allow_inf_nan=False, description="bytes of the layer's output")
    activation_parts: list[float] | None = Field(
        default=None, description="bytes of each output when the layer returns several tensors"
    )
    parameter_bytes: float = Field(ge=0, allow_inf_nan=False)
    saved_bytes: float = Field(
        default=0,
        ge=0,
        allow_inf_nan=False,
        description="bytes of its tensors held for a backward (each once, charged to their maker)",
    )
    output_shape: Any = Field(default=None, description="shape(s) of the output, nested lists")
    _output_shape = field_validator("output_shape")(checked_shape)
    members: list[str] | None = Field(default=None, description="traced nodes a grouped layer stands for")


class Edge(Strict):
    """A tensor flowing from ``source`` to ``target``."""

    source: str
    target: str
    bytes: float = Field(default=0, ge=0, allow_inf_nan=False)


class Timing(Strict):
    """How the figures were measured, and how the layer sum compares with a whole step."""

    method: str
    warmup: int = Field(ge=0)
    repeats: int = Field(ge=1)
    step_ms: float | None = Field(default=None, ge=0, description="a whole training step, timed directly")
    layer_sum_ms: float | None = Field(default=None, ge=0, description="sum of forward+backward medians")
    ratio: float | None = Field(default=None, description="layer_sum_ms / step_ms")


class LayerGraph(Strict):
    """The ``pdprof.graph/1`` artifact."""

    format: Literal["pdprof.graph/1"] = "pdprof.graph/1"
    writer: Writer = Field(default_factory=Writer)
    source: str = Field(default="pdprof", description="pdprof, or pipedream:FILE for an imported profile")
    spec: RunSpec = Field(default_factory=RunSpec)
    batch_size: int = Field(ge=1)
    input_shape: Any = Field(default=None, description="shape of one input batch, nested lists")
    _input_shape = field_validator("input_shape")(checked_shape)
    device: str = "cpu"
    threads: int | None = Field(default=None, ge=1)
    timing: Timing | None = None
    # node-link fields, as networkx writes them
    directed: Literal[True] = True
    multigraph: Literal[False] = False
    graph: dict[str, Any] = Field(default_factory=dict)
    nodes: list[Node] = Field(min_length=1)
    edges: list[Edge] = Field(default_factory=list)
    _index: tuple[tuple[int, int], dict[str, Node]] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_dag(self) -> LayerGraph:
        seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.id in seen:
                raise ValueError(
                    f"nodes[{i}].id: duplicate node id {node.id!r} (also nodes[{seen[node.id]}])"
                )
            seen[node.id] = i
        for i, edge in enumerate(self.edges):
            for end in ("source", "target"):
                name = getattr(edge, end)
                if name not in seen:
                    raise ValueError(f"edges[{i}].{end}: unknown node id {name!r}")
        if not _acyclic(self.nodes, self.edges):
            import networkx as nx  # only to name the cycle: importing it costs ~0.3 s

            cycle = nx.find_cycle(self.to_networkx())
            raise ValueError(f"edges: the graph has a cycle through {' -> '.join(str(u) for u, _ in cycle)}")
        return self

    def to_networkx(self) -> nx.DiGraph:
        """The graph as a ``networkx.DiGraph`` with every node and edge attribute."""
        import networkx as nx

        g: nx.DiGraph = nx.DiGraph()
        for node in self.nodes:
            g.add_node(node.id, **node.model_dump(exclude={"id"}))
        for edge in self.edges:
            g.add_edge(edge.source, edge.target, bytes=edge.bytes)
        return g

    def structure_hash(self) -> str:
        """The hash of the layer names and edges; a plan carries it, pdrun checks it."""
        return graph_hash((n.id for n in self.nodes), ((e.source, e.target) for e in self.edges))

    def ties(self) -> list[tuple[list[str], float | None]]:
        """pdprof's ``graph.ties`` (the layers reading one parameter) with ``graph.tie_bytes`` (its size;
        None in a graph from before pdprof wrote it, whose layers each counted the parameter)."""
        layers = self.graph.get("ties") or []
        sizes = self.graph.get("tie_bytes")
        if not isinstance(sizes, list) or len(sizes) != len(layers):
            sizes = [None] * len(layers)
        return [
            (list(names), None if size is None else float(size))
            for names, size in zip(layers, sizes, strict=True)
        ]

    def held_parameter_bytes(self, layers: Iterable[str]) -> float:
        """The parameter bytes a stage of ``layers`` holds: its layers' own (each tensor counted at its first
        reader) and a copy of every tied parameter one of them reads but an earlier stage's layer owns (pdrun
        gives each stage its own copy and sums their gradients, ``pdrun.tied``)."""
        inside = set(layers)
        by_id = self._by_id()
        held = sum(by_id[layer].parameter_bytes for layer in inside if layer in by_id)
        for readers, size in self.ties():
            if size is not None and readers[0] not in inside and inside.intersection(readers):
                held += size
        return float(held)

    def node(self, node_id: str) -> Node:
        return self._by_id()[node_id]

    def _by_id(self) -> dict[str, Node]:
        """The nodes by id, built once per nodes list: the planner asks per stage of every plan it tries, and
        a scan of every node per stage cost O(layers x stages) a plan."""
        key = (id(self.nodes), len(self.nodes))
        if self._index is None or self._index[0] != key:
            self._index = (key, {n.id: n for n in self.nodes})
        return self._index[1]


def _acyclic(nodes: list[Node], edges: list[Edge]) -> bool:
    """Whether the edges form no cycle (Kahn's algorithm: every node is reached with its inputs done)."""
    succs: dict[str, set[str]] = {n.id: set() for n in nodes}
    for e in edges:
        succs[e.source].add(e.target)
    waiting = dict.fromkeys(succs, 0)
    for targets in succs.values():
        for t in targets:
            waiting[t] += 1
    ready = [n for n, k in waiting.items() if k == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for t in succs[n]:
            waiting[t] -= 1
            if waiting[t] == 0:
                ready.append(t)
    return done == len(succs)


def graph_hash(node_ids: Iterable[str], edges: Iterable[tuple[str, str]]) -> str:
    """``sha256:...`` of the sorted node ids and edges: the structure, not the timings."""
    payload = json.dumps({"nodes": sorted(node_ids), "edges": sorted([list(e) for e in edges])})
    return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()


def load_graph(source: str | os.PathLike[str]) -> LayerGraph:
    """Load and validate a layer graph from a path or ``-``; its file specs are read relative to its folder."""
    graph = load_json_artifact(LayerGraph, source, FORMAT_GRAPH, "a layer graph (pdprof.graph/1)")
    return graph.model_copy(update={"spec": graph.spec.anchored(artifact_folder(source))})


def save_graph(graph: LayerGraph, path: str | os.PathLike[str]) -> None:
    save_json_artifact(graph, path)


def graph_json(graph: LayerGraph) -> str:
    return dump_json(graph)
