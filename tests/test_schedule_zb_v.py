"""ZB-V (Qi et al., ICLR'24, section 6): the V placement, its drawn grid, and invariants over grids of cases."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pdrun.cli import main
from shared.schedule import (
    Instr,
    Kind,
    ScheduleError,
    build_program,
    chunk_owner,
    chunk_virtual,
    get_schedule,
    make_pipeline,
    max_in_flight,
    peak_held,
)
from shared.schedule_check import validate_program, validate_run
from shared.schedule_grid import draw_grid
from shared.schedule_more import zb_v_orders, zb_v_paper_order
from shared.simulate import Costs, simulate

# ZB-V on 4 workers, 8 microbatches, one step, f = b = w = 1 slot a chunk (``F3.1``: microbatch 3 on
# chunk 1): the paper's ZB-V schedule (Qi et al., ICLR'24, section 6), as torch.distributed.pipelining's
# ScheduleZBVZeroBubble orders it too (the test below). Worker i holds virtual stages i
# and 7 - i. Worker i first forwards 2 (4 - i) - 1 microbatches through chunk 0 (s0: F0..F6; s3: F0
# alone), then i through chunk 1 and chunk 0 in turn, then 4 - i through chunk 1 whole (F, B, W); s3
# turns each unit round in its own process (F0 then F0.1). In the steady state each W follows its B
# and no slot is idle; the cool-down puts W's off behind the B's that later workers wait on.
# 51 slots for 48 of work a worker: a bubble of 3 / 51 (zb-h1: 27 slots for 24 of work half the size).
ZB_V_4x8 = """\
       0  1  2  3    4    5    6    7    8    9   10   11   12   13   14   15   16   17   18   19   20   21   22   23   24   25   26   27   28   29   30   31   32   33   34   35   36   37   38   39   40   41   42 43 44   45   46   47 48 49 50
s0.r0 F0 F1 F2 F3   F4   F5   F6 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F2.1 B2.1 W2.1 F3.1 B3.1 W3.1   F7   B0   W0 F4.1 B4.1 W4.1   B1   W1 F5.1 B5.1 W5.1   B2   W2 F6.1 B6.1 W6.1   B3   W3 F7.1 B7.1 W7.1   B4   W4   B5 W5 B6   W6   B7   W7  .  .  .
s1.r0  . F0 F1 F2   F3   F4 F0.1   F5 F1.1 B0.1 W0.1 F2.1 B1.1 W1.1 F3.1 B2.1 W2.1   F6   B0   W0 F4.1 B3.1 W3.1   F7   B1   W1 F5.1 B4.1 W4.1   B2   W2 F6.1 B5.1 W5.1   B3   W3 F7.1 B6.1 W6.1   B4 B7.1   B5   W4 B6 W5   B7   W6 W7.1 W7  .  .
s2.r0  .  . F0 F1   F2 F0.1   F3 F1.1   F4 F2.1 B0.1 W0.1 F3.1 B1.1 W1.1   F5   B0   W0 F4.1 B2.1 W2.1   F6   B1   W1 F5.1 B3.1 W3.1   F7   B2   W2 F6.1 B4.1 W4.1   B3   W3 F7.1 B5.1 W5.1   B4 B6.1   B5 B7.1   B6 W4 B7   W5 W6.1 W7.1 W6 W7  .
s3.r0  .  .  . F0 F0.1   F1 F1.1   F2 F2.1   F3 F3.1 B0.1 W0.1   F4   B0   W0 F4.1 B1.1 W1.1   F5   B1   W1 F5.1 B2.1 W2.1   F6   B2   W2 F6.1 B3.1 W3.1   F7   B3   W3 F7.1 B4.1 W4.1   B4 B5.1   B5 B6.1   B6 B7.1 B7 W4 W5.1 W6.1 W7.1 W5 W6 W7"""


def test_zb_v_matches_the_drawn_figure() -> None:
    assert draw_grid(build_program("zb-v", [1] * 4, 8, microbatches=8, chunks=2)) == ZB_V_4x8


@pytest.mark.parametrize("stages", range(2, 7))
def test_zb_v_orders_each_worker_as_torch_pipelining_does(stages: int) -> None:
    # An implementation of the same paper schedule written apart from ours (torch 2.13's, a private
    # method computing one rank's actions), from 2S - 1 microbatches, the fewest that fill the V.
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    kinds = {"FORWARD": Kind.FORWARD, "BACKWARD_INPUT": Kind.BACKWARD, "BACKWARD_WEIGHT": Kind.WEIGHT}
    for m in range(2 * stages - 1, 3 * stages + 1):
        shape = SimpleNamespace(pp_group_size=stages, _n_microbatches=m, num_stages=2 * stages)
        for w in range(stages):
            actions = ScheduleZBVZeroBubble._calculate_single_rank_operations(shape, w)  # type: ignore[arg-type]
            theirs = tuple(
                (kinds[a.computation_type.name], a.microbatch_index, 0 if a.stage_index == w else 1)
                for a in actions
                if a is not None
            )
            assert zb_v_paper_order(stages, m, w) == theirs, (stages, m, w)
            assert zb_v_orders(stages, m)[w] == theirs


def _chunk0_warmup(instrs: list[Instr]) -> int:
    """Forwards through chunk 0 before the worker's first forward through chunk 1."""
    forwards = [i for i in instrs if i.kind is Kind.FORWARD]
    return next(k for k, i in enumerate(forwards) if i.chunk == 1)


