"""``pdplan [GRAPH|-]``: plan a layer graph for a cluster and write the stage plan."""

from __future__ import annotations

from dataclasses import replace

import click

from pdplan.build import COST_MODELS, PlanConfig, worker_peaks
from pdplan.more_schedules import plan_for
from pdplan.report import search_text, simulated_text, with_simulation
from shared.cli import say
from shared.errors import PDError
from shared.graph import LayerGraph, load_graph
from shared.host import send_thread_pays
from shared.io import display_name, write_output
from shared.malloc import steady_malloc
from shared.outputs import check_output_file
from shared.plan import SCHEDULES, Plan, plan_json


def _numbers(text: str, option: str, kind: type) -> tuple[float, ...]:
    try:
        values = tuple(
            kind(float(part)) if kind is int and "e" in part.lower() else kind(part)
            for part in text.split(",")
        )
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated numbers, innermost level first; got {text!r}", param_hint=option
        ) from None
    return values


@click.command("plan")
@click.argument("graph", default="-")
@click.option(
    "--workers",
    required=True,
    metavar="N[,N2,...]",
    help="Workers per level, innermost first: 4,2 = 2 servers of 4 workers.",
)
@click.option(
    "--bandwidth",
    required=True,
    metavar="B[,B2,...]",
    help="Bytes/s between the units of each level, innermost first (e.g. 1e10,1e9).",
)
@click.option(
    "--memory",
    type=float,
    default=None,
    metavar="BYTES",
    help="Memory per worker: refuse stages whose stashed activations and weights exceed it.",
)
@click.option("--straight", is_flag=True, help="One replica per stage (no data parallelism inside a stage).")
@click.option(
    "--synchronous",
    is_flag=True,
    help="With --schedule auto: try only the schedules that train as one process does (not 1f1b's weight "
    "stashing or 2bw's delayed update).",
)
@click.option(
    "--schedule",
    type=click.Choice(("auto", *SCHEDULES)),
    default="auto",
    show_default=True,
    help="The schedule pdrun runs; recorded in the plan. auto: simulate the DP's partitions under every "
    "schedule and microbatch count and keep the fastest that fits --memory; a named schedule: PipeDream's "
    "optimizer's partition, exactly.",
)
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    default=None,
    metavar="M",
    help="Units per optimizer step (default: 1 for 1f1b, the number of stages for flush schedules, "
    "the units in flight for 2bw; auto tries a range unless given).",
)
@click.option(
    "--virtual-stages",
    type=click.IntRange(min=1),
    default=None,
    metavar="V",
    help="interleaved-1f1b: model chunks per worker (default 2); the plan holds V x workers chunks.",
)
@click.option(
    "--optimizer",
    type=click.Choice(("sgd", "momentum", "adam")),
    default="sgd",
    show_default=True,
    help="The optimizer pdrun will run (pdrun --optimizer; momentum: SGD with --momentum): its state "
    "per parameter (0, 1 or 2 copies) counts in each stage's predicted memory.",
)
@click.option(
    "--cost-model",
    type=click.Choice(COST_MODELS),
    default="pipedream",
    show_default=True,
    help="The cost model the DP minimises: pipedream (the paper's, with the transfers across cuts charged) or "
    "pipedream-compute (the paper's optimizer's default, transfers not charged).",
)
@click.option(
    "--latency",
    default=None,
    metavar="S[,S2,...]",
    help="Seconds per message at each level, innermost first (e.g. from `pdrun link`): the schedule "
    "simulation adds it to every transfer; the DP, as the paper's, does not.",
)
@click.option(
    "--blocking-sends",
    type=click.Choice(["auto", "yes", "no"]),
    default="auto",
    show_default=True,
    help="Whether a send keeps its worker busy for the transfer (the schedule simulation only). auto: "
    "yes for a CPU profile when this host has no core to spare beyond the first level's workers x the "
    "profile's threads, the rule by which pdrun's workers then post their own sends (pdrun --send-thread).",
)
@click.option(
    "--max-states",
    type=click.IntRange(min=2),
    default=500_000,
    show_default=True,
    help="Past this many antichain states, plan on the series-compressed DAG, then on a topological order.",
)
@click.option(
    "-o", "--output", "out", default=None, metavar="FILE", help="Write the plan here (default: stdout)."
)
def plan(
    graph: str,
    workers: str,
    bandwidth: str,
    memory: float | None,
    straight: bool,
    synchronous: bool,
    schedule: str,
    microbatches: int | None,
    virtual_stages: int | None,
    optimizer: str,
    cost_model: str,
    latency: str | None,
    blocking_sends: str,
    max_states: int,
    out: str | None,
) -> None:
    """Partition GRAPH (a pdprof.graph/1 file, or - for stdin) into pipeline stages.

    Prints the plan (pdplan.plan/1 JSON) on stdout, or writes it atomically to -o FILE,
    and a one-line summary on stderr.

    \b
    Examples:
      pdplan graph.json --workers 16 --bandwidth 1e9 -o plan.json
      pdplan graph.json --workers 4,2 --bandwidth 1e10,1e9 --memory 16e9
      pdplan graph.json --workers 4 --bandwidth 1e10 --schedule interleaved-1f1b --virtual-stages 2
      pdprof import-pipedream vgg16.txt | pdplan --workers 16 --bandwidth 1e9 | pdplan show -
    """
    # The chain solver's thousands of multi-megabyte numpy temporaries are mapped afresh and
    # faulted in under glibc's default thresholds (a third of the time on a 2,000-layer chain);
    # fixing them is a choice for the whole process, so it is made here, not in the library.
    steady_malloc()
    if synchronous and schedule != "auto":
        raise click.UsageError(
            f"--synchronous chooses among schedules (--schedule auto); --schedule {schedule} names one"
        )
    check_output_file("-o", out, {"the layer graph": graph})  # before the search: its minutes are not lost
    g = load_graph(graph)
    workers_per_level = tuple(int(w) for w in _numbers(workers, "--workers", int))
    if blocking_sends == "auto":
        # A GPU's or an imported profile's workers have cores for a send thread.
        blocks = g.device == "cpu" and not send_thread_pays("cpu", workers_per_level[0], g.threads or 1)
    else:
        blocks = blocking_sends == "yes"
    config = PlanConfig(
        workers=workers_per_level,
        bandwidths=tuple(float(b) for b in _numbers(bandwidth, "--bandwidth", float)),
        memory=memory,
        straight=straight,
        schedule=schedule,
        synchronous=synchronous,
        microbatches=microbatches,
        optimizer=optimizer,
        cost_model=cost_model,
        max_states=max_states,
        latencies=None if latency is None else tuple(float(s) for s in _numbers(latency, "--latency", float)),
        blocking_sends=blocks,
    )
    p = with_simulation(plan_for(g, config, virtual_stages), g).with_layout()
    write_output(plan_json(p), out)
    pred = p.predicted
    assert pred is not None
    shape = "-".join(str(s.replicas) for s in p.stages)
    speedup = f"{pred.speedup_over_data_parallel:.2f}x" if pred.speedup_over_data_parallel else "n/a"
    say(
        f"pdplan: {display_name(graph)}: {len(p.stages)} stage{'s' if len(p.stages) != 1 else ''} "
        f"(replicas {shape}) on {p.world_size} workers, "
        f"{pred.time_per_minibatch_s * 1000:.3f} ms/minibatch, {speedup} data parallelism; {p.schedule}"
        + (f" M={p.microbatches}" if p.schedule != "1f1b" else "")
        + (f" V={p.virtual_stages}" if p.virtual_stages > 1 else "")
        + (" chosen by simulation (pdplan show lists the runners-up)" if p.alternatives else "")
        + f", peak {max(worker_peaks(p)) / 1e6:.3g} MB/worker; "
        + search_text(pred)
        + simulated_text(pred, "; ")
        + (f" -> {out}" if out else "")
    )
    crowded = profiled_alone(g, workers_per_level[0])
    if crowded:
        say(f"pdplan: note: {display_name(graph)}: {crowded}")
    from pdplan.auto import asynchronous_note  # the search's module, loaded by the plan already

    alone = one_worker_note(g, config, p)
    if alone:
        say(f"pdplan: note: {alone}")

    if schedule == "1f1b" and microbatches not in (None, 1):
        say(
            f"pdplan: note: --microbatches {microbatches} is not used: 1f1b takes an optimizer step after every "
            "unit (--schedule 1f1b-flush or gpipe accumulates several units per step)"
        )
    stale = asynchronous_note(p)
    if stale:
        say(f"pdplan: note: {stale}")
    unused = interleaving_passed(p, virtual_stages)
    if unused:
        say(f"pdplan: note: {unused}")


