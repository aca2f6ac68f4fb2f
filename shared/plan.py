"""The stage plan artifact (``pdplan.plan/1``): stages, replicas, ranks, schedule, predictions.

Written by pdplan, read by pdrun, and meant to be edited by hand: loading validates the
plan on its own (ranks, replicas, duplicate layers), and ``check_against_graph`` checks
it against the layer graph it claims to be for (every layer exactly once, convex stages,
the graph hash).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from shared.artifact import Strict, Writer, checked_shape, dump_json, load_json_artifact, save_json_artifact
from shared.errors import PlanError
from shared.graph import LayerGraph
from shared.schedule import VSHAPED, chunk_owner, chunk_virtual
from shared.spec import RunSpec, artifact_folder
from shared.version import FORMAT_PLAN

if TYPE_CHECKING:
    import networkx as nx

Schedule = Literal["1f1b", "1f1b-flush", "gpipe", "interleaved-1f1b", "zb-h1", "2bw", "zb-v"]
SCHEDULES: tuple[str, ...] = ("1f1b", "1f1b-flush", "gpipe", "interleaved-1f1b", "zb-h1", "2bw", "zb-v")


class Level(Strict):
    """One level of the cluster hierarchy, innermost first: workers per unit and their bandwidth."""

    workers: int = Field(ge=1)
    bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s between units of this level")
    latency_s: float = Field(
        default=0, ge=0, allow_inf_nan=False, description="seconds per message (the schedule simulation only)"
    )


class Cluster(Strict):
    """The cluster a plan was made for."""

    levels: list[Level] = Field(min_length=1)
    memory_bytes: float | None = Field(default=None, gt=0, description="memory per worker")
    straight: bool = Field(default=False, description="one replica per stage")
    cost_model: str = "pipedream"
    blocking_sends: bool = Field(
        default=False,
        description="a send keeps its worker busy for the transfer (the schedule simulation only)",
    )
    # The memory model and the schedule search (pdplan.memory, pdplan.auto).
    optimizer: Literal["sgd", "momentum", "adam"] = Field(
        default="sgd", description="the optimizer whose state the memory model counts (pdrun --optimizer)"
    )
    schedule_search: Literal["given", "auto"] = Field(
        default="given", description="auto: the schedule and microbatches were chosen by simulation"
    )

    @property
    def workers(self) -> int:
        total = 1
        for level in self.levels:
            total *= level.workers
        return total


class StageMemory(Strict):
    """The memory model's parts for one worker of a stage, at its peak (``pdplan.memory``)."""

    weight_bytes: float = Field(ge=0, description="the live weights and every stashed version")
    weight_versions: int = Field(ge=1)
    gradient_bytes: float = Field(ge=0)
    optimizer_bytes: float = Field(ge=0, description="optimizer state (momentum, Adam's moments)")
    activation_bytes: float = Field(ge=0, description="saved for backward, times the units held")
    units_held: int = Field(ge=0, description="most units forwarded and not yet backwarded at once")
    message_bytes: float = Field(
        default=0, ge=0, description="the transport's buffers for the stage's messages in flight, both ways"
    )
    overhead_bytes: float = Field(
        default=0,
        ge=0,
        description="what the worker's process holds beyond the model's tensors (pdprof's memory probe)",
    )
    weight_grad_bytes: float = Field(
        default=0,
        ge=0,
        description="zero bubble: the gradients a unit keeps from its B for its W, times the units waiting for W",
    )
    total_bytes: float = Field(ge=0)


class StagePrediction(Strict):
    """What the planner expects of one stage, per minibatch."""

    compute_s: float = Field(ge=0, description="forward+backward of all its layers, one replica")
    allreduce_s: float = Field(default=0, ge=0, description="gradient all-reduce among its replicas")
    communication_s: float = Field(default=0, ge=0, description="activations in and gradients out")
    time_s: float = Field(ge=0, description="its effective time per minibatch, replicas counted")
    parameter_bytes: float = Field(default=0, ge=0)
    activation_bytes: float = Field(default=0, ge=0)
    memory_bytes: float = Field(
        default=0,
        ge=0,
        description="peak bytes per worker: memory.total_bytes (the paper's figure in old plans)",
    )
    paper_memory_bytes: float | None = Field(
        default=None, ge=0, description="PipeDream's constraint's figure, ceil(W_after / r) x (a + p)"
    )
    memory: StageMemory | None = None


class Stage(Strict):
    """One pipeline stage: its layers, how many replicas run it and on which ranks."""

    layers: list[str] = Field(min_length=1)
    replicas: int = Field(default=1, ge=1)
    ranks: list[int] = Field(min_length=1)
    predicted: StagePrediction | None = None


