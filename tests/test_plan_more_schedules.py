"""pdplan plans interleaved-1f1b (V x S chunks), zb-h1, 2bw and zb-v (2 x S chunks in a V), and its simulation
predicts each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplan.build import PlanConfig
from pdplan.cli import main
from pdplan.more_schedules import plan_for
from pdplan.schedule_sim import simulate_plan
from pdrun.launch import check_schedule_runs
from shared.errors import UserError
from shared.graph import LayerGraph, save_graph
from shared.plan import Plan, load_plan, plan_schema
from tests.test_plan_schedule_sim import BWD, FWD, chain


def _graph(layers: int = 8) -> LayerGraph:
    g = chain(layers, extras=False)  # every layer forward 1 ms, backward 2 ms
    return g.model_copy(update={"nodes": [n.model_copy(update={"update_ms": 0.0}) for n in g.nodes]})


def _plan(schedule: str, microbatches: int | None = 8, virtual: int | None = None, workers: int = 4) -> Plan:
    config = PlanConfig(
        workers=(workers,),
        bandwidths=(1e12,),  # transfers cost nothing
        straight=True,
        schedule=schedule,  # type: ignore[arg-type]
        microbatches=microbatches,
    )
    return plan_for(_graph(), config, virtual)


def test_interleaved_plan_holds_round_robin_chunks_of_consecutive_layers() -> None:
    p = _plan("interleaved-1f1b", virtual=2)
    assert p.virtual_stages == 2 and p.world_size == 4 and len(p.stages) == 8
    assert [s.ranks for s in p.stages] == [[0], [1], [2], [3], [0], [1], [2], [3]]
    layers = [layer for s in p.stages for layer in s.layers]
    assert layers == ["x", *(f"l{i}" for i in range(8))]  # consecutive ranges, in order
    assert Plan.model_validate_json(p.model_dump_json()) == p


def test_zb_v_plan_holds_its_chunks_in_a_v_and_steps_over_2s_microbatches() -> None:
    p = _plan("zb-v", None)
    assert p.virtual_stages == 2 and p.world_size == 4 and p.microbatches == 8
    assert [s.ranks for s in p.stages] == [[0], [1], [2], [3], [3], [2], [1], [0]]
    assert [layer for s in p.stages for layer in s.layers] == ["x", *(f"l{i}" for i in range(8))]
    assert Plan.model_validate_json(p.model_dump_json()) == p
    assert p.worker_chunks(0) == [0, 7] and p.chunk_worker(4) == 3
    # Each chunk is one layer (f = 1, b = 2 ms, split into B = W = 1 ms), but the first chunk received
    # nothing that needs a gradient, so its B is empty and its W takes the whole 2 ms, as in pdrun
    # (pdplan.schedule_sim.split_backward). The drawn 4 x 8 grid of tests/test_schedule_zb_v.py then
    # runs without a bubble in its steady state: every worker's 48 ms of work a step of 8, back to back.
    assert simulate_plan(_graph(), p).time_per_minibatch_s * 1000 == pytest.approx(48 / 8, rel=1e-3)
    check_schedule_runs(p)


def test_the_simulation_predicts_each_schedule() -> None:
    # Per step of m = 8 on 4 workers of 2 layers (f = 2, b = 4 ms a stage): 1F1B-flush takes
    # (m + S - 1)(f + b) = 66 ms; interleaved's chunks (f = 1, b = 2) leave (S - 1) chunk slots,
    # 8 x 2 x 3 + 3 x 3 = 57 ms; ZB-H1 with B = W = b / 2: 3 m x 2 + (S - 1)(f + b/2 - b/2) = 54 ms;
    # 2BW has no flush: 6 ms per unit in steady state.
    per_unit = {
        name: simulate_plan(_graph(), p).time_per_minibatch_s * 1000
        for name, p in {
            "1f1b-flush": _plan("1f1b-flush"),
            "interleaved-1f1b": _plan("interleaved-1f1b", virtual=2),
            "zb-h1": _plan("zb-h1"),
            "2bw": _plan("2bw", None),
        }.items()
    }
    stage = 2 * (FWD + BWD)
    assert per_unit["1f1b-flush"] == pytest.approx((8 + 3) * stage / 8, rel=1e-3)
    assert per_unit["interleaved-1f1b"] == pytest.approx((8 * stage + 3 * stage / 2) / 8, rel=1e-3)
    assert per_unit["zb-h1"] == pytest.approx((8 * stage + 3 * 2 * FWD) / 8, rel=1e-3)
    assert per_unit["2bw"] == pytest.approx(stage, rel=1e-3)


def test_2bw_steps_over_the_units_in_flight_by_default() -> None:
    assert _plan("2bw", None).microbatches == 4  # a straight pipeline of 4: m = depth = 4
    with pytest.raises(UserError, match=r"got 2; use 4"):
        _plan("2bw", 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "interleaved-1f1b", "--microbatches", "6"], "not a multiple of the 4 stages"),
        (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"], "at least 2 chunks per worker"),
        (["--schedule", "zb-h1", "--virtual-stages", "2"], "zb-h1 runs one model chunk per worker"),
        # A worker holds its two chunks: their sum must fit.
        (
            ["--schedule", "interleaved-1f1b", "--memory", "1e4"],
            "of the interleaved-1f1b plan (4 workers x 2 chunks",
        ),
        (
            ["--schedule", "zb-v", "--virtual-stages", "3"],
            "zb-v places exactly 2 model chunks on each worker",
        ),
        (["--schedule", "zb-v", "--memory", "1e4"], "of the zb-v plan (4 workers x 2 chunks"),
        # Not make_plan's "--straight gives each of the 200 workers ...": the user gave neither.
        (["--schedule", "interleaved-1f1b", "--virtual-stages", "50"], "= 50 x 4 = 200 chunks"),
    ],
)
def test_bad_options_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    path = tmp_path / "g.json"
    save_graph(_graph(), path)
    result = CliRunner().invoke(main, [str(path), "--workers", "4", "--bandwidth", "1e12", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_writes_an_interleaved_plan_with_its_prediction(tmp_path: Path) -> None:
    path, out = tmp_path / "g.json", tmp_path / "plan.json"
    save_graph(_graph(), path)
    args = [str(path), "--workers", "4", "--bandwidth", "1e12", "--schedule", "interleaved-1f1b"]
    result = CliRunner().invoke(main, [*args, "--virtual-stages", "2", "--microbatches", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    p = load_plan(out)
    assert p.schedule == "interleaved-1f1b" and p.virtual_stages == 2 and p.predicted is not None
    assert p.predicted.simulated_time_per_minibatch_s is not None and p.predicted.simulated_bubble is not None
    assert "virtual_stages" in json.loads(plan_schema())["properties"]


def test_old_plans_load_and_hand_edits_are_checked(tmp_path: Path) -> None:
    data = json.loads(_plan("1f1b-flush").model_dump_json())
    del data["virtual_stages"]  # a plan written before the field
    assert Plan.model_validate(data).virtual_stages == 1
    data = json.loads(_plan("interleaved-1f1b", virtual=2).model_dump_json())
    data["stages"][5]["ranks"] = [2]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"stages\[5\]\.ranks: rank 2 of stage 5") as info:
        load_plan(path)
    assert "\n" not in str(info.value)
    # A zb-v plan edited into round-robin ranks: stages[4] is chunk 1 of worker 3 in the V, not of worker 0.
    data = json.loads(_plan("zb-v", None).model_dump_json())
    for v, stage in enumerate(data["stages"]):
        stage["ranks"] = [v % 4]
    path.write_text(json.dumps(data))
    with pytest.raises(
        UserError, match=r"stages\[4\]\.ranks: rank 0 of stage 4 .* also runs stage 0; a rank runs"
    ) as info:
        load_plan(path)
    assert "(stage 4 is chunk 1 of worker stage 3)" in str(info.value) and "\n" not in str(info.value)


def test_pdrun_runs_each_of_them() -> None:
    for p in (_plan("interleaved-1f1b", 8, 2), _plan("zb-h1"), _plan("2bw", None)):
        check_schedule_runs(p)  # no refusal: pdrun runs them (tests/test_run_interleaved.py, _zb.py, _2bw.py)


def test_a_value_that_skips_chunks_is_relayed_and_costed_on_every_hop(tmp_path: Path) -> None:
    """pdrun relays a value read several chunks later along the chain of chunks (``pdrun.partition``; a
    Hugging Face model's attention mask is read by every block): a graph that every split makes skip
    is planned, each hop between its maker's chunk and its reader's carries its bytes in the
    simulation's costs and in the relaying chunks' memory, and pdplan validate accepts the plan."""
    from pdplan.memory import relayed_bytes
    from pdplan.schedule_sim import stage_costs
    from shared.graph import Edge

    g = _graph()
    mask = 5e6  # l0's output, read by l7 in the last chunk: bytes enough to move the costs
    nodes = [n.model_copy(update={"activation_bytes": mask}) if n.id == "l0" else n for n in g.nodes]
    g = g.model_copy(
        update={"nodes": nodes, "edges": [*g.edges, Edge(source="l0", target="l7", bytes=g.edges[0].bytes)]}
    )
    save_graph(g, tmp_path / "g.json")
    args = [str(tmp_path / "g.json"), "--workers", "2", "--bandwidth", "1e9", "--straight"]
    res = CliRunner().invoke(main, [*args, "--schedule", "interleaved-1f1b", "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    plan = load_plan(tmp_path / "p.json")
    check_schedule_runs(plan)
    owner = plan.stage_of()
    first, last = owner["l0"], owner["l7"]
    assert last - first >= 2  # it skips a chunk at least
    costs, edges = stage_costs(g, plan)
    assert edges == [(s, s + 1) for s in range(len(plan.stages) - 1)]  # a chain: the relays included
    alone = g.model_copy(update={"edges": g.edges[:-1]})
    bare, _ = stage_costs(alone, plan)
    for hop in range(first, last):  # every hop pays the relayed bytes at 1 GB/s, on top of its own
        assert costs.transfer[(hop, hop + 1)] - bare.transfer.get((hop, hop + 1), 0.0) == pytest.approx(
            mask / 1e9, rel=1e-6
        )
    layers = [st.layers for st in plan.stages]
    relayed = relayed_bytes(g, layers)
    relays = [s for s, held in enumerate(relayed) if held > 0]
    assert relays == list(range(first + 1, last)) and relayed[relays[0]] == mask
    res = CliRunner().invoke(
        main, ["validate", str(tmp_path / "p.json"), "--graph", str(tmp_path / "g.json")]
    )
    assert res.exit_code == 0, res.output


# The MNIST CNN as pdprof profiled it on this host (bench_runtime's graph, channels-last, batch 64):
# layer, forward ms, backward ms, output bytes, parameter bytes.
MNIST_CNN = [
    ("conv1", 0.646, 0.506, 3211264.0, 640.0),
    ("relu1", 0.254, 0.303, 3211264.0, 0.0),
    ("pool1", 0.573, 0.524, 802816.0, 0.0),
    ("conv2", 1.327, 2.559, 1605632.0, 18560.0),
    ("relu2", 0.141, 0.136, 1605632.0, 0.0),
    ("pool2", 0.211, 0.964, 401408.0, 0.0),
    ("flatten", 0.112, 0.011, 401408.0, 0.0),
    ("fc1", 0.422, 0.71, 32768.0, 803328.0),
    ("relu3", 0.032, 0.013, 32768.0, 0.0),
    ("fc2", 0.036, 0.08, 2560.0, 5160.0),
]


def test_a_named_chunked_schedule_takes_the_split_that_simulates_fastest_not_the_dps() -> None:
    """The DP for V x S straight workers balances the chunks against each other; a worker runs the sum of
    its chunks and sends every chunk's output. On the MNIST CNN's profile over a 1 GB/s link, the split
    interleaved-1f1b is given simulates at least 5% faster than the DP's chunks, and no split of the
    graph into 4 chunks simulates faster than it (every one tried here)."""
    import itertools
    from dataclasses import replace

    from pdplan.build import Partition, assemble, make_plan
    from pdplan.more_schedules import interleave
    from pdplan.problem import prepare_layers
    from shared.graph import Edge, Node

    nodes = [
        Node(id="x", op="input", forward_ms=0, backward_ms=0, activation_bytes=200704.0, parameter_bytes=0)
    ]
    nodes += [
        Node(id=n, forward_ms=f, backward_ms=b, activation_bytes=a, parameter_bytes=w)
        for n, f, b, a, w in MNIST_CNN
    ]
    edges = [Edge(source=a.id, target=b.id, bytes=a.activation_bytes) for a, b in itertools.pairwise(nodes)]
    g = LayerGraph(batch_size=64, nodes=nodes, edges=edges, graph={"update_overhead_ms": 0.254})
    config = PlanConfig(
        workers=(2,), bandwidths=(1e9,), straight=True, schedule="interleaved-1f1b", microbatches=4
    )
    plan = plan_for(g, config, 2)
    chosen = simulate_plan(g, plan).time_per_minibatch_s
    dp = make_plan(g, replace(config, workers=(4,), microbatches=None, schedule="1f1b"))
    assert [s.layers for s in plan.stages] != [s.layers for s in dp.stages]
    dps = simulate_plan(g, interleave(g, dp, config.levels(), 2, 4, True)).time_per_minibatch_s
    assert chosen < dps * 0.95
    problem = prepare_layers(g)
    every = []
    for cuts in itertools.combinations(range(1, problem.size), 3):
        bounds = (0, *cuts, problem.size)
        stages = [list(range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]
        straight = assemble(
            g, replace(config, workers=(4,)), Partition(problem, stages, [[i] for i in range(4)]), "1f1b", 1
        )
        every.append(
            simulate_plan(g, interleave(g, straight, config.levels(), 2, 4, True)).time_per_minibatch_s
        )
    assert len(every) == 84 and chosen == min(every)
    # The summary line says what was searched: no DP ran.
    from pdplan.report import search_text

    assert plan.predicted is not None and search_text(plan.predicted).startswith("every split simulated in ")
