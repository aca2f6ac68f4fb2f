"""--schedule auto equals an exhaustive simulation of every partition, schedule and M (small graphs).

The exhaustive search here is written apart from pdplan.auto: every chain of downsets of
the reduced DAG (every convex split into stages), every split of the workers among them on
consecutive ranks, every schedule (1f1b, 1f1b-flush, gpipe, zb-h1, 2bw) and every M of the
search's range that the schedule accepts, and every split into V x N chunks of
interleaved-1f1b (chunk c of worker stage w on its r replicas' ranks, for every r dividing
N that leaves two worker stages or more) whose chunks form a chain (values relayed), and at V = 2
the same splits placed in a V under zb-v (chunk 1 of worker stage w at stages[2S - 1 - w]),
each simulated with no pruning; the best that fits memory (a worker's chunks together
under interleaved-1f1b) must be what the search chose.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdplan.auto import TIE_DIGITS, VIRTUAL_STAGES, asynchronous_note, microbatch_range
from pdplan.build import Partition, PlanConfig, assemble, make_plan, with_memory
from pdplan.more_schedules import interleave, two_bw_least
from pdplan.problem import prepare
from pdplan.schedule_sim import simulate_plan
from shared.errors import PlanError
from shared.graph import Edge, LayerGraph, Node
from shared.plan import check_against_graph, crossing_values
from shared.schedule import ScheduleError, make_pipeline

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _graph(costs, edges):
    nodes = [Node(id="in", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0)]
    for i, (f, b, a, p, u) in enumerate(costs):
        nodes.append(
            Node(
                id=f"n{i}",
                forward_ms=f,
                backward_ms=b,
                update_ms=u,
                activation_bytes=a,
                saved_bytes=a / 2,
                parameter_bytes=p,
            )
        )
    es = [Edge(source="in", target="n0")] + [Edge(source=f"n{u}", target=f"n{v}") for u, v in edges]
    return LayerGraph(batch_size=4, nodes=nodes, edges=es)


def _exhaustive(graph, config):
    problem = prepare(graph.to_networkx())
    n = problem.size
    closed = []
    for bits in range(1, 1 << n):
        members = {v for v in range(n) if bits >> v & 1}
        if 0 in members and all(set(problem.preds[v]) <= members for v in members):
            closed.append(frozenset(members))
    full = frozenset(range(n))
    workers = math.prod(config.workers)

    def chains(prefix):
        if prefix[-1] == full:
            yield prefix
            return
        for d in closed:
            if prefix[-1] < d:
                yield from chains([*prefix, d])

    best = math.inf

    def consider(plan):
        nonlocal best
        per_worker = [0.0] * plan.world_size
        for stage in plan.stages:
            per_worker[stage.ranks[0]] += stage.predicted.memory.total_bytes
        if config.memory is not None and max(per_worker) > config.memory:
            return
        # A stage that feeds no later one (a second model output): no schedule runs it.
        with contextlib.suppress(ScheduleError):
            best = min(best, simulate_plan(graph, plan).time_per_minibatch_s)

    for chain in itertools.chain.from_iterable(chains([d]) for d in closed):
        stages = [sorted(hi - lo) for lo, hi in zip([frozenset(), *chain[:-1]], chain, strict=True)]
        k = len(stages)
        for cut in itertools.combinations(range(1, workers), k - 1):
            bounds = (0, *cut, workers)
            ranks = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
            base = assemble(graph, config, Partition(problem, stages, ranks), "1f1b", 1)
            replicas = [len(r) for r in ranks]
            for schedule, m in [("1f1b", 1)] + [
                (s, m)
                for s in ("1f1b-flush", "gpipe", "zb-h1", "2bw")
                for m in sorted({*microbatch_range(k), *([two_bw_least(replicas)] if s == "2bw" else [])})
            ]:
                if schedule != "1f1b":
                    try:
                        make_pipeline(schedule, replicas, microbatches=m)
                    except ScheduleError:
                        continue  # 2bw below its depth or at M not a multiple of every replica count
                consider(
                    with_memory(base.model_copy(update={"schedule": schedule, "microbatches": m}), graph)
                )
        # interleaved-1f1b: k = V x S chunks on S = N / r worker stages of r replicas, one level of
        # at least 2 workers.
        if workers < 2:
            continue
        owner = {layer: s for s, nodes in enumerate(stages) for v in nodes for layer in problem.layers_of(v)}
        if set(crossing_values(graph, owner, True)) != {(s, s + 1) for s in range(k - 1)}:
            continue  # a chunk feeds none after it: no chain (a value that skips chunks is relayed)
        for r in (1,) if config.straight else range(1, workers // 2 + 1):
            s_ = workers // r
            if workers % r or k % s_ or k // s_ not in VIRTUAL_STAGES:
                continue
            flat = replace(config, workers=(k * r,), straight=r == 1)
            ranks = [list(range(s * r, (s + 1) * r)) for s in range(k)]
            base = assemble(graph, flat, Partition(problem, stages, ranks), "1f1b", 1)
            for m in microbatch_range(workers):
                if m % workers == 0:
                    consider(interleave(graph, base, config.levels(), k // s_, m, config.straight))
                if k // s_ == 2 and m % r == 0:
                    consider(interleave(graph, base, config.levels(), 2, m, config.straight, schedule="zb-v"))
    return best


costs_st = st.tuples(
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(0, 4).map(lambda x: x * 1e6),
    st.integers(0, 4).map(lambda x: x * 2e6),
    st.integers(0, 3),
)


@st.composite
def dags(draw):
    n = draw(st.integers(1, 4))
    edges = set()
    for v in range(1, n):
        parents = draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=min(2, v)))
        edges |= {(u, v) for u in parents}
    return draw(st.lists(costs_st, min_size=n, max_size=n)), sorted(edges)


def _check(costs, edges, workers, bandwidth, memory):
    graph = _graph(costs, edges)
    config = PlanConfig(workers=(workers,), bandwidths=(bandwidth,), memory=memory, schedule="auto")
    expected = _exhaustive(graph, config)
    try:
        plan = make_plan(graph, config)
    except PlanError as exc:
        assert math.isinf(expected) and "no plan fits" in str(exc), exc
        return
    check_against_graph(plan, graph)
    assert plan.predicted is not None and plan.predicted.simulated_time_per_minibatch_s is not None
    assert math.isclose(plan.predicted.simulated_time_per_minibatch_s, expected, rel_tol=1e-9, abs_tol=1e-12)
    # The recorded figure is the plan's own simulation, and the plan fits.
    assert math.isclose(
        simulate_plan(graph, plan).time_per_minibatch_s, expected, rel_tol=1e-9, abs_tol=1e-12
    )
    assert memory is None or all(s.predicted.memory.total_bytes <= memory for s in plan.stages)
    # Its memory figures are its own schedule's (the search works them out late without --memory).
    assert with_memory(plan, graph).stages == plan.stages
    assert plan.alternatives[0].schedule == plan.schedule
    times = [a.simulated_time_per_minibatch_s for a in plan.alternatives]
    assert times == sorted(
        times, key=lambda t: float(f"{t:.{TIE_DIGITS}g}")
    )  # ties ranked by what comes after


@SETTINGS
@given(st.lists(costs_st, min_size=1, max_size=4), st.integers(1, 3), st.sampled_from([1e7, 1e8, 1e9]))
def test_auto_on_chains_equals_exhaustive_simulation(costs, workers, bandwidth):
    _check(costs, [(i, i + 1) for i in range(len(costs) - 1)], workers, bandwidth, None)


@SETTINGS
@given(dags(), st.integers(1, 3), st.sampled_from([1e7, 1e8]), st.sampled_from([None, 2e7, 6e7]))
def test_auto_on_dags_with_memory_equals_exhaustive_simulation(dag, workers, bandwidth, memory):
    costs, edges = dag
    _check(costs, edges, workers, bandwidth, memory)


def test_auto_picks_chunks_where_they_are_the_fastest_that_fit() -> None:
    # 8 equal layers of 8 MB of parameters on 2 workers: a second weight version (2bw, 1f1b's stash)
    # does not fit 70 MB, and of the one-version schedules zb-v's 2 chunks in a V leave no bubble (12 ms
    # a unit, each worker's 24 ms of work a step of 2 back to back, its first chunk's backward all W),
    # then interleaved-1f1b's 4 chunks (12.375 ms), then zb-h1 (12.5 ms).
    costs = [(1, 2, 1e3, 8e6, 0)] * 8
    graph = _graph(costs, [(i, i + 1) for i in range(7)])
    config = PlanConfig(workers=(2,), bandwidths=(1e12,), memory=7e7, schedule="auto")
    plan = make_plan(graph, config)
    assert plan.schedule == "zb-v" and plan.virtual_stages == 2
    assert math.isclose(plan.predicted.simulated_time_per_minibatch_s or 0.0, 0.012, rel_tol=1e-6)
    assert [s.ranks for s in plan.stages] == [[0], [1], [1], [0]]
    assert {(a.schedule, a.virtual_stages) for a in plan.alternatives} >= {("interleaved-1f1b", 4)}
    _check(costs, [(i, i + 1) for i in range(7)], 2, 1e12, 7e7)
    # --virtual-stages 4 tries chunked schedules at V = 4 only, which zb-v (a V of 2) is not.
    plan = make_plan(graph, replace(config, virtual_stages=4))
    assert plan.schedule == "interleaved-1f1b" and plan.virtual_stages == 4


def test_auto_replicates_chunks_where_that_is_the_fastest() -> None:
    # 6 equal layers of 4 MB of parameters on 4 workers behind a 1 GB/s link: 2 worker stages of 2
    # replicas, each holding 2 chunks in a V (zb-v, 19.75 ms a unit) or 3 round-robin (interleaved,
    # 20.251 ms), beat every one-chunk schedule (2bw, zb-h1 on 2 x 2) and 4 x 1 chunks.
    costs = [(4, 8, 1e3, 4e6, 0)] * 6
    edges = [(i, i + 1) for i in range(5)]
    config = PlanConfig(workers=(4,), bandwidths=(1e9,), schedule="auto")
    plan = make_plan(_graph(costs, edges), config)
    assert plan.schedule == "zb-v" and plan.virtual_stages == 2
    assert [s.ranks for s in plan.stages] == [[0, 1], [2, 3], [2, 3], [0, 1]] and plan.world_size == 4
    assert plan.microbatches % 2 == 0
    assert {a.schedule for a in plan.alternatives} == {"zb-v", "interleaved-1f1b"}  # the runners-up
    _check(costs, edges, 4, 1e9, None)
    plan = make_plan(_graph(costs, edges), replace(config, virtual_stages=3))
    assert plan.schedule == "interleaved-1f1b" and plan.virtual_stages == 3
    assert [s.ranks for s in plan.stages] == [[0, 1], [2, 3]] * 3 and plan.world_size == 4
    assert plan.in_flight == 2 and plan.microbatches % 4 == 0


def test_a_tie_in_the_last_bits_goes_to_the_leaner_plan_and_a_stale_weight_choice_is_said() -> None:
    # One stage on 2 workers: gpipe simulated 2.025000000000001 ms and 1f1b-flush 2.0250000000000016 ms,
    # and the last bit chose gpipe, with more memory; 2bw ties too, with a third more. The docs promised
    # ties to the leaner plan.
    config = PlanConfig(workers=(2,), bandwidths=(1e9,), schedule="auto")
    plan = make_plan(_graph([(1, 2, 1e3, 1e6, 0.1)], []), config)
    ranked = [(a.schedule, a.microbatches) for a in plan.alternatives[:4]]
    # zb-h1 counts what each unit keeps from its B for its W: more than gpipe here, so it ranks after it.
    assert ranked == [("1f1b-flush", 4), ("gpipe", 4), ("zb-h1", 4), ("2bw", 4)], ranked
    assert asynchronous_note(plan) is None
    # Two stages where 2bw is 3.5% faster than any synchronous schedule: it wins, and pdplan says what
    # it changes and what the synchronous plan would cost.
    plan = make_plan(_graph([(3, 2, 1e3, 1e5, 0.2)] * 2, [(0, 1)]), config)
    assert plan.schedule == "2bw"
    note = asynchronous_note(plan)
    assert note is not None and note.startswith(
        "2bw was chosen: each step's gradient is applied one step late"
    )
    assert note.endswith(
        "the fastest synchronous runner-up, 1f1b-flush M=4 on 1 stage x 2 replicas (data parallel), simulates "
        "5.200 ms/minibatch (+3.5%); "
        "--synchronous searches the synchronous schedules alone (it may find a faster one)"
    ), note
    # What the note offers plans it: the search without 1f1b and 2bw (a note once offered options that
    # planned another layout, slower than it said).
    synced = make_plan(_graph([(3, 2, 1e3, 1e5, 0.2)] * 2, [(0, 1)]), replace(config, synchronous=True))
    best = next(a for a in plan.alternatives if a.schedule not in ("1f1b", "2bw"))
    assert synced.schedule not in ("1f1b", "2bw") and synced.predicted is not None
    assert synced.predicted.simulated_time_per_minibatch_s <= best.simulated_time_per_minibatch_s * (
        1 + 1e-12
    )
    assert all(a.schedule not in ("1f1b", "2bw") for a in synced.alternatives)
