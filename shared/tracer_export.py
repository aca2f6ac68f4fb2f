"""The torch.export frontend of the tracer: a model fx cannot follow (Hugging Face) becomes module-sized layers.

transformers' own fx tracer no longer follows its models (GPT-2 and Llama build their attention
masks under ``vmap``; ``forward(..., **kwargs)`` defeats fx's argument handling), while
``torch.export`` (non-strict) traces them as they come. Export yields a flat graph of aten ops;
each op carries the module stack it ran in. So the ops are grouped into *runs*: consecutive ops
of the same innermost module (``transformer.h.0.attn.c_attn``) become one layer, a small
``fx.GraphModule`` called from the top graph, named after the module. A run never ends inside a
``vmap`` region (its nesting calls change global state and must stay in one stage), and a
``getitem`` stays with the op it unpacks.

Parameters and buffers stay on the top graph as ``get_attr`` nodes under the model's own names
(so a stage's state dict has the model's keys) and the very objects of the user's model: a
weight read by two layers (GPT-2's token embedding and output projection) is one parameter
object, read by whichever stages hold those layers. They are not layers; each is *folded* into
the layers that read it (``Layer.params``). Train-mode ``aten.dropout`` becomes an
``nn.Dropout`` of the run, so ``eval()`` turns it off as it would in the model.

The graph is exported for the example inputs' shapes (``TraceOptions.example``: the profiled
batch), which is the unit every stage runs, on the CPU and in float32 (a float64 run gets the
same graph with its float32 constants set to float64; see [Note: export in float32]).
"""

from __future__ import annotations

import copy
import linecache
import logging
import operator
import os
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from shared.errors import TraceError
from shared.fields import forward_parameters
from shared.spec import TraceOptions

EXPORT_DTYPE = torch.float32  # see [Note: export in float32]
RUNS = "runs"  # the top graph's attribute holding the runs' modules
WRAPPER = "model"  # the attribute the user's model sits under during export: stripped from every name
_MOD_INDEX = "torch._dynamo._trace_wrapped_higher_order_op.ModIndex"  # see _plain_mod_index
_ASSERTS = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}


def select_output(output: Any, field: str | None) -> tuple[Any, str | None]:
    """(the value the loss reads, the field it came from): ``field``, else ``logits``, else the first field."""
    if isinstance(output, Mapping):
        keys = [k for k, v in output.items() if v is not None]
        name = field if field is not None else ("logits" if "logits" in keys else (keys[0] if keys else None))
        if name is None or name not in output:
            raise TraceError(
                f"the model's output has no field {name!r} (it has {', '.join(map(str, keys)) or 'none'})"
            )
        return output[name], str(name)
    return output, None


class KeywordCall(nn.Module):
    """``model(**dict(zip(names, args)))`` with the output the loss reads (and no cache or tuple output)."""

    def __init__(self, model: nn.Module, names: list[str], field: str | None) -> None:
        super().__init__()
        self.model = model
        self.names = list(names)
        self.field = field
        accepted = forward_parameters(model)
        # Hugging Face: no key/value cache (a training step does not decode), a ModelOutput rather than a tuple.
        self.fixed = {k: v for k, v in (("use_cache", False), ("return_dict", True)) if k in accepted}
        # Export runs forward on a deep copy of this module; a function is not copied, so the
        # field chosen there reaches us through the dict it closes over.
        chosen: dict[str, str | None] = {"field": field}

        def record(name: str | None) -> dict[str, str | None]:
            if name is not None:
                chosen["field"] = name
            return chosen

        self.record = record

    @property
    def chosen(self) -> str | None:
        return self.record(None)["field"]

    def forward(self, *args: Any) -> Any:
        out = self.model(**dict(zip(self.names, args, strict=True)), **self.fixed)
        value, name = select_output(out, self.field)
        self.record(name)
        return value


def example_inputs(model: nn.Module, options: TraceOptions) -> tuple[torch.Tensor, ...]:
    """Ones of the recorded shapes; floating inputs in the model's dtype (a float64 run exports in float64)."""
    floating = _floating_dtype(model)
    out = []
    for e in options.example:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise TraceError(f"trace.example: input {e.name!r} has dtype {e.dtype!r}, not a torch dtype")
        out.append(torch.ones(e.shape, dtype=floating if dtype.is_floating_point else dtype))
    return tuple(out)


def _name_of(target: Any) -> str:
    return str(getattr(target, "__name__", "") or getattr(target, "_opname", "") or target)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = str(list(stack.values())[-1][0]) if stack else WRAPPER
    return path[len(WRAPPER) + 1 :] if path.startswith(WRAPPER + ".") else ""


