"""pdrun against torch.distributed.pipelining, single-process training and DDP, at equal settings.

Two cases, each one model, one dataset, one split (the planner's 2-stage plan, wherever it
cuts: the baselines run the same split), the same microbatch size, microbatches per step,
steps, warm-up, optimizer and one thread per process for every system: the MNIST CNN, where
the runtime's overheads weigh most, and a transformer where compute dominates (the zoo's GPT,
4 layers x 256 wide, batch 16), so that the CNN alone does not overstate the advantage. pdrun runs the plan through its command line; the alternatives run in
``bench.baselines``. Each system runs ``repeats`` times, interleaved, and its best run
counts (the machine is shared; the best run is the least disturbed one). Every ratio is
pdrun's samples/s over the alternative's, measured in the same invocation. Beside them, for
each of pdrun's schedules, the measured busy fraction (computing time over workers x wall
time) against that schedule's own ideal: the busy fraction the planner's simulator gives for
the same program with the run's own stage costs (the profile's, scaled to the workers' measured
shares of the compute), the limit a perfect runtime reaches.

The second wave's schedules stand beside their torch counterparts: pdrun's interleaved-1f1b
(2 workers x 2 chunks, the planner's ``--virtual-stages 2`` plan) beside
``ScheduleInterleaved1F1B`` on the same 4 chunks (one ``PipelineStage`` per chunk, stage
index = chunk, rank w holding chunks w and w + 2), and pdrun's zb-h1 beside
``ScheduleInterleavedZeroBubble`` with one stage a rank on the 2-stage split (torch 2.13 runs
it so; it needs no second stage a rank). The bubble table gives each, and pdrun's
1f1b-flush, the measured idle fraction (1 - busy fraction) and samples/s beside the
simulator's for pdrun's program of that schedule (``shared.simulate`` via
``pdplan.schedule_sim``). A run that fails is reported as failed in its row and figures; the
others are still written.

Every plan is made for the link the runs use, ``pdrun link``'s bandwidth and latency between two
local workers: the chunked schedules' split is chosen by simulation, and a split chosen for a
slower link than the one that runs is not the one that runs best on it.

Run alone: ``python -m bench.bench_runtime [--quick]``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from bench import toolchain
from bench.baselines import Result, Settings, run
from bench.measure import Figure, PdrunTiming, Report, judged, main_of, pdrun_timing, spread
from pdplan.schedule_sim import ScheduleFigures, simulate_plan, stage_costs
from shared.graph import LayerGraph, load_graph
from shared.plan import Plan, load_plan
from shared.simulate import Costs
from shared.zoo.datasets.pydoc_text import VOCAB_SIZE as PYDOC_VOCAB

# pdrun runs: label -> (schedule, --memory-format). The "nchw" runs keep the contiguous layout the
# baselines run in, so the table shows what the layout brings apart from the runtime itself.
PDRUN_RUNS = {
    "1f1b-flush": ("1f1b-flush", "auto"),
    "gpipe": ("gpipe", "auto"),
    "1f1b": ("1f1b", "auto"),
    "1f1b-flush nchw": ("1f1b-flush", "contiguous"),
    "gpipe nchw": ("gpipe", "contiguous"),
    # The second wave beside their torch counterparts: interleaved-1f1b on the chunked plan (2 workers x
    # V = 2 chunks), zb-h1 on the 2-stage plan the others run.
    "interleaved-1f1b": ("interleaved-1f1b", "auto"),
    "zb-h1": ("zb-h1", "auto"),
    "zb-v": ("zb-v", "auto"),
}
# Baselines: label -> (system, channels-last). pipelining's stages also run in pdrun's layout (gloo
# sends only contiguous tensors, so each stage hands its output on as NCHW, as a user would).
BASELINES = {
    "pipe-1f1b": ("pipe-1f1b", False),
    "pipe-gpipe": ("pipe-gpipe", False),
    "pipe-1f1b channels-last": ("pipe-1f1b", True),
    "pipe-gpipe channels-last": ("pipe-gpipe", True),
    "pipe-interleaved-1f1b": ("pipe-interleaved-1f1b", False),
    "pipe-zb": ("pipe-zb", False),
    "pipe-interleaved-1f1b channels-last": ("pipe-interleaved-1f1b", True),
    "pipe-zb channels-last": ("pipe-zb", True),
    "pipe-zbv": ("pipe-zbv", False),
    "pipe-zbv channels-last": ("pipe-zbv", True),
    "single": ("single", False),
    "ddp": ("ddp", False),
}
# The runs on a chunked plan (V = 2 chunks a worker), by the schedule pdplan made it for: round-robin
# (interleaved-1f1b) or in a V (zb-v), the same split. The rest run the 2-stage plan.
ON_CHUNKS = {
    "interleaved-1f1b": "interleaved-1f1b",
    "pipe-interleaved-1f1b": "interleaved-1f1b",
    "pipe-interleaved-1f1b channels-last": "interleaved-1f1b",
    "zb-v": "zb-v",
    "pipe-zbv": "zb-v",
    "pipe-zbv channels-last": "zb-v",
}
VIRTUAL_STAGES = 2
# Which baseline each pdrun schedule is compared with at equal settings (a case compares the pairs
# whose both sides it runs).
PAIRS = (
    (
        "1f1b-flush",
        "pipe-1f1b channels-last",
        "pdrun 1F1B-flush / pipelining Schedule1F1B, both channels-last",
    ),
    ("gpipe", "pipe-gpipe channels-last", "pdrun GPipe / pipelining ScheduleGPipe, both channels-last"),
    ("1f1b", "pipe-1f1b channels-last", "pdrun 1F1B (async) / pipelining Schedule1F1B, both channels-last"),
    ("1f1b-flush", "pipe-1f1b", "pdrun 1F1B-flush / pipelining Schedule1F1B"),
    ("gpipe", "pipe-gpipe", "pdrun GPipe / pipelining ScheduleGPipe"),
    ("1f1b", "pipe-1f1b", "pdrun 1F1B (async) / pipelining Schedule1F1B"),
    ("1f1b", "single", "pdrun 1F1B (async) / single process"),
    ("1f1b", "ddp", "pdrun 1F1B (async) / DDP"),
    ("1f1b-flush", "ddp", "pdrun 1F1B-flush / DDP"),
    ("1f1b-flush nchw", "pipe-1f1b", "pdrun 1F1B-flush, NCHW layout / pipelining Schedule1F1B"),
    ("gpipe nchw", "pipe-gpipe", "pdrun GPipe, NCHW layout / pipelining ScheduleGPipe"),
    (
        "interleaved-1f1b",
        "pipe-interleaved-1f1b channels-last",
        "pdrun interleaved-1F1B / pipelining ScheduleInterleaved1F1B (2 ranks x 2 chunks), both channels-last",
    ),
    (
        "zb-h1",
        "pipe-zb channels-last",
        "pdrun ZB-H1 / pipelining ScheduleInterleavedZeroBubble (one stage a rank), both channels-last",
    ),
    (
        "interleaved-1f1b",
        "pipe-interleaved-1f1b",
        "pdrun interleaved-1F1B / pipelining ScheduleInterleaved1F1B (2 ranks x 2 chunks)",
    ),
    ("zb-h1", "pipe-zb", "pdrun ZB-H1 / pipelining ScheduleInterleavedZeroBubble (one stage a rank)"),
    (
        "zb-v",
        "pipe-zbv channels-last",
        "pdrun ZB-V / pipelining ScheduleZBVZeroBubble (2 ranks x 2 chunks in a V), both channels-last",
    ),
    ("zb-v", "pipe-zbv", "pdrun ZB-V / pipelining ScheduleZBVZeroBubble (2 ranks x 2 chunks in a V)"),
)
# The bubble table: each new schedule, its torch counterpart, and pdrun's 1f1b-flush; (pdrun's schedule
# the simulator runs for the row, label). Interleaving divides 1F1B-flush's bubble by V (Narayanan et
# al., SC'21, section 2.2.1); ZB-H1 cuts it to about a third at T_F = T_B = T_W (Qi et al., ICLR'24,
# section 3.1), and ZB-V to about half of ZB-H1's (section 6): the papers say the bubble is smaller
# than 1F1B-flush's.
BUBBLE_ROWS = (
    ("1f1b-flush", "1f1b-flush"),
    ("interleaved-1f1b", "interleaved-1f1b"),
    ("interleaved-1f1b", "pipe-interleaved-1f1b channels-last"),
    ("interleaved-1f1b", "pipe-interleaved-1f1b"),
    ("zb-h1", "zb-h1"),
    ("zb-h1", "pipe-zb channels-last"),
    ("zb-h1", "pipe-zb"),
    ("zb-v", "zb-v"),
    ("zb-v", "pipe-zbv channels-last"),
    ("zb-v", "pipe-zbv"),
)
SMALLER_BUBBLE = 0.9  # "measurably smaller": at most 0.9 of 1f1b-flush's measured idle fraction
# The split of a rank's time the "where time goes" table gives, where a system measures it.
PARTS = ("forward_s", "backward_s", "loss_s", "optimizer_s", "send_s", "recv_wait_s")


@dataclass(frozen=True)
class Config:
    microbatches: int = 4
    steps: int = 40  # timed optimizer steps (flush schedules); 1F1B runs as many units
    warmup: int = 4
    # What the plans assume between the two workers (bytes/s, seconds); None: the link `pdrun link`
    # measures on this host, the one the runs use. Planned for a 1 GB/s link on shared memory
    # (1.4e10 B/s), interleaved-1f1b's chunks were chosen for sends 14x dearer than they are: its
    # measured idle fraction was 1.0-1.07 of 1F1B-flush's, 0.83 on the chunks chosen for the link.
    bandwidth: float | None = None
    latency: float | None = None
    repeats: int = 3  # best of three interleaved runs: the machine is shared
    lr: float = 0.05
    momentum: float = 0.9
    profile_warmup: int = 4  # pdprof --warmup / --repeats (its defaults)
    profile_repeats: int = 10


QUICK = Config(steps=6, warmup=2, repeats=1, profile_warmup=1, profile_repeats=2)


@dataclass(frozen=True)
class Case:
    """One model the systems are compared on: what runs, and which pairs are compared."""

    name: str  # "" for the MNIST CNN (its figures keep their names), else prefixes figures and tables
    model: str
    data: str
    batch_size: int
    model_args: tuple[tuple[str, Any], ...] = ()
    pdrun_runs: tuple[str, ...] = tuple(PDRUN_RUNS)
    baselines: tuple[str, ...] = tuple(BASELINES)
    target: float | None = 1.2  # the ratio over pipelining the issue asks of pdrun (None: reported only)
    steps: int | None = None  # timed steps, if fewer than the config's (a slower model)

    @property
    def pairs(self) -> tuple[tuple[str, str, str], ...]:
        """The pairs of ``PAIRS`` whose both sides this case runs."""
        return tuple(p for p in PAIRS if p[0] in self.pdrun_runs and p[1] in self.baselines)


# The CNN's new torch schedules run in pdrun's layout only (the NCHW pairs above show the layout's share).
CNN = Case(
    "",
    "zoo:mnist_cnn",
    "zoo:mnist5k",
    64,
    baselines=tuple(b for b in BASELINES if b not in ("pipe-interleaved-1f1b", "pipe-zb", "pipe-zbv")),
)
# The zoo's GPT at 4 layers x 256 wide: 3-d activations, so no layout variants; no target, only the figure.
GPT = Case(
    "GPT 4x256",
    "zoo:gpt",
    "zoo:pydoc_text",
    16,
    # The zoo builds GPT-2 small's vocabulary and context unless told: pydoc_text's characters, 64 of them.
    model_args=(
        ("n_layer", 4),
        ("n_embd", 256),
        ("n_head", 4),
        ("block_size", 64),
        ("vocab_size", PYDOC_VOCAB),
    ),
    pdrun_runs=("1f1b-flush", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"),
    baselines=("pipe-1f1b", "pipe-gpipe", "pipe-interleaved-1f1b", "pipe-zb", "pipe-zbv", "single", "ddp"),
    target=None,
    steps=12,
)
CASES = (CNN, GPT)


def settings_from_plan(plan: Plan, cfg: Config) -> Settings:
    """The baselines' settings: the plan's model, data, split and unit, the benchmark's step counts."""
    spec = plan.spec
    assert spec.model is not None and spec.data is not None
    return Settings(
        model=spec.model,
        model_args=dict(spec.model_args),
        data=spec.data,
        data_args={**spec.data_args, "split": "train"},
        loss=spec.loss,
        trace=spec.trace,
        batch_size=plan.batch_size,
        microbatches=cfg.microbatches,
        stage_of=plan.stage_of(),
        steps=cfg.steps,
        warmup=cfg.warmup,
        lr=cfg.lr,
        momentum=cfg.momentum,
    )


