"""The planner's predicted time per minibatch against pdrun's measured one, for several plans.

Each case profiles a model (``pdprof``), plans it (``pdplan``, 1F1B, the paper's cost model)
and runs the plan (``pdrun``, 1F1B: one unit per step). Two predictions: the plan's
``predicted.time_per_minibatch_s`` (the paper's: the bottleneck stage's time per minibatch)
and ``predicted.simulated_time_per_minibatch_s`` (the plan's schedule simulated with the
profiled costs, optimizer steps and transfers: what pdrun should measure). Measured:
the timed interval after the warm-up over the units it trained. Each case runs a few rounds
of (profile, plan, run), the run right after its own profile, and the figure is the median
of the rounds' ratios (``Config.rounds`` says why). The
slow-link case runs with the link the plan assumes emulated (``bench.slow_link``), so the
communication term of the prediction is put to the test too.

Run alone: ``python -m bench.bench_predict [--quick]``.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import toolchain
from bench.measure import Figure, Report, judged, main_of, pdrun_timing, spread
from shared.plan import load_plan


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    data: str
    batch_size: int
    workers: int
    bandwidth: float | None  # None: the link pdrun link measures on this machine
    straight: bool = True
    emulate: bool = False  # run with the planned bandwidth emulated
    model_args: dict[str, Any] = field(default_factory=dict)
    data_args: dict[str, Any] = field(default_factory=dict)
    # pdprof's options beyond model, data and batch: None for the harness's (beside the other workers,
    # Config.repeats rounds); the real models take pdprof's defaults, as a user would (issue 17).
    profile_args: tuple[str, ...] | None = None
    steps: int | None = None  # timed steps, fewer for the slow models (Config.steps caps it)
    tolerance: float = 0.1  # the simulated / measured figure's target: within this fraction


# Real models nobody here wrote for the benchmark (issue 17): torchvision's ResNet-18, MobileNetV2 and
# VGG-16 recipes at 3x32x32 and transformers' BERT and GPT-2 from small configs, each in two stages of
# 1F1B at batch 16, with pdprof's defaults.
_IMAGES = {"image_size": 32, "num_classes": 10, "size": 512}


def _image_case(name: str, model: str, **model_args: Any) -> Case:
    """A torchvision-style CNN on 3x32x32 synthetic images, 10 classes, 150 timed steps."""
    return Case(
        name,
        model,
        "zoo:synthetic_images",
        16,
        2,
        None,
        model_args={"num_classes": 10, "image_size": 32, **model_args},
        data_args=_IMAGES,
        steps=150,
        profile_args=(),
        tolerance=0.15,
    )


REAL_CASES = (
    _image_case("ResNet-18, 2 stages", "zoo:resnet18"),
    _image_case("MobileNetV2, 2 stages", "zoo:mobilenet_v2"),
    _image_case("VGG-16 (half width), 2 stages", "zoo:vgg16", widths=[32, 64, 128, 256, 256], hidden=512),
    Case(
        "BERT (transformers, 4 x 64), 2 stages",
        "zoo:hf_bert",
        "zoo:pydoc_lines",
        16,
        2,
        None,
        profile_args=(),
        tolerance=0.15,
    ),
    Case(
        "GPT-2 (transformers, 4 x 64), 2 stages",
        "zoo:hf_gpt2",
        "zoo:pydoc_tokens",
        16,
        2,
        None,
        profile_args=("--loss", "causal_lm"),
        tolerance=0.15,
    ),
)


CASES = (
    Case("mnist_cnn, 1 worker", "zoo:mnist_cnn", "zoo:mnist5k", 64, 1, None),
    Case("mnist_cnn, 2 stages", "zoo:mnist_cnn", "zoo:mnist5k", 64, 2, None),
    Case(
        "mnist_cnn, 2 stages, slow link (emulated)", "zoo:mnist_cnn", "zoo:mnist5k", 64, 2, 2e7, emulate=True
    ),
    Case(
        "mnist_cnn, 2 workers, planner's choice", "zoo:mnist_cnn", "zoo:mnist5k", 64, 2, None, straight=False
    ),
    Case(
        "resmlp 512 wide, 2 stages",
        "zoo:resmlp",
        "zoo:synthetic",
        128,
        2,
        None,
        model_args={"width": 512, "depth": 4},
        data_args={"size": 4096, "shape": [64]},
    ),
    *REAL_CASES,
)


@dataclass(frozen=True)
class Config:
    # Long enough that a hiccup of the VM (a fraction of a second) is averaged out rather than being the
    # figure: 60 steps were a 0.3 s window, and one round in a few came out 20% slow.
    steps: int = 300
    warmup: int = 10
    repeats: int = 50  # pdprof's timed rounds (its default, 10, is ~0.1 s of this model's steps)
    # Rounds of (profile, plan, run) per case, each run right after its own profile. This VM's speed
    # drifts by 10-15% over tens of seconds (five profiles in a row of the same model ranged 4.5-6.6 ms);
    # a profile and a run taken seconds apart see the same machine, so each round's ratio is a fair
    # test of the cost model, and the median over the rounds (spread over the whole benchmark) is the
    # figure held to 10%.
    rounds: int = 3
    cases: tuple[Case, ...] = CASES


QUICK = Config(steps=6, warmup=2, repeats=3, rounds=1, cases=CASES[1:2])


def one_round(case: Case, cfg: Config, work: Path, index: int, link: tuple[float, float]) -> dict[str, Any]:
    """Profile, plan and run ``case`` once; the plan's predictions beside the run's measurement."""
    graph, plan_path = work / f"predict-{index}-graph.json", work / f"predict-{index}-plan.json"
    steps = min(cfg.steps, case.steps or cfg.steps)
    metrics = work / f"predict-{index}-run.parquet"
    # The workers share this host: profile as one of them, beside the others (pdprof --concurrent).
    prof = toolchain.profile(
        graph,
        case.model,
        case.data,
        case.batch_size,
        case.model_args,
        case.data_args,
        extra=(
            ["--concurrent", str(case.workers), "--repeats", str(cfg.repeats)]
            if case.profile_args is None
            else list(case.profile_args)
        ),
    )
    bandwidth = case.bandwidth if case.bandwidth is not None else link[0]
    # The emulated link sleeps in the sender (bench.slow_link): its sends block on any host. Otherwise
    # pdplan's auto follows pdrun's rule for posting sends (a send thread when a core is spare).
    planned = toolchain.plan(
        graph,
        plan_path,
        case.workers,
        bandwidth,
        "1f1b",
        1,
        straight=case.straight,
        latency=link[1],
        blocking_sends="yes" if case.emulate else None,
    )
    plan = load_plan(plan_path)
    predicted = plan.predicted.time_per_minibatch_s if plan.predicted else math.nan
    simulated = plan.predicted.simulated_time_per_minibatch_s if plan.predicted else None
    simulated = math.nan if simulated is None else simulated
    done, run_summary = toolchain.pdrun(
        plan_path,
        metrics,
        steps=steps + cfg.warmup,
        extra=["--no-val", "-q"],
        bandwidth=case.bandwidth if case.emulate else None,
    )
    # Time per unit (minibatch) = the timed interval over the units it trained (1 / throughput). (The
    # median of per-step maxima over the ranks is kept beside it: in asynchronous 1F1B the ranks' steps
    # do not line up, so that figure runs high.)
    t = pdrun_timing(metrics, cfg.warmup)
    measured = t.seconds_per_minibatch(plan.batch_size)
    # Where a gap comes from: the bottleneck's compute as planned, and as measured (the busiest rank's
    # compute share of the interval times the time per unit); the rest is communication and waiting.
    bottleneck = plan.stages[plan.predicted.bottleneck_stage or 0] if plan.predicted else plan.stages[0]
    planned_compute = (
        bottleneck.predicted.compute_s / bottleneck.replicas if bottleneck.predicted else math.nan
    )
    busiest = max(r["compute_s"] for r in t.ranks) / t.seconds if t.seconds > 0 else math.nan
    # Memory (issue 17, point 2): each stage's measured peak (its busiest rank) over the plan's prediction.
    memory = [
        (m["measured_over_predicted"] or math.nan, max(m["measured_bytes"].values(), default=math.nan))
        for m in run_summary.get("memory", [])
    ]
    return {
        "plan": " | ".join(f"{len(st.layers)} layers x{st.replicas}" for st in plan.stages),
        "predicted_ms": predicted * 1000,
        "simulated_ms": simulated * 1000,
        "measured_ms": measured * 1000,
        "measured_median_step_ms": plan.batch_size / t.steady_samples_per_s * 1000,
        "predicted_compute_ms": planned_compute * 1000,
        "measured_compute_ms": busiest * measured * 1000,
        "predicted_over_measured": predicted / measured if measured > 0 else math.nan,
        "simulated_over_measured": simulated / measured if measured > 0 else math.nan,
        **{f"stage{s}_measured_mb": peak / 1e6 for s, (_, peak) in enumerate(memory)},
        **{f"stage{s}_memory_measured_over_predicted": ratio for s, (ratio, _) in enumerate(memory)},
        "command": f"{prof.cmd} && {planned.cmd} && {done.cmd}",
    }


def summarize(case: Case, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row for ``case``: every figure's median over its rounds, each round's ratio beside."""
    row: dict[str, Any] = {"case": case.name, "plan": rounds[-1]["plan"], "rounds": len(rounds)}
    figures = [k for k, v in rounds[0].items() if isinstance(v, float)]
    row.update({k: statistics.median(r[k] for r in rounds) for k in figures})
    row["simulated_over_measured_each"] = " ".join(f"{r['simulated_over_measured']:.3f}" for r in rounds)
    row["command"] = rounds[-1]["command"]
    return row


