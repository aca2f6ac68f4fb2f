"""What the forkserver imports once before it forks the workers: torch, the worker, and the model's own packages.

Every worker builds the plan's model from its spec. Without a preload each would import the
model's packages afresh: for a Hugging Face model that is ``transformers`` and its model
classes, about 6 CPU-seconds a worker (tiny GPT-2, measured), paid again by every rank of every
launch. The launcher has built the model already (``pdrun.launch.check``), so it knows which
modules that took; the forkserver imports those, and its children start with them.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
from collections.abc import Sequence
from multiprocessing import forkserver
from typing import Any

from pdrun.env import under_torchrun

# pdrun.forkserver_quiet first (its doc: Ctrl-C while the forkserver imports torch); torch._dynamo:
# creating an optimizer imports it (seconds); pdrun.runner: the worker itself.
BASE = ("pdrun.forkserver_quiet", "torch", "torch._dynamo", "pdrun.runner")
# torch is in BASE; the standard library costs nothing to import again.
_NOT_PRELOADED = {"torch", "builtins", *sys.stdlib_module_names}
# The packages a forkserver preloading BASE holds: ours come with pdrun.runner. A worker that lacks
# one of their submodules (a zoo model's file) imports it in milliseconds, not worth a restart.
_BASE_PACKAGES = {"torch", "pdrun", "shared"}


def defining_modules(*objects: Any) -> tuple[str, ...]:
    """The imported modules of the packages that define ``objects``' classes (a model's modules: every submodule).

    Only modules with an import spec of their own name: one loaded from a file path under a
    made-up name cannot be imported by name in the forkserver.
    """
    packages: set[str] = set()
    for obj in objects:
        parts = obj.modules() if hasattr(obj, "modules") and callable(obj.modules) else [obj]
        packages |= {type(p).__module__.split(".")[0] for p in parts}
    packages -= _NOT_PRELOADED
    found = []
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name.split(".")[0] in packages and spec is not None and spec.name == name:
            found.append(name)
    return tuple(sorted(found))


def preload_forkserver(extra: tuple[str, ...] = ()) -> None:
    """Have the forkserver import ``BASE`` and ``extra`` before it forks a worker.

    The forkserver is one per process and keeps the preload it started with. pdrun's command
    line launches once, but a program calling ``launch`` for one model after another would
    keep the first model's: when the running one lacks a module wanted now, it is stopped and
    the next launch starts a fresh one (CPython's private ``_stop``; where it is missing, the
    workers import what they lack themselves, as without a preload).
    """
    server = getattr(forkserver, "_forkserver", None)
    running = _server_running()
    current = tuple(getattr(server, "_preload_modules", ()) or ())
    wanted = tuple(dict.fromkeys((*BASE, *current, *extra)))  # ordered, without repeats
    stop = getattr(server, "_stop", None)
    if running and _packages(wanted) - _packages(current) and callable(stop):
        stop()
    multiprocessing.set_forkserver_preload(list(wanted))


def start_forkserver(extra: tuple[str, ...] = ()) -> None:
    """:func:`preload_forkserver`, then start the server at once: it imports while the caller goes on."""
    preload_forkserver(extra)
    forkserver.ensure_running()


def _packages(modules: tuple[str, ...]) -> set[str]:
    """The top-level packages a forkserver preloading ``modules`` holds (BASE's with ours)."""
    top = {m.split(".")[0] for m in modules}
    return top | _BASE_PACKAGES if set(BASE) <= set(modules) else top


def _server_running() -> bool:
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is not None


def warm_for_run(args: Sequence[str]) -> None:
    """``pdrun run``'s hook (``shared.cli``): start the forkserver now, preloading BASE.

    A local CPU launch forks its workers from the forkserver, which must first import torch and
    the worker (about as long as the launcher's own imports: seconds). Started here, before the
    launcher imports torch, the two imports run side by side on two cores instead of one after
    the other. :func:`preload_forkserver` later keeps this server unless the model needs a package
    it lacks (``transformers``): then it restarts it with that package, as without the early start.

    Not for help, not under torchrun (this process is the worker), not on CUDA (spawned workers),
    not when one runs already (a program launching again: preload_forkserver decides about it).
    A guess from the words alone: a wrong one (a bad plan, a launch that never comes) costs an
    idle process that exits with this one, never a wrong run.
    """
    words = list(args)
    if {"-h", "--help"} & set(words) or under_torchrun() or _server_running():
        return
    if "--device=cuda" in words or any(a == "--device" and b == "cuda" for a, b in itertools.pairwise(words)):
        return
    start_forkserver()
