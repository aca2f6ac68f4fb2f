"""Run a Python snippet in a fresh process and read the JSON object its last line prints: for what is
process-wide (glibc's allocator settings, the kernel's memory high-water mark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

# A snippet's prelude: ``mapped(size)``, whether glibc serves a block of ``size`` bytes with a fresh
# mmap (mallinfo2's count of mapped blocks grows) rather than from its heap.
MAPPED = """
import ctypes, ctypes.util

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size):
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    out = libc.mallinfo2().hblks > before
    libc.free(block)
    return out
"""


def run_json(code: str, *argv: str, timeout_s: float = 300) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out