def _runs(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """Consecutive ops of one module, never cut inside a vmap region or between an op and its getitem."""
    runs: list[list[fx.Node]] = []
    depth = 0
    for n in nodes:
        name = _name_of(n.target)
        joins = bool(runs) and (
            depth > 0
            or _module_path(n) == _module_path(runs[-1][0])
            or (n.target is operator.getitem and n.args[0] in runs[-1])
        )
        if joins:
            runs[-1].append(n)
        else:
            runs.append([n])
        if name == "_vmap_increment_nesting":
            depth += 1
        elif name == "_vmap_decrement_nesting":
            depth -= 1
    return runs


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def export_module(model: nn.Module, options: TraceOptions) -> tuple[fx.GraphModule, str | None]:
    """The model as a top graph of module runs (see the module's docstring) and the output field chosen."""
    names = [e.name for e in options.example]
    if not names:
        raise TraceError("trace.example: the export frontend needs the example inputs' names and shapes")
    run_dtype = _floating_dtype(model)
    # [Note: export in float32] The graph's data flow depends on the dtype it was exported in: a
    # ``.to(torch.float32)`` (Llama's RMSNorm) is the tensor itself in float32 and a copy in float64,
    # and export follows the tensor, so a float64 export of Llama has other edges than a float32 one
    # and pdrun's float64 stages would not match pdprof's float32 graph. So a float32 copy of the
    # model is exported, always, and the graph's float32 constants are set to the run's dtype; the
    # parameters the graph reads are the model's own (``_regroup`` looks them up by name).
    subject = model if run_dtype == EXPORT_DTYPE else copy.deepcopy(model).to(EXPORT_DTYPE)
    call = KeywordCall(subject, names, options.output)
    was_training = subject.training
    subject.train()
    try:
        with _layerdrop_off(subject), _quiet_torch_logs():
            exported = torch.export.export(call, example_inputs(subject, options), strict=False)
    except TraceError:
        raise
    except Exception as exc:
        first = " ".join(str(exc).split())
        first = first if len(first) <= 300 else first[:300].rsplit(" ", 1)[0] + " ..."
        where = _model_line(exc)
        raise TraceError(
            f"torch.export cannot trace {type(model).__name__}"
            + (f" at {where}" if where else "")
            + f": {type(exc).__name__}: {first}"
        ) from exc
    finally:
        subject.train(was_training)
    flat = exported.module()
    _plain_mod_index(flat)
    if run_dtype != EXPORT_DTYPE:
        _set_dtype(flat, run_dtype)
    return _regroup(flat, model, names), call.chosen


@contextmanager
def _layerdrop_off(model: nn.Module) -> Iterator[None]:
    """LayerDrop (OPT, BART, Whisper, mBART and some 40 more transformers models) skips a layer when
    ``torch.rand([]) < self.layerdrop``, in training, even at ``layerdrop = 0``: a draw a static graph
    cannot hold, which export refuses (a data-dependent guard). At 0 no layer is ever skipped, so while
    exporting a 0-dim ``torch.rand`` draws 1.0, which decides the same; above 0 the model skips layers
    at random, which no fixed partition runs: refused, naming the setting."""
    rates: dict[str, float] = {}
    for name, m in model.named_modules():
        rate = getattr(m, "layerdrop", None)
        if isinstance(rate, float | int):
            rates[name or type(model).__name__] = float(rate)
    if not rates:
        yield
        return
    dropping = {name: r for name, r in rates.items() if r > 0}
    if dropping:
        name, rate = next(iter(dropping.items()))
        raise TraceError(
            f"{type(model).__name__}: {name}.layerdrop is {rate:g}: LayerDrop skips layers at random, which a "
            "pipeline's fixed stages cannot; build the model with layerdrop=0.0 in its config"
        )
    original = torch.rand

    def rand(*size: Any, **kwargs: Any) -> Any:
        if size in (([],), ((),), ()) and not kwargs:
            return 1.0  # torch.rand([]) of LayerDrop: never below a rate of 0
        return original(*size, **kwargs)

    torch.rand = rand
    try:
        yield
    finally:
        torch.rand = original


@contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs the whole graph (a hundred lines) before raising on some failures; the error
    line we raise says what went wrong and where."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _model_line(exc: BaseException) -> str | None:
    """``file.py:line (code)`` of the model's own source where ``exc`` was raised: the innermost frame
    outside torch (a transformers model, or the user's), for a message that names what to change."""
    skipped = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(os.__file__))
    frames = [
        f for f, _ in traceback.walk_tb(exc.__traceback__) if not f.f_code.co_filename.startswith(skipped)
    ]
    if not frames:
        return None
    frame = frames[-1]
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({code})"


