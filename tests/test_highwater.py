"""The memory count both sides of a memory prediction use (shared.highwater), and the allocator
settings its mark relies on (shared.malloc), each in a fresh process: the high-water mark and
glibc's thresholds are process-wide."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.subprocess_json import MAPPED, run_json

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc: Linux only")

_RISE = r"""
import json, mmap, sys
import torch
from shared.highwater import mark, rise

path, mb = sys.argv[1], 24
since = mark(torch.device("cpu"))
with open(path, "rb") as f:  # library-like: a file's pages mapped and touched
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    touched = sum(view[i] for i in range(0, len(view), 4096))
file_rise = rise(since)
block = torch.ones(mb * 1024 * 1024 // 4)  # anonymous: a tensor, every page written
print(json.dumps({"file_rise": file_rise, "anon_rise": rise(since), "touched": touched, "mb": mb}))
"""


def test_the_rise_counts_a_tensor_but_not_the_file_pages_a_run_maps(tmp_path: Path) -> None:
    # A library's pages are mapped by how much of the file the page cache holds, not by the model
    # (issue 19: BERT's probe read 18.5-25.5 MB with them from run to run): neither side counts them.
    data = tmp_path / "library.bin"
    data.write_bytes(os.urandom(24 * 1024 * 1024))
    got = run_json(_RISE, str(data))
    assert got["file_rise"] < 4e6, got  # 24 MB of file pages touched, (almost) none counted
    assert got["mb"] * 1024 * 1024 * 0.95 <= got["anon_rise"] <= got["mb"] * 1024 * 1024 + 8e6, got


_ALLOCATOR = (
    MAPPED
    + r"""
import json
from shared import malloc

state = {"building": malloc.building_malloc(), "build_1mb": mapped(1 << 20)}
state |= {"steady": malloc.steady_malloc(), "steady_1mb": mapped(1 << 20), "steady_30mb": mapped(30 << 20)}
state["flag"] = malloc.malloc_is_steady()
print(json.dumps(state))
"""
)


def test_a_build_maps_its_big_blocks_afresh_and_the_run_reuses_the_heap() -> None:
    # While building, a 1 MiB block is mapped (and unmapped when freed: no hole left in the heap);
    # once steady, blocks up to 32 MiB come from the heap, as pdprof times them.
    got = run_json(_ALLOCATOR)
    assert got == {
        "building": True,
        "build_1mb": True,
        "steady": True,
        "steady_1mb": False,
        "steady_30mb": False,
        "flag": True,
    }, got
