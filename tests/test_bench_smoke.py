"""The benchmark harness runs: torch.distributed.pipelining on the plan's split reports numbers, and its
losses are those of sequential training on the same data (so the baseline it measures is the real model)."""

from __future__ import annotations

import math
from typing import Any

import torch

from bench.baselines import (
    Settings,
    UnitOrder,
    batch_at,
    build_model,
    even_split,
    load_tensors,
    make_optimizer,
    run,
)
from shared.resolve import resolve_loss


def _sequential_losses(s: Settings) -> list[float]:
    """The same steps in this process: microbatch losses averaged, the same optimizer and settings."""
    model = build_model(s)
    opt = make_optimizer(list(model.parameters()), s)
    loss_fn = resolve_loss(s.loss)
    x, y = load_tensors(s.data, s.data_args)
    order = UnitOrder(x.shape[0], s.batch_size, s.seed)
    out = []
    for step in range(s.steps):
        xb, yb = batch_at(x, y, order, step, s.microbatches)
        total = 0.0
        for xm, ym in zip(torch.split(xb, s.batch_size), torch.split(yb, s.batch_size), strict=True):
            loss = loss_fn(model(xm), ym) / s.microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        out.append(total)
    return out


def _two_stages(**kw: Any) -> Settings:
    """A short run (16-sample microbatches, two a step, no warm-up) split evenly into two stages."""
    base = Settings(**{"batch_size": 16, "microbatches": 2, "warmup": 0, "lr": 0.05, "timeout_s": 60, **kw})
    return Settings(**{**base.__dict__, "stage_of": even_split(base, 2)})


def test_pipelining_baseline_runs_and_matches_sequential() -> None:
    s = _two_stages(
        model="zoo:resmlp",
        model_args={"width": 32, "depth": 2},
        data="zoo:synthetic",
        data_args={"size": 96},
        steps=3,
    )
    assert set(s.stage_of.values()) == {0, 1}

    result = run("pipe-1f1b", s)

    assert result.world == 2 and result.steps == 3 and result.samples == 3 * 2 * 16
    assert result.seconds > 0 and math.isfinite(result.samples_per_s) and result.samples_per_s > 0
    assert len(result.ranks) == 2 and all(r.compute_s > 0 and r.total_s >= r.compute_s for r in result.ranks)
    assert len(result.step_end_s) == 3
    torch.testing.assert_close(result.losses, _sequential_losses(s), rtol=1e-5, atol=1e-6)


def _cut_at(s: Settings, firsts: list[str], **kw: Any) -> Settings:
    """``s`` split into stages that open at the layers ``firsts`` (in the traced order)."""
    from shared.tracer import trace

    names = [layer.name for layer in trace(build_model(s), s.trace).layers]
    cuts = [names.index(f) for f in firsts]
    stage_of = {n: sum(i >= c for c in cuts) for i, n in enumerate(names)}
    return Settings(**{**s.__dict__, "stage_of": stage_of, **kw})


def test_baselines_train_with_the_optimizer_they_are_given() -> None:
    # bench_accuracy's sweep runs the baselines with Adam beside SGD. One process equals this test's own
    # loop with Adam; DDP (rank 0 reports the loss of its half of the step) starts where SGD does, and
    # the two part after the first update.
    adam = _two_stages(steps=3, optimizer="adam", lr=0.002)
    torch.testing.assert_close(run("single", adam).losses, _sequential_losses(adam), rtol=1e-5, atol=1e-6)
    sgd = Settings(**{**adam.__dict__, "optimizer": "sgd"})
    with_adam, with_sgd = run("ddp", adam).losses, run("ddp", sgd).losses
    assert with_adam[0] == with_sgd[0] and abs(with_adam[-1] - with_sgd[-1]) > 1e-3


