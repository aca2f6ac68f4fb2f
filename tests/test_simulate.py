"""The simulator matches closed forms on small pipelines and finds deadlocks."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from shared.schedule import Instr, Kind, Program, ScheduleError, build_program
from shared.simulate import Costs, run_timeline, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-flush"])
@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 3), (4, 4), (4, 8), (3, 7)])
@pytest.mark.parametrize(("f", "b"), [(1.0, 1.0), (1.0, 2.0), (0.5, 1.5)])
def test_flush_step_is_m_plus_s_minus_1_slots(
    schedule: str, stages: int, micro: int, f: float, b: float
) -> None:
    # GPipe (and PipeDream-Flush, same bubble): makespan (M + S - 1)(f + b) per step,
    # bubble (S - 1) / (M + S - 1).
    steps = 2
    program = build_program(schedule, [1] * stages, micro * steps, microbatches=micro)
    run = simulate(program, Costs.uniform(stages, forward=f, backward=b))
    assert run.makespan == pytest.approx(steps * (micro + stages - 1) * (f + b))
    assert run.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    assert run.time_per_unit == pytest.approx((micro + stages - 1) * (f + b) / micro)
    for w in program:
        assert run.busy[w] == pytest.approx(steps * micro * (f + b))
        assert run.idle[w] == pytest.approx(run.makespan - run.busy[w])


@pytest.mark.parametrize(("stages", "units"), [(1, 5), (2, 6), (4, 8), (4, 16), (5, 12)])
@pytest.mark.parametrize(("f", "b"), [(1.0, 1.0), (1.0, 2.0)])
def test_1f1b_fills_once_then_one_unit_per_f_plus_b(stages: int, units: int, f: float, b: float) -> None:
    # PipeDream: the pipeline fills once (S - 1 units' worth), then every worker alternates
    # F and B, so a unit completes every f + b seconds.
    program = build_program("1f1b", [1] * stages, units)
    run = simulate(program, Costs.uniform(stages, forward=f, backward=b))
    assert run.makespan == pytest.approx((units + stages - 1) * (f + b))
    assert run.time_per_unit == pytest.approx(f + b)
    assert run.peak_in_flight == {(s, 0): min(units, stages - s) for s in range(stages)}


def test_replicated_stage_halves_its_time_per_unit() -> None:
    # stage 0 costs twice stage 1 but has two replicas: steady state is stage 1's f + b
    program = build_program("1f1b", [2, 1], 32)
    run = simulate(program, Costs(forward=[2.0, 1.0], backward=[4.0, 2.0]))
    assert run.time_per_unit == pytest.approx(3.0)
    without = simulate(build_program("1f1b", [1, 1], 32), Costs(forward=[2.0, 1.0], backward=[4.0, 2.0]))
    assert without.time_per_unit == pytest.approx(6.0)
    # replicas that all-reduce together finish their units together: measured per round
    assert simulate(build_program("1f1b", [2, 2], 48), Costs.uniform(2)).time_per_unit == pytest.approx(1.0)
    assert simulate(build_program("1f1b", [3, 1], 48), Costs.uniform(2)).time_per_unit == pytest.approx(2.0)


def test_transfer_allreduce_and_step_costs_add_where_they_occur() -> None:
    # one unit through 2 stages: f0, link, f1, b1, link, b0, then the step
    program = build_program("gpipe", [1, 1], 1, microbatches=1)
    costs = Costs(forward=[1.0, 2.0], backward=[3.0, 4.0], transfer={(0, 1): 0.5}, step=[0.25, 0.25])
    run = simulate(program, costs)
    assert run.makespan == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3 + 0.25)
    assert run.busy[(1, 0)] == pytest.approx(2 + 4 + 0.25)
    # two replicas of one stage, one unit each: both finish their unit, then all-reduce, then step
    program = build_program("1f1b", [2], 2)
    run = simulate(program, Costs(forward=[1.0], backward=[2.0], allreduce=[0.75], step=[0.25]))
    assert run.makespan == pytest.approx(1 + 2 + 0.75 + 0.25)
    assert run.allreduce == {(0, 0): 0.75, (0, 1): 0.75}
    assert run.bubble == pytest.approx(0.0)


def test_blocking_sends_keep_the_sender_busy_for_the_transfer() -> None:
    # GPipe, 2 microbatches, 2 stages: stage 0 sends after each forward. Non-blocking, its second
    # forward starts at once (t=1) and reaches stage 1 at 2.5; blocking, it starts after the first
    # send (t=1.5), and its own send ends, and arrives, at 3.
    program = build_program("gpipe", [1, 1], 2, microbatches=2)
    base = {"forward": [1.0, 1.0], "backward": [1.0, 1.0], "transfer": {(0, 1): 0.5}}
    free = run_timeline(program, Costs(**base))  # type: ignore[arg-type]
    held = run_timeline(program, Costs(**base, blocking_sends=True))  # type: ignore[arg-type]

    def ops(timeline, kind):  # type: ignore[no-untyped-def]
        return [op for op in timeline.ops if op.worker == (0, 0) and op.instr.kind is kind]

    assert [op.end - op.start for op in ops(free, Kind.SEND_ACT)] == [0.0, 0.0]
    assert [op.end - op.start for op in ops(held, Kind.SEND_ACT)] == [0.5, 0.5]
    assert [op.start for op in ops(free, Kind.FORWARD)] == [0.0, 1.0]
    assert [op.start for op in ops(held, Kind.FORWARD)] == [0.0, 1.5]
    second = [op for op in held.ops if op.worker == (1, 0) and op.instr.kind is Kind.FORWARD][1]
    assert second.start == pytest.approx(3.0)
    assert (
        simulate(program, Costs(**base, blocking_sends=True)).makespan
        > simulate(program, Costs(**base)).makespan
    )  # type: ignore[arg-type]


def test_all_reduce_waits_for_the_slowest_replica() -> None:
    # replica 1 gets unit 1 only after unit 0's transfer... with a straight 2x1 pipeline at
    # unit costs the replica of unit 0 waits 2 slots at its first all-reduce (see the grid test)
    run = simulate(build_program("1f1b", [2, 1], 2), Costs.uniform(2))
    timeline = {(op.worker, str(op.instr)): (op.start, op.end) for op in run.timeline.ops}
    assert timeline[((0, 0), "B0")] == (3.0, 4.0)
    assert timeline[((0, 1), "B1")] == (5.0, 6.0)
    assert timeline[((0, 0), "AR0")] == (6.0, 6.0)  # started when the last replica came
    assert run.idle[(0, 0)] == pytest.approx(run.makespan - 2.0)


@pytest.mark.parametrize("tie", [0.0, 0.5])
def test_a_tie_across_stages_makes_each_step_wait_for_both(tie: float) -> None:
    # Two stages, f = b = 1, one parameter tied across them (pdrun sums its gradient before every
    # step). Stage 1's step of unit u waits for stage 0's backward of u, so stage 1 forwards u + 1
    # only after it: B1(u), B0(u), the sum, F1(u + 1), then B1(u + 1): 3 + tie a unit, not 1F1B's 2.
    program = build_program("1f1b", [1, 1], 32)
    untied = simulate(program, Costs.uniform(2))
    tied = simulate(program, replace(Costs.uniform(2), ties=[((0, 1), tie)]))
    assert untied.time_per_unit == pytest.approx(2.0)
    assert tied.time_per_unit == pytest.approx(3.0 + tie)
    # A flush step drains anyway: the stages meet at its end, and the tie costs nothing more.
    flush = build_program("1f1b-flush", [1, 1], 16, microbatches=4)
    assert simulate(flush, replace(Costs.uniform(2), ties=[((0, 1), 0.0)])).time_per_unit == pytest.approx(
        simulate(flush, Costs.uniform(2)).time_per_unit
    )


def test_times_do_not_depend_on_worker_order() -> None:
    program = build_program("1f1b-flush", [1, 2, 1], 12, microbatches=4, stage_edges=[(0, 1), (1, 2), (0, 2)])
    costs = Costs(
        forward=[1.0, 3.0, 0.5], backward=[2.0, 5.0, 1.0], transfer={(0, 1): 0.2, (1, 2): 0.3, (0, 2): 0.7}
    )
    reordered: Program = dict(reversed(list(program.items())))
    a = {(op.worker, op.position): (op.start, op.end) for op in run_timeline(program, costs).ops}
    b = {(op.worker, op.position): (op.start, op.end) for op in run_timeline(reordered, costs).ops}
    assert a == b and len(a) == sum(len(v) for v in program.values())


def test_deadlock_is_reported() -> None:
    program: Program = {
        (0, 0): [Instr(Kind.RECV_GRAD, 0, (1, 0)), Instr(Kind.FORWARD, 0), Instr(Kind.SEND_ACT, 0, (1, 0))],
        (1, 0): [Instr(Kind.RECV_ACT, 0, (0, 0)), Instr(Kind.FORWARD, 0), Instr(Kind.SEND_GRAD, 0, (0, 0))],
    }
    timeline = run_timeline(program, Costs.uniform(2))
    assert timeline.deadlocked and dict(timeline.blocked) == {(0, 0): 0, (1, 0): 0}
    with pytest.raises(ScheduleError, match=r"deadlocks: s0\.r0 at RG0<1\.0, s1\.r0 at RA0<0\.0"):
        simulate(program, Costs.uniform(2))


def test_schedule_modules_do_not_import_torch() -> None:
    # schedules are data: the planner and `pdrun schedule` use them without torch
    code = "import sys, shared.schedule, shared.simulate, pdrun.cmd_schedule; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_blocking_sends_count_apart_from_compute_and_the_bubble() -> None:
    # The same GPipe pipeline as above: blocking, stage 0 spends 0.5 s in each of its 2 sends and stage 1
    # (which sends its gradients back) as long in each of its 2; busy is compute alone, and the workers'
    # time is busy + sending + idle, with the bubble the idle share as before (sending was in busy).
    program = build_program("gpipe", [1, 1], 2, microbatches=2)
    costs = Costs(
        forward=[1.0, 1.0], backward=[1.0, 1.0], transfer={(0, 1): 0.5, (1, 0): 0.5}, blocking_sends=True
    )
    run = simulate(program, costs)
    for w in program:
        assert run.sending[w] == pytest.approx(1.0)
        assert run.busy[w] == pytest.approx(4.0)
        assert run.busy[w] + run.sending[w] + run.idle[w] == pytest.approx(run.makespan)
    assert run.sending_share == pytest.approx(2.0 / (2 * run.makespan))
    assert run.bubble == pytest.approx(sum(run.idle.values()) / (2 * run.makespan))
    free = simulate(program, Costs(forward=[1.0, 1.0], backward=[1.0, 1.0], transfer={(0, 1): 0.5}))
    assert free.sending_share == 0.0
