"""Turning a spec string into the thing it names: a model, a dataset or a loss.

A spec is ``zoo:NAME`` (our built-in zoo), ``package.module:callable`` or
``path/to/file.py:callable``; the callable is called with the spec's keyword arguments.
A loss is ``cross_entropy``, ``causal_lm``, ``mse`` or a callable spec returning a loss function.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.errors import SpecError
from shared.spec import file_target

FORMS = "zoo:NAME, package.module:callable or path/to/file.py:callable"
_ZOO_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
IGNORE_INDEX = -100  # the target the built-in cross_entropy skips (padding); validation scores none


def _zoo_name(spec: str, kind: str) -> str:
    """The NAME of ``zoo:NAME``, refused early when it cannot be a zoo entry (keeps messages one line)."""
    name = spec[4:]
    if not _ZOO_NAME.match(name):
        raise SpecError(f"{kind} spec {spec!r}: expected zoo:NAME with a name from `pdprof zoo`")
    return name


def _why(exc: BaseException) -> str:
    """An exception from user code as one line: its type and its message, newlines folded."""
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_callable(spec: str, kind: str) -> Callable[..., Any]:
    """The callable a ``module:callable`` or ``file.py:callable`` spec names."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise SpecError(f"{kind} spec {spec!r}: expected {FORMS}")
    if file_target(spec) is not None:
        path = Path(target)
        if not path.is_file():
            raise SpecError(f"{kind} spec {spec!r}: file {target!r} not found")
        # The same name in every process (str's hash() is salted per process): it names the file's
        # classes and functions in the graph (an autograd Function's call: shared.tracer).
        digest = hashlib.sha256(str(path.resolve()).encode("utf-8")).hexdigest()[:12]
        mod_name = f"_pipedream_user_{path.stem}_{digest}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise SpecError(f"{kind} spec {spec!r}: cannot load {target!r} as Python")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            # As `python file.py` would: the file's folder on the import path, so that it can import the
            # files beside it (`from hfdata import tokens` in data.py failed with "No module named").
            # At the end, not the front: a user's datasets.py must not stand in for the package of that
            # name that transformers looks for later.
            folder = str(path.resolve().parent)
            if folder not in sys.path:
                sys.path.append(folder)
            try:
                loader_spec.loader.exec_module(module)
            except (Exception, SystemExit) as exc:  # the user's file may even call sys.exit
                del sys.modules[mod_name]
                raise SpecError(f"{kind} spec {spec!r}: importing {target!r} failed: {_why(exc)}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise SpecError(
                f"{kind} spec {spec!r}: cannot import module {target!r} ({_why(exc)}){_path_hint(target)}"
            ) from None
        except (Exception, SystemExit) as exc:  # a relative name ('..x'), or a module failing on import
            raise SpecError(f"{kind} spec {spec!r}: cannot import module {target!r}: {_why(exc)}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise SpecError(f"{kind} spec {spec!r}: {target} has no attribute {attr!r}")
    if not callable(obj):
        raise SpecError(f"{kind} spec {spec!r}: {target}.{attr} is not callable")
    return obj  # type: ignore[no-any-return]


def _path_hint(target: str) -> str:
    """Where the module's top package is in this directory but not on the import path (the tools are run
    as scripts, so the directory is not on it as under ``python -m``): how to reach it."""
    top = target.split(".")[0]
    here = Path(top)
    if not (here.is_dir() or here.with_suffix(".py").is_file()) or any(
        Path(p or ".").resolve() == Path.cwd().resolve() for p in sys.path
    ):
        return ""
    file = Path(*target.split(".")).with_suffix(".py")
    return f"; {top} is in this directory, which is not on the import path: run with PYTHONPATH=. or name the file ({file}:...)"


def call_with_args(fn: Callable[..., Any], args: dict[str, Any], spec: str, kind: str) -> Any:
    """Call ``fn(**args)``, turning a bad keyword into a clear ``SpecError``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            signature.bind(**args)
        except TypeError as exc:
            accepted = ", ".join(p for p in signature.parameters if p != "self") or "none"
            raise SpecError(f"{kind} spec {spec!r}: {exc} (accepted arguments: {accepted})") from None
    try:
        return fn(**args)
    except SpecError:
        raise
    except Exception as exc:  # the user's builder failed on these arguments: their input, one line
        raise SpecError(f"{kind} spec {spec!r} with {_short_args(args)}: {_why(exc)}") from exc


def _short_args(args: dict[str, Any]) -> str:
    text = " ".join(repr(args).split())
    return text if len(text) <= 120 else text[:117] + "..."


def resolve_model(spec: str, args: dict[str, Any] | None = None) -> Any:
    """Build the ``nn.Module`` a model spec names."""
    import torch.nn as nn

    args = dict(args or {})
    if spec.startswith("zoo:"):
        from shared.zoo import registry

        fn = registry.model_builder(_zoo_name(spec, "model"))
    else:
        fn = load_callable(spec, "model")
    model = call_with_args(fn, args, spec, "model")
    if not isinstance(model, nn.Module):
        raise SpecError(f"model spec {spec!r}: returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def resolve_dataset(spec: str, args: dict[str, Any] | None = None) -> Any:
    """Build the map-style dataset of ``(input, target)`` pairs a dataset spec names."""
    args = dict(args or {})
    if spec.startswith("zoo:"):
        from shared.zoo import registry

        fn = registry.dataset_builder(_zoo_name(spec, "dataset"))
    else:
        fn = load_callable(spec, "dataset")
    data = call_with_args(fn, args, spec, "dataset")
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise SpecError(
            f"dataset spec {spec!r}: returned {type(data).__name__}, expected a map-style Dataset"
        )
    try:
        size = len(data)
    except Exception as exc:  # a __len__ that raises or returns a negative number
        raise SpecError(f"dataset spec {spec!r}: len() of the dataset failed: {_why(exc)}") from exc
    if size == 0:
        raise SpecError(f"dataset spec {spec!r}: the dataset is empty")
    return data


def _output_head(output: Any) -> tuple[Any, Any]:
    """(main output, auxiliary output or None): Inception-style models return both."""
    if isinstance(output, (tuple, list)):
        return output[0], (output[1] if len(output) > 1 else None)
    return output, None


def cross_entropy(output: Any, target: Any) -> Any:
    """Cross entropy; a sequence output (N, T, C) against (N, T) targets is flattened, and an
    auxiliary head (a second output of the logits' shape, as Inception-v3's) adds 0.4 of its loss, as
    in its paper. Any other second output (a model returning ``(logits, features)``) is not the loss's:
    it counted as class scores once, and a new user's reported loss was 2.83 where the logits' was 1.45."""
    import torch.nn.functional as F

    main, aux = _output_head(output)

    def ce(logits: Any) -> Any:
        if logits.dim() == 3:
            return F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE_INDEX
            )
        return F.cross_entropy(logits, target)

    loss = ce(main)
    if aux is not None and getattr(aux, "shape", None) == main.shape:
        loss = loss + 0.4 * ce(aux)
    return loss


def causal_lm(output: Any, target: Any) -> Any:
    """Next-token cross entropy of a causal LM whose labels are its inputs (Hugging Face's convention).

    For logits (N, T, V) and labels (N, T): the logits at positions 0..T-2 against the labels at
    1..T-1, flattened to N (T-1) predictions, labels of -100 ignored, the mean over the rest: what
    transformers' ``*ForCausalLM`` computes inside the model when given ``labels``.
    """
    import torch.nn.functional as F

    main, _ = _output_head(output)
    if main.dim() != 3 or target.dim() != 2:
        raise ValueError(
            f"causal_lm: expected logits (N, T, V) and labels (N, T), got {list(main.shape)} "
            f"and {list(target.shape)}"
        )
    logits = main[:, :-1, :]
    labels = target[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def mse(output: Any, target: Any) -> Any:
    """Mean squared error on the (main) output."""
    import torch.nn.functional as F

    main, _ = _output_head(output)
    return F.mse_loss(main, target.to(main.dtype).reshape(main.shape))


BUILTIN_LOSSES: dict[str, Callable[[Any, Any], Any]] = {
    "cross_entropy": cross_entropy,
    "causal_lm": causal_lm,
    "mse": mse,
}


def resolve_loss(spec: str) -> Callable[[Any, Any], Any]:
    """The loss function ``loss(output, target) -> scalar tensor`` a loss spec names."""
    if spec in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[spec]
    if ":" not in spec:
        raise SpecError(
            f"loss spec {spec!r}: expected {', '.join(BUILTIN_LOSSES)} or a callable spec ({FORMS})"
        )
    fn = load_callable(spec, "loss")
    # A callable spec may be the loss itself, or a factory returning it (e.g. torch.nn.CrossEntropyLoss).
    if inspect.isclass(fn):
        try:
            loss: Any = fn()
        except Exception as exc:
            raise SpecError(f"loss spec {spec!r}: {fn.__name__}() failed: {_why(exc)}") from exc
        if not callable(loss):
            raise SpecError(
                f"loss spec {spec!r}: {fn.__name__}() gave {type(loss).__name__}, expected a callable loss"
            )
        return loss  # type: ignore[no-any-return]
    return fn