def test_pipelining_multi_stage_schedules_run_and_match_sequential() -> None:
    # Interleaved 1F1B and interleaved zero bubble on 4 stages dealt to 2 ranks (rank r holds stages r
    # and r + 2, pdrun's chunk order), ZB-V on the same 4 stages in a V (rank r holds r and 3 - r, as
    # pdrun places zb-v's chunks), and zero bubble with one stage a rank: each trains what one
    # process trains (the flush arithmetic). The cuts follow the residual adds: torch's zero bubble
    # detaches a sent output in place, which fails when the stage's own backward saved it (a ReLU's
    # output, as an even split of resmlp sends), with "a saved tensor that has been detached in-place".
    base = _two_stages(
        model="zoo:resmlp", model_args={"width": 32, "depth": 3}, data="zoo:synthetic", data_args={"size": 96}
    )
    four = _cut_at(base, ["blocks_1_fc1", "blocks_2_fc1", "head"], chunks=2, steps=2)
    expected = _sequential_losses(four)
    for system in ("pipe-interleaved-1f1b", "pipe-zb", "pipe-zbv"):
        result = run(system, four)
        assert result.world == 2 and len(result.ranks) == 2 and result.steps == 2, system
        assert all(r.compute_s > 0 for r in result.ranks), system
        torch.testing.assert_close(result.losses, expected, rtol=1e-5, atol=1e-6)
    two = _cut_at(base, ["blocks_2_fc1"], steps=2)
    result = run("pipe-zb", two)
    assert result.world == 2
    torch.testing.assert_close(result.losses, _sequential_losses(two), rtol=1e-5, atol=1e-6)


def test_pipelining_baseline_in_channels_last_trains_the_same_cnn() -> None:
    # The baseline at pdrun's layout: NHWC weights and inputs, each stage's output handed on contiguous
    # (gloo sends nothing else). Without the hand-off the send fails; with it the losses are sequential
    # training's, up to the layouts' rounding.
    s = _two_stages(
        model="zoo:mnist_cnn",
        model_args={"channels": 4},
        data="zoo:synthetic",
        data_args={"size": 64, "shape": (1, 28, 28)},
        steps=2,
        channels_last=True,
    )
    result = run("pipe-gpipe", s)
    assert result.steps == 2 and result.samples_per_s > 0
    torch.testing.assert_close(result.losses, _sequential_losses(s), rtol=1e-4, atol=1e-5)


def _cut_after(s: Settings, last_of_stage0: str) -> Settings:
    """``s`` split into two stages after the layer ``last_of_stage0`` (in the traced order)."""
    from shared.tracer import trace

    names = [layer.name for layer in trace(build_model(s), s.trace).layers]
    cut = names.index(last_of_stage0) + 1
    return Settings(**{**s.__dict__, "stage_of": {n: int(i >= cut) for i, n in enumerate(names)}})


def test_pipelining_baseline_in_channels_last_runs_a_cut_before_a_convolution() -> None:
    # The planner may cut after pool1, so stage 1 opens with a convolution: in NHWC its input gradient
    # comes out channels-last, which gloo refuses to send ("input tensor has to be contiguous") unless the
    # stage hands it back contiguous too. Both schedules, losses as sequential training's.
    base = _two_stages(
        model="zoo:mnist_cnn",
        model_args={"channels": 4},
        data="zoo:synthetic",
        data_args={"size": 64, "shape": (1, 28, 28)},
        steps=2,
        channels_last=True,
    )
    s = _cut_after(base, "pool1")
    assert s.stage_of["conv2"] == 1 and s.stage_of["pool1"] == 0
    for system in ("pipe-1f1b", "pipe-gpipe"):
        result = run(system, s)
        assert result.steps == 2 and result.samples_per_s > 0
        torch.testing.assert_close(result.losses, _sequential_losses(s), rtol=1e-4, atol=1e-5)


def test_ideal_busy_fraction_is_the_schedules_own_limit() -> None:
    # bench_runtime's ideal: the planner's simulation of the very program pdrun runs. One worker is never
    # idle; two stages under GPipe with one microbatch take turns (about half); more microbatches fill
    # the pipeline; asynchronous 1F1B, flushing never, is above every flush schedule of few microbatches.
    from bench.bench_planner import synthetic_chain
    from bench.bench_runtime import ideal_busy_fraction
    from pdplan.build import PlanConfig, make_plan

    graph = synthetic_chain(8, seed=1)
    one = make_plan(graph, PlanConfig(workers=(1,), bandwidths=(1e12,)))
    assert len(one.stages) == 1
    for schedule in ("1f1b", "1f1b-flush", "gpipe"):
        assert math.isclose(ideal_busy_fraction(graph, one, schedule, 4), 1.0, rel_tol=1e-9)
    two = make_plan(graph, PlanConfig(workers=(2,), bandwidths=(1e12,), straight=True))
    assert len(two.stages) == 2
    gpipe = [ideal_busy_fraction(graph, two, "gpipe", m) for m in (1, 2, 8)]
    assert 0.4 < gpipe[0] <= 0.5 + 1e-9 and gpipe[0] < gpipe[1] < gpipe[2] < 1.0
    async_1f1b = ideal_busy_fraction(graph, two, "1f1b", 4)
    assert gpipe[1] < async_1f1b < 1.0


