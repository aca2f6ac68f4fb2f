"""The forkserver imports the model's packages once, so the workers it forks start with them."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from pdrun.preload import BASE, defining_modules, preload_forkserver
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