def bench(work: Path, cfg: Config) -> Report:
    report = Report("predicted vs measured time per minibatch", "python -m bench.bench_predict")
    report.notes.append(
        f"{cfg.rounds} rounds per case of (pdprof, pdplan, pdrun), each run right after its own profile, the cases "
        "interleaved; every figure is the median over a case's rounds (the ratio of each round beside it). "
        f"pdrun 1F1B, {cfg.steps} timed steps (the three CNNs of the real models 150) after {cfg.warmup} "
        "warm-up steps; measured = the "
        "timed interval over the units it trained (1 / throughput), and beside it the median step (the slowest rank's "
        "wall time) per unit; predicted = the plan's "
        "predicted.time_per_minibatch_s (the paper's bottleneck figure); simulated = predicted.simulated_time_per_minibatch_s "
        "(the plan's schedule simulated with the profiled costs, optimizer steps and transfers), the figure held to 10% "
        "(15% for the real models: ResNet-18, MobileNetV2, VGG-16, BERT and GPT-2, profiled with pdprof's defaults). "
        "Memory: each stage's measured peak (pdrun's summary) over the plan's predicted memory.total_bytes"
    )
    # Plan for the link this machine has: pdrun link measures two local gloo workers.
    probe, bandwidth, latency = toolchain.link()
    report.notes.append(
        f"link measured by `{probe.cmd}`: {bandwidth:.3g} B/s, latency {latency * 1e6:.0f} us; the fast-link cases "
        "are planned with both (--bandwidth, --latency), the slow link with its emulated bandwidth and this latency; "
        "every profile is taken beside its case's other workers (pdprof --concurrent)"
    )
    # Rounds outermost: a case's rounds are spread over the whole benchmark, not taken in one stretch.
    done: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cfg.cases))}
    for _ in range(cfg.rounds):
        for i, case in enumerate(cfg.cases):
            done[i].append(one_round(case, cfg, work, i, (bandwidth, latency)))
    rows = [summarize(case, done[i]) for i, case in enumerate(cfg.cases)]
    report.tables["prediction"] = rows
    report.tables["prediction_rounds"] = [
        {
            "case": case.name,
            "round": k + 1,
            **{key: v for key, v in r.items() if key not in ("plan", "command")},
        }
        for i, case in enumerate(cfg.cases)
        for k, r in enumerate(done[i])
    ]
    for i, (case, row) in enumerate(zip(cfg.cases, rows, strict=True)):
        report.add(
            judged(
                f"simulated / measured time per minibatch: {row['case']}",
                row["simulated_over_measured"],
                "",
                row["command"],
                at_least=1 - case.tolerance,
                at_most=1 + case.tolerance,
                noise=spread([r["simulated_over_measured"] for r in done[i]], row["simulated_over_measured"]),
            )
        )
    # One figure per stage, not the stage furthest from its prediction: which stage is furthest flips from
    # run to run when two stages are about as far (MobileNetV2: 0.93 and 1.05-1.09), and a figure that
    # reports another stage each run cannot reproduce.
    for i, row in enumerate(rows):
        for key in (k for k in row if k.endswith("_memory_measured_over_predicted")):
            if math.isnan(row[key]):
                continue
            stage = key.removesuffix("_memory_measured_over_predicted").removeprefix("stage")
            report.add(
                judged(
                    f"measured / predicted peak memory, stage {stage}: {row['case']}",
                    row[key],
                    "",
                    row["command"],
                    at_least=0.8,
                    at_most=1.2,
                    noise=spread([r[key] for r in done[i] if key in r], row[key]),
                )
            )
    for i, row in enumerate(rows):
        report.add(
            Figure(
                f"paper's bottleneck / measured time per minibatch: {row['case']}",
                row["predicted_over_measured"],
                "",
                row["command"],
                noise=spread([r["predicted_over_measured"] for r in done[i]], row["predicted_over_measured"]),
            )
        )
    return report


def main(argv: list[str] | None = None) -> Report:
    return main_of(
        __doc__, argv, "bench_predict", lambda work, quick: bench(work, QUICK if quick else Config())
    )


if __name__ == "__main__":
    main()
    sys.exit(0)