@dataclass
class PdrunRun:
    """One pdrun run: its command, its timing and each rank's seconds per part (``PARTS``) over the timed steps."""

    cmd: str
    timing: PdrunTiming
    parts: dict[int, dict[str, float]]


def run_pdrun(
    plan_path: Path, schedule: str, cfg: Config, work: Path, tag: str, memory_format: str = "auto", **kw: Any
) -> PdrunRun:
    """pdrun on ``plan_path`` with ``schedule``: the same samples as the baselines' warm-up + timed steps."""
    ups = 1 if schedule == "1f1b" else cfg.microbatches
    # In 1F1B each unit is a step: run as many units as the flush schedules do.
    scale = cfg.microbatches // ups
    metrics = work / f"run-{tag}-{schedule}-{memory_format}.parquet"
    extra = ["--schedule", schedule, "--microbatches", str(cfg.microbatches), "--lr", f"{cfg.lr:g}"]
    extra += ["--momentum", f"{cfg.momentum:g}", "--no-val", "-q"]
    if memory_format != "auto":
        extra += ["--memory-format", memory_format]
    done, _ = toolchain.pdrun(plan_path, metrics, steps=(cfg.steps + cfg.warmup) * scale, extra=extra, **kw)
    return PdrunRun(
        done.cmd, pdrun_timing(metrics, cfg.warmup * scale), _pdrun_parts(metrics, cfg.warmup * scale)
    )


