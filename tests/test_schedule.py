"""Schedule generators keep their invariants over grids of (schedule, stages, units, replicas)."""

from __future__ import annotations

import math

import pytest

from shared.errors import UserError
from shared.schedule import (
    SCHEDULES,
    Instr,
    Kind,
    Program,
    ScheduleError,
    build_program,
    compute_units,
    default_in_flight,
    default_microbatches,
    max_in_flight,
    parse_instr,
    program_from_text,
    program_to_text,
    stage_workers,
    worker_of_unit,
)
from shared.schedule_check import validate_program


def _patterns(stages: int) -> list[tuple[int, ...]]:
    ones = [1] * stages
    out = {tuple(ones)}
    for s in {0, stages // 2, stages - 1}:
        pattern = list(ones)
        pattern[s] = 2
        out.add(tuple(pattern))
    out.add(tuple(1 + (s % 2) for s in range(stages)))  # 1,2,1,2,...
    out.add(tuple(3 if s == 0 else 1 for s in range(stages)))
    return sorted(out)


def _cases() -> list[tuple[str, tuple[int, ...], int, int]]:
    """(schedule, replicas, units, microbatches) over stages 1..6 and units/microbatches 1..12."""
    cases = []
    for stages in range(1, 7):
        for replicas in _patterns(stages):
            lcm = math.lcm(*replicas)
            for n in range(1, 13):
                if n % lcm == 0:
                    cases.append(("1f1b", replicas, n, 1))
                cases.append(("1f1b-flush", replicas, 2 * n, n))  # two steps of n microbatches
                cases.append(("gpipe", replicas, 2 * n, n))
    return cases


CASES = _cases()


def _compute(instrs: list[Instr]) -> list[tuple[Kind, int]]:
    return [(i.kind, i.unit) for i in instrs if i.kind in (Kind.FORWARD, Kind.BACKWARD)]


@pytest.mark.parametrize(("schedule", "replicas", "units", "microbatches"), CASES)
def test_program_invariants(schedule: str, replicas: tuple[int, ...], units: int, microbatches: int) -> None:
    program = build_program(schedule, replicas, units, microbatches=microbatches)
    validate_program(program)
    assert sorted(program) == stage_workers(replicas)
    last_stage = len(replicas) - 1
    for (stage, replica), instrs in program.items():
        mine = [u for u in range(units) if worker_of_unit(stage, u, replicas) == (stage, replica)]
        forwards = compute_units(instrs, Kind.FORWARD)
        backwards = compute_units(instrs, Kind.BACKWARD)
        # each of the worker's units forwarded once and backwarded once, forward first
        assert sorted(forwards) == mine and sorted(backwards) == mine
        for u in mine:
            f = instrs.index(Instr(Kind.FORWARD, u))
            b = instrs.index(Instr(Kind.BACKWARD, u))
            assert f < b
        # lowering: receive right before compute, send right after; none at the pipeline's ends
        kinds = {i.kind for i in instrs}
        works = bool(mine)  # a replica may have no unit at all in a short run
        assert (Kind.RECV_ACT in kinds) == (Kind.SEND_GRAD in kinds) == (works and stage > 0)
        assert (Kind.RECV_GRAD in kinds) == (Kind.SEND_ACT in kinds) == (works and stage < last_stage)
        for i, ins in enumerate(instrs):
            if ins.kind is Kind.FORWARD and stage > 0:
                assert instrs[i - 1] == Instr(
                    Kind.RECV_ACT, ins.unit, worker_of_unit(stage - 1, ins.unit, replicas)
                )
            if ins.kind is Kind.FORWARD and stage < last_stage:
                assert instrs[i + 1] == Instr(
                    Kind.SEND_ACT, ins.unit, worker_of_unit(stage + 1, ins.unit, replicas)
                )
            if ins.kind is Kind.BACKWARD and stage < last_stage:
                assert instrs[i - 1] == Instr(
                    Kind.RECV_GRAD, ins.unit, worker_of_unit(stage + 1, ins.unit, replicas)
                )
        # all-reduce only on replicated stages
        assert (Kind.ALLREDUCE in kinds) == (replicas[stage] > 1)


@pytest.mark.parametrize(
    ("schedule", "replicas", "units", "microbatches"), [c for c in CASES if c[0] == "1f1b"]
)
def test_1f1b_alternates_and_steps_every_unit(
    schedule: str, replicas: tuple[int, ...], units: int, microbatches: int
) -> None:
    program = build_program(schedule, replicas, units)
    for (stage, _), instrs in program.items():
        seq = _compute(instrs)
        k = max_in_flight({(stage, 0): instrs})[(stage, 0)]
        n = len(seq) // 2
        warm, steady, drain = seq[:k], seq[k : 2 * n - k], seq[2 * n - k :]
        assert all(kind is Kind.FORWARD for kind, _ in warm)
        assert [kind for kind, _ in steady] == [Kind.BACKWARD, Kind.FORWARD] * (n - k)
        assert all(kind is Kind.BACKWARD for kind, _ in drain)
        # every backward is its own optimizer step: B u [SG u] [AR u] S u
        for i, ins in enumerate(instrs):
            if ins.kind is Kind.BACKWARD:
                tail = [t for t in instrs[i + 1 :] if t.kind is not Kind.SEND_GRAD][:2]
                expect = [Instr(Kind.ALLREDUCE, ins.unit)] if replicas[stage] > 1 else []
                assert tail[: len(expect) + 1] == [*expect, Instr(Kind.STEP, ins.unit)]


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("units", range(1, 13))
def test_1f1b_peak_in_flight_straight_pipeline(stages: int, units: int) -> None:
    program = build_program("1f1b", [1] * stages, units)
    peaks = max_in_flight(program)
    assert default_in_flight([1] * stages) == stages
    for s in range(stages):
        assert peaks[(s, 0)] == min(units, stages - s)


def test_1f1b_noam_per_input_replica() -> None:
    # PipeDream: NOAM = ceil(workers / input-stage replicas), admitted by each input replica
    program = build_program("1f1b", [2, 1], 8)
    assert default_in_flight([2, 1]) == 2
    assert max_in_flight(program) == {(0, 0): 2, (0, 1): 2, (1, 0): 1}
    lowered = build_program("1f1b", [1, 1, 1, 1], 8, in_flight=2)
    validate_program(lowered)
    assert max_in_flight(lowered) == {(0, 0): 2, (1, 0): 2, (2, 0): 2, (3, 0): 1}


@pytest.mark.parametrize(
    ("schedule", "replicas", "units", "microbatches"), [c for c in CASES if c[0] != "1f1b"]
)
def test_flush_schedules_step_once_per_microbatches(
    schedule: str, replicas: tuple[int, ...], units: int, microbatches: int
) -> None:
    program = build_program(schedule, replicas, units, microbatches=microbatches)
    lasts = [first + microbatches - 1 for first in range(0, units, microbatches)]
    stages = len(replicas)
    for (stage, replica), instrs in program.items():
        assert compute_units(instrs, Kind.STEP) == lasts  # every replica steps, even one idle in a step
        if replicas[stage] > 1:
            assert compute_units(instrs, Kind.ALLREDUCE) == lasts
        # nothing of a step runs before the previous step's update
        steps_at = [i for i, ins in enumerate(instrs) if ins.kind is Kind.STEP]
        for j, at in enumerate(steps_at):
            before = {ins.unit for ins in instrs[:at] if ins.kind in (Kind.FORWARD, Kind.BACKWARD)}
            assert all(u <= lasts[j] for u in before)
            after = {ins.unit for ins in instrs[at:] if ins.kind in (Kind.FORWARD, Kind.BACKWARD)}
            assert all(u > lasts[j] for u in after)
        peak = max_in_flight({(stage, 0): instrs})[(stage, 0)]
        per_worker = max(
            len([u for u in range(last - microbatches + 1, last + 1) if u % replicas[stage] == replica])
            for last in lasts
        )
        if schedule == "gpipe":
            assert peak == per_worker
            seq = _compute(instrs)
            for last in lasts:
                ours = [(k, u) for k, u in seq if last - microbatches < u <= last]
                fs = [u for k, u in ours if k is Kind.FORWARD]
                assert ours == [(Kind.FORWARD, u) for u in fs] + [(Kind.BACKWARD, u) for u in reversed(fs)]
        elif set(replicas) == {1}:
            assert peak == min(microbatches, stages - stage)


def test_skip_connection_dag_lowers_to_the_consumer() -> None:
    edges = [(0, 1), (1, 2), (0, 2)]
    for schedule in SCHEDULES:
        program = build_program(schedule, [1, 2, 1], 8, microbatches=4, stage_edges=edges)
        validate_program(program)
        s2 = program[(2, 0)]
        f3 = s2.index(Instr(Kind.FORWARD, 3))
        assert set(s2[f3 - 2 : f3]) == {Instr(Kind.RECV_ACT, 3, (0, 0)), Instr(Kind.RECV_ACT, 3, (1, 1))}
        s0 = program[(0, 0)]
        b3 = s0.index(Instr(Kind.BACKWARD, 3))
        assert set(s0[b3 - 2 : b3]) == {Instr(Kind.RECV_GRAD, 3, (1, 1)), Instr(Kind.RECV_GRAD, 3, (2, 0))}


def test_text_form_round_trips() -> None:
    program = build_program("1f1b", [2, 1, 3], 12, stage_edges=[(0, 1), (1, 2), (0, 2)])
    for instrs in program.values():
        for ins in instrs:
            assert parse_instr(str(ins)) == ins
    assert program_from_text(program_to_text(program)) == program
    assert str(Instr(Kind.RECV_GRAD, 3, (2, 0))) == "RG3<2.0"
    with pytest.raises(ScheduleError, match="not an instruction"):
        parse_instr("X3")
    with pytest.raises(ScheduleError, match="needs peer"):
        parse_instr("SA3")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "zb"}, "is not one of 1f1b, 1f1b-flush, gpipe"),
        ({"replicas": [2, 0]}, "positive count per stage"),
        ({"units": 0}, "at least 1"),
        ({"schedule": "gpipe", "units": 6, "microbatches": 4}, "not a multiple of microbatches=4"),
        ({"replicas": [2, 1], "units": 3}, "not a multiple of stage 0's 2 replicas"),
        ({"stage_edges": [(0, 2)], "replicas": [1, 1, 1]}, "stage 1 has no producer"),
        ({"stage_edges": [(0, 1), (0, 2)], "replicas": [1, 1, 1]}, "stage 1 has no consumer"),
        ({"stage_edges": [(1, 0)], "replicas": [1, 1]}, r"\(1, 0\) is not a pair of stages a < b"),
        ({"in_flight": 0}, "in_flight: 0"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"schedule": "1f1b", "replicas": [1, 1], "units": 4}
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=message) as info:
        build_program(**args)  # type: ignore[arg-type]
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------- broken programs


