"""In-place operations whose result the model does not use, made explicit in the traced graph.

fx records ``y.add_(x)`` as a node that reads ``y``, but the layers after it read ``y`` itself, not the
node: ``y = a(x); y.add_(x); return b(relu(y))`` traces to a graph where ``relu`` does not depend on
``add_``. The graph then lets a plan run ``relu`` before ``add_`` (pdplan put ``add_`` in a later stage
than ``relu`` for a new user's residual block, and training ran on the value before the add, without a
word: a step-0 loss of 1.38166 where the model computes 1.38922), and the dangling node multiplied the
planner's states (1,300 antichains for a 37-layer model).

:func:`make_explicit` rewrites each such node so the graph says what the model computes: the node
becomes its out-of-place twin (``add_`` -> ``add``, ``torch.relu_`` -> ``torch.relu``, ``inplace=True``
-> ``False``, ``operator.iadd`` -> ``operator.add``) and every later reader of the old value reads the
node instead. Out of place, the old value also stays as it was for the readers before the node, which
may run on another stage after it. An in-place module (``nn.ReLU(inplace=True)`` called without using
its result) cannot be switched (its other calls share it): its later readers are pointed at it, which
orders them after it. A node that writes a module's buffer or parameter (``self.ema.add_(...)``) is
state the graph cannot keep: :func:`state_writes` names it, and the tracer refuses the model.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

_IN_PLACE_OPERATORS: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
    operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod,
    operator.ipow: operator.pow,
    operator.iand: operator.and_,
    operator.ior: operator.or_,
    operator.ixor: operator.xor,
    operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
    operator.imatmul: operator.matmul,
}


def _twin(module: fx.GraphModule, node: fx.Node) -> tuple[bool, Callable[[], None] | None]:
    """(whether ``node`` writes its first argument in place, how to make it out of place: None when it
    cannot be)."""
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        if name.endswith("_") and not name.startswith("_"):
            plain = name[:-1]
            if hasattr(torch.Tensor, plain):
                return True, lambda: setattr(node, "target", plain)
            return True, None  # copy_, zero_, fill_, requires_grad_: no twin
        return False, None
    if node.op == "call_function":
        target = node.target
        if target in _IN_PLACE_OPERATORS:
            return True, lambda: setattr(node, "target", _IN_PLACE_OPERATORS[target])
        if node.kwargs.get("inplace") is True:
            return True, lambda: setattr(node, "kwargs", {**node.kwargs, "inplace": False})
        name = getattr(target, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):
            where = str(getattr(target, "__module__", None) or "")
            home = torch.nn.functional if "functional" in where else torch
            twin = getattr(home, name[:-1], None)
            return True, (lambda: setattr(node, "target", twin)) if callable(twin) else None
        return False, None
    if node.op == "call_module" and isinstance(node.target, str):
        sub = module.get_submodule(node.target)
        return bool(getattr(sub, "inplace", False) is True), None
    return False, None


def _written(node: fx.Node) -> fx.Node | None:
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def state_writes(module: fx.GraphModule) -> list[str]:
    """The module attributes (buffers, parameters) some node of the graph writes in place."""
    out = []
    for node in module.graph.nodes:
        written = _written(node)
        if written is not None and written.op == "get_attr" and _twin(module, node)[0]:
            out.append(str(written.target))
    return list(dict.fromkeys(out))


def make_explicit(module: fx.GraphModule) -> int:
    """Rewrite the in-place nodes whose written value is read again after them (module doc); how many."""
    order = {node: i for i, node in enumerate(module.graph.nodes)}
    rewritten = 0
    for node in list(module.graph.nodes):
        written = _written(node)
        if written is None:
            continue
        in_place, make_plain = _twin(module, node)
        if not in_place:
            continue
        later = [u for u in written.users if u is not node and order[u] > order[node]]
        if not later:
            continue  # its result is what the model goes on with (y = y.add_(x)), or nothing reads it
        if make_plain is not None:
            make_plain()
        for user in later:
            user.replace_input_with(written, node)
        rewritten += 1
    if rewritten:
        module.graph.lint()
        module.recompile()
    return rewritten
