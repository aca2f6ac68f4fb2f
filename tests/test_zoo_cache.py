"""The parsed-dataset cache: built once, reused while the source is unchanged, never fatal."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from shared.zoo import cache


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PIPEDREAM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "data.txt"
    path.write_text("1 2 3")
    return path


def _builder(calls: list[int]):  # type: ignore[no-untyped-def]
    def build() -> dict[str, np.ndarray]:
        calls.append(1)
        return {"x": np.arange(5), "y": np.ones((2, 3))}

    return build


def test_built_once_then_read_back_equal(source: Path) -> None:
    calls: list[int] = []
    first = cache.cached("t", "1", source, _builder(calls))
    second = cache.cached("t", "1", source, _builder(calls))
    assert calls == [1]
    assert set(second) == {"x", "y"} and all(np.array_equal(first[k], second[k]) for k in first)


def test_a_changed_source_or_loader_version_builds_afresh(source: Path) -> None:
    calls: list[int] = []
    cache.cached("t", "1", source, _builder(calls))
    cache.cached("t", "2", source, _builder(calls))
    source.write_text("1 2 3 4")
    os.utime(source, ns=(1, 1))
    cache.cached("t", "2", source, _builder(calls))
    assert calls == [1, 1, 1]


def test_a_corrupt_file_is_rebuilt_and_an_unwritable_dir_is_no_error(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    cache.cached("t", "1", source, _builder(calls))
    (stored,) = (tmp_path / "cache").glob("t-*.npz")
    stored.write_bytes(b"not a zip")
    assert np.array_equal(cache.cached("t", "1", source, _builder(calls))["x"], np.arange(5))
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PIPEDREAM_CACHE", str(blocker / "sub"))  # a directory under a file: cannot exist
    assert np.array_equal(cache.cached("t", "1", source, _builder(calls))["x"], np.arange(5))
    assert calls == [1, 1, 1]


def test_the_zoo_datasets_are_equal_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from shared.zoo.datasets import tabular

    monkeypatch.setenv("PIPEDREAM_CACHE", str(tmp_path / "cache"))
    built = tabular._mnist_arrays.__wrapped__()
    again = tabular._mnist_arrays.__wrapped__()  # from the file now
    assert len(list((tmp_path / "cache").glob("mnist5k-*.npz"))) == 1
    assert all(np.array_equal(a, b) for a, b in zip(built, again, strict=True))
    assert torch.equal(tabular.mnist5k()[0][0], tabular.mnist5k()[0][0])