def _pdrun_parts(metrics: Path, warmup_steps: int) -> dict[int, dict[str, float]]:
    """Per rank, seconds per part over the steps after the warm-up (pdrun's loss is inside its forward)."""
    df = pd.read_parquet(metrics)
    timed = df[df["step"] >= warmup_steps]
    out: dict[int, dict[str, float]] = {}
    for rank, rows in timed.groupby("rank"):
        out[int(str(rank))] = {p: float(rows[p].sum()) for p in PARTS if p in rows}
    return out


def make_plan(work: Path, cfg: Config, case: Case = CNN) -> tuple[Path, Path, list[str]]:
    """Profile the case's model and plan it onto 2 workers, one stage each: (graph, plan, commands)."""
    tag = _slug(case.name)
    graph, plan_path = work / f"graph{tag}.json", work / f"plan-2stage{tag}.json"
    prof = toolchain.profile(
        graph,
        case.model,
        case.data,
        case.batch_size,
        dict(case.model_args),
        timeout_s=900,
        extra=["--warmup", str(cfg.profile_warmup), "--repeats", str(cfg.profile_repeats)],
    )
    cmds = [prof.cmd]
    cmds.append(
        toolchain.plan(
            graph,
            plan_path,
            2,
            _known(cfg.bandwidth),
            "1f1b-flush",
            cfg.microbatches,
            straight=True,
            latency=cfg.latency,
        ).cmd
    )
    return graph, plan_path, cmds


