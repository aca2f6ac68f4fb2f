"""Test settings: one thread per process (2-core machines), and the PipeDream profiles in profiles/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a dependency
    pass

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "profiles"


@pytest.fixture(scope="session")
def profiles_dir() -> Path:
    """The PipeDream profiles published with the paper (the repository's own copy, profiles/)."""
    assert PROFILES.is_dir(), f"expected PipeDream's profiles at {PROFILES}"
    return PROFILES


# The modules that take longest (test-seconds measured on 2 cores, 2026-12-01: 100 s down to 20 s),
# started first: make test runs two workers (pytest-xdist), and a long test drawn last kept one
# worker busy minutes after the other had finished (13.8 min for 19.3 min of tests).
SLOW_FIRST = (
    "test_hf_models",
    "test_run_nodes",
    "test_reliability_failures",
    "test_docs_runnable",
    "test_run_inplace",
    "test_plan_statecount",
    "test_reliability_resume",
    "test_fuzz_loaders",
    "test_plan_profiles",
    "test_run_cli",
    "test_plan_portable",
    "test_schedule_window",
    "test_plan_narrow",
    "test_zoo_models",
    "test_run_topology",
    "test_run_tied",
    "test_run_options",
    "test_reliability_leftovers",
    "test_preload",
    "test_run_flush",
    "test_containers",
    "test_plan_cli",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(
        key=lambda item: (
            rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)) if item.module else len(rank)
        )
    )
