"""The planning problem: the layer graph reduced to the DAG PipeDream's optimizer partitions.

As the paper's optimizer does before planning: model inputs (op ``input`` sources) are
zeroed and set aside, since they always go with stage 0, and dangling sinks that only
index a tuple (``__getitem__`` / ``getitem``) are dropped. What remains is numbered in a
topological order; each node carries its cost figures, and ``attached`` remembers where
every set-aside node goes back, so that the plan still covers the whole graph.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.errors import PlanError
from shared.graph import LayerGraph

if TYPE_CHECKING:
    import networkx as nx

_GETITEM = ("__getitem__", "getitem")


def _is_tuple_index(attrs: dict[str, object]) -> bool:
    target = str(attrs.get("target", ""))
    return any(target.startswith(prefix) for prefix in _GETITEM) or target.endswith(".__getitem__")


@dataclass
class Problem:
    """The DAG to partition: node ids, per-node costs and ancestor/successor bit masks."""

    ids: list[str]
    compute_s: list[float]  # (forward + backward) ms / 1000
    parameter_bytes: list[float]
    activation_bytes: list[float]  # summed over a merged node's members (memory)
    preds: list[list[int]]
    succs: list[list[int]]
    first_source: int
    inputs: list[str] = field(default_factory=list)  # set aside: stage 0
    attached: dict[str, str] = field(default_factory=dict)  # dropped sink -> its producer
    members: dict[int, list[str]] = field(default_factory=dict)  # node -> graph nodes it stands for
    output_bytes: list[float] | None = None  # the tensor leaving a merged node: its last member's
    cache: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def outputs(self) -> list[float]:
        """Bytes each node sends out (what crosses a cut after it)."""
        return self.output_bytes if self.output_bytes is not None else self.activation_bytes

    @property
    def size(self) -> int:
        return len(self.ids)

    def ancestor_masks(self) -> list[int]:
        """Bit masks of each node's downset (itself and every ancestor); nodes are in topological order."""
        if "anc" in self.cache:
            return self.cache["anc"]
        anc = [0] * self.size
        for v in range(self.size):
            mask = 1 << v
            for p in self.preds[v]:
                mask |= anc[p]
            anc[v] = mask
        self.cache["anc"] = anc
        return anc

    def successor_masks(self) -> list[int]:
        if "succ" in self.cache:
            return self.cache["succ"]
        out = [0] * self.size
        for v in range(self.size):
            for s in self.succs[v]:
                out[v] |= 1 << s
        self.cache["succ"] = out
        return out

    def layers_of(self, node: int) -> list[str]:
        """The graph layers node ``node`` stands for."""
        return self.members.get(node, [self.ids[node]])


def prepare(g: nx.DiGraph) -> Problem:
    """The problem of a networkx graph of layers (node attributes as ``LayerGraph.to_networkx`` sets them)."""
    order = list(g.nodes)
    return _prepare(
        order,
        {n: g.nodes[n] for n in order},
        {n: list(g.predecessors(n)) for n in order},
        {n: list(g.successors(n)) for n in order},
    )


def prepare_layers(graph: LayerGraph) -> Problem:
    """The problem of a layer graph, as ``prepare(graph.to_networkx())`` without importing networkx.

    networkx takes about a third of a second to import, most of what ``pdplan`` on a small
    model costs; the DP itself works on plain lists.
    """
    order = [node.id for node in graph.nodes]
    preds: dict[str, dict[str, None]] = {n: {} for n in order}
    succs: dict[str, dict[str, None]] = {n: {} for n in order}
    for edge in graph.edges:  # in the file's order, as networkx keeps its adjacency
        preds[edge.target][edge.source] = None
        succs[edge.source][edge.target] = None
    return _prepare(
        order,
        {node.id: node.model_dump(exclude={"id"}) for node in graph.nodes},
        {n: list(p) for n, p in preds.items()},
        {n: list(s) for n, s in succs.items()},
    )