def _copy(program: Program) -> Program:
    return {w: list(instrs) for w, instrs in program.items()}


def _rejects(program: Program, message: str) -> ScheduleError:
    with pytest.raises(ScheduleError, match=message) as info:
        validate_program(program)
    err = info.value
    assert "\n" not in str(err)
    assert "!" in err.grid and "(! marks the failing instruction)" in err.grid
    return err


def test_dropped_receive_is_rejected() -> None:
    program = _copy(build_program("1f1b", [1, 1, 1], 6))
    program[(1, 0)].remove(Instr(Kind.RECV_ACT, 2, (0, 0)))
    err = _rejects(program, r"^s0\.r0 SA2>1\.0: no matching RA2<0\.0 on s1\.r0$")
    assert err.worker == (0, 0) and program[(0, 0)][err.index or 0] == Instr(Kind.SEND_ACT, 2, (1, 0))
    assert "!SA2>1.0" in err.grid


def test_receive_without_send_is_rejected() -> None:
    program = _copy(build_program("gpipe", [1, 1], 4, microbatches=4))
    program[(1, 0)].remove(Instr(Kind.SEND_GRAD, 1, (0, 0)))
    _rejects(program, r"^s0\.r0 RG1<1\.0: no matching SG1>0\.0 on s1\.r0$")