def test_ideal_busy_fraction_of_a_run_takes_the_runs_own_stage_balance() -> None:
    # With each rank's measured compute, the ideal is that run's limit: shares equal to the profile's
    # give the profile's ideal; a run measured balanced is ideally never idle in 1F1B's steady state;
    # one measured 3:1 is bounded by its slow worker, (3 + 1) / (2 x 3).
    from bench.bench_planner import synthetic_chain
    from bench.bench_runtime import ideal_busy_fraction
    from pdplan.build import PlanConfig, make_plan
    from pdplan.schedule_sim import stage_costs

    graph = synthetic_chain(8, seed=1)
    two = make_plan(graph, PlanConfig(workers=(2,), bandwidths=(1e12,), straight=True))
    costs, _ = stage_costs(graph, two.model_copy(update={"schedule": "1f1b", "microbatches": 1}))
    profiled = [costs.forward[s] + costs.backward[s] + costs.step[s] for s in range(2)]
    ranks = [two.stages[s].ranks[0] for s in range(2)]
    as_profiled = [0.0, 0.0]
    for s, r in enumerate(ranks):
        as_profiled[r] = 7.0 * profiled[s]  # any common scale
    for schedule in ("1f1b", "1f1b-flush", "gpipe"):
        assert math.isclose(
            ideal_busy_fraction(graph, two, schedule, 4, as_profiled),
            ideal_busy_fraction(graph, two, schedule, 4),
            rel_tol=1e-9,
        )
    assert ideal_busy_fraction(graph, two, "1f1b", 4, [5.0, 5.0]) > 0.97
    slow_first = [0.0, 0.0]
    slow_first[ranks[0]], slow_first[ranks[1]] = 3.0, 1.0
    assert math.isclose(ideal_busy_fraction(graph, two, "1f1b", 4, slow_first), 4 / 6, rel_tol=0.03)
    flush = ideal_busy_fraction(graph, two, "1f1b-flush", 4, [5.0, 5.0])
    assert flush < ideal_busy_fraction(graph, two, "1f1b", 4, [5.0, 5.0])  # the flush's bubble stays


def test_time_to_accuracy_keeps_each_systems_best_rate_from_the_sweep() -> None:
    # Fewest epochs to the target first, then the higher final accuracy, then the smaller rate; a run that
    # never reaches the target loses to every run that does.
    from bench.bench_accuracy import Curve, best

    def curve(lr: float, accs: list[float]) -> Curve:
        return Curve("ddp", "fast", "sgd", lr, 256, [(float(i + 1), a) for i, a in enumerate(accs)], "")

    never, late, early, early_better = (
        curve(0.1, [0.2, 0.3, 0.4]),
        curve(0.01, [0.5, 0.8, 0.95]),
        curve(0.05, [0.91, 0.93, 0.94]),
        curve(0.02, [0.92, 0.95, 0.96]),
    )
    assert best([never, late], 0.9) is late
    assert best([late, early], 0.9) is early
    assert best([early, early_better, late], 0.9) is early_better
    assert best([curve(0.05, [0.95]), curve(0.02, [0.95])], 0.9).lr == 0.02
    assert early.epochs_to(0.9) == 1 and never.epochs_to(0.9) is None and late.time_to(0.9) == 3.0


