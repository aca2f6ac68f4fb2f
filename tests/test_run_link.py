"""pdrun link: two real processes time round trips over gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PDRUN = str(Path(sys.executable).parent / "pdrun")


@pytest.mark.serial  # times the machine: run alone (Makefile)
def test_link_reports_a_finite_bandwidth_and_latency_as_json() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [PDRUN, "link", "--size", "2000000", "--repeats", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["sizes"] == [8, 2000000]
    small, large = result["one_way_s"]
    assert 0 < small < large < 1.0
    assert result["latency_s"] == small
    assert result["bandwidth_bytes_per_s"] == (2000000 - 8) / (large - small)
    assert 1e6 < result["bandwidth_bytes_per_s"] < 1e12
    assert "pdrun link" in proc.stderr


def test_link_refuses_a_size_below_the_latency_probe() -> None:
    proc = subprocess.run([PDRUN, "link", "--size", "4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--size" in proc.stderr


def test_the_probe_sends_from_cold_buffers_but_never_more_than_it_sends() -> None:
    from pdrun.link import _COLD_BYTES, cold_sources

    assert len(cold_sources(torch.zeros(2), 7)) == 7  # the 8-byte latency probe: one per round trip
    big = torch.zeros(_COLD_BYTES // 4 // 4)  # a quarter of the cold bytes in float32
    sources = cold_sources(big, 7)
    assert len(sources) == 4 and all(s.shape == big.shape for s in sources)
