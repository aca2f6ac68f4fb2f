"""The one tracer: a model becomes named layers in a DAG, the same in pdprof and pdrun.

Two frontends give the same kind of graph (``TraceOptions.frontend``, which pdprof picks and
the graph records):

- ``fx`` (plain torch models): torch.fx traces the model at leaf-module and function
  granularity: each fx node (a module call, a function such as ``add`` or ``flatten``, a
  method call, a parameter read, a model input) is one layer, named by fx's deterministic
  node name (``layer1_0_conv1``). torch.nn modules are leaves, except the containers
  (``Sequential``, ``TransformerEncoder``, ``TransformerDecoder``), which open into their
  layers; ``TransformerEncoderLayer``/``DecoderLayer`` stay leaves (their fast path is not
  traceable, and in training it is never taken). ``TraceOptions`` keep chosen module types,
  or every module at a depth, as single layers, so constructs fx cannot see through stay
  hidden inside one.
- ``export`` (Hugging Face models, detected as ``PreTrainedModel``): ``shared.tracer_export``.

A model called with keyword inputs (``TraceOptions.example`` names them, in order) gets one
placeholder per input; a dict or ``ModelOutput`` output is resolved to the one field the loss
reads (``TraceOptions.output``: ``logits`` unless named), recorded so pdrun picks the same.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from shared.errors import TraceError
from shared.graph import graph_hash
from shared.inplace import make_explicit, state_writes
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
    params: tuple[str, ...] = ()  # get_attr nodes folded into this layer (the export frontend)


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
        if isinstance(m, CONTAINERS):
            return False
        # Recurrent layers are torch.nn leaves already; keep any module without children as one layer too.
        return super().is_leaf_module(m, module_qualified_name) or not any(True for _ in m.children())

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        qualname = self.path_of_module(m)
        self.stack.append((qualname, type(m).__name__))
        try:
            if isinstance(m, CONTAINERS) and not self.is_leaf_module(m, qualname):
                return _open_container(m, args, kwargs)
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


# torch.nn modules that are containers of layers: opened by default, closed by --leaf-module.
CONTAINERS = (nn.TransformerEncoder, nn.TransformerDecoder)


def _open_container(m: nn.Module, args: Any, kwargs: Any) -> Any:
    """A TransformerEncoder/Decoder as the loop over its layers that it runs in training.

    Their own forward checks its inputs' values (fast-path conditions, causal-mask detection),
    which fx cannot follow; in training (autograd on) they reduce to this loop, which is what
    the traced layers run: each layer gets the masks as given, then the optional final norm.
    """
    names = (
        ("src", "mask", "src_key_padding_mask", "is_causal")
        if isinstance(m, nn.TransformerEncoder)
        else (
            "tgt",
            "memory",
            "tgt_mask",
            "memory_mask",
            "tgt_key_padding_mask",
            "memory_key_padding_mask",
            "tgt_is_causal",
            "memory_is_causal",
        )
    )
    bound = dict(zip(names, args, strict=False)) | dict(kwargs)
    layers = cast(nn.ModuleList, m.layers)
    norm = cast(nn.Module | None, m.norm)
    if isinstance(m, nn.TransformerEncoder):
        out = bound["src"]
        layer_kwargs = {
            "src_mask": bound.get("mask"),
            "src_key_padding_mask": bound.get("src_key_padding_mask"),
            "is_causal": bool(bound.get("is_causal") or False),
        }
        for layer in layers:
            out = layer(out, **layer_kwargs)
    else:
        out, memory = bound["tgt"], bound["memory"]
        rest = {k: bound.get(k) for k in names[2:6]}
        flags = {k: bool(bound.get(k) or False) for k in names[6:]}
        for layer in layers:
            out = layer(out, memory, **rest, **flags)
    return norm(out) if norm is not None else out


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


@functools.cache
def _function_call(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` as a plain function for the graph to call, named after the Function."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        return cls.apply(*args, **kwargs)  # type: ignore[no-untyped-call]

    apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
    apply.__module__ = cls.__module__
    return apply


@contextmanager
def _functions_kept(tracer: _Tracer) -> Iterator[None]:
    """A user's ``torch.autograd.Function`` stays one call in the graph while fx traces.

    Left alone, fx runs the Function's ``forward`` on its proxies and records the ops inside, so the
    graph computes the forward with autograd's own backward for those ops, not the Function's (a
    straight-through or gradient-scaling Function silently trains otherwise). So while tracing,
    ``Function.apply`` on traced values records one call of it (:func:`_function_call`), which runs
    the Function itself, its backward included. torch's own Functions (inside its modules, which
    are leaves, or a reentrant checkpoint) are traced as before.
    """
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
        traced = any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs)))
        if not traced or cls.__module__.split(".")[0] == "torch":
            return original.__func__(cls, *args, **kwargs)
        return tracer.create_proxy("call_function", _function_call(cls), args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


@contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Refuse a forward that changes a module's state (``self.seen += n`` on a buffer), and leave the
    model as it was. While fx traces, buffers are plain tensors: an update with constants runs once, then
    and never again (the graph has no node for it: a new user's step counter stayed at 1 and its EMA
    went wrong without a word), and an assignment stores a traced value in the module, which breaks
    its later use (``model.to`` fails on it) far from the cause."""
    buffers = {(name, key): value for name, m in model.named_modules() for key, value in m._buffers.items()}
    before = {k: v.detach().clone() for k, v in buffers.items() if isinstance(v, torch.Tensor)}
    try:
        yield
    finally:
        assigned = []
        for name, m in model.named_modules():
            for key, value in list(m._buffers.items()):
                old = before.get((name, key))
                if isinstance(value, fx.Proxy) or value is not buffers.get((name, key)):
                    m._buffers[key] = buffers.get((name, key))
                    assigned.append(f"{name}.{key}" if name else key)
                elif isinstance(value, torch.Tensor) and old is not None and not torch.equal(value, old):
                    with torch.no_grad():
                        value.copy_(old)
                    assigned.append(f"{name}.{key}" if name else key)
            for key, value in list(vars(m).items()):
                if isinstance(value, fx.Proxy):
                    delattr(m, key)
                    assigned.append(f"{name}.{key}" if name else key)
        if assigned:
            raise _state_error(model, assigned)


