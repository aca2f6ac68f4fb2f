"""Where the memory model's overhead rule comes from: each stage's measured peak beside its parts.

``pdplan.memory`` charges each worker the process floor plus the rest of the whole model's
overhead by its share of the model's step tensors (``shared_overhead``). The floor and the
power of the share are empirical; this module measures the stages they are fitted on and
says how each rule does, on all of them and on each model left out of the fit.

The stages: bench_memory's cases (the MNIST CNN, a residual MLP and a 2-block GPT; 1f1b,
1f1b-flush, gpipe; 12 steps) and bench_predict's (torchvision's ResNet-18, MobileNetV2 and
VGG-16 recipes, transformers' BERT and GPT-2, the MNIST CNN, a 512-wide residual MLP; two
workers, 1F1B, momentum, the benchmark's steps), one run each. Not part of ``make bench``: it
calibrates, and takes about four minutes.

Run: ``python -m bench.fit_memory [--work DIR]``; the rows and the table go to
``WORK/fit_memory.json``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import toolchain
from bench.bench_memory import CASES as MEMORY_CASES
from bench.bench_memory import run_case
from bench.bench_predict import CASES as PREDICT_CASES
from bench.measure import Report, main_of
from pdplan.memory import PROCESS_FLOOR_BYTES, loss_overhead, process_overhead, shared_overhead, tensor_share
from shared.graph import LayerGraph, load_graph
from shared.plan import Plan, load_plan

# The rule fitted with the library pages counted (2026-12-03), for comparison.
RULE_BEFORE = (2.5e6, 0.5)
FLOORS = (0.0, 1e6, 2.5e6, 5e6, 7.5e6, 10e6, 15e6, 20e6)
POWERS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
WITHIN = 0.2


@dataclass(frozen=True)
class StageRow:
    model: str  # the left-out unit of the cross-check
    case: str
    stage: int
    measured: float  # pdrun's peak (its busiest rank)
    model_terms: float  # the prediction less its overhead (weights, gradients, activations, ...)
    loss: float  # the loss's part, the last stage's alone
    rest: float  # the whole model's overhead less the loss's part
    share: float  # the stage's share of the model's step tensors

    def ratio(self, floor: float, power: float) -> float:
        return self.measured / (
            self.model_terms + self.loss + shared_overhead(self.rest, self.share, floor, power)
        )


def stage_rows(
    model: str, case: str, graph: LayerGraph, plan: Plan, measured: dict[int, float]
) -> list[StageRow]:
    loss = loss_overhead(graph)
    rest = process_overhead(graph) - loss
    rows = []
    last = len(plan.stages) - 1
    for s, stage in enumerate(plan.stages):
        memory = stage.predicted.memory if stage.predicted else None
        assert memory is not None, "a plan with the memory model's parts"
        rows.append(
            StageRow(
                model,
                case,
                s,
                measured[s],
                memory.total_bytes - memory.overhead_bytes,
                loss if s == last else 0.0,
                rest,
                tensor_share(graph, stage.layers),
            )
        )
    return rows


def _peaks(run_summary: dict[str, object]) -> dict[int, float]:
    entries = run_summary["memory"]
    assert isinstance(entries, list)
    return {e["stage"]: max(e["measured_bytes"].values()) for e in entries}


def memory_cases(work: Path) -> list[StageRow]:
    rows: list[StageRow] = []
    graphs: dict[tuple[str | None, int], LayerGraph] = {}
    for case in MEMORY_CASES:
        graph, plan, run_summary = run_case(case, work, graphs, 12)
        rows += stage_rows(case.spec.model or "", case.name, graph, plan, _peaks(run_summary))
    return rows


def predict_cases(work: Path) -> list[StageRow]:
    rows: list[StageRow] = []
    for i, case in enumerate(PREDICT_CASES):
        graph, plan_path = work / f"fit-p{i}-graph.json", work / f"fit-p{i}-plan.json"
        # Memory does not depend on how many rounds pdprof times: a few, to keep the fit quick.
        extra = [*(case.profile_args or ["--concurrent", str(case.workers)]), "--repeats", "5"]
        toolchain.profile(
            graph, case.model, case.data, case.batch_size, case.model_args, case.data_args, extra=extra
        )
        # The slow link's case, with its link emulated, is the planner's cut of a small last stage.
        bandwidth = case.bandwidth or 1e10
        sends = "yes" if case.emulate else None
        toolchain.plan(
            graph, plan_path, case.workers, bandwidth, "1f1b", 1, straight=case.straight, blocking_sends=sends
        )
        _, run_summary = toolchain.pdrun(
            plan_path,
            work / f"fit-p{i}-run.parquet",
            steps=min(300, case.steps or 300) + 10,
            extra=["--no-val", "-q"],
            bandwidth=case.bandwidth if case.emulate else None,
        )
        rows += stage_rows(
            case.model, case.name, load_graph(graph), load_plan(plan_path), _peaks(run_summary)
        )
    return rows


def within(rows: Iterable[StageRow], floor: float, power: float) -> int:
    return sum(1 - WITHIN <= r.ratio(floor, power) <= 1 + WITHIN for r in rows)


def best_rule(rows: list[StageRow]) -> tuple[float, float]:
    """The floor and power that put most stages within 20%, ties to the smaller mean log error."""

    def score(rule: tuple[float, float]) -> tuple[int, float]:
        return within(rows, *rule), -sum(abs(math.log(r.ratio(*rule))) for r in rows)

    return max(((f, p) for f in FLOORS for p in POWERS), key=score)


def bench(work: Path, quick: bool) -> Report:
    del quick
    report = Report("The memory model's overhead rule against measured stages", "python -m bench.fit_memory")
    rows = memory_cases(work) + predict_cases(work)
    rule = (PROCESS_FLOOR_BYTES, 1.0)
    held_out = 0
    table = []
    for model in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == model]
        fitted = best_rule([r for r in rows if r.model != model])
        held_out += within(mine, *fitted)
        ratios = [r.ratio(*rule) for r in mine]
        before = [r.ratio(*RULE_BEFORE) for r in mine]
        table.append(
            {
                "model": model,
                "stages": len(mine),
                "within_20%": within(mine, *rule),
                "ratios": f"{min(ratios):.2f}-{max(ratios):.2f}",
                "rule_before": f"{min(before):.2f}-{max(before):.2f}",
                "held_out_rule": f"floor {fitted[0] / 1e6:g} MB, power {fitted[1]:g}",
                "held_out_within_20%": within(mine, *fitted),
            }
        )
    report.tables["rows"] = [asdict(r) | {"ratio": r.ratio(*rule)} for r in rows]
    report.tables["models"] = table
    report.notes.append(
        f"rule (floor {rule[0] / 1e6:g} MB, power 1): {within(rows, *rule)} of {len(rows)} within 20%; "
        f"before (floor 2.5 MB, square root): {within(rows, *RULE_BEFORE)}; each model held out of the fit: "
        f"{held_out}; best on all: {best_rule(rows)}"
    )
    for line in [*report.notes, *(str(t) for t in table)]:
        print(line, file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> Report:
    return main_of(__doc__, argv, "fit_memory", bench)


if __name__ == "__main__":
    main()
