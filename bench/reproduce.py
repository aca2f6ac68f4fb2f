"""Does a ``make bench`` reproduce the one before it? Each figure against its previous value, within its noise.

A figure's stated noise (``Figure.noise``, ``bench.measure.spread``) is the band a second run lands
within ``bench.measure.COVERAGE`` of the time when its rounds scatter normally (chosen so that every judged
figure does 95 times in 100, ``FAMILY_COVERAGE``): a multiple of the range of the rounds behind
it (``bench.measure.band_factor``), over its value. A figure reproduces when its new value lies within
the larger of the two runs' stated noises of its previous value: ``|now - previous| <= max(noise_now, noise_previous) x |previous|``.
A figure without a stated noise on either side (one measurement, nothing to say how much it
moves) is listed but not judged. ``make bench`` keeps each run's figures in
``bench/results/figures.json``, with the host that timed them (``bench.host``), and writes this
comparison into RESULTS.md against the run before; when the two hosts differ it says so first,
since a figure with a CPU's time in it moves with the machine.

    python -m bench.reproduce OLD.json NEW.json    # two runs' figures.json, the table on stdout
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.measure import Figure
from shared.io import atomic_write_bytes


def figure_records(figures: list[Figure]) -> list[dict[str, Any]]:
    """What a later run compares against: each figure's name, value, unit and noise."""
    return [
        {
            "name": f.name,
            "value": f.value if math.isfinite(f.value) else None,
            "unit": f.unit,
            "noise": f.noise,
        }
        for f in figures
    ]


def save(figures: list[Figure], path: Path, host: str) -> None:
    text = json.dumps({"host": host, "figures": figure_records(figures)}, indent=1) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def load(path: Path) -> list[dict[str, Any]] | None:
    """A run's figures, or None when there is none (the first run) or it cannot be read.

    Runs before 2026-12-05 wrote the list of figures alone; later ones ``{"host", "figures"}``.
    """
    data = _read(path)
    if isinstance(data, dict):
        data = data.get("figures")
    return data if isinstance(data, list) else None


def load_host(path: Path) -> str | None:
    """The host a run's figures were timed on (``bench.host.describe``), None where it did not say."""
    data = _read(path)
    host = data.get("host") if isinstance(data, dict) else None
    return host if isinstance(host, str) else None


def host_line(previous: str | None, now: str) -> str | None:
    """A warning before the comparison when the two runs' hosts differ or the previous one is unknown."""
    if previous == now:
        return None
    before = "an unrecorded host" if previous is None else previous
    return (
        f"**The previous run was timed on {before}, this one on {now}.** A figure with a CPU's time in it "
        "(a prediction against a run, a command's start-up, a memory peak) moves with the machine: "
        "it need not reproduce across hosts, only on the same one."
    )


def reproduced(previous: dict[str, Any], now: dict[str, Any]) -> bool | None:
    """Whether ``now`` reproduces ``previous`` within their stated noise (None: no noise stated, or a value missing)."""
    a, b = previous.get("value"), now.get("value")
    noises = [n for n in (previous.get("noise"), now.get("noise")) if isinstance(n, int | float)]
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not noises:
        return None
    return abs(b - a) <= max(noises) * abs(a) + 1e-12


def compare(previous: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per figure of ``now`` that ``previous`` has too, by name."""
    before = {r["name"]: r for r in previous if isinstance(r, dict) and "name" in r}
    rows = []
    for r in now:
        old = before.get(r["name"])
        if old is None:
            continue
        a, b = old.get("value"), r.get("value")
        change = (b - a) / abs(a) if isinstance(a, int | float) and isinstance(b, int | float) and a else None
        noises = [n for n in (old.get("noise"), r.get("noise")) if isinstance(n, int | float)]
        rows.append(
            {
                "figure": r["name"],
                "previous": a,
                "now": b,
                "change": change,
                "stated_noise": max(noises) if noises else None,
                "reproduced": reproduced(old, r),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The comparison as a table, with a count of the judged figures that reproduced first."""
    judged = [r for r in rows if r["reproduced"] is not None]
    held = sum(bool(r["reproduced"]) for r in judged)
    out = [
        f"{held} of the {len(judged)} figures with a stated noise reproduced the previous run within it "
        f"({len(rows) - len(judged)} more are listed without one).",
        "",
        "| figure | previous | now | change | stated noise | reproduced |",
        "|---|---|---|---|---|---|",
    ]

    def num(v: Any, pct: bool = False) -> str:
        if not isinstance(v, int | float):
            return "-"
        return f"{v * 100:+.1f}%" if pct else (f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}")

    for r in rows:
        noise = r["stated_noise"]
        mark = "-" if r["reproduced"] is None else ("yes" if r["reproduced"] else "**no**")
        out.append(
            f"| {r['figure']} | {num(r['previous'])} | {num(r['now'])} | {num(r['change'], True)} | "
            f"{'-' if noise is None else f'±{noise * 100:.1f}%'} | {mark} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.reproduce OLD.json NEW.json", file=sys.stderr)
        return 2
    old, new = load(Path(args[0])), load(Path(args[1]))
    for path, data in ((args[0], old), (args[1], new)):
        if data is None:
            print(f"{path}: not a figures.json written by make bench", file=sys.stderr)
            return 2
    assert old is not None and new is not None
    print("\n".join(markdown(compare(old, new))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