class Prediction(Strict):
    """The planner's figures for the whole plan beside plain data parallelism."""

    time_per_minibatch_s: float = Field(ge=0, description="the bottleneck stage's time per minibatch")
    throughput_samples_per_s: float | None = Field(default=None, ge=0)
    communication_bytes_per_sample: float | None = Field(default=None, ge=0)
    bottleneck_stage: int | None = Field(default=None, ge=0)
    data_parallel_time_per_minibatch_s: float = Field(ge=0)
    data_parallel_throughput_samples_per_s: float | None = Field(default=None, ge=0)
    data_parallel_communication_bytes_per_sample: float | None = Field(default=None, ge=0)
    speedup_over_data_parallel: float | None = Field(default=None, ge=0)
    states: int | None = Field(default=None, ge=0, description="DP states explored")
    search: str | None = Field(
        default=None,
        description="states searched: antichain (all), compressed, narrow, prefix or coarse-prefix",
    )
    solve_s: float | None = Field(default=None, ge=0, description="planner wall time")
    antichain_states: int | None = Field(
        default=None,
        ge=0,
        description="states of PipeDream's antichain DAG of the graph, counted exactly (the search may cover "
        "fewer: see search); null when not counted",
    )
    simulated_time_per_minibatch_s: float | None = Field(
        default=None,
        ge=0,
        description="the plan's schedule simulated with the profiled costs, optimizer steps, loss and transfers: "
        "the steady-state time per minibatch pdrun should measure",
    )
    simulated_bubble: float | None = Field(
        default=None, ge=0, le=1, description="idle share of the workers, simulated"
    )
    layout: str | None = Field(
        default=None,
        description="the digest of what pdplan predicted for (Plan.layout_digest: stages, replicas, ranks, "
        "schedule, microbatches, in-flight, vertical sync, chunks, batch size, cluster); a plan edited by hand "
        "since no longer matches it, and pdrun and pdplan show then set its predictions aside",
    )


class Alternative(Strict):
    """One candidate the schedule search simulated (``pdplan --schedule auto``)."""

    schedule: Schedule
    microbatches: int = Field(ge=1)
    virtual_stages: int = Field(default=1, ge=1, description="model chunks per worker (interleaved-1f1b)")
    replicas: list[int] = Field(min_length=1, description="replicas of each stage")
    stage_layers: list[int] = Field(min_length=1, description="how many layers each stage holds")
    simulated_time_per_minibatch_s: float = Field(ge=0)
    simulated_bubble: float = Field(ge=0, le=1)
    memory_bytes: float = Field(ge=0, description="the largest stage's peak bytes per worker")
    fits: bool = Field(default=True, description="within --memory")


