"""The forkserver imports the model's packages once, so the workers it forks start with them."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from pdrun.preload import BASE, defining_modules, preload_forkserver, start_forkserver
from shared.resolve import resolve_model

pytest.importorskip("transformers")  # the dev install has it (setup.cfg: dev, hf)

GPT2 = "transformers.models.gpt2.modeling_gpt2"


def _has(name: str, queue: multiprocessing.Queue[bool]) -> None:
    queue.put(name in sys.modules)  # at the child's start, before it imports anything itself


def _child_has(name: str) -> bool:
    ctx = multiprocessing.get_context("forkserver")
    queue: multiprocessing.Queue[bool] = ctx.Queue()
    proc = ctx.Process(target=_has, args=(name, queue))
    proc.start()
    got = queue.get(timeout=120)
    proc.join(timeout=60)
    return got


def test_a_hugging_face_models_modules_are_its_package_not_torch_or_the_standard_library() -> None:
    modules = defining_modules(resolve_model("zoo:hf_gpt2", {"n_layer": 1}))
    assert GPT2 in modules and "transformers" in modules
    assert not any(m.split(".")[0] in {"torch", "json", "os", "typing"} for m in modules)


@pytest.mark.timeout(300)
def test_a_running_forkserver_without_the_models_modules_is_restarted_with_them() -> None:
    # Whatever earlier tests started, and the preload they left (a stopped forkserver keeps its list).
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    multiprocessing.set_forkserver_preload([])
    preload_forkserver()  # as a first launch of a model that needs nothing more
    assert not _child_has(GPT2)  # the forkserver runs now, without transformers
    preload_forkserver(defining_modules(resolve_model("zoo:hf_gpt2", {"n_layer": 1})))
    assert _child_has(GPT2)  # a fresh forkserver imported it before forking
    preload_forkserver()  # a later launch needing less keeps the running one and what it has
    assert _child_has(GPT2)
    assert set(BASE) <= set(multiprocessing.forkserver._forkserver._preload_modules)  # type: ignore[attr-defined]


def _warm(args: list[str]) -> tuple[bool, bool]:
    """In a fresh interpreter: (a forkserver runs after ``pdrun run ARGS``'s hook, torch is imported here)."""
    code = (
        "import sys\n"
        "from multiprocessing import forkserver\n"
        "from pdrun.preload import warm_for_run\n"
        f"warm_for_run({args!r})\n"
        "print(forkserver._forkserver._forkserver_pid is not None, 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    started, torch_here = done.stdout.split()
    return started == "True", torch_here == "True"


def test_pdrun_run_starts_its_forkserver_before_the_launcher_imports_torch() -> None:
    # The server imports torch and the worker in its own process while the launcher imports and checks:
    # before, the launcher's imports, then the server's, one after the other (pdrun on the MNIST CNN,
    # 2 steps: 10.3-13.7 s before, 5.4-10.0 s after, 2026-12-03).
    assert _warm(["plan.json", "--steps", "2"]) == (True, False)
    # No server where the run will not fork from one: help, CUDA (spawned workers).
    assert _warm(["--help"]) == (False, False)
    assert _warm(["plan.json", "--device", "cuda"]) == (False, False)
    assert _warm(["plan.json", "--device=cuda"]) == (False, False)


@pytest.mark.timeout(300)
def test_a_running_forkserver_is_kept_for_a_model_of_our_own_packages() -> None:
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    multiprocessing.set_forkserver_preload([])
    start_forkserver()  # as pdrun's early start: BASE only
    pid = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert pid is not None
    # A zoo model's modules are submodules of ours, which the worker imports in milliseconds: kept.
    preload_forkserver(defining_modules(resolve_model("zoo:mnist_cnn", {})))
    assert multiprocessing.forkserver._forkserver._forkserver_pid == pid  # type: ignore[attr-defined]
    # transformers is not in it: stopped, so the next process start launches a server that preloads it
    # (what that server's children hold: the test above).
    preload_forkserver(defining_modules(resolve_model("zoo:hf_gpt2", {"n_layer": 1})))
    assert multiprocessing.forkserver._forkserver._forkserver_pid is None  # type: ignore[attr-defined]
