"""Tied parameters stay one parameter: the stages that hold one sum its gradient every step.

GPT with ``tie=True`` (token embedding = output projection, on the first and last stage)
and a plain torch model that reads its embedding matrix again through ``F.linear`` (a
``get_attr`` layer) train as one process does on flush schedules; under 1f1b the copies
stay identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pdrun.config import RunConfig
from pdrun.launch import launch
from pdrun.partition import partition
from pdrun.plans import cut_plan, traced_for
from pdrun.result import WorkerResult
from pdrun.tied import TiedGradients, find_ties
from pdrun.transport.gloo_sum import GlooSum
from shared.errors import PlanError
from shared.plan import Plan
from shared.resolve import resolve_dataset, resolve_loss, resolve_model
from shared.spec import RunSpec
from tests.test_run_flush import assert_same

GPT = RunSpec(
    model="zoo:gpt",
    model_args={"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 98, "tie": True},
    data="zoo:pydoc_text",
    data_args={"block_size": 16},
)

TIED_LM = '''
import torch
import torch.nn.functional as F
from torch import nn


class TiedLM(nn.Module):
    """Embed, two hidden layers, and logits against the embedding matrix itself (read by F.linear)."""

    def __init__(self, vocab=98, width=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, idx):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(self.emb(idx)))))
        return F.linear(h, self.emb.weight)


def build():
    return TiedLM()
'''


def _plain(tmp_path: Path) -> RunSpec:
    path = tmp_path / "tied_lm.py"
    path.write_text(TIED_LM)
    return RunSpec(model=f"{path}:build", data="zoo:pydoc_text", data_args={"block_size": 16})


def test_a_tie_is_found_by_identity_across_stages_only(tmp_path: Path) -> None:
    traced = traced_for(GPT)
    ties = find_ties(traced, partition(traced, cut_plan(GPT, ["h_1_ln_1"], batch_size=4)))
    assert [t.names for t in ties] == [((0, ("wte.weight",)), (1, ("lm_head.weight",)))]
    # Both readers on one stage: nothing to sum.
    assert find_ties(traced, partition(traced, cut_plan(GPT, [], batch_size=4))) == []
    untied = RunSpec(model="zoo:gpt", model_args={**GPT.model_args, "tie": False}, data=GPT.data)
    t2 = traced_for(untied)
    assert find_ties(t2, partition(t2, cut_plan(untied, ["h_1_ln_1"], batch_size=4))) == []
    plain = _plain(tmp_path)
    t3 = traced_for(plain)
    ties = find_ties(t3, partition(t3, cut_plan(plain, ["fc2"], batch_size=4)))
    assert [t.names for t in ties] == [((0, ("emb.weight",)), (1, ("emb.weight",)))]  # the get_attr layer


def sequential(
    spec: RunSpec, *, steps: int, batch: int, seed: int, lr: float, momentum: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial, final) parameters of one process (float64) on token ids, pdrun's data order."""
    assert spec.model is not None and spec.data is not None
    torch.manual_seed(seed)
    model = resolve_model(spec.model, spec.model_args).double()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = resolve_dataset(spec.data, spec.data_args)
    loss_fn = resolve_loss(spec.loss)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    n = len(data)
    for step in range(steps):
        epoch, b = divmod(step, n // batch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        idx = order[b * batch : (b + 1) * batch]
        x = torch.stack([data[int(i)][0] for i in idx])
        y = torch.stack([data[int(i)][1] for i in idx])
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return initial, {k: v.detach().clone() for k, v in model.named_parameters()}


def _copies(results: list[WorkerResult], stage_name: dict[int, str]) -> dict[int, torch.Tensor]:
    """The tied parameter as each stage's replica 0 holds it, after training."""
    return {
        r.stage: r.params[stage_name[r.stage]] for r in results if r.replica == 0 and r.stage in stage_name
    }


def _merged(results: list[WorkerResult], tied: set[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in sorted(results, key=lambda r: r.rank):
        if r.replica == 0:
            out.update({n: t for n, t in r.params.items() if n not in tied})
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("which", "cuts", "replicas", "schedule"),
    [
        (
            "gpt",
            ["h_0_ln_2", "h_1_ln_2"],
            [2, 1, 1],
            "1f1b-flush",
        ),  # the tie skips stage 1; stage 0 replicated
        ("plain", ["fc2"], [1, 1], "gpipe"),
    ],
)
def test_flush_with_a_tie_across_stages_equals_one_process(
    tmp_path: Path, which: str, cuts: list[str], replicas: list[int], schedule: str
) -> None:
    spec = GPT if which == "gpt" else _plain(tmp_path)
    first, last = ("wte.weight", "lm_head.weight") if which == "gpt" else ("emb.weight", "emb.weight")
    batch, microbatches, steps = 4, 2, 4
    plan = cut_plan(
        spec,
        cuts,
        batch_size=batch,
        schedule=schedule,
        microbatches=microbatches,
        replicas=replicas,  # type: ignore[arg-type]
    )
    cfg = RunConfig(steps=steps, seed=1, dtype="float64", lr=0.5, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None
    initial, want = sequential(spec, steps=steps, batch=batch * microbatches, seed=1, lr=0.5, momentum=0.9)
    copies = _copies(results, {0: first, len(cuts): last})
    assert torch.equal(copies[0], copies[len(cuts)])  # one parameter: the copies never part
    # One host: the tie's ranks sum it through shared memory, as a replicated stage's gradients.
    tied = {r.rank: r.tie_sum for r in results if r.stage in (0, len(cuts))}
    assert set(tied.values()) == {"shm"}, tied
    assert all(r.tie_sum is None for r in results if r.stage not in (0, len(cuts)))
    assert_same({first: copies[0]}, {first: want[first]}, 1e-6)
    assert (want[first] - initial[first]).abs().max().item() > 1e-3
    assert_same(_merged(results, {first, last}), {n: t for n, t in want.items() if n != first}, 1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("vertical_sync", [False, True])
def test_1f1b_keeps_the_tied_copies_identical(vertical_sync: bool) -> None:
    plan = cut_plan(GPT, ["h_0_ln_2", "h_1_ln_2"], batch_size=8, schedule="1f1b", vertical_sync=vertical_sync)
    # Over gloo: the tie's sum takes the process group's all-reduce, the other way it may go.
    cfg = RunConfig(
        steps=20, seed=0, lr=3e-3, optimizer="adam", record=True, validate=False, transport="gloo"
    )
    results = launch(plan, cfg)
    assert results is not None
    assert {r.tie_sum for r in results if r.stage in (0, 2)} == {"gloo"}
    copies = _copies(results, {0: "wte.weight", 2: "lm_head.weight"})
    assert torch.equal(copies[0], copies[2])
    losses = [row["loss"] for r in results if r.stage == 2 for row in r.rows]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4, losses


def test_1f1b_refuses_a_tie_over_a_replicated_stage() -> None:
    plan = cut_plan(GPT, ["h_1_ln_1"], batch_size=4, schedule="1f1b", replicas=[2, 1])
    with pytest.raises(
        PlanError, match=r"tied parameter wte.weight \(stage 0\) = lm_head.weight \(stage 1\)"
    ):
        launch(plan, RunConfig(steps=2, validate=False))


@pytest.mark.timeout(180)
def test_interleaved_with_a_tie_across_ranks_equals_one_process() -> None:
    # wte.weight on chunk 0 of rank 0 and lm_head.weight on chunk 1 of rank 1: each rank sums the tie
    # before its step, and training equals one process (without the sum the copies drifted 0.09 apart
    # in 5 steps).
    flat = cut_plan(
        GPT, ["h_0_ln_2", "h_1_ln_1", "h_1_ln_2"], batch_size=4, schedule="1f1b-flush", microbatches=2
    )
    data = flat.model_dump(mode="json")
    for v, stage in enumerate(data["stages"]):
        stage["ranks"] = [v % 2]
    data.update(schedule="interleaved-1f1b", virtual_stages=2, world_size=2, in_flight=2)
    plan = Plan.model_validate(data)
    steps = 4
    cfg = RunConfig(steps=steps, seed=1, dtype="float64", lr=0.5, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None and sorted(r.stage for r in results) == [0, 3]
    initial, want = sequential(GPT, steps=steps, batch=8, seed=1, lr=0.5, momentum=0.9)
    copies = _copies(results, {0: "wte.weight", 3: "lm_head.weight"})
    assert torch.equal(copies[0], copies[3])
    assert_same({"wte.weight": copies[0]}, {"wte.weight": want["wte.weight"]}, 1e-6)
    assert (want["wte.weight"] - initial["wte.weight"]).abs().max().item() > 1e-3
    rest = _merged(results, {"wte.weight", "lm_head.weight"})
    assert_same(rest, {n: t for n, t in want.items() if n != "wte.weight"}, 1e-6)


@pytest.mark.timeout(180)
def test_zb_v_with_both_ends_of_a_tie_on_one_rank_equals_one_process() -> None:
    # zb-v's V puts the first chunk (wte) and the last (lm_head) on rank 0, both built from one traced
    # model: one tensor in two chunks. It is stepped once (by the first chunk's optimizer) and counted
    # once in the tie's sum; before, both chunks stepped it and the sum doubled its gradient (wte.weight
    # 1.64 off one process after 4 steps).
    from tests.test_run_zb_v import zb_v_plan

    plan = zb_v_plan(["h_0_ln_2", "h_1_ln_1", "h_1_ln_2"], 2, 4, 2, GPT)
    assert plan.chunk_worker(0) == plan.chunk_worker(3) == 0
    steps = 4
    cfg = RunConfig(steps=steps, seed=1, dtype="float64", lr=0.5, momentum=0.9, record=True, validate=False)
    results = launch(plan, cfg)
    assert results is not None
    initial, want = sequential(GPT, steps=steps, batch=8, seed=1, lr=0.5, momentum=0.9)
    got = {n: t for r in results for n, t in r.params.items()}
    assert_same({n: got[n] for n in want}, want, 1e-6)
    assert (want["wte.weight"] - initial["wte.weight"]).abs().max().item() > 1e-3


def test_a_ranks_own_copies_of_a_tie_add_up_before_the_group_sums_them() -> None:
    # An interleaved rank may hold a tie in two chunks: its copies' gradients add up, the group's
    # all-reduce adds the other ranks' (none here), and each copy gets the sum in a tensor of its own.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        a, b, lone = (nn.Parameter(torch.zeros(3, 2, dtype=torch.float64)) for _ in range(3))
        a.grad, b.grad = torch.full_like(a, 1.5), torch.arange(6.0, dtype=torch.float64).view(3, 2)
        lone.grad = torch.ones_like(lone)
        TiedGradients([(GlooSum(None, torch.device("cpu")), 1.0, [[a, b], [lone]])]).sum()
        want = 1.5 + torch.arange(6.0, dtype=torch.float64).view(3, 2)
        assert torch.equal(a.grad, want) and torch.equal(b.grad, want)
        assert a.grad.data_ptr() != b.grad.data_ptr()
        assert torch.equal(lone.grad, torch.ones_like(lone))
    finally:
        dist.destroy_process_group()


def test_pdprof_records_ties_and_the_simulation_charges_their_sum() -> None:
    # The profile names the layers reading one parameter; a plan that puts them on two stages
    # waits at every 1f1b step for the other stage's backward (pdrun.tied), and its simulated time
    # per unit is above the same plan's without the tie. One stage: nothing to sum, no change.
    from pdplan.schedule_sim import simulate_plan
    from pdprof.profiler import ProfileConfig, profile_spec
    from shared.plan import Cluster, Level

    measured = profile_spec(ProfileConfig(GPT, batch_size=4, warmup=1, repeats=2)).graph
    assert measured.graph["ties"] == [["wte", "lm_head"]]
    # The same figures for every layer, so the margin is the schedule's, not this host's noise
    # (measured ones put it at 1.19-1.34 on a busy 2-core machine; these at 1.48).
    fixed = {"forward_ms": 1.0, "backward_ms": 2.0, "update_ms": 0.1}
    graph = measured.model_copy(
        update={"nodes": [n if n.op == "input" else n.model_copy(update=fixed) for n in measured.nodes]}
    )
    untied = graph.model_copy(update={"graph": {**graph.graph, "ties": []}})
    cluster = Cluster(levels=[Level(workers=2, bandwidth=1e9)])
    split = cut_plan(GPT, ["h_1_ln_1"], batch_size=4).model_copy(update={"cluster": cluster})
    assert (
        simulate_plan(graph, split).time_per_minibatch_s
        > 1.4 * simulate_plan(untied, split).time_per_minibatch_s
    )
    one = cut_plan(GPT, [], batch_size=4).model_copy(
        update={"cluster": Cluster(levels=[Level(workers=1, bandwidth=1e9)])}
    )
    assert simulate_plan(graph, one).time_per_minibatch_s == simulate_plan(untied, one).time_per_minibatch_s