def make_chunked_plan(
    work: Path, graph: Path, cfg: Config, case: Case, schedule: str = "interleaved-1f1b"
) -> tuple[Path, str]:
    """The chunked plan of the same graph: 2 workers x ``VIRTUAL_STAGES`` chunks, the planner's cuts, placed
    round-robin (interleaved-1f1b) or in a V (zb-v)."""
    name = "chunked" if schedule == "interleaved-1f1b" else schedule
    path = work / f"plan-{name}{_slug(case.name)}.json"
    done = toolchain.plan(
        graph,
        path,
        2,
        _known(cfg.bandwidth),
        schedule,
        cfg.microbatches,
        straight=True,
        latency=cfg.latency,
        extra=["--virtual-stages", str(VIRTUAL_STAGES)],
    )
    return path, done.cmd


def _slug(name: str) -> str:
    return "-" + "".join(c if c.isalnum() else "-" for c in name.lower()) if name else ""


def _known(bandwidth: float | None) -> float:
    assert bandwidth is not None, "bench() fills in the measured link"
    return bandwidth


def bench(work: Path, cfg: Config, cases: tuple[Case, ...] = CASES) -> Report:
    report = Report("pdrun against the alternatives", "python -m bench.bench_runtime")
    if cfg.bandwidth is None:
        # The median of three probes: one probe read 2.2e9 B/s where the next four read 1.3e10-2.0e10.
        probes = sorted((toolchain.link() for _ in range(3)), key=lambda p: p[1])
        probe, bandwidth, latency = probes[1]
        cfg = replace(cfg, bandwidth=bandwidth, latency=latency)
        report.notes.append(
            f"Every plan is made for the link the runs use, the median of three `{probe.cmd}`: "
            f"{bandwidth:.3g} B/s, latency {latency * 1e6:.0f} us (the three read "
            f"{', '.join(f'{p[1]:.3g}' for p in probes)} B/s; `pdplan --bandwidth --latency`)."
        )
    for case in cases:
        bench_case(work, replace(cfg, steps=min(cfg.steps, case.steps or cfg.steps)), case, report)
    return report


