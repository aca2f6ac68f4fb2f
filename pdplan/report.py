"""Re-costing a plan from its graph: the predictions of a (possibly hand-edited) plan."""

from __future__ import annotations

from pdplan.costs import StageCost, data_parallel_time, stage_costs
from pdplan.more_schedules import worker_bounds
from pdplan.problem import prepare_layers
from pdplan.schedule_sim import simulate_plan
from shared.errors import PlanError
from shared.graph import LayerGraph
from shared.plan import Cluster, Plan, Prediction


def recost(plan: Plan, graph: LayerGraph) -> tuple[list[StageCost], float, float]:
    """Per-stage costs, the bottleneck time per minibatch and data parallelism's, from ``graph``.

    Uses the plan's cluster; layers the optimizer sets aside (inputs, dangling tuple
    indexing) cost nothing, as in the DP. For a one-level cluster the bottleneck equals
    what the DP reports for the same stages; for interleaved-1f1b it is the busiest
    worker's, over its chunks, as ``pdplan.more_schedules.interleave`` predicts it.
    """
    cluster = plan.cluster
    if cluster is None:
        raise PlanError("plan: cluster: the plan records no cluster; re-run pdplan to cost it")
    problem = prepare_layers(graph)
    index = {layer: v for v, layer in enumerate(problem.ids)}
    stage_nodes = [[index[layer] for layer in stage.layers if layer in index] for stage in plan.stages]
    for s, nodes in enumerate(stage_nodes):
        if not nodes and s > 0:
            raise PlanError(
                f"plan: stages[{s}]: stage {s} has no layer with a cost; merge it into a neighbour"
            )
    transfers = cluster.cost_model != "pipedream-compute"
    costs = stage_costs(
        problem, stage_nodes, [stage.ranks for stage in plan.stages], cluster.levels, transfers
    )
    if plan.virtual_stages > 1:
        # A worker runs its V chunks: its chunks' terms add up (pdplan.more_schedules.worker_bounds).
        workers = len(plan.stages) // plan.virtual_stages
        bottleneck = max(worker_bounds([(c.time_s, c.communication_s) for c in costs], workers, plan.vshape))
    else:
        bottleneck = max(c.bound_s for c in costs)
    total_c = sum(problem.compute_s)
    total_p = sum(problem.parameter_bytes)
    return costs, bottleneck, data_parallel_time(total_c, total_p, cluster.levels)


def with_simulation(plan: Plan, graph: LayerGraph) -> Plan:
    """``plan`` with its schedule's simulated time per minibatch (``pdplan.schedule_sim``)."""
    if plan.predicted is None or plan.cluster is None:
        return plan
    if plan.alternatives:
        return plan  # the schedule search simulated it already
    sim = simulate_plan(graph, plan)
    # The bubble is 1 - busy / total: clamp the float rounding of a bubble-free schedule (-5e-17).
    bubble = min(1.0, max(0.0, sim.bubble))
    update = {
        "simulated_time_per_minibatch_s": max(0.0, sim.time_per_minibatch_s),
        "simulated_bubble": bubble,
    }
    return plan.model_copy(update={"predicted": plan.predicted.model_copy(update=update)})


def simulated_text(pred: Prediction, lead: str = "") -> str:
    """``; 1f1b simulated: 6.330 ms/minibatch, bubble 25%`` when the plan has it."""
    if pred.simulated_time_per_minibatch_s is None:
        return ""
    bubble = f", bubble {pred.simulated_bubble:.0%}" if pred.simulated_bubble is not None else ""
    return f"{lead}schedule simulated: {pred.simulated_time_per_minibatch_s * 1000:.3f} ms/minibatch{bubble}"


def search_text(pred: Prediction) -> str:
    """What the DP searched: ``920 prefix states of 163,798,401,193 antichain states in 2.00 s``."""
    if pred.search == "exhaustive" and pred.states is None:
        text = "every split simulated"  # pdplan.auto on a small graph: no DP ran
    else:
        text = " ".join(str(part) for part in (pred.states, pred.search, "states") if part is not None)
    total = pred.antichain_states
    if total is not None and total != pred.states:
        text += f" of {total:,} antichain states"
    return text + (f" in {pred.solve_s:.2f} s" if pred.solve_s is not None else "")


def cluster_text(cluster: Cluster | None) -> str:
    if cluster is None:
        return "unknown cluster"
    parts = [f"{lv.workers} x {lv.bandwidth:.3g} B/s" for lv in cluster.levels]
    extra = (", straight" if cluster.straight else "") + (
        f", memory {cluster.memory_bytes:.3g} B" if cluster.memory_bytes else ""
    )
    return " inside ".join(parts) + extra