def test_swapped_forward_and_backward_is_rejected() -> None:
    program = _copy(build_program("1f1b-flush", [1, 1], 4, microbatches=4))
    instrs = program[(1, 0)]
    f, b = instrs.index(Instr(Kind.FORWARD, 1)), instrs.index(Instr(Kind.BACKWARD, 1))
    instrs[f], instrs[b] = instrs[b], instrs[f]
    err = _rejects(program, r"^s1\.r0 B1: backward of unit 1 before its forward$")
    assert "!B1" in err.grid


def test_unit_run_twice_is_rejected() -> None:
    program = _copy(build_program("1f1b", [1, 1], 4))
    program[(0, 0)].append(Instr(Kind.FORWARD, 0))
    _rejects(program, "unit 0 is forwarded twice")


def test_forward_without_backward_is_rejected() -> None:
    program = _copy(build_program("1f1b", [1], 3))
    program[(0, 0)].remove(Instr(Kind.BACKWARD, 2))
    _rejects(program, "unit 2 is forwarded but never backwarded")


def test_deadlock_is_rejected() -> None:
    # stage 1 waits for unit 1 before backwarding unit 0; stage 0 waits for unit 0's gradient first
    a, g = Kind.SEND_ACT, Kind.SEND_GRAD
    program: Program = {
        (0, 0): [
            Instr(Kind.FORWARD, 0), Instr(a, 0, (1, 0)), Instr(Kind.RECV_GRAD, 0, (1, 0)), Instr(Kind.BACKWARD, 0),
            Instr(Kind.FORWARD, 1), Instr(a, 1, (1, 0)), Instr(Kind.RECV_GRAD, 1, (1, 0)), Instr(Kind.BACKWARD, 1),
        ],
        (1, 0): [
            Instr(Kind.RECV_ACT, 0, (0, 0)), Instr(Kind.FORWARD, 0), Instr(Kind.RECV_ACT, 1, (0, 0)),
            Instr(Kind.FORWARD, 1), Instr(Kind.BACKWARD, 0), Instr(g, 0, (0, 0)),
            Instr(Kind.BACKWARD, 1), Instr(g, 1, (0, 0)),
        ],
    }  # fmt: skip
    err = _rejects(program, r"deadlocks: s0\.r0 at RG0<1\.0, s1\.r0 at RA1<0\.0 wait forever")
    assert "!RG0<1.0" in err.grid and "!RA1<0.0" in err.grid