def _failure(exc: Exception) -> str:
    """One line for a run that failed: the table and the figure carry it, and the other runs go on."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # A worker's error is often "rank 1 failed: RuntimeError:" with its words on the next line.
    head = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"failed: {type(exc).__name__}: {head}"


def bench_case(work: Path, cfg: Config, case: Case, report: Report) -> None:
    """Run every system of ``case`` and add its figures and tables to ``report``.

    A run that fails (or whose plan the planner refuses) is reported as failed, in its table row and
    in every figure that needs it; the other runs still run and are written."""
    graph_path, plan_path, cmds = make_plan(work, cfg, case)
    plan = load_plan(plan_path)
    s = settings_from_plan(plan, cfg)
    failed: dict[str, str] = {}
    # The chunked plans this case's runs need, by schedule (ON_CHUNKS): path and plan.
    chunked: dict[str, tuple[Path, Plan]] = {}
    for schedule in sorted({ON_CHUNKS[x] for x in (*case.pdrun_runs, *case.baselines) if x in ON_CHUNKS}):
        try:
            path, chunked_cmd = make_chunked_plan(work, graph_path, cfg, case, schedule)
            chunked[schedule] = (path, load_plan(path))
            cmds.append(chunked_cmd)
        except Exception as exc:  # the runs on it fail with it; the others go on
            failed.update({x: _failure(exc) for x, on in ON_CHUNKS.items() if on == schedule})

    def plan_of(label: str) -> tuple[Path, Plan] | None:
        """The plan (path) a run of ``label`` runs: its chunked plan, or the 2-stage plan; None if not made."""
        return chunked.get(ON_CHUNKS[label]) if label in ON_CHUNKS else (plan_path, plan)

    prefix = f"{case.name}: " if case.name else ""
    suffix = f" {case.name}" if case.name else ""
    chunk_note = "".join(
        f"; {name} runs: {len(p.stages)} chunks ({' | '.join(str(len(st.layers)) for st in p.stages)} layers), "
        + (
            "chunk c of worker w at stages[c * 2 + w]"
            if name == "interleaved-1f1b"
            else "chunk 0 of worker w at stages[w], chunk 1 at stages[3 - w]"
        )
        + ", torch's PipelineStage index the same"
        for name, (_, p) in chunked.items()
    )
    report.notes.append(
        f"{prefix}{case.model} {dict(case.model_args) or ''} on {case.data}: {len(plan.stages)} stages "
        f"({' | '.join(str(len(st.layers)) + ' layers' for st in plan.stages)}, the cut before "
        f"{plan.stages[-1].layers[0]!r}){chunk_note}, microbatch {case.batch_size}, "
        f"{cfg.microbatches} microbatches per step ({s.global_batch} samples), {cfg.steps} timed steps after "
        f"{cfg.warmup} warm-up steps, SGD lr {cfg.lr} momentum {cfg.momentum}, one thread per process, "
        f"gloo on 127.0.0.1; best of {cfg.repeats} interleaved runs. Plan: {' && '.join(cmds)}"
    )
    best_runs: dict[str, PdrunRun] = {}
    best_base: dict[str, Result] = {}
    # Each round's steady samples/s per system, by round: a ratio's noise is the spread of the rounds' ratios.
    by_round: dict[str, dict[int, float]] = {}
    for round_ in range(cfg.repeats):
        for label in case.pdrun_runs:
            if label in failed:
                continue
            schedule, memory_format = PDRUN_RUNS[label]
            placed = plan_of(label)
            assert placed is not None  # a plan that failed failed its runs above
            path = placed[0]
            try:
                got = run_pdrun(path, schedule, cfg, work, "rt" + _slug(case.name), memory_format)
            except Exception as exc:  # reported as failed; the other systems still run
                failed[label] = _failure(exc)
                continue
            by_round.setdefault(label, {})[round_] = got.timing.steady_samples_per_s
            best = best_runs.get(label)
            if best is None or got.timing.steady_samples_per_s > best.timing.steady_samples_per_s:
                best_runs[label] = got
        for label in case.baselines:
            if label in failed:
                continue
            system, channels_last = BASELINES[label]
            placed = plan_of(label)
            assert placed is not None
            run_s = replace(settings_from_plan(placed[1], cfg), chunks=placed[1].virtual_stages)
            try:
                r = run(system, replace(run_s, channels_last=channels_last), 2 if system == "ddp" else None)
            except Exception as exc:  # reported as failed; the other systems still run
                failed[label] = _failure(exc)
                continue
            by_round.setdefault(label, {})[round_] = r.steady_samples_per_s
            if label not in best_base or r.steady_samples_per_s > best_base[label].steady_samples_per_s:
                best_base[label] = r
    best_pd = {label: (r.cmd, r.timing) for label, r in best_runs.items()}
    rows: list[dict[str, Any]] = []
    for schedule, (cmd, t) in best_pd.items():
        rows.append(
            {
                "system": f"pdrun {schedule}",
                "samples_per_s": t.steady_samples_per_s,
                "whole_interval_samples_per_s": t.samples_per_s,
                "seconds": t.seconds,
                "final_loss": t.losses[-1] if t.losses else math.nan,
                "command": cmd,
            }
        )
    base_cmd = "python -m bench.bench_runtime"
    for system, r in best_base.items():
        rows.append(
            {
                "system": system,
                "samples_per_s": r.steady_samples_per_s,
                "whole_interval_samples_per_s": r.samples_per_s,
                "seconds": r.seconds,
                "final_loss": r.losses[-1] if r.losses else math.nan,
                "command": base_cmd,
            }
        )
    for label, why in failed.items():
        if label in (*case.pdrun_runs, *case.baselines):
            rows.append({"system": f"pdrun {label}" if label in PDRUN_RUNS else label, "command": why})
    report.tables[f"throughput{suffix}"] = rows
    for ours, theirs, name in case.pairs:
        wanted = case.target if theirs.startswith("pipe") else None
        missing = failed.get(ours) or failed.get(theirs)
        if ours in best_pd and theirs in best_base:
            ratio = best_pd[ours][1].steady_samples_per_s / best_base[theirs].steady_samples_per_s
            command = f"{best_pd[ours][0]}  vs  {base_cmd}"
        else:
            ratio, command = math.nan, base_cmd
        mine, other = by_round.get(ours, {}), by_round.get(theirs, {})
        each = [mine[k] / other[k] for k in sorted(mine.keys() & other.keys()) if other[k] > 0]
        report.add(
            judged(
                prefix + name,
                ratio,
                "x",
                command,
                at_least=wanted,
                note=missing or ("rounds' ratios " + " ".join(f"{x:.3f}" for x in each) if each else ""),
                noise=spread(each, ratio, "best"),
            )
        )
    # Equal settings, checked: the flush schedules train exactly what one process trains.
    for ours, theirs in (("1f1b-flush", "pipe-1f1b"), ("1f1b-flush", "single"), ("gpipe", "pipe-gpipe")):
        if ours not in best_pd or theirs not in best_base:
            continue
        a, b = best_pd[ours][1].losses, best_base[theirs].losses
        if a and len(a) == len(b):
            diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
            report.add(
                Figure(
                    f"{prefix}same training: largest per-step loss difference, pdrun {ours} vs {theirs}",
                    diff,
                    "",
                    f"{best_pd[ours][0]}  vs  {base_cmd}",
                    note="equal settings: ~0 up to float rounding",
                )
            )
    report.tables[f"where_time_goes{suffix}"] = _breakdown(best_runs, best_base)
    graph = load_graph(graph_path)
    busy_rows: list[dict[str, Any]] = []
    for label in case.pdrun_runs:
        if label not in best_runs:
            continue
        schedule, _ = PDRUN_RUNS[label]
        measured = _busy_fraction(best_runs[label].timing)
        placed = plan_of(label)
        assert placed is not None
        run_plan = placed[1]
        ideal = ideal_busy_fraction(
            graph,
            run_plan,
            schedule,
            cfg.microbatches,
            [r["compute_s"] for r in best_runs[label].timing.ranks],
        )
        busy_rows.append(
            {
                "schedule": label,
                "measured_busy_fraction": measured,
                "ideal_busy_fraction": ideal,
                "measured_over_ideal": measured / ideal if ideal > 0 else math.nan,
                "command": best_runs[label].cmd,
            }
        )
    report.tables[f"busy_fraction{suffix}"] = busy_rows
    _bubble_table(report, case, graph, plan_of, cfg, best_runs, best_base, failed, prefix, suffix)
    for row in busy_rows:
        if row["schedule"] != "1f1b":
            continue
        report.add(
            Figure(
                f"{prefix}pdrun 1F1B pipeline efficiency (busy fraction of the workers)",
                row["measured_busy_fraction"],
                "",
                row["command"],
            )
        )
        report.add(
            Figure(
                f"{prefix}1F1B's ideal busy fraction for this run (the simulator's, same program, its stage costs)",
                row["ideal_busy_fraction"],
                "",
                cmds[1],
            )
        )
        ratio = row["measured_over_ideal"]
        report.add(
            judged(
                f"{prefix}measured efficiency / the schedule's ideal",
                ratio,
                "",
                row["command"],
                at_least=0.85,
            )
        )


def _bubble_table(
    report: Report,
    case: Case,
    graph: LayerGraph,
    plan_of: Callable[[str], tuple[Path, Plan] | None],
    cfg: Config,
    runs: dict[str, PdrunRun],
    base: dict[str, Result],
    failed: dict[str, str],
    prefix: str,
    suffix: str,
) -> None:
    """Each new schedule beside its torch counterpart and pdrun's 1f1b-flush: measured idle fraction and
    samples/s against the simulator's for pdrun's program of that schedule, on the same split; then the
    figures: each new schedule's measured idle fraction over 1f1b-flush's (the papers say smaller)."""
    rows: list[dict[str, Any]] = []
    idle: dict[str, float] = {}
    wait: dict[str, float] = {}
    sim_idle: dict[str, float] = {}
    sim_wait: dict[str, float] = {}
    for schedule, label in BUBBLE_ROWS:
        if label not in (*case.pdrun_runs, *case.baselines):
            continue
        placed = plan_of(label)
        run_plan = placed[1] if placed is not None else None
        if run_plan is None:
            split = "-"
        elif run_plan.virtual_stages > 1:
            split = (
                f"{len(run_plan.stages)} chunks on {len(run_plan.stages) // run_plan.virtual_stages} ranks"
            )
        else:
            split = f"{len(run_plan.stages)} stages"
        sim = simulated(graph, run_plan, schedule, cfg.microbatches) if run_plan is not None else None
        row: dict[str, Any] = {
            "system": f"pdrun {label}" if label in PDRUN_RUNS else label,
            "split": split,
            "measured_idle_fraction": math.nan,
            "measured_wait_fraction": math.nan,
            "samples_per_s": math.nan,
            # As measured: idle is all but computing (the sender's copies too), wait the bubble alone.
            "simulated_idle_fraction": sim.bubble + sim.sending if sim else math.nan,
            "simulated_wait_fraction": sim.bubble if sim else math.nan,
            "simulated_samples_per_s": (
                run_plan.batch_size / sim.time_per_minibatch_s
                if sim and run_plan is not None and sim.time_per_minibatch_s > 0
                else math.nan
            ),
            "command": failed.get(label, ""),
        }
        if label in runs:
            row["measured_idle_fraction"] = 1.0 - _busy_fraction(runs[label].timing)
            row["measured_wait_fraction"] = _pdrun_wait_fraction(runs[label])
            row["samples_per_s"] = runs[label].timing.steady_samples_per_s
            row["command"] = runs[label].cmd
        elif label in base:
            row["measured_idle_fraction"] = 1.0 - _result_busy_fraction(base[label])
            row["measured_wait_fraction"] = _result_wait_fraction(base[label])
            row["samples_per_s"] = base[label].steady_samples_per_s
            row["command"] = report.command
        if label in PDRUN_RUNS:
            idle[label] = row["measured_idle_fraction"]
            wait[label] = row["measured_wait_fraction"]
            sim_idle[label] = row["simulated_idle_fraction"]
            sim_wait[label] = row["simulated_wait_fraction"]
        rows.append(row)
    report.tables[f"bubble{suffix}"] = rows
    for label in ("interleaved-1f1b", "zb-h1", "zb-v"):
        if label not in case.pdrun_runs or "1f1b-flush" not in case.pdrun_runs:
            continue
        cmd = runs[label].cmd if label in runs else report.command
        # Idle: all but computing (the framework's own work per chunk counts); wait: blocked on a peer,
        # the bubble alone.
        for what, measured in (("idle", idle), ("wait", wait)):
            report.add(
                judged(
                    f"{prefix}pdrun {label} {what} fraction / pdrun 1f1b-flush {what} fraction (measured)",
                    _over_flush(measured, label),
                    "",
                    cmd,
                    at_most=SMALLER_BUBBLE,
                    note=failed.get(label) or failed.get("1f1b-flush") or "",
                )
            )
        for what, simulated_fractions in (("idle", sim_idle), ("wait", sim_wait)):
            report.add(
                Figure(
                    f"{prefix}simulated {label} {what} fraction / simulated 1f1b-flush {what} fraction",
                    _over_flush(simulated_fractions, label),
                    "",
                    report.command,
                    note="the simulator's, on the same splits, counted as the measured figure above",
                )
            )


def _over_flush(fractions: dict[str, float], label: str) -> float:
    """``label``'s fraction over pdrun 1f1b-flush's (NaN where either is missing or flush's is 0)."""
    flush = fractions.get("1f1b-flush", math.nan)
    return fractions.get(label, math.nan) / flush if flush > 0 else math.nan


def simulated(graph: LayerGraph, plan: Plan, schedule: str, microbatches: int) -> ScheduleFigures:
    """The simulator's run of ``schedule`` on ``plan``'s split: pdrun's program, the profiled costs."""
    ups = 1 if schedule == "1f1b" else microbatches
    return simulate_plan(graph, plan.model_copy(update={"schedule": schedule, "microbatches": ups}))


def _breakdown(runs: dict[str, PdrunRun], base: dict[str, Result]) -> list[dict[str, Any]]:
    """Per system and rank: seconds computing (forward, backward, loss, optimizer step), in communication
    calls or waiting for a peer, and the rest (the framework's own work between them); then the same
    time by part where the system measures it: forward, backward, loss (pdrun: inside its forward),
    optimizer, posting sends (gloo writes into the socket there) and waiting for receives."""
    rows: list[dict[str, Any]] = []
    for label, pd_run in runs.items():
        for r in pd_run.timing.ranks:
            rank = int(r["rank"])
            rest = r["total_s"] - r["compute_s"] - r["comm_s"] - r["idle_s"]
            rows.append(
                {
                    "system": f"pdrun {label}",
                    "rank": rank,
                    "total_s": r["total_s"],
                    "compute_s": r["compute_s"],
                    "comm_wait_s": r["comm_s"] + r["idle_s"],
                    "other_s": max(0.0, rest),
                    **_parts(pd_run.parts.get(rank, {})),
                }
            )
    for system, res in base.items():
        for k in res.ranks:
            known = {**k.parts, "optimizer_s": k.optimizer_s} if k.parts else {}
            rows.append(
                {
                    "system": system,
                    "rank": k.rank,
                    "total_s": k.total_s,
                    "compute_s": k.compute_s + k.optimizer_s,
                    "comm_wait_s": k.comm_s,
                    "other_s": k.other_s,
                    **_parts(known),
                }
            )
    return rows


def _parts(known: dict[str, float]) -> dict[str, float | None]:
    """Every column of ``PARTS``, None where not measured."""
    return {p: known.get(p) for p in PARTS}


def _busy_fraction(t: PdrunTiming) -> float:
    """Measured: every rank's computing time (forward, backward, loss, optimizer step) over ranks x wall."""
    return sum(r["compute_s"] for r in t.ranks) / (len(t.ranks) * t.seconds) if t.seconds > 0 else math.nan


def _pdrun_wait_fraction(run: PdrunRun) -> float:
    """Measured: every rank's seconds blocked on a peer's message (``recv_wait_s``) over ranks x wall."""
    t = run.timing
    return _share(
        [run.parts.get(int(r["rank"]), {}).get("recv_wait_s", math.nan) for r in t.ranks], t.seconds
    )


def _result_wait_fraction(r: Result) -> float:
    """A baseline's :func:`_pdrun_wait_fraction` where it times its waits (pipelining's ``recv_wait_s``)."""
    return _share([k.parts.get("recv_wait_s", math.nan) for k in r.ranks], r.seconds)


def _share(per_rank_s: Sequence[float], wall_s: float) -> float:
    """The ranks' seconds over ranks x wall (NaN without ranks or wall time)."""
    return sum(per_rank_s) / (len(per_rank_s) * wall_s) if wall_s > 0 and per_rank_s else math.nan


def _result_busy_fraction(r: Result) -> float:
    """A baseline's busy fraction, measured as pdrun's: computing and optimizer time over ranks x wall."""
    busy = sum(k.compute_s + k.optimizer_s for k in r.ranks)
    return busy / (len(r.ranks) * r.seconds) if r.seconds > 0 and r.ranks else math.nan


def ideal_busy_fraction(
    graph: LayerGraph,
    plan: Plan,
    schedule: str,
    microbatches: int,
    measured: Sequence[float] | None = None,
) -> float:
    """The busy fraction a perfect runtime reaches with ``schedule``: the planner's simulation of the same
    program pdrun runs (``pdrun --schedule S --microbatches M``), in steady state. Per unit, each stage
    computes its forward and backward and ``1/M`` of a step (every unit is a step in 1f1b); over the
    simulated seconds per unit, that is the share of the workers' time spent computing.

    ``measured``, each rank's computing seconds over a run's timed interval, makes it that run's own
    limit: each worker's stages are scaled so that the workers' shares of the computing are the run's
    (their sum stays the profile's). A run whose stages came out better balanced than the profile
    said would otherwise beat its "ideal"."""
    ups = 1 if schedule == "1f1b" else microbatches
    run_plan = plan.model_copy(update={"schedule": schedule, "microbatches": ups})
    costs, _ = stage_costs(graph, run_plan)
    scale = None if measured is None else _measured_scale(run_plan, costs, ups, measured)
    per_unit = simulate_plan(graph, run_plan, scale).time_per_minibatch_s
    # Interleaved: the stages are the chunks, V of them a worker.
    workers = sum(st.replicas for st in run_plan.stages) // run_plan.virtual_stages
    if per_unit <= 0 or workers == 0:
        return math.nan
    busy = sum(
        (1.0 if scale is None else scale[s]) * (costs.forward[s] + costs.backward[s] + costs.step[s] / ups)
        for s in range(len(run_plan.stages))
    )
    return busy / (workers * per_unit)


def _measured_scale(plan: Plan, costs: Costs, ups: int, measured: Sequence[float]) -> list[float] | None:
    """Per stage, the factor that gives each worker its measured share of the run's computing.

    A worker's profiled busy time per unit is the sum over its stages (an interleaved worker's
    chunks); a stage's replicas are averaged. None when the run's ranks do not match the plan.
    """
    n = len(plan.stages)
    busy = [costs.forward[s] + costs.backward[s] + costs.step[s] / ups for s in range(n)]
    if any(r >= len(measured) for st in plan.stages for r in st.ranks):
        return None
    ranks = sorted({r for st in plan.stages for r in st.ranks})
    profiled = {
        r: sum(busy[s] / st.replicas for s, st in enumerate(plan.stages) if r in st.ranks) for r in ranks
    }
    total_profiled = sum(profiled.values())
    total_measured = sum(measured[r] for r in ranks)
    if total_profiled <= 0 or total_measured <= 0 or any(v <= 0 for v in profiled.values()):
        return None
    factor = {r: (measured[r] / total_measured) / (profiled[r] / total_profiled) for r in ranks}
    return [sum(factor[r] for r in st.ranks) / len(st.ranks) for st in plan.stages]


def main(argv: list[str] | None = None) -> Report:
    return main_of(
        __doc__, argv, "bench_runtime", lambda work, quick: bench(work, QUICK if quick else Config())
    )


if __name__ == "__main__":
    main()
    sys.exit(0)