def test_bubble_table_simulates_each_schedule_on_its_own_split() -> None:
    # bench_runtime's simulated column: pdrun's program of each schedule on the split it runs. On a
    # uniform chain of 8 layers, 2 workers, M = 4, both papers' claims hold in the simulation: the
    # interleaved plan (2 chunks a worker), ZB-H1 and ZB-V (2 chunks in a V) idle less than 1F1B-flush
    # on 2 stages, ZB-V least; every ideal busy fraction is at most 1 (a chunked plan counts its 2
    # workers, not its 4 chunks).
    from bench.bench_planner import synthetic_chain
    from bench.bench_runtime import ideal_busy_fraction, simulated
    from pdplan.build import PlanConfig, make_plan
    from pdplan.more_schedules import plan_for
    from shared.graph import LayerGraph

    chain = synthetic_chain(8, seed=3)
    # Uniform costs and tiny activations: the papers' closed forms assume equal stages and free links.
    uniform = {"forward_ms": 1.0, "backward_ms": 2.0, "activation_bytes": 4.0}
    nodes = [n if n.op == "input" else n.model_copy(update=uniform) for n in chain.nodes]
    graph = LayerGraph.model_validate({**chain.model_dump(), "nodes": [n.model_dump() for n in nodes]})
    two = make_plan(graph, PlanConfig(workers=(2,), bandwidths=(1e12,), straight=True, schedule="1f1b-flush"))
    chunked = plan_for(
        graph,
        PlanConfig(
            workers=(2,), bandwidths=(1e12,), straight=True, schedule="interleaved-1f1b", microbatches=4
        ),
        2,
    )
    assert len(two.stages) == 2 and len(chunked.stages) == 4 and chunked.virtual_stages == 2
    vee = plan_for(
        graph,
        PlanConfig(workers=(2,), bandwidths=(1e12,), straight=True, schedule="zb-v", microbatches=4),
        2,
    )
    assert [s.ranks for s in vee.stages] == [[0], [1], [1], [0]]
    flush = simulated(graph, two, "1f1b-flush", 4)
    inter = simulated(graph, chunked, "interleaved-1f1b", 4)
    zb = simulated(graph, two, "zb-h1", 4)
    zbv = simulated(graph, vee, "zb-v", 4)
    assert 0 < inter.bubble < flush.bubble and 0 <= zb.bubble < flush.bubble
    assert 0 <= zbv.bubble < min(zb.bubble, inter.bubble)
    assert inter.time_per_minibatch_s < flush.time_per_minibatch_s
    for plan, schedule in ((two, "1f1b-flush"), (two, "zb-h1"), (chunked, "interleaved-1f1b"), (vee, "zb-v")):
        busy = ideal_busy_fraction(graph, plan, schedule, 4)
        assert 0 < busy <= 1 + 1e-9, (schedule, busy)


def test_the_simulated_idle_fraction_counts_blocking_sends_as_the_measured_one_does() -> None:
    # The measured idle fraction is all but computing, so the sender's copies into shared memory count in
    # it; the simulated one beside it must count them too. On the uniform chain with messages that cost
    # a third of a forward, sent blocking (as pdrun's CPU workers send on a 2-core host): the interleaved
    # plan crosses three cuts a unit where the 2-stage flush plan crosses one, so it spends more of its
    # time sending, and its idle fraction (bubble plus sending) stands above its bubble alone.
    from dataclasses import replace

    from bench.bench_planner import synthetic_chain
    from bench.bench_runtime import simulated
    from pdplan.build import PlanConfig, make_plan
    from pdplan.more_schedules import plan_for
    from shared.graph import LayerGraph

    chain = synthetic_chain(8, seed=3)
    # 1 MB a message at 3e9 B/s: a third of a millisecond, against 1 ms forwards.
    uniform = {"forward_ms": 1.0, "backward_ms": 2.0, "activation_bytes": 1e6}
    nodes = [n if n.op == "input" else n.model_copy(update=uniform) for n in chain.nodes]
    graph = LayerGraph.model_validate({**chain.model_dump(), "nodes": [n.model_dump() for n in nodes]})
    config = PlanConfig(workers=(2,), bandwidths=(3e9,), straight=True, blocking_sends=True, microbatches=4)
    two = make_plan(graph, replace(config, schedule="1f1b-flush"))
    chunked = plan_for(graph, replace(config, schedule="interleaved-1f1b"), 2)
    flush = simulated(graph, two, "1f1b-flush", 4)
    inter = simulated(graph, chunked, "interleaved-1f1b", 4)
    assert 0 < flush.sending < inter.sending
    assert flush.bubble + flush.sending < 1 and inter.bubble + inter.sending < 1
    free = simulated(
        graph,
        chunked.model_copy(update={"cluster": chunked.cluster.model_copy(update={"blocking_sends": False})}),
        "interleaved-1f1b",
        4,
    )
    assert free.sending == 0.0


def test_each_case_compares_the_pairs_it_runs() -> None:
    # A case's pairs are PAIRS filtered by what it runs: the GPT case (no layout variants) gets the
    # NCHW pairs, the second wave's included, and none of the channels-last ones.
    from bench.bench_runtime import CNN, GPT, PAIRS

    assert all(p in PAIRS for p in GPT.pairs)
    assert {("interleaved-1f1b", "pipe-interleaved-1f1b"), ("zb-v", "pipe-zbv")} <= {
        (a, b) for a, b, _ in GPT.pairs
    }
    assert not any("channels-last" in theirs for _, theirs, _ in GPT.pairs)
    cnn = {(ours, theirs) for ours, theirs, _ in CNN.pairs}
    assert ("zb-h1", "pipe-zb channels-last") in cnn and ("zb-h1", "pipe-zb") not in cnn
    assert ("zb-v", "pipe-zbv channels-last") in cnn and ("zb-v", "pipe-zbv") not in cnn
