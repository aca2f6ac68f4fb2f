"""The memory model per stage (pdplan.memory) by hand, and --memory binding every stage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdplan.build import PlanConfig, make_plan, with_memory
from pdplan.memory import (
    WARMUP_PEAKED,
    _held,
    _peaks,
    loss_overhead,
    output_unsaved,
    shared_overhead,
    tensor_share,
    worker_overhead,
)
from shared.errors import PlanError
from shared.graph import Edge, LayerGraph, Node, save_graph
from shared.plan import Cluster, Level, Plan, Stage
from shared.schedule import build_program, max_in_flight

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}


def _graph(saved: bool = True) -> LayerGraph:
    """input -> a -> b -> c: parameters 100, 200, 300 bytes; saved 10, 20, 30 (outputs 5, 10, 15)."""
    nodes = [Node(id="x", op="input", forward_ms=0, backward_ms=0, activation_bytes=0, parameter_bytes=0)]
    for i, name in enumerate("abc", start=1):
        nodes.append(
            Node(
                id=name,
                forward_ms=1.0,
                backward_ms=2.0,
                activation_bytes=5.0 * i,
                parameter_bytes=100.0 * i,
                saved_bytes=10.0 * i if saved else 0.0,
            )
        )
    edges = [Edge(source="x", target="a"), Edge(source="a", target="b"), Edge(source="b", target="c")]
    return LayerGraph(batch_size=4, nodes=nodes, edges=edges)


def _plan(
    graph: LayerGraph,
    schedule: str,
    microbatches: int = 1,
    replicas: tuple[int, ...] = (1, 1, 1),
    optimizer: str = "sgd",
    vertical_sync: bool = False,
) -> Plan:
    layers = [["x", "a"], ["b"], ["c"]]
    stages, rank = [], 0
    for ls, r in zip(layers, replicas, strict=True):
        stages.append(Stage(layers=ls, replicas=r, ranks=list(range(rank, rank + r))))
        rank += r
    plan = Plan(
        graph_hash=graph.structure_hash(),
        batch_size=4,
        schedule=schedule,  # type: ignore[arg-type]
        microbatches=microbatches,
        in_flight=-(-rank // replicas[0]),
        vertical_sync=vertical_sync,
        world_size=rank,
        cluster=Cluster(levels=[Level(workers=rank, bandwidth=1e9)], optimizer=optimizer),  # type: ignore[arg-type]
        stages=stages,
    )
    return with_memory(plan, graph)


def _totals(plan: Plan) -> list[float]:
    return [s.predicted.memory.total_bytes for s in plan.stages]  # type: ignore[union-attr]


def test_1f1b_stashes_one_version_per_unit_in_flight() -> None:
    plan = _plan(_graph(), "1f1b")
    memory = [s.predicted.memory for s in plan.stages]  # type: ignore[union-attr]
    # In flight: 3, 2, 1 (PipeDream's warm-up on a straight pipeline of 3); versions the same.
    assert [m.units_held for m in memory] == [3, 2, 1]  # type: ignore[union-attr]
    assert [m.weight_versions for m in memory] == [3, 2, 1]  # type: ignore[union-attr]
    # weights x versions + gradients + (saved + received) x held (plain SGD keeps no state); stage
    # b receives a's 5-byte output, stage c b's 10 bytes. Each link's buffers, at both its ends:
    # its bytes per unit x the units its two ends hold (a -> b: 5 x (3 + 2), b -> c: 10 x (2 + 1)).
    ab, bc = 5 * (3 + 2), 10 * (2 + 1)
    assert [m.message_bytes for m in memory] == [ab, ab + bc, bc]  # type: ignore[union-attr]
    assert _totals(plan) == [
        3 * 100 + 100 + 3 * 10 + ab,
        2 * 200 + 200 + 2 * (20 + 5) + ab + bc,
        300 + 300 + 30 + 10 + bc,
    ]
    assert all(s.predicted.memory_bytes == s.predicted.memory.total_bytes for s in plan.stages)  # type: ignore[union-attr]


def test_optimizer_state_per_optimizer() -> None:
    g = _graph()
    sgd, momentum, adam = (_totals(_plan(g, "1f1b", optimizer=o)) for o in ("sgd", "momentum", "adam"))
    assert [m - s for m, s in zip(momentum, sgd, strict=True)] == [100, 200, 300]
    assert [a - s for a, s in zip(adam, sgd, strict=True)] == [200, 400, 600]


def test_flush_schedules_keep_one_version_and_hold_their_units() -> None:
    g = _graph()
    # 1F1B-flush with M=4 holds min(M, S - s) units; GPipe all M; one weight version each. The
    # links' buffers follow the units held at their ends (test above): 5 and 10 bytes per unit.
    ab, bc = 5 * (3 + 2), 10 * (2 + 1)
    assert _totals(_plan(g, "1f1b-flush", 4)) == [
        100 + 100 + 3 * 10 + ab,
        200 + 200 + 2 * 25 + ab + bc,
        300 + 300 + 40 + bc,
    ]
    ab, bc = 5 * (4 + 4), 10 * (4 + 4)
    assert _totals(_plan(g, "gpipe", 4)) == [
        100 + 100 + 4 * 10 + ab,
        200 + 200 + 4 * 25 + ab + bc,
        300 + 300 + 4 * 40 + bc,
    ]
    ab, bc = 5 * (2 + 2), 10 * (2 + 1)
    assert _totals(_plan(g, "1f1b-flush", 2)) == [200 + 2 * 10 + ab, 400 + 2 * 25 + ab + bc, 600 + 40 + bc]
    # A replicated stage's workers each hold their share of GPipe's units: 2 of 4.
    replicated = _plan(g, "gpipe", 4, replicas=(2, 1, 1))
    assert replicated.stages[0].predicted.memory.units_held == 2  # type: ignore[union-attr]
    assert _totals(replicated)[0] == 200 + 2 * 10 + 5 * (2 + 4)


def test_vertical_sync_keeps_the_input_stages_versions() -> None:
    plan = _plan(_graph(), "1f1b", vertical_sync=True)
    assert [s.predicted.memory.weight_versions for s in plan.stages] == [3, 3, 3]  # type: ignore[union-attr]


def test_without_saved_bytes_the_outputs_count() -> None:
    # An imported PipeDream profile measures no saved bytes: the layer outputs stand in, as in the paper.
    # Each stage: its layers' outputs and the output it receives, per unit held (the sent outputs
    # are among the layers' outputs: not counted again), and its links' buffers.
    ab, bc = 5 * (2 + 2), 10 * (2 + 2)
    assert _totals(_plan(_graph(saved=False), "gpipe", 2)) == [
        200 + 2 * 5 + ab,
        400 + 2 * (10 + 5) + ab + bc,
        600 + 2 * (15 + 10) + bc,
    ]


def test_a_stage_holds_the_values_it_sends_that_it_did_not_save() -> None:
    # pdrun keeps a unit's sent values until its backward starts from them: an output its maker did
    # not save (a convolution's, saved by the ReLU of the next stage) is held as well; a saved one
    # (the ReLU's own) is in the saved bytes already.
    from pdplan.memory import sent_per_unit

    g = _graph()
    nodes = [n.model_copy(update={"saved_bytes": 2.0}) if n.id == "b" else n for n in g.nodes]
    g = g.model_copy(update={"nodes": nodes})
    assert sent_per_unit(g, ["x", "a"]) == 0  # a saved 10 of its 5-byte output
    assert sent_per_unit(g, ["b"]) == 10 - 2
    assert sent_per_unit(g, ["c"]) == 0  # the model's output goes to the loss, not to a stage
    assert sent_per_unit(g, ["a", "b"]) == 10 - 2  # a's output stays inside
    plan = _plan(g, "1f1b")
    memory = plan.stages[1].predicted.memory  # type: ignore[union-attr]
    assert memory.activation_bytes == 2 * (2 + 5 + 8)  # saved + received + sent, two units held


def test_a_worker_pays_the_floor_and_the_rest_by_its_share_of_the_tensors() -> None:
    # The probe left 25 MB to the process: 15 MB of floor, 10 MB to share. Each stage's share of the
    # step's tensors (gradients twice, plus saved): [x, a] 2 x 100 + 10 of 1,260, b 420, c 630.
    probed = _graph().model_copy(update={"graph": {"memory_rise_bytes": 660.0 + 25e6}})
    plan = _plan(probed, "1f1b")
    got = [s.predicted.memory.overhead_bytes for s in plan.stages]  # type: ignore[union-attr]
    want = [15e6 + 10e6 * share for share in (210 / 1260, 420 / 1260, 630 / 1260)]
    assert all(math.isclose(g, w, rel_tol=1e-12) for g, w in zip(got, want, strict=True)), (got, want)
    assert math.isclose(tensor_share(probed, ["x", "a", "b", "c"]), 1.0)
    assert math.isclose(worker_overhead(probed, ["x", "a", "b", "c"]), 25e6)  # one worker: all of it
    # The loss's part stays out of the share and goes to the last stage whole.
    lossy = _graph().model_copy(update={"graph": {"memory_rise_bytes": 660.0 + 25e6, "loss_rise_bytes": 4e6}})
    got = [s.predicted.memory.overhead_bytes for s in _plan(lossy, "1f1b").stages]  # type: ignore[union-attr]
    want = [15e6 + 6e6 * share for share in (210 / 1260, 420 / 1260, 630 / 1260)]
    want[-1] += 4e6
    assert all(math.isclose(g, w, rel_tol=1e-12) for g, w in zip(got, want, strict=True)), (got, want)


def test_a_stage_of_almost_nothing_pays_the_floor_by_its_share() -> None:
    # Under a tenth of the model's step tensors, the floor in proportion (the MNIST CNN's slow-link plan
    # cut off a last stage of 0.4% that rose 0.6-1.0 MB where the whole 9.4 MB floor was charged).
    assert math.isclose(shared_overhead(9.4e6, 0.004), 9.4e6 * 0.04, rel_tol=1e-12)
    assert math.isclose(shared_overhead(9.4e6, 0.1), 9.4e6, rel_tol=1e-12)
    assert math.isclose(
        shared_overhead(9.4e6, 0.5), 9.4e6, rel_tol=1e-12
    )  # the whole overhead, under the floor
    assert math.isclose(shared_overhead(25e6, 0.05), 15e6 * 0.5 + 10e6 * 0.05, rel_tol=1e-12)
    assert math.isclose(shared_overhead(25e6, 1.0), 25e6, rel_tol=1e-12)  # one stage: all of it
    assert math.isclose(shared_overhead(25e6, 0.004, ramp=0.0), 15e6 + 10e6 * 0.004, rel_tol=1e-12)


def test_a_model_whose_overhead_is_under_the_floor_charges_every_worker_all_of_it() -> None:
    # 9 MB left to the process, below the 15 MB floor: each worker pays the whole 9 MB, however small its
    # stage (the 2-block GPT's 7.6 MB and BERT's 2.8 MB measured so, each stage 1.00-1.18 of the prediction).
    probed = _graph().model_copy(update={"graph": {"memory_rise_bytes": 660.0 + 9e6}})
    got = [s.predicted.memory.overhead_bytes for s in _plan(probed, "1f1b").stages]  # type: ignore[union-attr]
    assert all(math.isclose(g, 9e6, rel_tol=1e-12) for g in got), got


def test_the_losss_own_memory_goes_to_the_last_stage_alone() -> None:
    # Of the 9,340 bytes the probe leaves to the process, pdprof measured 4,000 as the loss's own
    # (graph.loss_rise_bytes): the last stage, which computes the loss, pays them beside every worker's
    # 5,340; a loss figure larger than the whole overhead is capped at it.
    probed = _graph().model_copy(
        update={"graph": {"memory_rise_bytes": 10_000.0, "loss_rise_bytes": 4_000.0}}
    )
    plan = _plan(probed, "1f1b")
    assert [s.predicted.memory.overhead_bytes for s in plan.stages] == [5340.0, 5340.0, 9340.0]  # type: ignore[union-attr]
    capped = _graph().model_copy(update={"graph": {"memory_rise_bytes": 10_000.0, "loss_rise_bytes": 1e9}})
    assert [s.predicted.memory.overhead_bytes for s in _plan(capped, "1f1b").stages] == [0.0, 0.0, 9340.0]  # type: ignore[union-attr]
    # One stage: the whole overhead, as before the split.
    one = with_memory(
        _plan(probed, "1f1b").model_copy(
            update={
                "stages": [Stage(layers=["x", "a", "b", "c"], replicas=1, ranks=[0])],
                "world_size": 1,
                "in_flight": 1,
                "cluster": Cluster(levels=[Level(workers=1, bandwidth=1e9)]),
            }
        ),
        probed,
    )
    assert one.stages[0].predicted.memory.overhead_bytes == 9340.0  # type: ignore[union-attr]


def test_the_models_unsaved_outputs_count_with_the_loss() -> None:
    # The loss reads the model's output (c's, 15 bytes), which no layer saved once c saves only 5
    # of it: a language model's logits. It joins the loss's part, the last stage's alone.
    assert output_unsaved(_graph()) == 0.0  # c saved 30, more than its output
    nodes = [n.model_copy(update={"saved_bytes": 5.0}) if n.id == "c" else n for n in _graph().nodes]
    g = _graph().model_copy(
        update={"nodes": nodes, "graph": {"memory_rise_bytes": 1e7, "loss_rise_bytes": 100.0}}
    )
    assert output_unsaved(g) == 10.0
    assert loss_overhead(g) == 110.0


def test_the_measured_process_overhead_goes_once_to_every_worker() -> None:
    # pdprof's probe rose 10,000 bytes over the whole model's first steps; the model's own terms for
    # it (one stage, one unit, plain SGD: gradients 600 + saved 60) leave 9,340 to the process.
    base = _totals(_plan(_graph(), "1f1b"))
    probed = _graph().model_copy(update={"graph": {"memory_rise_bytes": 10_000.0}})
    plan = _plan(probed, "1f1b")
    assert [s.predicted.memory.overhead_bytes for s in plan.stages] == [9340.0] * 3  # type: ignore[union-attr]
    assert _totals(plan) == [b + 9340.0 for b in base]
    # A rise the model's terms explain leaves none; so does a graph without the probe.
    explained = _graph().model_copy(update={"graph": {"memory_rise_bytes": 500.0}})
    assert _totals(_plan(explained, "1f1b")) == base
    # An interleaved worker is one process: its first chunk carries the overhead, the second none.
    chunks = [
        Stage(layers=ls, replicas=1, ranks=[i % 2]) for i, ls in enumerate([["x"], ["a"], ["b"], ["c"]])
    ]
    chunked = with_memory(
        Plan(
            graph_hash=probed.structure_hash(),
            batch_size=4,
            schedule="interleaved-1f1b",
            microbatches=2,
            virtual_stages=2,
            world_size=2,
            cluster=Cluster(levels=[Level(workers=2, bandwidth=1e9)]),
            stages=chunks,
        ),
        probed,
    )
    assert [s.predicted.memory.overhead_bytes for s in chunked.stages] == [9340.0, 9340.0, 0.0, 0.0]  # type: ignore[union-attr]


def test_every_stage_of_a_planned_graph_has_its_memory() -> None:
    plan = make_plan(_graph(), PlanConfig(workers=(3,), bandwidths=(1e9,), straight=True))
    assert len(plan.stages) == 3
    assert all(s.predicted.memory.total_bytes > 0 for s in plan.stages)  # type: ignore[union-attr]
    # 1F1B on 3 workers holds 2 units at stage 1 and 1 at stage 2: their link's buffers 10 x (2 + 1).
    assert plan.stages[-1].predicted.memory_bytes == 300 + 300 + 30 + 10 + 10 * (2 + 1)  # type: ignore[union-attr]


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_memory_binds_a_one_stage_plan(schedule: str) -> None:
    g = _graph()
    whole = 600 + 600 + 60  # one worker: weights, gradients, saved bytes of one unit
    plan = make_plan(g, PlanConfig(workers=(1,), bandwidths=(1e9,), memory=whole, schedule=schedule))
    assert _totals(plan) == [whole]
    with pytest.raises(PlanError, match="no plan fits --memory 1000 bytes") as err:
        make_plan(g, PlanConfig(workers=(1,), bandwidths=(1e9,), memory=1000, schedule=schedule))
    assert "needs 0.00126 MB" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_memory_binds_data_parallel_plans(schedule: str) -> None:
    # Compute-heavy, parameter-free layers on a fast network: the DP replicates the whole model.
    g = _graph()
    free = make_plan(g, PlanConfig(workers=(2,), bandwidths=(1e12,), schedule="1f1b"))
    assert [s.replicas for s in free.stages] == [2]
    need = _totals(free)[0]
    with pytest.raises(PlanError, match="no plan fits --memory"):
        make_plan(g, PlanConfig(workers=(2,), bandwidths=(1e12,), memory=need - 1, schedule="1f1b"))
    if schedule == "auto":
        # The search still finds a layout that fits: a pipeline whose stages each hold less.
        fits = make_plan(g, PlanConfig(workers=(2,), bandwidths=(1e12,), memory=need - 1, schedule="auto"))
        assert len(fits.stages) == 2 and max(_totals(fits)) <= need - 1


def test_memory_nothing_fits_is_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    save_graph(_graph(), path)
    for extra in ([], ["--schedule", "1f1b"], ["--schedule", "gpipe"]):
        done = subprocess.run(
            [
                str(BIN / "pdplan"),
                str(path),
                "--workers",
                "2",
                "--bandwidth",
                "1e9",
                "--memory",
                "100",
                *extra,
            ],
            capture_output=True,
            env=ENV,
            timeout=120,
        )
        err = done.stderr.decode().strip()
        assert done.returncode == 2, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "--memory 100 bytes" in err and "needs" in err and "MB" in err, err
        assert done.stdout == b""


def test_memory_fits_and_is_recorded(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    save_graph(_graph(), path)
    done = subprocess.run(
        [
            str(BIN / "pdplan"),
            str(path),
            "--workers",
            "3",
            "--bandwidth",
            "1e9",
            "--memory",
            "1300",
            "--optimizer",
            "adam",
        ],
        capture_output=True,
        env=ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    plan = json.loads(done.stdout)
    assert plan["cluster"]["optimizer"] == "adam" and plan["cluster"]["schedule_search"] == "auto"
    for stage in plan["stages"]:
        memory = stage["predicted"]["memory"]
        assert memory["total_bytes"] <= 1300
        assert memory["optimizer_bytes"] == 2 * memory["gradient_bytes"]
    assert plan["alternatives"] and plan["alternatives"][0]["schedule"] == plan["schedule"]


def test_saved_bytes_count_each_tensor_once_and_no_parameter() -> None:
    # conv -> relu -> maxpool -> flatten -> linear on a (2, 1, 4, 4) float32 batch. The ReLU saves
    # its 512-byte output and the pool saves the same tensor as its input; the Linear saves the
    # pool's output (through flatten's view) and weight.t(), a view of its parameter. Counted
    # per saving layer that was 128 + 512 + (512 + 256) + (128 + 192) = 1728 bytes, 704 of them
    # twice or parameters; each storage once, charged to the layer that made it, it is 1024.
    import torch
    from torch import fx, nn

    from pdprof.sizes import measure_sizes

    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3)
    )
    sizes, _ = measure_sizes(fx.symbolic_trace(model), [torch.randn(2, 1, 4, 4)])
    saved = {name: size.saved_bytes for name, size in sizes.items()}
    four = 4  # float32
    assert saved == {
        "input_1": 2 * 16 * four,  # the batch, saved by the conv
        "_0": 0,  # the conv's output only feeds the ReLU, which saves its own output
        "_1": 2 * 4 * 16 * four,  # the ReLU's output (saved by the ReLU and by the pool)
        "_2": 2 * 4 * 4 * 8 + 2 * 16 * four,  # the pool's int64 indices and its output (the Linear's input)
        "_3": 0,  # flatten: a view of the pool's output
        "_4": 0,  # the Linear: its input is the pool's, its weight.t() a parameter
    }


def test_a_stage_holds_each_value_it_receives_once() -> None:
    # a feeds b and c (a skip connection). Stage [b, c] receives a's 5-byte output once, though two
    # of its layers read it; stage [c] after [b] receives a's and b's (5 + 10).
    from pdplan.memory import received_per_unit

    g = _graph()
    g = g.model_copy(update={"edges": [*g.edges, Edge(source="a", target="c")]})
    assert received_per_unit(g, ["b", "c"]) == 5
    assert received_per_unit(g, ["c"]) == 5 + 10
    assert received_per_unit(g, ["x", "a"]) == 0
    plan = _plan(g, "gpipe", 2)
    # A link per pair of stages, at both ends, 2 + 2 units held: a -> b (5), b -> c (10), a -> c (5).
    ab, bc, ac = 5 * 4, 10 * 4, 5 * 4
    assert [s.predicted.memory.message_bytes for s in plan.stages] == [ab + ac, ab + bc, bc + ac]  # type: ignore[union-attr]
    assert _totals(plan) == [
        200 + 2 * 10 + ab + ac,
        400 + 2 * (20 + 5) + ab + bc,
        600 + 2 * (30 + 5 + 10) + bc + ac,
    ]


@pytest.mark.parametrize(
    ("schedule", "replicas", "microbatches", "in_flight"),
    [
        ("1f1b", (1, 1), 1, None),
        ("1f1b", (1, 1, 1, 1), 1, None),
        ("1f1b", (2, 1, 3), 1, None),
        ("1f1b", (3, 1), 1, 2),
        ("1f1b", (1, 2, 2, 1), 1, 3),
        ("2bw", (1, 1), 2, None),
        ("2bw", (1, 1, 1, 1), 4, None),
        ("2bw", (2, 1, 3), 6, None),
        ("2bw", (1, 2, 2, 1), 6, None),
    ],
)
def test_a_1f1b_order_peak_read_up_to_the_first_backward_is_the_whole_programs(
    schedule: str, replicas: tuple[int, ...], microbatches: int, in_flight: int | None
) -> None:
    """The memory model reads 1F1B-ordered workers (WARMUP_PEAKED) only up to their first backward: the
    same peaks as every instruction of a long program (whose peaks it reads for the other schedules)."""
    assert schedule in WARMUP_PEAKED
    period = math.lcm(*replicas, microbatches)
    program = build_program(
        schedule, replicas, 8 * period, microbatches=microbatches, in_flight=in_flight, messages=False
    )
    whole = max_in_flight(program)
    expected = tuple(max(whole[(s, r)] for r in range(n)) for s, n in enumerate(replicas))
    assert _held(schedule, replicas, microbatches, in_flight, 1) == expected
    assert max(expected) > 1  # each case holds more than one unit somewhere: a count that means something


def test_zero_bubble_holds_a_unit_until_its_w_and_the_gradients_w_starts_from() -> None:
    # zb-h1 on 2 stages, M=4 (pdrun schedule draws it): s0 F0 F1 . B0 W0 F2 B1 W1 F3 B2 W2 B3 W3,
    # s1 . F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3. The last stage holds two units' graphs at once (B keeps
    # the graph for W), and both past their B; counting to B said one, as for 1f1b-flush, and an ALBERT's
    # last stage measured 37.9 MB against 12.7 predicted.
    assert _peaks("zb-h1", (1, 1), 4, None, 1) == ((2, 1), (2, 2))
    assert _peaks("1f1b-flush", (1, 1), 4, None, 1) == ((2, 0), (1, 0))  # no W: nothing waits for one