class Plan(Strict):
    """The ``pdplan.plan/1`` artifact."""

    format: Literal["pdplan.plan/1"] = "pdplan.plan/1"
    writer: Writer = Field(default_factory=Writer)
    graph_hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    graph_source: str = Field(default="pdprof")
    spec: RunSpec = Field(default_factory=RunSpec)
    batch_size: int = Field(ge=1, description="samples per unit (minibatch / microbatch)")
    input_shape: Any = Field(default=None, description="shape of one input batch as profiled, nested lists")
    schedule: Schedule = "1f1b"
    microbatches: int = Field(default=1, ge=1, description="units per optimizer step (flush schedules)")
    in_flight: int = Field(default=1, ge=1, description="units admitted before the first backward (NOAM)")
    vertical_sync: bool = False
    virtual_stages: int = Field(
        default=1,
        ge=1,
        description="model chunks per worker (interleaved-1f1b, zb-v): the stages are then the V x S chunks in "
        "pipeline order, chunk c of worker stage w being stages[c * S + w] (zb-v's V: stages[c * S + S - 1 - w] "
        "for odd c), on that stage's ranks",
    )
    world_size: int = Field(ge=1)
    cluster: Cluster | None = None
    stages: list[Stage] = Field(min_length=1)
    predicted: Prediction | None = None
    alternatives: list[Alternative] = Field(
        default_factory=list, description="the schedule search's best candidates, fastest first (auto)"
    )

    _input_shape = field_validator("input_shape")(checked_shape)

    @model_validator(mode="after")
    def _check_consistency(self) -> Plan:
        owner: dict[str, int] = {}
        rank_owner: dict[int, int] = {}
        for s, stage in enumerate(self.stages):
            if len(stage.ranks) != stage.replicas:
                raise ValueError(
                    f"stages[{s}].ranks: stage {s} ({layer_span(stage.layers)}) has replicas={stage.replicas} "
                    f"but {len(stage.ranks)} ranks {_short_list(stage.ranks)}; give one rank per replica"
                )
            for layer in stage.layers:
                if layer in owner:
                    where = "twice in stage" if owner[layer] == s else f"in stage {owner[layer]} and stage"
                    raise ValueError(f"stages[{s}].layers: layer {layer!r} is {where} {s}")
                owner[layer] = s
            for rank in stage.ranks:
                if not 0 <= rank < self.world_size:
                    raise ValueError(
                        f"stages[{s}].ranks: rank {rank} of stage {s} ({layer_span(stage.layers)}) is outside "
                        f"0..{self.world_size - 1} (world_size={self.world_size})"
                    )
                if rank in rank_owner and not self._chunks_of_one_worker(rank_owner[rank], s):
                    raise ValueError(
                        f"stages[{s}].ranks: rank {rank} of stage {s} ({layer_span(stage.layers)}) "
                        f"also runs stage {rank_owner[rank]}; {self._one_rank_text(s)}"
                    )
                rank_owner[rank] = s
        _check_batch_size(self.batch_size, self.input_shape)
        if len(rank_owner) != self.world_size:
            # Lazily: world_size comes from the file and may be huge; the first few gaps are enough.
            missing = list(itertools.islice((r for r in range(self.world_size) if r not in rank_owner), 3))
            more = " ..." if self.world_size - len(rank_owner) > len(missing) else ""
            raise ValueError(
                f"world_size: {self.world_size} ranks, but the stages run {len(rank_owner)}; "
                f"no stage runs rank(s) {missing}{more}"
            )
        return self

    @model_validator(mode="after")
    def _check_chunks(self) -> Plan:
        v, n = self.virtual_stages, len(self.stages)
        if v == 1:
            return self
        if n % v:
            raise ValueError(
                f"virtual_stages: {n} stages are not {v} chunks of each worker stage; "
                f"give a multiple of {v} stages (chunk c of worker w is stages[{self._where_text()}])"
            )
        per = n // v
        for s, stage in enumerate(self.stages):
            w, c = chunk_owner(per, s, self.vshape)
            if stage.ranks != self.stages[w].ranks:
                raise ValueError(
                    f"stages[{s}].ranks: chunk {c} of worker stage {w} runs on "
                    f"{_short_list(stage.ranks)}, not on that worker's ranks {_short_list(self.stages[w].ranks)}"
                )
        return self

    def _one_rank_text(self, s: int) -> str:
        """What a rank may run, said where a stage's rank runs another stage too."""
        if self.virtual_stages <= 1 or len(self.stages) % self.virtual_stages:
            return "a rank runs one stage"
        w, c = chunk_owner(len(self.stages) // self.virtual_stages, s, self.vshape)
        return (
            f"a rank runs the chunks of one worker stage, chunk c of worker w at stages[{self._where_text()}] "
            f"(stage {s} is chunk {c} of worker stage {w})"
        )

    def _where_text(self) -> str:
        return "c * S + (S - 1 - w if c is odd else w)" if self.vshape else "c * S + w"

    def layout_digest(self) -> str:
        """A digest of everything the predictions depend on besides the graph (``Prediction.layout``)."""
        what = {
            "stages": [[stage.layers, stage.replicas, stage.ranks] for stage in self.stages],
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "in_flight": self.in_flight,
            "vertical_sync": self.vertical_sync,
            "virtual_stages": self.virtual_stages,
            "batch_size": self.batch_size,
            "cluster": None if self.cluster is None else self.cluster.model_dump(mode="json"),
        }
        return "sha256:" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def with_layout(self) -> Plan:
        """This plan with its predictions stamped as made for its present layout (pdplan, when it writes)."""
        if self.predicted is None:
            return self
        return self.model_copy(
            update={"predicted": self.predicted.model_copy(update={"layout": self.layout_digest()})}
        )

    def edited_since_predicted(self) -> bool:
        """Whether the plan was changed after pdplan predicted it (its stamp no longer matches)."""
        stamp = self.predicted.layout if self.predicted is not None else None
        return stamp is not None and stamp != self.layout_digest()

    @property
    def vshape(self) -> bool:
        """Whether the chunks sit in a V (zb-v) rather than round-robin (``shared.schedule.chunk_virtual``)."""
        return self.schedule in VSHAPED

    def chunk_worker(self, s: int) -> int:
        """The worker stage that runs ``stages[s]`` (a chunk of it, when the plan has several per worker)."""
        return chunk_owner(len(self.stages) // self.virtual_stages, s, self.vshape)[0]

    def worker_chunks(self, w: int) -> list[int]:
        """The indices into ``stages`` of worker stage ``w``'s chunks, chunk 0 first."""
        per = len(self.stages) // self.virtual_stages
        return [chunk_virtual(per, w, c, self.vshape) for c in range(self.virtual_stages)]

    def _chunks_of_one_worker(self, a: int, b: int) -> bool:
        """Whether stages a and b are chunks of one worker (interleaved plans): a rank runs both."""
        if self.virtual_stages <= 1 or len(self.stages) % self.virtual_stages:
            return False
        return self.chunk_worker(a) == self.chunk_worker(b)

    def cluster_mismatch(self) -> str | None:
        """``cluster.levels: 2 x 2 = 4 workers but world_size is 8`` when the recorded cluster has another
        number of workers than the plan has ranks (a plan edited by hand); None when they agree or no
        cluster is recorded. ``pdplan validate`` refuses such a plan, pdrun runs it with a note."""
        if self.cluster is None or self.cluster.workers == self.world_size:
            return None
        levels = " x ".join(str(level.workers) for level in self.cluster.levels)
        return (
            f"cluster.levels: {levels} = {self.cluster.workers} workers but world_size is {self.world_size}"
        )

    def stage_of(self) -> dict[str, int]:
        """Layer name -> stage index."""
        return {layer: s for s, stage in enumerate(self.stages) for layer in stage.layers}

    def rank_stage(self, rank: int) -> tuple[int, int]:
        """(stage index, replica index) of ``rank``."""
        for s, stage in enumerate(self.stages):
            if rank in stage.ranks:
                return s, stage.ranks.index(rank)
        raise KeyError(rank)


def batch_of_shape(shape: Any) -> int | None:
    """The batch an ``input_shape`` was recorded at: dim 0 of every input tensor (the collated batch).

    None when the shape tells nothing (absent, scalars) or its tensors disagree.
    """
    firsts: set[int] = set()

    def visit(node: Any) -> None:
        if isinstance(node, list) and node and all(type(d) is int for d in node):
            if node[0] >= 1:
                firsts.add(node[0])
        elif isinstance(node, list):
            for child in node:
                visit(child)
        elif isinstance(node, dict):
            for child in node.values():
                visit(child)

    visit(shape)
    return firsts.pop() if len(firsts) == 1 else None


def _check_batch_size(batch_size: int, input_shape: Any) -> None:
    """Every figure of the plan is per unit of the profiled batch: a batch_size edited by hand is refused."""
    profiled = batch_of_shape(input_shape)
    if profiled is not None and profiled != batch_size:
        raise ValueError(
            f"batch_size: {batch_size}, but the graph was profiled at {profiled} samples per unit "
            f"(input_shape {input_shape}) and every prediction of the plan is for {profiled}; set batch_size "
            f"back to {profiled}, or profile at {batch_size} (pdprof --batch-size {batch_size}) and plan again"
        )


def layer_span(layers: list[str]) -> str:
    """How messages name a stage's layers: ``layer 'fc'`` or ``layers 'conv1' .. 'fc' (7)``."""
    if len(layers) == 1:
        return f"layer {layers[0]!r}"
    return f"layers {layers[0]!r} .. {layers[-1]!r} ({len(layers)})"


def _short_list(items: list[int]) -> str:
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"


def check_against_graph(
    plan: Plan, graph: LayerGraph, source: str = "plan", world_size: int | None = None
) -> None:
    """Refuse a plan that does not fit ``graph`` (and, when given, a launcher of ``world_size`` ranks).

    Checks, in order: the graph hash (a plan for another model), every plan layer is in the
    graph, every graph layer is in a stage, stages follow the data flow (which makes each
    stage convex: a path that leaves a stage only reaches later stages, so never comes
    back), and the ranks the plan needs. Each message names the stage and the layer.
    """
    owner = plan.stage_of()
    ids = [n.id for n in graph.nodes]
    id_set = set(ids)
    foreign = next(
        ((s, layer) for s, st in enumerate(plan.stages) for layer in st.layers if layer not in id_set), None
    )
    missing = [i for i in ids if i not in owner]
    expected = graph.structure_hash()
    if plan.graph_hash != expected:
        if foreign is not None:
            why = f"stages[{foreign[0]}] holds layer {foreign[1]!r}, which this graph does not have"
        elif missing:
            why = f"layer {missing[0]!r} of this graph is in no stage"
        else:
            why = "the layers match but the edges between them differ"
        raise PlanError(
            f"{source}: graph_hash: the plan was made for another graph ({plan.graph_hash[:19]}...), "
            f"this one is {expected[:19]}... ({why}); re-run pdplan on this graph"
        )
    if foreign is not None:
        s, layer = foreign
        raise PlanError(f"{source}: stages[{s}].layers: layer {layer!r} (stage {s}) is not in the graph")
    if missing:
        g = graph.to_networkx()
        first = missing[0]
        near = sorted(
            {owner[p] for p in g.predecessors(first) if p in owner}
            | {owner[n] for n in g.successors(first) if n in owner}
        )
        hint = f" (its neighbours are in stage(s) {near})" if near else ""
        more = f"; {len(missing) - 1} more layer(s) are missing too" if len(missing) > 1 else ""
        raise PlanError(
            f"{source}: stages: layer {first!r} is in no stage{hint}; every layer needs one{more}"
        )
    for edge in graph.edges:
        a, b = owner[edge.source], owner[edge.target]
        if a > b:
            raise PlanError(
                f"{source}: stages[{b}]: not convex: layer {edge.target!r} (stage {b}) feeds from "
                f"{edge.source!r} in the later stage {a}; stages must follow the data flow"
            )
    if plan.batch_size != graph.batch_size:
        raise PlanError(
            f"{source}: batch_size: {plan.batch_size}, but the graph was profiled at {graph.batch_size} "
            f"samples per unit and every prediction of the plan is for {graph.batch_size}; set it back, or "
            f"profile at {plan.batch_size} and plan again"
        )
    if world_size is not None and world_size != plan.world_size:
        last = len(plan.stages) - 1
        raise PlanError(
            f"{source}: world_size: the plan needs {plan.world_size} ranks (stages[{last}] ends with rank "
            f"{max(plan.stages[last].ranks)}, layer {plan.stages[last].layers[-1]!r}), "
            f"but the launcher provides {world_size}"
        )


def chunk_route(chunked: bool, a: int, b: int) -> list[tuple[int, int]]:
    """The stage edges a value made at stage ``a`` and read at stage ``b`` crosses: ``(a, b)`` itself, or
    in a chunked plan (``virtual_stages`` > 1: interleaved-1f1b and zb-v run a chain of chunks) every hop
    from ``a`` to ``b``, the chunks in between relaying it (``pdrun.partition``)."""
    return [(s, s + 1) for s in range(a, b)] if chunked else [(a, b)]


def crossing_values(
    graph: LayerGraph, owner: Mapping[str, int], chunked: bool
) -> dict[tuple[int, int], set[str]]:
    """Per stage edge, the layers whose outputs cross it every unit, as pdrun sends them: each value
    once per edge, straight to each later stage that reads it, or in a chunked plan along
    :func:`chunk_route`. A model input read by a later stage comes from that stage's own batch, not
    over the wire. ``owner`` maps layers to stages (layers it lacks are left out)."""
    inputs = {n.id for n in graph.nodes if n.op == "input"}
    out: dict[tuple[int, int], set[str]] = {}
    for edge in graph.edges:
        a, b = owner.get(edge.source), owner.get(edge.target)
        if a is None or b is None or a >= b or edge.source in inputs:
            continue
        for hop in chunk_route(chunked, a, b):
            out.setdefault(hop, set()).add(edge.source)
    return out


def stage_graph(plan: Plan, graph: LayerGraph) -> nx.DiGraph:
    """The DAG of stages: an edge wherever a tensor crosses from one stage to another."""
    import networkx as nx  # here, not at the top: most users of plans need no graph library

    owner = plan.stage_of()
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(range(len(plan.stages)))
    for edge in graph.edges:
        a, b = owner[edge.source], owner[edge.target]
        if a != b:
            g.add_edge(a, b)
    return g


def load_plan(source: str | os.PathLike[str]) -> Plan:
    """Load and validate a plan from a path or ``-``; its file specs are read relative to the plan's folder."""
    plan = load_json_artifact(Plan, source, FORMAT_PLAN, "a stage plan (pdplan.plan/1)")
    return plan.model_copy(update={"spec": plan.spec.anchored(artifact_folder(source))})


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    save_json_artifact(plan, path)


def plan_json(plan: Plan) -> str:
    return dump_json(plan)


def plan_schema() -> str:
    """The plan's JSON Schema, for editors."""
    schema = Plan.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "pdplan.plan/1"
    return json.dumps(schema, indent=2) + "\n"