def _plain_mod_index(flat: fx.GraphModule) -> None:
    """Each call of torch's ``ModIndex`` autograd Function becomes the ``aten.index`` it runs.

    transformers builds its attention masks under ``vmap`` from functions that index tensors
    (``padding_mask[batch_idx, kv_idx]``), which export records as ``ModIndex``, a custom autograd
    Function with a generated vmap rule. Run under ``vmap``, such a Function makes a new class on every
    call (torch's ``vmapify_autograd_function``), and a class is a reference cycle that only Python's
    full collection frees. Measured on transformers' GPT-2 (2 stages, 1F1B, 3,000 steps): the first
    stage's resident set grew 2.7 KB a step, 34 to 45 MB, where the second stayed at 24 MB. ``aten.index``
    computes the same values and has its own vmap rule and gradient, and makes no class.
    """
    for gm in flat.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        changed = False
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or n.target is not torch.ops.higher_order.flat_apply:
                continue
            spec = n.args[1]
            if not (isinstance(spec, fx.Node) and spec.op == "get_attr"):
                continue
            args, kwargs = pytree.tree_unflatten(list(n.args[2:]), _attr(gm, str(spec.target)))
            if kwargs or len(args) != 3 or args[0] != _MOD_INDEX:
                continue
            with gm.graph.inserting_before(n):
                index = gm.graph.call_function(torch.ops.aten.index.Tensor, (args[1], list(args[2])))
            index.meta = dict(n.meta)
            n.replace_all_uses_with(index)
            gm.graph.erase_node(n)
            for attr in (n.args[0], spec):
                if isinstance(attr, fx.Node) and attr.op == "get_attr" and not attr.users:
                    gm.graph.erase_node(attr)
            changed = True
        if changed:
            gm.recompile()


def _set_dtype(flat: fx.GraphModule, dtype: torch.dtype) -> None:
    """Every float32 constant of the graph, and of the graphs its higher-order ops call, becomes ``dtype``."""
    for gm in flat.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        for n in gm.graph.nodes:
            n.args = fx.node.map_aggregate(n.args, lambda a: dtype if a is EXPORT_DTYPE else a)
            n.kwargs = fx.node.map_aggregate(n.kwargs, lambda a: dtype if a is EXPORT_DTYPE else a)
        if gm is not flat:
            gm.recompile()


def set_device(module: nn.Module, device: torch.device) -> None:
    """The devices an exported graph names become ``device``, in ``module`` and every graph it calls.

    Export bakes the device it traced on into the graph (GPT-2's ``aten.arange`` of positions, the
    ``aten.to`` of its mask: ``device=cpu``), where an fx graph reads ``x.device`` as it runs; so a
    stage moved to a GPU with ``module.to`` would still make those tensors on the CPU. Called by
    ``shared.tracer.place``, where pdprof places its traced model and pdrun its stage, as torch's own
    ``move_to_device_pass`` does for an ExportedProgram.
    """
    moved: list[bool] = []

    def place(a: Any) -> Any:
        if isinstance(a, torch.device) and a != device:
            moved.append(True)
            return device
        return a

    for gm in module.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        moved.clear()
        for n in gm.graph.nodes:
            n.args = fx.node.map_aggregate(n.args, place)
            n.kwargs = fx.node.map_aggregate(n.kwargs, place)
        if moved:
            gm.recompile()


def _floating_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), EXPORT_DTYPE)