def test_out_of_order_messages_are_rejected() -> None:
    program = _copy(build_program("gpipe", [1, 1], 2, microbatches=2))
    s1 = program[(1, 0)]
    i, j = s1.index(Instr(Kind.RECV_ACT, 0, (0, 0))), s1.index(Instr(Kind.RECV_ACT, 1, (0, 0)))
    s1[i], s1[j] = s1[j], s1[i]
    _rejects(program, r"in the order \[0, 1\] but s1\.r0 receives them in the order \[1, 0\]")


def test_wrong_direction_and_uneven_all_reduce_are_rejected() -> None:
    program = _copy(build_program("1f1b", [1, 1], 2))
    program[(0, 0)][1] = Instr(Kind.SEND_GRAD, 0, (1, 0))
    _rejects(program, "the peer must be at an earlier stage than 0")
    program = _copy(build_program("1f1b", [2], 4))
    program[(0, 1)].remove(Instr(Kind.ALLREDUCE, 3))
    _rejects(program, r"stage 0's replicas join different numbers of all-reduces \(s0\.r0: 2, s0\.r1: 1\)")


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [
        ([1], 1),
        ([1, 1], 2),
        ([1, 1, 1, 1], 4),
        ([2], 2),
        ([2, 1], 2),
        ([2, 1, 1], 4),
        ([3, 2], 6),
        ([4, 4], 4),
    ],
)
def test_default_microbatches_fill_every_stage_and_every_replica(replicas: list[int], expected: int) -> None:
    # A flushing step's units go round-robin to a stage's replicas: M a multiple of every replica
    # count gives each replica the same share, and M >= stages gives every stage work when full.
    m = default_microbatches(replicas)
    assert m == expected
    assert m >= len(replicas) and all(m % r == 0 for r in replicas)
