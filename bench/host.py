"""Which machine a ``make bench`` timed: the CPU's model and the vector units its kernels may use.

Two runs agree only on the same kind of machine. A figure with a CPU's time on either side of it
(a prediction against a run, a command's start-up) moves with the machine: on 2026-12-05 a host
whose CPU had AMX and AVX-512 planned AlexNet in 0.48-0.72 s where the host of the day before took
0.37 s, and the demo's measured time per minibatch was 1.33-1.39 times its prediction, against
within 15% before. So RESULTS.md names the host it ran on, and the comparison with the previous
run says when the two differ (``bench.reproduce``).

The vector units named are those that choose oneDNN's and ATen's CPU kernels: AMX (``amx_tile``),
AVX-512 (``avx512f``), else AVX2.
"""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# (cpuinfo flag, name shown), widest first: each present one is named.
UNITS = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def describe(cpuinfo: str | None = None) -> str:
    """``model name (units)`` from ``/proc/cpuinfo`` (or ``cpuinfo``'s text); the platform's name where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's: the cores of one host agree
            fields[key.strip()] = value.strip()
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    units = [shown for flag, shown in UNITS if flag in flags]
    return f"{model} ({', '.join(units)})" if units else model