def _regroup(flat: fx.GraphModule, model: nn.Module, names: list[str]) -> fx.GraphModule:
    """The exported flat graph as placeholders, parameters (get_attr) and one call per run of ops."""
    graph = flat.graph
    keep: list[fx.Node] = []
    for n in graph.nodes:
        if n.op == "call_module" and str(n.target).startswith("_guards"):
            continue  # export's input guard: the stages check their inputs' shapes themselves
        if n.op == "call_function" and _name_of(n.target).split(".")[0] in _ASSERTS and not n.users:
            continue
        keep.append(n)
    placeholders = [n for n in keep if n.op == "placeholder"]
    params = [n for n in keep if n.op == "get_attr" and isinstance(_attr(flat, str(n.target)), torch.Tensor)]
    ops = [n for n in keep if n.op in ("call_function", "call_method")]
    out_node = next(n for n in keep if n.op == "output")

    top = fx.Graph()
    root: dict[str, Any] = {}
    env: dict[fx.Node, fx.Node] = {}
    for n, name in zip(placeholders, names, strict=True):
        env[n] = top.placeholder(name)
    for n in params:
        target = str(n.target)
        own = target[len(WRAPPER) + 1 :] if target.startswith(WRAPPER + ".") else target
        try:
            value = _attr(model, own)  # the user's own parameter object: ties and checkpoints keep it
        except AttributeError:
            value = _attr(flat, target)
            own = target.replace(".", "_")
        root[own] = value
        env[n] = top.get_attr(own)
    for members in _runs(ops):
        inside = set(members)
        inputs = list(dict.fromkeys(a for m in members for a in m.all_input_nodes if a not in inside))
        # get_attr of modules and constants (higher-order ops' graphs, pytree specs) go with the run.
        consts = [a for a in inputs if a.op == "get_attr" and a not in env]
        inputs = [a for a in inputs if a not in consts]
        outputs = [m for m in members if any(u not in inside for u in m.users)]
        sub, sub_root = _run_graph(members, inputs, consts, outputs, flat)
        path = _module_path(members[0]).replace(".", "_") or members[0].name
        node = top.create_node("call_module", RUNS, tuple(env[a] for a in inputs), name=path)
        # The namespace made the name unique; the run's module sits under RUNS, apart from the
        # model's own attributes (a run named ``transformer`` beside the parameters' ``transformer.``).
        node.target = f"{RUNS}.{node.name}"
        root[node.target] = fx.GraphModule(sub_root, sub, f"Run_{node.name}")
        if len(outputs) <= 1:
            env.update({o: node for o in outputs})
        else:
            for i, o in enumerate(outputs):
                env[o] = top.create_node(
                    "call_function", operator.getitem, (node, i), name=f"{node.name}_{i}"
                )
    result = fx.map_arg(out_node.args[0], lambda a: env[a])
    if isinstance(result, (tuple, list)) and len(result) == 1:
        result = result[0]
    top.output(result)
    top.lint()
    return fx.GraphModule(root, top, type(model).__name__)


class TrainOnlyAttention(nn.Module):
    """``scaled_dot_product_attention`` whose dropout applies in training only, as in the model."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(
        self, q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, *args: Any, **kwargs: Any
    ) -> Any:
        p = self.p if self.training else 0.0  # the traced dropout_p is the train-mode one
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, attn_mask, p, *args, **kwargs)


def _sdpa_dropout(node: fx.Node) -> float:
    """The dropout probability an exported attention call was traced with (0 when none)."""
    if node.target is not torch.ops.aten.scaled_dot_product_attention.default:
        return 0.0
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return float(p) if isinstance(p, (int, float)) else 0.0


def _run_graph(
    members: list[fx.Node],
    inputs: list[fx.Node],
    consts: list[fx.Node],
    outputs: list[fx.Node],
    flat: fx.GraphModule,
) -> tuple[fx.Graph, dict[str, Any]]:
    """One run as its own graph: the outside values as placeholders, its outputs returned."""
    sub = fx.Graph()
    root: dict[str, Any] = {}
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
    for c in consts:
        root[str(c.target)] = _attr(flat, str(c.target))
        env[c] = sub.get_attr(str(c.target))
    dropouts = 0
    for m in members:
        if m.target is torch.ops.aten.dropout.default and len(m.args) == 3 and m.args[2] is True:
            # Train-mode dropout as a module, so that eval() switches it off as in the model.
            name = f"dropout_{dropouts}"
            dropouts += 1
            root[name] = nn.Dropout(float(m.args[1]))  # type: ignore[arg-type]
            env[m] = sub.call_module(name, (env[m.args[0]],))  # type: ignore[index]
            continue
        p = _sdpa_dropout(m)
        if p:
            name = f"attention_{dropouts}"
            dropouts += 1
            root[name] = TrainOnlyAttention(p)
            args = fx.map_arg(m.args, lambda a: env[a])
            kwargs = fx.map_arg(m.kwargs, lambda a: env[a])
            env[m] = sub.call_module(name, args, kwargs)
            continue
        env[m] = sub.node_copy(m, lambda a: env[a])
    if len(outputs) <= 1:
        sub.output(env[outputs[0]] if outputs else None)
    else:
        sub.output(tuple(env[o] for o in outputs))
    return sub, root
