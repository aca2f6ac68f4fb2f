"""An interleaved-1f1b plan's figures are per worker, over its V chunks, in the plan and in ``pdplan show``.

A worker runs V of the plan's stages (its chunks): its predicted time is its chunks' time
and transfers added up, its bottleneck names one of its own chunks, each chunk holds the
units the interleaved program leaves in flight on it, and ``pdplan show --graph`` re-costs
the plan to the same figure.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplan.build import PlanConfig
from pdplan.cli import main
from pdplan.memory import received_per_unit, saved_per_unit, sent_per_unit
from pdplan.more_schedules import plan_for
from shared.graph import Edge, LayerGraph, Node, save_graph
from shared.plan import Plan, load_plan, save_plan
from shared.schedule import Kind, build_program


def _graph(forward_ms: list[float], act: float = 1e6) -> LayerGraph:
    nodes = [Node(id="x", op="input", forward_ms=0, backward_ms=0, activation_bytes=act, parameter_bytes=0)]
    for i, f in enumerate(forward_ms):
        nodes.append(
            Node(
                id=f"l{i}",
                forward_ms=f,
                backward_ms=2 * f,
                activation_bytes=act,
                saved_bytes=act / 2,
                parameter_bytes=4e3,
            )
        )
    ids = [n.id for n in nodes]
    edges = [Edge(source=a, target=b, bytes=act) for a, b in itertools.pairwise(ids)]
    return LayerGraph(batch_size=8, nodes=nodes, edges=edges)


def _plan(graph: LayerGraph, bandwidth: float = 1e12, workers: int = 2, microbatches: int = 4) -> Plan:
    config = PlanConfig(
        workers=(workers,), bandwidths=(bandwidth,), schedule="interleaved-1f1b", microbatches=microbatches
    )
    return plan_for(graph, config, 2)


def _show(tmp_path: Path, plan: Plan, graph: LayerGraph | None = None) -> str:
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    args = ["show", str(path)]
    if graph is not None:
        save_graph(graph, tmp_path / "g.json")
        args += ["--graph", str(tmp_path / "g.json")]
    result = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_bottleneck_is_a_chunk_of_the_busiest_worker(tmp_path: Path) -> None:
    # The last layer is the heaviest: it is a chunk of its own, the last (stage 3, on worker 1).
    p = _plan(_graph([1, 1, 1, 1, 1, 1, 1, 6]))
    assert [s.ranks for s in p.stages] == [[0], [1], [0], [1]]
    assert p.stages[3].layers == ["l7"]
    assert p.predicted is not None and p.predicted.bottleneck_stage == 3  # not worker 1's index 1
    per_worker = [sum(s.predicted.time_s for s in p.stages[w::2] if s.predicted) for w in range(2)]
    assert p.predicted.time_per_minibatch_s == pytest.approx(max(per_worker), rel=1e-12)
    assert "bottleneck worker 1, its chunks stages 1, 3" in _show(tmp_path, p)


def test_a_workers_transfers_add_up_over_its_chunks(tmp_path: Path) -> None:
    # 1 MB crosses every cut at 1e8 B/s: 20 ms a cut each way, far above a chunk's compute.
    graph = _graph([1.0] * 8)
    p = _plan(graph, bandwidth=1e8)
    comm = [sum(s.predicted.communication_s for s in p.stages[w::2] if s.predicted) for w in range(2)]
    time = [sum(s.predicted.time_s for s in p.stages[w::2] if s.predicted) for w in range(2)]
    assert max(comm) > max(time)
    assert p.predicted is not None
    assert p.predicted.time_per_minibatch_s == pytest.approx(max(max(comm), max(time)), rel=1e-12)
    # Re-costed from the graph, the same figure (it took the slowest chunk, as if each were a worker).
    out = _show(tmp_path, p, graph)
    assert f"g.json: {p.predicted.time_per_minibatch_s * 1000:.3f} ms per minibatch" in out


def test_each_chunk_holds_what_the_interleaved_program_leaves_in_flight() -> None:
    graph = _graph([1.0] * 8)
    p = _plan(graph, microbatches=4)
    program = build_program("interleaved-1f1b", [1, 1], 4, microbatches=4, chunks=2)
    for s, stage in enumerate(p.stages):
        w, c = s % 2, s // 2
        live = peak = 0
        for ins in program[(w, 0)]:
            if ins.chunk == c and ins.kind in (Kind.FORWARD, Kind.BACKWARD):
                live += 1 if ins.kind is Kind.FORWARD else -1
                peak = max(peak, live)
        assert stage.predicted is not None and stage.predicted.memory is not None
        assert stage.predicted.memory.units_held == peak, s
        per_unit = (
            saved_per_unit(graph, stage.layers)
            + received_per_unit(graph, stage.layers)
            + sent_per_unit(graph, stage.layers)
        )
        assert stage.predicted.memory.activation_bytes == peak * per_unit
    # The first chunk of worker 0 holds more than its last one (which turns each unit straight round).
    held = [s.predicted.memory.units_held for s in p.stages if s.predicted and s.predicted.memory]
    assert held[0] > held[3]


def test_the_summary_line_and_memory_limit_count_a_workers_chunks_together(tmp_path: Path) -> None:
    graph = _graph([1.0] * 8)
    save_graph(graph, tmp_path / "g.json")
    args = [
        str(tmp_path / "g.json"),
        "--workers",
        "2",
        "--bandwidth",
        "1e12",
        "--schedule",
        "interleaved-1f1b",
    ]
    res = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    p = _plan(graph, microbatches=2)
    per_worker = [sum(s.predicted.memory_bytes for s in p.stages[w::2] if s.predicted) for w in range(2)]
    assert f"M=2 V=2, peak {max(per_worker) / 1e6:.3g} MB/worker" in res.stderr
    # Each chunk alone fits a limit just under the worker's total; the worker does not.
    assert max(s.predicted.memory_bytes for s in p.stages if s.predicted) < max(per_worker) - 1
    # Under a limit one of this split's workers exceeds, another split is chosen whose every worker's
    # chunks, counted together, fit it (pdplan.auto.best_chunking searches the splits).
    limit = max(per_worker) - 1
    res = CliRunner().invoke(main, [*args, "--memory", str(limit), "-o", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = load_plan(tmp_path / "r.json")
    assert [s.layers for s in r.stages] != [s.layers for s in p.stages]
    assert (
        max(sum(s.predicted.memory_bytes for s in r.stages[w::2] if s.predicted) for w in range(2)) <= limit
    )
    # A limit no split fits: one line naming a worker of the interleaved-1f1b plan, exit 2.
    res = CliRunner().invoke(main, [*args, "--memory", "1000"])
    assert res.exit_code == 2 and "of the interleaved-1f1b plan" in res.stderr, res.output
    res = CliRunner().invoke(main, [*args, "--memory", str(max(per_worker)), "-o", str(tmp_path / "q.json")])
    assert res.exit_code == 0, res.output
