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