def _prepare(
    order: list[str],
    attrs: dict[str, Any],
    preds: dict[str, list[str]],
    succs: dict[str, list[str]],
) -> Problem:
    """Zero and set aside the inputs, drop dangling tuple-indexing sinks, number the rest.

    ``order`` is the file's order: PipeDream's optimizer starts from its first source.
    """
    inputs = [n for n in order if not preds[n] and attrs[n].get("op") == "input"]
    work = set(order) - set(inputs)
    # One pass, as in the paper's optimizer: only sinks that dangle now are dropped.
    attached: dict[str, str] = {}
    for n in [n for n in order if n in work and not succs[n] and _is_tuple_index(attrs[n])]:
        producers = preds[n]
        attached[n] = producers[0] if producers else ""
        work.discard(n)
    if not work:
        raise PlanError("graph: nothing to plan: the graph has only model inputs and tuple indexing")
    topo = _topological(order, work, preds, succs)
    index = {n: i for i, n in enumerate(topo)}
    sources = [n for n in order if n in work and not any(p in work for p in preds[n])]
    for sink, producer in attached.items():
        # A dropped sink goes with its producer; one fed only by an input goes to stage 0.
        if producer not in index:
            attached[sink] = ""
    return Problem(
        ids=topo,
        compute_s=[(float(attrs[n]["forward_ms"]) + float(attrs[n]["backward_ms"])) / 1000.0 for n in topo],
        parameter_bytes=[float(attrs[n]["parameter_bytes"]) for n in topo],
        activation_bytes=[float(attrs[n]["activation_bytes"]) for n in topo],
        preds=[sorted(index[p] for p in preds[n] if p in work) for n in topo],
        succs=[sorted(index[s] for s in succs[n] if s in work) for n in topo],
        first_source=index[sources[0]],
        inputs=inputs,
        attached=attached,
    )


def _topological(
    order: list[str], work: set[str], preds: dict[str, list[str]], succs: dict[str, list[str]]
) -> list[str]:
    """A topological order of ``work`` that keeps the file's order where it can (ties broken by it).

    Kahn's algorithm with a heap on file position: networkx's ``lexicographical_topological_sort``.
    """
    position = {n: i for i, n in enumerate(order)}
    waiting = {n: sum(p in work for p in preds[n]) for n in work}
    ready = [(position[n], n) for n in work if waiting[n] == 0]
    heapq.heapify(ready)
    topo: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        topo.append(n)
        for s in succs[n]:
            if s in work:
                waiting[s] -= 1
                if waiting[s] == 0:
                    heapq.heappush(ready, (position[s], s))
    if len(topo) != len(work):
        raise PlanError("graph: edges: the graph has a cycle")  # LayerGraph refuses one on load
    return topo


def compress_series(problem: Problem) -> Problem:
    """Merge every edge u -> v where u has one successor and v one predecessor into one node.

    The fallback for DAGs with too many antichain states (as PipeDream's compressed
    profiles do): a chain inside a branch becomes one node whose compute and parameters are
    the sums, whose output is its last member's, so stage boundaries fall only between
    chains. Costs of every remaining cut are unchanged.
    """
    anc = problem.ancestor_masks()
    desc = [0] * problem.size
    for v in reversed(range(problem.size)):
        mask = 1 << v
        for w in problem.succs[v]:
            mask |= desc[w]
        desc[v] = mask
    full = (1 << problem.size) - 1
    # A node every other node is before or after (the trunk of a chain) keeps its own cuts.
    trunk = [(anc[v] | desc[v]) == full for v in range(problem.size)]
    head = list(range(problem.size))  # node -> first node of its chain
    for v in range(problem.size):
        if len(problem.preds[v]) == 1:
            u = problem.preds[v][0]
            if len(problem.succs[u]) == 1 and v != problem.first_source and not (trunk[u] or trunk[v]):
                head[v] = head[u]
    heads = sorted(set(head))
    new = {h: i for i, h in enumerate(heads)}
    groups: list[list[int]] = [[] for _ in heads]
    for v in range(problem.size):
        groups[new[head[v]]].append(v)
    preds = [sorted({new[head[p]] for p in problem.preds[g[0]]}) for g in groups]
    succs = [sorted({new[head[s]] for s in problem.succs[g[-1]]}) for g in groups]
    return Problem(
        ids=[problem.ids[g[0]] for g in groups],
        compute_s=[sum(problem.compute_s[v] for v in g) for g in groups],
        parameter_bytes=[sum(problem.parameter_bytes[v] for v in g) for g in groups],
        activation_bytes=[sum(problem.activation_bytes[v] for v in g) for g in groups],
        preds=preds,
        succs=succs,
        first_source=new[head[problem.first_source]],
        inputs=list(problem.inputs),
        attached=dict(problem.attached),
        members={i: [m for v in g for m in problem.layers_of(v)] for i, g in enumerate(groups)},
        output_bytes=[problem.outputs()[g[-1]] for g in groups],
    )