def one_worker_note(graph: LayerGraph, config: PlanConfig, plan: Plan) -> str | None:
    """A note when one worker alone is predicted faster than ``plan``'s workers (None otherwise): the
    demo's 2-worker plan for a 100 MB/s link simulated 4,885 samples/s where one worker did 6,337, and
    nothing said so beside its "speedup over data parallelism"."""
    ours = plan.predicted.simulated_time_per_minibatch_s if plan.predicted is not None else None
    if plan.world_size < 2 or not ours:
        return None
    single = replace(
        config,
        workers=(1,),
        bandwidths=config.bandwidths[:1],
        latencies=None,
        memory=None,
        schedule="1f1b-flush",
        microbatches=1,
        straight=True,
    )
    try:
        one = with_simulation(plan_for(graph, single, None), graph).predicted
    except PDError:
        return None  # no one-worker plan to compare with: nothing to say
    theirs = one.simulated_time_per_minibatch_s if one is not None else None
    if not theirs or theirs >= ours:
        return None
    return (
        f"one worker alone is predicted faster: {theirs * 1000:.3f} ms/minibatch against this plan's "
        f"{ours * 1000:.3f} on {plan.world_size} workers (its transfers and bubble cost more than the workers add)"
    )


def interleaving_passed(p: Plan, virtual_stages: int | None) -> str | None:
    """Why ``--schedule auto --virtual-stages V`` wrote a plan of one chunk a worker (None when it did not)."""
    if p.cluster is None or p.cluster.schedule_search != "auto" or not virtual_stages or virtual_stages < 2:
        return None
    if p.virtual_stages > 1:
        return None
    tried = [a for a in p.alternatives if a.virtual_stages > 1]
    why = (
        f"the best simulated {min(a.simulated_time_per_minibatch_s for a in tried) * 1000:.3f} ms/minibatch"
        if tried
        else f"no split into {virtual_stages} chunks a worker came near, or a parameter tied across "
        "chunks rules the splits out"
    )
    names = "interleaved-1f1b" + (" and zb-v were" if virtual_stages == 2 else " was")
    return (
        f"--virtual-stages {virtual_stages}: {names} searched and not chosen ({why}); "
        f"the plan runs {p.schedule}; --schedule interleaved-1f1b asks for it"
    )


def profiled_alone(g: LayerGraph, per_host: int) -> str | None:
    """Why a CPU profile taken with fewer neighbours than the plan's workers per host reads optimistic.

    The workers of one host share its last-level cache and memory bandwidth (pdprof.siblings): on
    this project's 2-core machine a 512-wide ResMLP step took 10% longer beside a neighbour, and a
    2-stage ResNet-18's simulated / measured time was 0.87 profiled alone, 0.93 with --concurrent 2.
    None when the profile saw as many busy workers as the plan puts on a host.
    """
    concurrent = g.graph.get("concurrent")
    if g.device != "cpu" or not isinstance(concurrent, int) or concurrent >= per_host:
        return None
    seen = "alone" if concurrent == 1 else f"beside {concurrent - 1} other workers"
    return (
        f"profiled {seen} (pdprof --concurrent {concurrent}), but the plan "
        f"puts {per_host} CPU workers on a host, which slow each other; the predicted times may be optimistic "
        f"(about 10% on a 2-core host): pdprof --concurrent {per_host} profiles as they will run"
    )