def test_the_v_places_chunk_one_backwards_and_turns_on_the_last_worker() -> None:
    assert [chunk_virtual(4, w, c, vshape=True) for c in (0, 1) for w in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(chunk_owner(4, chunk_virtual(4, w, c, True), True) == (w, c) for w in range(4) for c in (0, 1))
    program = build_program("zb-v", [1] * 3, 3, microbatches=3, chunks=2)
    # The last worker sends to itself (chunk 0 -> chunk 1 and back); the first holds the loss's chunk.
    assert Instr(Kind.SEND_ACT, 0, (2, 0), 0) in program[(2, 0)]
    assert Instr(Kind.RECV_ACT, 0, (2, 0), 0) in program[(2, 0)]
    assert Instr(Kind.SEND_GRAD, 0, (2, 0), 1) in program[(2, 0)]
    assert not any(i.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) and i.chunk == 1 for i in program[(0, 0)])


@pytest.mark.parametrize("stages", range(2, 7))
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("replicas", [1, 2])
def test_zb_v_invariants_memory_and_bubble(stages: int, groups: int, replicas: int) -> None:
    m = groups * stages * replicas
    program = build_program("zb-v", [replicas] * stages, 2 * m, microbatches=m, chunks=2)
    validate_program(program)
    for (s, r), instrs in program.items():
        assert _chunk0_warmup(instrs) == min(m // replicas, 2 * (stages - s) - 1), (s, r)
        # 1F1B's activation memory: 2S units of half a stage each, the first stage's S units in 1F1B.
        assert peak_held(instrs, Kind.WEIGHT) <= 2 * stages  # forwarded, W not yet taken
        mine = [i.unit for i in instrs if i.kind is Kind.FORWARD and i.chunk == 0]
        assert all(u % replicas == r for u in mine) and len(mine) == 2 * m // replicas
    run = simulate(program, Costs.uniform(stages))
    h1 = simulate(build_program("zb-h1", [replicas] * stages, 2 * m, microbatches=m), Costs.uniform(stages))
    # ZB-V's bubble is below ZB-H1's at the same microbatches (the paper's Table 4: about half of it).
    assert run.bubble < 0.75 * h1.bubble, (run.bubble, h1.bubble)
    assert max(max_in_flight(program).values()) <= 2 * stages


def test_zb_v_window_validation_stands_for_a_long_run() -> None:
    gen = get_schedule("zb-v")
    pipe = make_pipeline("zb-v", (2, 2, 2), microbatches=6, chunks=2)
    for units in (6, 42, 6 * 10**6):
        assert gen.window(pipe, units) <= 8 * 6 * 2
    validate_run(gen, pipe, [6, 42, 6 * 10**6])
    validate_program({w: list(gen.program(pipe, w, 0, 42)) for w in pipe.workers()})


@pytest.mark.parametrize(
    ("replicas", "kwargs", "message"),
    [
        ([1, 1], {"chunks": 3}, "runs 2 model chunks per worker"),
        ([1, 1], {"chunks": 1}, "runs 2 model chunks per worker"),
        ([1], {"chunks": 2}, "at least 2 stages"),
        ([2, 1], {"chunks": 2, "microbatches": 4}, "same number of replicas"),
        ([2, 2], {"chunks": 2, "microbatches": 3}, "not a multiple of the 2 replicas"),
        ([1, 1, 1], {"chunks": 2, "stage_edges": [(0, 1), (0, 2), (1, 2)]}, "chain of stages"),
    ],
)
def test_zb_v_refuses_what_it_cannot_run(
    replicas: list[int], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ScheduleError, match=message):
        make_pipeline("zb-v", replicas, **kwargs)  # type: ignore[arg-type]


def test_pdrun_schedule_draws_zb_v() -> None:
    out = CliRunner().invoke(main, ["schedule", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8"])
    assert out.exit_code == 0, out.output
    assert ZB_V_4x8 in out.output and "2 chunks per worker" in out.output
    bad = CliRunner().invoke(
        main, ["schedule", "--schedule", "zb-v", "--stages", "4", "--virtual-stages", "3"]
    )
    assert bad.exit_code == 2 and "exactly 2 model chunks" in bad.output
