"""The run's timeline as a Chrome trace (``chrome://tracing``, Perfetto): one row per rank, one box per instruction."""

from __future__ import annotations

import json

from pdrun.result import WorkerResult
from shared.io import atomic_write_bytes


def chrome_trace(results: list[WorkerResult]) -> dict[str, object]:
    """Complete events ("ph": "X") with times relative to the earliest instruction, in microseconds.

    Metadata a worker adds (``"ph": "M"``: an interleaved rank names its chunks' threads) passes as it is.
    """
    events = [e for r in results for e in r.events if e["ph"] != "M"]
    named = [e for r in results for e in r.events if e["ph"] == "M"]
    origin = min((e["ts"] for e in events), default=0.0)
    out: list[dict[str, object]] = []
    for r in sorted(results, key=lambda r: r.rank):
        out.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": r.rank,
                "args": {"name": f"rank {r.rank} (stage {r.stage}, replica {r.replica})"},
            }
        )
        out.append({"name": "process_sort_index", "ph": "M", "pid": r.rank, "args": {"sort_index": r.rank}})
    out.extend(named)
    for e in events:
        out.append({**e, "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def save(results: list[WorkerResult], path: str) -> None:
    atomic_write_bytes(path, json.dumps(chrome_trace(results)).encode("utf-8"))
