"""The one tracer: a model becomes named layers in a DAG, the same in pdprof and pdrun.

torch.fx traces the model at leaf-module and function granularity: each fx node
(a module call, a function such as ``add`` or ``flatten``, a method call, a parameter
read, a model input) is one layer, named by fx's deterministic node name
(``layer1_0_conv1``). ``TraceOptions`` keep chosen module types, or every module at a
depth, as single layers, so a transformer block or an LSTM stack is one layer and
constructs fx cannot see through stay hidden inside it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from shared.errors import TraceError
from shared.graph import graph_hash
from shared.spec import TraceOptions

OP_KIND = {
    "placeholder": "input",
    "call_module": "call_module",
    "call_function": "call_function",
    "call_method": "call_method",
    "get_attr": "get_attr",
}


@dataclass(frozen=True)
class Layer:
    """One traced layer: its name, kind, what it calls, and the layers it reads."""

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]


@dataclass
class TracedModel:
    """A traced model: the fx ``GraphModule`` and its layers in topological order."""

    module: fx.GraphModule
    layers: list[Layer]
    outputs: tuple[str, ...]  # layers whose values form the model's output
    options: TraceOptions = field(default_factory=TraceOptions)

    def edges(self) -> list[tuple[str, str]]:
        return [(src, layer.name) for layer in self.layers for src in layer.inputs]

    def structure_hash(self) -> str:
        return graph_hash((layer.name for layer in self.layers), self.edges())

    def fx_nodes(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.module.graph.nodes}


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if target is operator.getitem:
        return "getitem"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    if name.startswith("_VariableFunctionsClass."):  # torch.relu and friends: name them as users write them
        module, name = "torch", name.split(".", 1)[1]
    short = module.replace("torch._C._nn", "torch.nn.functional").replace("_operator", "operator")
    return f"{short}.{name}" if short else str(name)


class _Tracer(fx.Tracer):
    """fx's tracer with our leaf rules, remembering which module it is inside for errors."""

    def __init__(self, options: TraceOptions) -> None:
        super().__init__()
        self.options = options
        self.leaf_names = set(options.leaf_modules)
        self.stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None  # the innermost module an error came from

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        cls = type(m)
        if cls.__name__ in self.leaf_names or f"{cls.__module__}.{cls.__qualname__}" in self.leaf_names:
            return True
        depth = self.options.depth
        if depth is not None and module_qualified_name and module_qualified_name.count(".") + 1 >= depth:
            return True
        # Recurrent layers are torch.nn leaves already; keep any module without children as one layer too.
        return super().is_leaf_module(m, module_qualified_name) or not any(True for _ in m.children())

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        qualname = self.path_of_module(m)
        self.stack.append((qualname, type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.stack[-1]
            raise
        finally:
            self.stack.pop()


def _construct(message: str) -> str | None:
    """Name the Python construct behind one of fx's tracing errors, when we recognise it."""
    if "control flow" in message or "bool" in message:
        return "data-dependent control flow (an if/while on a tensor's value)"
    if "iterate" in message:
        return "iterating over a tensor (a for loop or unpacking of a traced value)"
    if "len(" in message:
        return "len() of a traced tensor"
    if "Proxy" in message and ("int()" in message or "float()" in message or "integer" in message):
        return "a tensor or its shape used as a Python number (int(), float(), range())"
    return None


@contextmanager
def _explain(tracer: _Tracer, model: nn.Module) -> Iterator[None]:
    try:
        yield
    except TraceError:
        raise
    except Exception as exc:
        where, cls = tracer.failed_in or ("", type(model).__name__)
        place = f"module {where!r} ({cls})" if where else f"the model's own forward ({cls})"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        construct = _construct(first) or f"{type(exc).__name__}: {first}"
        hint = (
            f"keep it as one layer with --leaf-module {cls}"
            if where
            else "keep the offending submodules as single layers with --leaf-module NAME or --depth N"
        )
        raise TraceError(f"torch.fx cannot trace {place}: {construct}; {hint}") from exc


def trace(model: nn.Module, options: TraceOptions | None = None) -> TracedModel:
    """Trace ``model`` into layers; raises ``TraceError`` naming the construct fx cannot follow."""
    options = options or TraceOptions()
    tracer = _Tracer(options)
    with _explain(tracer, model):
        graph = tracer.trace(model)
    module = fx.GraphModule(tracer.root, graph, type(model).__name__)
    layers: list[Layer] = []
    outputs: tuple[str, ...] = ()
    for node in module.graph.nodes:
        if node.op == "output":
            outputs = tuple(dict.fromkeys(n.name for n in node.all_input_nodes))
            continue
        inputs = tuple(dict.fromkeys(n.name for n in node.all_input_nodes))
        layers.append(Layer(node.name, OP_KIND[node.op], _target_name(node), inputs))
    if not any(layer.op != "input" for layer in layers):
        raise TraceError(
            f"model {type(model).__name__}: tracing found no layers (does forward use its input?)"
        )
    return TracedModel(module, layers, outputs, options)


def parameter_bytes(traced: TracedModel, layer: Layer) -> int:
    """Bytes of the parameters (and buffers) a layer owns."""
    if layer.op == "call_module":
        sub = traced.module.get_submodule(layer.target)
        tensors = [*sub.parameters(), *sub.buffers()]
    elif layer.op == "get_attr":
        value = _get_attr(traced.module, layer.target)
        tensors = [value] if isinstance(value, torch.Tensor) else []
    else:
        tensors = []
    return sum(t.numel() * t.element_size() for t in tensors)


def _get_attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
