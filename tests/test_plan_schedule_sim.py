"""pdplan's schedule simulation: the plan's own schedule run against the profiled costs.

Closed forms on uniform chains: one stage pays forward + loss + backward + optimizer step
per unit; GPipe and 1F1B-flush take (M + S - 1)(F + B) per step of M units plus the
transfers' latency on the way down and back up; asynchronous 1F1B on balanced stages
reaches the bottleneck stage's time.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplan import schedule_sim
from pdplan.build import PlanConfig, make_plan
from pdplan.cli import main
from pdplan.report import with_simulation
from pdplan.schedule_sim import chunked_costs, simulate_plan, stage_costs
from pdprof.pipedream_import import parse_pipedream
from shared.graph import Edge, LayerGraph, Node, save_graph
from shared.host import send_thread_pays
from shared.plan import load_plan, save_plan
from shared.simulate import Costs

FWD, BWD, UPD, OVERHEAD, LOSS_F, LOSS_B, DATA = 1.0, 2.0, 0.25, 0.1, 0.05, 0.15, 0.4  # milliseconds
PROFILES = Path(__file__).resolve().parent.parent / "profiles"
ACT = 1e6  # bytes each layer outputs


def chain(layers: int, extras: bool = True) -> LayerGraph:
    nodes = [Node(id="x", op="input", forward_ms=0, backward_ms=0, activation_bytes=ACT, parameter_bytes=0)]
    for i in range(layers):
        nodes.append(
            Node(
                id=f"l{i}",
                forward_ms=FWD,
                backward_ms=BWD,
                update_ms=UPD,
                activation_bytes=ACT,
                parameter_bytes=4e3,
            )
        )
    ids = [n.id for n in nodes]
    edges = [Edge(source=a, target=b, bytes=ACT) for a, b in itertools.pairwise(ids)]
    graph = (
        {
            "loss_forward_ms": LOSS_F,
            "loss_backward_ms": LOSS_B,
            "update_overhead_ms": OVERHEAD,
            "data_ms": DATA,
        }
        if extras
        else {}
    )
    return LayerGraph(batch_size=8, nodes=nodes, edges=edges, graph=graph)


def plan_for(
    graph: LayerGraph, workers: int, bandwidth: float, schedule: str = "1f1b", microbatches: int = 1
):
    config = PlanConfig(
        workers=(workers,),
        bandwidths=(bandwidth,),
        straight=True,
        schedule=schedule,
        microbatches=microbatches,  # type: ignore[arg-type]
    )
    return make_plan(graph, config)


def test_one_stage_pays_data_forward_loss_backward_and_the_step() -> None:
    g = chain(3)
    sim = simulate_plan(g, plan_for(g, 1, 1e9))
    expected = DATA + 3 * (FWD + BWD) + LOSS_F + LOSS_B + 3 * UPD + OVERHEAD
    assert sim.time_per_minibatch_s * 1000 == pytest.approx(expected, rel=1e-9)
    assert sim.bubble == pytest.approx(0.0, abs=1e-12)


def test_each_stage_pays_its_fetch_the_inputs_the_targets_or_both() -> None:
    """The first stage fetches the model inputs (data_ms), the last the targets (target_ms), a single
    stage both in one fetch (data_target_ms); a graph without the last two charges data_ms alone."""
    fetches = {"data_ms": 0.7, "target_ms": 0.3, "data_target_ms": 0.9}
    base = chain(4)
    g = base.model_copy(update={"graph": {**base.graph, **fetches}})
    costs, _ = schedule_sim.stage_costs(g, plan_for(g, 2, 1e12))
    before, _ = schedule_sim.stage_costs(base, plan_for(base, 2, 1e12))
    added = [(a - b) * 1000 for a, b in zip(costs.forward, before.forward, strict=True)]
    assert added == pytest.approx([0.7 - DATA, 0.3], rel=1e-9)
    one, _ = schedule_sim.stage_costs(g, plan_for(g, 1, 1e12))
    alone, _ = schedule_sim.stage_costs(base, plan_for(base, 1, 1e12))
    assert (one.forward[0] - alone.forward[0]) * 1000 == pytest.approx(0.9 - DATA, rel=1e-9)


def test_imported_profiles_without_update_or_loss_cost_only_compute() -> None:
    g = chain(3, extras=False)
    g = g.model_copy(update={"nodes": [n.model_copy(update={"update_ms": 0.0}) for n in g.nodes]})
    sim = simulate_plan(g, plan_for(g, 1, 1e9))
    assert sim.time_per_minibatch_s * 1000 == pytest.approx(3 * (FWD + BWD), rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-flush"])
@pytest.mark.parametrize(("stages", "m"), [(2, 4), (4, 4), (3, 8)])
def test_flush_schedules_take_the_fill_and_drain_formula(schedule: str, stages: int, m: int) -> None:
    g = chain(stages, extras=False)
    # GPipe: a transfer of ACT bytes takes 1 ms, no longer than a forward, so it only adds its latency
    # down and back up. 1F1B-flush interleaves, so a latency also stalls its steady phase: free links.
    bandwidth = 1e9 if schedule == "gpipe" else 1e12
    p = plan_for(g, stages, bandwidth, schedule, m)
    assert [len(s.layers) for s in p.stages][1:] == [1] * (stages - 1)
    sim = simulate_plan(g, p)
    transfer = ACT / bandwidth * 1000
    step = (m + stages - 1) * (FWD + BWD) + 2 * (stages - 1) * transfer + UPD
    # (1F1B-flush still waits out its nanosecond transfers a few more times.)
    assert sim.time_per_minibatch_s * 1000 == pytest.approx(
        step / m, rel=1e-9 if schedule == "gpipe" else 1e-3
    )


@pytest.mark.parametrize("name", ["alexnet", "vgg16", "gnmt"])
@pytest.mark.parametrize(("workers", "bandwidth"), [(2, 1e9), (4, 1e8), (8, 1e10)])
def test_the_few_steps_simulated_give_the_long_runs_time_per_unit(
    monkeypatch: pytest.MonkeyPatch, name: str, workers: int, bandwidth: float
) -> None:
    # The planner simulates FLUSH_STEPS steps of a flushing schedule and TWO_BW_STEPS of 2bw (few,
    # for its start-up): on PipeDream's profiles they give what 32 steps give.
    g = parse_pipedream((PROFILES / f"{name}.txt").read_text(), name)
    plan = make_plan(g, PlanConfig(workers=(workers,), bandwidths=(bandwidth,), straight=True))
    s = len(plan.stages)
    compared = 0
    for schedule, m in itertools.product(("1f1b-flush", "gpipe", "zb-h1", "2bw"), (s, 2 * s + 1, 4 * s + 3)):
        p = plan.model_copy(update={"schedule": schedule, "microbatches": m})
        few = simulate_plan(g, p).time_per_minibatch_s
        monkeypatch.setattr(schedule_sim, "FLUSH_STEPS", 32)
        monkeypatch.setattr(schedule_sim, "TWO_BW_STEPS", 32)
        many = simulate_plan(g, p).time_per_minibatch_s
        monkeypatch.undo()
        # A flush drains every step, so its steps repeat exactly; 2bw's settle after its warm-up.
        assert few == pytest.approx(many, rel=1e-12 if schedule != "2bw" else 1e-2), (schedule, m)
        compared += 1
    assert compared == 12


def test_async_1f1b_on_balanced_stages_reaches_the_bottleneck() -> None:
    g = chain(4, extras=False)
    p = plan_for(g, 4, 1e12)  # transfers cost nothing
    sim = simulate_plan(g, p)
    assert sim.time_per_minibatch_s * 1000 == pytest.approx(FWD + BWD + UPD, rel=1e-9)
    assert p.predicted is not None and p.predicted.time_per_minibatch_s * 1000 == pytest.approx(
        FWD + BWD, rel=1e-9
    )


def test_a_slower_link_can_only_cost_more() -> None:
    g = chain(4, extras=False)
    times = [simulate_plan(g, plan_for(g, 4, b)).time_per_minibatch_s for b in (1e12, 1e9, 1e8, 1e7)]
    assert times == sorted(times) and times[-1] > 2 * times[0]


def test_the_input_stage_fetches_the_batch_and_the_last_computes_the_loss() -> None:
    g = chain(2)
    p = plan_for(g, 2, 1e12)
    costs, _ = stage_costs(g, p)
    assert costs.forward[0] * 1000 == pytest.approx(DATA + FWD)
    assert costs.forward[1] * 1000 == pytest.approx(FWD + LOSS_F)
    assert costs.step[0] * 1000 == pytest.approx(UPD + OVERHEAD)


def test_each_stage_boundary_costs_what_pdprof_measured_of_a_cut() -> None:
    cut_f, cut_b = 0.03, 0.2
    g = chain(3)
    g = g.model_copy(update={"graph": {**g.graph, "cut_forward_ms": cut_f, "cut_backward_ms": cut_b}})
    p = plan_for(g, 3, 1e12)
    assert [len(s.layers) for s in p.stages] == [2, 1, 1]
    costs, _ = stage_costs(g, p)
    # Every stage that sends a later one values runs its backward as a call of its own; every stage
    # that receives them starts its forward from a leaf.
    assert [b * 1000 for b in costs.backward] == pytest.approx([BWD + cut_b, BWD + cut_b, BWD + LOSS_B])
    assert [f * 1000 for f in costs.forward] == pytest.approx([DATA + FWD, FWD + cut_f, FWD + LOSS_F + cut_f])
    whole = simulate_plan(g, plan_for(g, 1, 1e12))
    alone, _ = stage_costs(g, plan_for(g, 1, 1e12))
    assert alone.forward[0] * 1000 == pytest.approx(DATA + 3 * FWD + LOSS_F)  # no boundary, no cost
    # A cut measured as free (noise below zero) costs nothing rather than speeding a stage up.
    free = g.model_copy(update={"graph": {**g.graph, "cut_forward_ms": -0.01, "cut_backward_ms": -0.02}})
    assert simulate_plan(free, plan_for(free, 1, 1e12)).time_per_minibatch_s == whole.time_per_minibatch_s
    costs, _ = stage_costs(free, plan_for(free, 3, 1e12))
    assert costs.backward[0] * 1000 == pytest.approx(BWD)


def test_pdplan_writes_the_simulation_into_the_plan_and_show_recomputes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = chain(4)
    save_graph(g, tmp_path / "g.json")
    out = tmp_path / "p.json"
    r = CliRunner().invoke(
        main,
        [
            "plan",
            str(tmp_path / "g.json"),
            "--workers",
            "2",
            "--bandwidth",
            "1e9",
            "--straight",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    p = load_plan(out)
    assert p.predicted is not None and p.predicted.simulated_time_per_minibatch_s is not None
    assert p.predicted.simulated_time_per_minibatch_s == pytest.approx(
        simulate_plan(g, p).time_per_minibatch_s
    )
    assert "schedule simulated" in r.output
    # A hand edit (all layers on stage 0's side but one) changes what show --graph recomputes.
    edited = p.model_copy(update={"predicted": None})
    assert with_simulation(edited, g).predicted is None
    save_plan(p, tmp_path / "same.json")
    shown = CliRunner().invoke(
        main, ["show", str(tmp_path / "same.json"), "--graph", str(tmp_path / "g.json")]
    )
    assert shown.exit_code == 0, shown.output
    assert f"schedule simulated: {p.predicted.simulated_time_per_minibatch_s * 1000:.3f}" in shown.output
    assert "edited after pdplan predicted it" not in shown.output
    # pdplan stamps what it predicted for; a layer moved by hand since is said, with or without --graph.
    assert p.predicted.layout == p.layout_digest() and not p.edited_since_predicted()
    first, second = p.stages[0], p.stages[1]
    moved = p.model_copy(
        update={
            "stages": [
                first.model_copy(update={"layers": [*first.layers, second.layers[0]]}),
                second.model_copy(update={"layers": second.layers[1:]}),
            ]
        }
    )
    save_plan(moved, tmp_path / "moved.json")
    for extra in ([], ["--graph", str(tmp_path / "g.json")]):
        shown = CliRunner().invoke(main, ["show", str(tmp_path / "moved.json"), *extra])
        assert shown.exit_code == 0, shown.output
        assert "note: the plan was edited after pdplan predicted it" in shown.output, shown.output


def _gpipe_args(graph: Path, out: Path, *extra: str) -> list[str]:
    """pdplan's arguments for a straight 3-worker GPipe plan of ``graph`` with 4 microbatches."""
    fixed = [
        "--workers",
        "3",
        "--bandwidth",
        "1e9",
        "--straight",
        "--schedule",
        "gpipe",
        "--microbatches",
        "4",
    ]
    return ["plan", str(graph), *fixed, *extra, "-o", str(out)]