def _state_error(model: nn.Module, names: list[str]) -> TraceError:
    return TraceError(
        f"{type(model).__name__}'s forward assigns {', '.join(repr(a) for a in names)} while it runs "
        "(e.g. a buffer updated in place): a traced graph cannot update a module's state; update it "
        "outside forward, or do it in a submodule kept as one layer with --leaf-module NAME"
    )


def is_hugging_face(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (transformers imported only where the model came from it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def place(module: nn.Module, device: torch.device, options: TraceOptions) -> None:
    """Move a traced module (or a stage of it) to ``device``: its tensors, and for the export frontend
    the devices its graph names (``shared.tracer_export.set_device``). pdprof and pdrun both place so."""
    module.to(device)
    if options.frontend == "export":
        from shared.tracer_export import set_device

        set_device(module, device)


def trace(model: nn.Module, options: TraceOptions | None = None) -> TracedModel:
    """Trace ``model`` into layers; raises ``TraceError`` naming the construct fx cannot follow.

    The options returned with the traced model (``TracedModel.options``) name the output field
    chosen, for the artifact to record.
    """
    options = options or TraceOptions()
    if options.frontend == "export":
        from shared.tracer_export import export_module

        module, field_name = export_module(model, options)
        return _layers(module, options.model_copy(update={"output": field_name}), model, fold=True)
    if is_hugging_face(model):
        raise TraceError(
            f"{type(model).__name__} is a Hugging Face model: it is traced with torch.export for given "
            "inputs (TraceOptions frontend='export' and example, which pdprof sets from the dataset)"
        )
    tracer = _Tracer(options)
    names = [e.name for e in options.example]
    with _explain(tracer, model), _functions_kept(tracer), _state_kept(model):
        graph = tracer.trace(model, concrete_args=_concrete(model, names) if names else None)
    module = fx.GraphModule(tracer.root, graph, type(model).__name__)
    written = state_writes(module)  # a buffer's in-place update on traced values (self.ema.add_(x))
    if written:
        raise _state_error(model, written)
    make_explicit(module)  # y.add_(x) with its result unused: the later readers read it (shared.inplace)
    field_name = _select_output(module, options.output)
    return _layers(module, options.model_copy(update={"output": field_name}), model, fold=False)


def _concrete(model: nn.Module, names: list[str]) -> dict[str, Any]:
    """Keyword inputs: every other parameter of forward keeps its default while tracing."""
    params = inspect.signature(model.forward).parameters
    return {
        k: p.default
        for k, p in params.items()
        if k not in names and p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
    }


def _select_output(module: fx.GraphModule, field_name: str | None) -> str | None:
    """Rewrite a dict output to the one field the loss reads; the field's name, or None. On the module,
    not its bare graph: dead-code elimination asks the owning module which calls are pure."""
    from shared.tracer_export import select_output

    out = next(n for n in module.graph.nodes if n.op == "output")
    value, chosen = select_output(out.args[0], field_name)
    if chosen is not None:
        out.args = (value,)
        module.graph.eliminate_dead_code()
        module.recompile()
    return chosen


def _layers(module: fx.GraphModule, options: TraceOptions, model: nn.Module, fold: bool) -> TracedModel:
    layers: list[Layer] = []
    outputs: tuple[str, ...] = ()
    for node in module.graph.nodes:
        if node.op == "output":
            outputs = tuple(dict.fromkeys(n.name for n in node.all_input_nodes))
            continue
        if fold and node.op == "get_attr":
            continue  # a parameter, folded into the layers that read it
        reads = list(dict.fromkeys(node.all_input_nodes))
        inputs = tuple(n.name for n in reads if not (fold and n.op == "get_attr"))
        params = tuple(n.name for n in reads if fold and n.op == "get_attr")
        layers.append(Layer(node.name, OP_KIND[node.op], _target_name(node), inputs, params))
    if not any(layer.op != "input" for layer in layers):
        raise TraceError(
            f"model {type(model).__name__}: tracing found no layers (does forward use its input?)"
        )
    return TracedModel(module, layers, outputs, options)


def layer_tensors(traced: TracedModel, layer: Layer) -> list[torch.Tensor]:
    """The parameters (and buffers) a layer owns: its module's, its get_attr's, or those folded into it."""
    if layer.op == "call_module":
        sub = traced.module.get_submodule(layer.target)
        tensors: list[torch.Tensor] = [*sub.parameters(), *sub.buffers()]
    elif layer.op == "get_attr":
        value = _get_attr(traced.module, layer.target)
        tensors = [value] if isinstance(value, torch.Tensor) else []
    else:
        tensors = []
    nodes = traced.fx_nodes() if layer.params else {}
    for name in layer.params:
        value = _get_attr(traced.module, str(nodes[name].target))
        if isinstance(value, torch.Tensor):
            tensors.append(value)
    return tensors


def parameter_bytes(traced: TracedModel, layer: Layer) -> int:
    """Bytes of the parameters (and buffers) a layer owns."""
    return sum(t.numel() * t.element_size() for t in layer_tensors(traced, layer))


def owned_parameter_bytes(traced: TracedModel) -> dict[str, int]:
    """Per layer, the bytes of the parameters (and buffers) it reads that no earlier layer read: a tensor
    several layers read (a tied embedding and head, ALBERT's one layer run N times) counts once, at its
    first reader, so the layers' sum is the model's size (it was N times ALBERT's shared layer: 692 KiB
    for a 298 KiB model). The stages that also hold it are the graph's ``ties`` (``shared.ties``)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for layer in traced.layers:
        fresh = [t for t in layer_tensors(traced, layer) if id(t) not in seen]
        seen.update(id(t) for t in fresh)
        out[layer.name] = sum(t.numel() * t.element_size() for t in fresh)
    return out


def _get_attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
