"""The weight half of a split backward, computed from what the input half already found.

Zero bubble's W (Qi et al., ICLR'24, section 2) is only cheap if it does not redo B. A second
``autograd.grad(roots, params)`` after B would: every activation gradient between the roots
and a parameter's use is computed again (a convolution stage's backward cost 1.56x a plain
one here). Instead, B records the gradient arriving at each *boundary* node, an autograd node
on a path to the stage's received values that a parameter's gradient also flows out of (the
matmul or convolution using a weight), and W starts there: it differentiates those nodes'
recorded gradients with respect to the parameters behind them, so only the weight-side work
runs (the weight product of each matmul, a bias's sum). The graph terms follow the autograd
engine: a node's ``next_functions`` lead towards the leaves, a leaf's gradient arrives at its
``AccumulateGrad`` node, and :class:`torch.autograd.graph.GradientEdge` names one input of a
node as the place a gradient starts or ends.

Parameters are grouped by the boundary nodes they share (a weight used by two matmuls is one
group with both); in a group of several, W pins each boundary's gradient to the recorded one
(a pre-hook), since one boundary's weight-side path may pass through another's. A parameter
whose gradient reaches a root without crossing the input paths (an output computed from
weights alone), or whose boundary B never ran, is differentiated from the roots as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

Grads = tuple[torch.Tensor | None, ...]


def grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient of ``t`` flows into: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn  # a leaf's accumulator is made on demand; a view reaches it
    return None if view is None else view.next_functions[0][0]


@dataclass
class _Group:
    boundary: set[Node]
    params: list[torch.Tensor]


@dataclass
class WeightPass:
    """What W needs of one unit: each group's boundary gradients, and the parameters done the plain way."""

    roots: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    groups: list[_Group] = field(default_factory=list)
    plain: list[torch.Tensor] = field(default_factory=list)  # differentiated from the roots
    seen: dict[Node, Grads] = field(default_factory=dict)  # the gradient B saw arrive at each boundary


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Each node of the graph below ``roots`` with the nodes whose gradients flow into it."""
    into: dict[Node, list[Node]] = {n: [] for n in roots}
    todo = deque(roots)
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in into:
                into[child] = []
                todo.append(child)
            into[child].append(node)
    return into


def _above(starts: Sequence[Node], into: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node a gradient passes on its way from the roots to them."""
    found = {n for n in starts if n in into}
    todo = deque(found)
    while todo:
        for parent in into[todo.popleft()]:
            if parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


def _boundary(param: Node, into: dict[Node, list[Node]], inputs_side: set[Node]) -> set[Node] | None:
    """The nodes on the input paths where ``param``'s gradient leaves them; None if it reaches a root apart."""
    hit: set[Node] = set()
    seen = {param}
    todo = deque([param])
    while todo:
        node = todo.popleft()
        parents = into[node]
        if not parents:
            return None  # a root reached without crossing an input path
        for parent in parents:
            if parent in inputs_side:
                hit.add(parent)
            elif parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return hit


def _grouped(pairs: list[tuple[set[Node], torch.Tensor]]) -> list[_Group]:
    """Parameters whose boundaries overlap, one group each (a shared weight joins its uses)."""
    groups: list[_Group] = []
    for boundary, param in pairs:
        joined = _Group(set(boundary), [param])
        rest = []
        for g in groups:
            if g.boundary & joined.boundary:
                joined.boundary |= g.boundary
                joined.params = g.params + joined.params
            else:
                rest.append(g)
        groups = [*rest, joined]
    return groups


def backward_input(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    params: list[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """B: the gradients of ``inputs``, and what :func:`backward_weight` needs for ``params`` later."""
    wp = WeightPass(roots, grads)
    if not roots:
        return tuple(None for _ in inputs), wp
    if not inputs:
        wp.plain = params  # nothing below the roots is shared with an input path: W does all of it
        return (), wp
    root_nodes = [n for n in map(grad_node, roots) if n is not None]
    into = _consumers(root_nodes)
    inputs_side = _above([n for n in map(grad_node, inputs) if n is not None], into)
    pairs: list[tuple[set[Node], torch.Tensor]] = []
    for p in params:
        node = grad_node(p)
        if node is None or node not in into:
            continue  # unused by this unit: no gradient
        boundary = _boundary(node, into, inputs_side)
        if boundary:
            pairs.append((boundary, p))
        else:
            wp.plain.append(p)
    wp.groups = _grouped(pairs)

    def recorder(node: Node):  # type: ignore[no-untyped-def]
        def hook(grad_outputs: Grads) -> None:
            wp.seen[node] = grad_outputs

        return hook

    handles = [n.register_prehook(recorder(n)) for g in wp.groups for n in g.boundary]
    try:
        got = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return got, wp


def backward_weight(wp: WeightPass) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """W: each parameter with its gradient, from the boundaries B recorded (or the roots)."""
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    plain = list(wp.plain)
    for g in wp.groups:
        if any(n not in wp.seen for n in g.boundary):
            plain.extend(g.params)  # B never reached this boundary: start from the roots
            continue
        edges, start = [], []
        for node in g.boundary:
            for i, grad in enumerate(wp.seen[node]):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    start.append(grad)
        if not edges:
            out.extend((p, None) for p in g.params)
            continue
        pins = []
        if len(g.boundary) > 1:  # one boundary's weight side may run through another: keep B's figure there
            for node in g.boundary:
                pins.append(node.register_prehook(lambda _, seen=wp.seen[node]: seen))
        try:
            got = torch.autograd.grad(edges, g.params, start, retain_graph=True, allow_unused=True)
        finally:
            for h in pins:
                h.remove()
        out.extend(zip(g.params, got, strict=True))
    if plain:
        got = torch.autograd.grad(wp.roots, plain, wp.grads, retain_graph=True, allow_unused=True)
        out.extend(zip(plain, got, strict=True))
    return out