def test_latency_adds_to_every_transfer_and_the_cli_checks_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = chain(3, extras=False)
    save_graph(g, tmp_path / "g.json")
    out = tmp_path / "p.json"
    args = _gpipe_args(tmp_path / "g.json", out, "--latency", "2e-4", "--blocking-sends", "no")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    p = load_plan(out)
    assert p.cluster is not None and p.cluster.levels[0].latency_s == 2e-4
    transfer = ACT / 1e9 * 1000 + 0.2  # ms: bytes over bandwidth, plus the latency
    step = (4 + 3 - 1) * (FWD + BWD) + 2 * (3 - 1) * transfer + UPD
    assert p.predicted is not None and p.predicted.simulated_time_per_minibatch_s is not None
    assert p.predicted.simulated_time_per_minibatch_s * 1000 == pytest.approx(step / 4, rel=1e-9)
    for bad in ("1e-3,1e-3", "-1", "inf"):
        r = CliRunner().invoke(main, _gpipe_args(tmp_path / "g.json", out, "--latency", bad))
        assert r.exit_code == 2 and "--latency" in r.output, (bad, r.output)


def test_blocking_sends_slow_the_simulation_and_auto_follows_pdrun(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = chain(3, extras=False)
    save_graph(g, tmp_path / "g.json")
    simulated = {}
    for mode in ("no", "yes", "auto"):
        out = tmp_path / f"{mode}.json"
        args = _gpipe_args(tmp_path / "g.json", out, "--blocking-sends", mode)
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        p = load_plan(out)
        assert p.cluster is not None and p.predicted is not None
        assert p.cluster.blocking_sends == (
            mode == "yes" or (mode == "auto" and not send_thread_pays("cpu", 3, 1))
        )
        simulated[mode] = p.predicted.simulated_time_per_minibatch_s
    assert simulated["yes"] > simulated["no"]
    assert simulated["auto"] == simulated["yes" if not send_thread_pays("cpu", 3, 1) else "no"]


def test_a_tie_across_chunks_joins_the_workers_that_hold_them() -> None:
    # 2 workers x 2 chunks: virtual stage v runs on worker v % 2. A tie of chunks 0 and 3 is a sum
    # between workers 0 and 1; one of chunks 0 and 2 is worker 0's own add, no collective.
    tied = replace(Costs.uniform(4), ties=[((0, 3), 0.25), ((0, 2), 0.5)])
    chunked = chunked_costs(tied, 2)
    assert list(chunked.ties) == [((0, 1), 0.25)]


def test_a_replicated_workers_all_reduce_is_its_chunks_in_turn() -> None:
    # 2 workers x 2 chunks, each chunk replicated: pdrun all-reduces chunk after chunk, so a
    # worker's all-reduce costs the sum of its chunks' (virtual stages w and 2 + w).
    costs = replace(Costs.uniform(4), allreduce=[0.5, 0.25, 2.0, 1.0], step=[1.0, 2.0, 3.0, 4.0])
    chunked = chunked_costs(costs, 2)
    assert list(chunked.allreduce) == [2.5, 1.25]
    assert list(chunked.step) == [4.0, 6.0]


def test_pdplan_says_microbatches_are_not_used_by_1f1b(tmp_path) -> None:  # type: ignore[no-untyped-def]
    save_graph(chain(4), tmp_path / "g.json")
    args = ["plan", str(tmp_path / "g.json"), "--workers", "2", "--bandwidth", "1e9", "--schedule", "1f1b"]
    r = CliRunner().invoke(main, [*args, "--microbatches", "4", "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert (
        "pdplan: note: --microbatches 4 is not used: 1f1b takes an optimizer step after every unit"
        in r.stderr
    )
    r = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "q.json")])
    assert r.exit_code == 0 and "is not used" not in r.stderr


def test_pdplan_says_when_one_worker_alone_is_predicted_faster(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The demo's 2-worker plan for a slow link simulated slower than one worker, and only its "speedup over
    # data parallelism" was said.
    save_graph(chain(4), tmp_path / "g.json")
    args = ["plan", str(tmp_path / "g.json"), "--workers", "2", "--straight", "--schedule", "1f1b"]
    slow = CliRunner().invoke(main, [*args, "--bandwidth", "1e5", "-o", str(tmp_path / "slow.json")])
    assert slow.exit_code == 0, slow.output
    [note] = [line for line in slow.stderr.splitlines() if "one worker alone" in line]
    assert note.startswith("pdplan: note: one worker alone is predicted faster: ") and "on 2 workers" in note
    fast = CliRunner().invoke(main, [*args, "--bandwidth", "1e12", "-o", str(tmp_path / "fast.json")])
    assert fast.exit_code == 0 and "one worker alone" not in fast.stderr
