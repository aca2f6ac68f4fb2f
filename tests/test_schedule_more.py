"""Interleaved 1F1B, ZB-H1 and 2BW: hand-drawn tables from the papers' figures, and invariants over grids."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from pdrun.cli import main
from shared.errors import UserError
from shared.schedule import (
    RECVS,
    Instr,
    Kind,
    Pipeline,
    Program,
    Schedule,
    ScheduleError,
    Worker,
    build_program,
    get_schedule,
    make_pipeline,
    max_in_flight,
    parse_instr,
    pipeline,
    program_from_text,
    program_to_text,
)
from shared.schedule_check import validate_program, validate_run
from shared.schedule_grid import draw_grid
from shared.schedule_more import two_bw_depth, two_bw_version
from shared.simulate import Costs, simulate
from tests.schedule_helpers import Wrapped

# Interleaved 1F1B as in Narayanan et al. (SC'21) Figure 4: 4 devices, 2 chunks each (device
# d holds virtual stages d and 4 + d), 8 microbatches, one step; f = b = 1 slot per chunk.
# Each device forwards microbatches 0-3 through chunk 0, the same four through chunk 1, then
# 4-7; device d warms up with 2 (4 - d - 1) + 4 forwards; the last virtual stage (s3, chunk
# 1) starts backwarding at slot 8; backwards go chunk 1 first. 38 slots, against 1f1b-flush's
# (8 + 3) x 2 = 22 slots of twice the size (44 here).
INTERLEAVED_4x2x8 = """\
       0  1  2  3    4    5    6    7    8    9   10   11   12   13   14   15   16   17   18   19   20   21   22   23   24   25   26   27   28   29   30   31   32   33 34 35 36 37
s0.r0 F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1   F4   F5   F6 B0.1   F7 B1.1    .    . F4.1 B2.1 F5.1 B3.1 F6.1   B0 F7.1   B1   B2   B3    . B4.1    . B5.1    . B6.1    . B7.1 B4 B5 B6 B7
s1.r0  . F0 F1 F2   F3 F0.1 F1.1 F2.1 F3.1   F4 B0.1   F5 B1.1   F6 B2.1   F7 B3.1 F4.1   B0 F5.1   B1 F6.1   B2 F7.1   B3    . B4.1    . B5.1    . B6.1    . B7.1   B4 B5 B6 B7  .
s2.r0  .  . F0 F1   F2   F3 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1   F4 B2.1   F5 B3.1   F6   B0   F7   B1 F4.1   B2 F5.1   B3 F6.1 B4.1 F7.1 B5.1    . B6.1    . B7.1   B4   B5 B6 B7  .  .
s3.r0  .  .  . F0   F1   F2   F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1   F4   B0   F5   B1   F6   B2   F7   B3 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1   B4   B5   B6 B7  .  .  ."""

# ZB-H1 as in Qi et al. (ICLR'24) Figure 3: 4 stages, 8 microbatches, f = b = w = 1 slot.
# 1F1B's forwards and input backwards (B), the weight gradients (W) lagging s backwards at
# stage s: the last stage runs B after B to send the gradients on, and does its W at the end
# while the earlier stages drain. 3 x 8 + 3 = 27 slots; 1F1B-flush with b + w = 2 takes 33.
ZB_H1_4x8 = """\
       0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
s0.r0 F0 F1 F2 F3  .  .  . B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
s1.r0  . F0 F1 F2  .  . B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
s2.r0  .  . F0 F1  . B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
s3.r0  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"""

# PipeDream-2BW (Narayanan et al., ICML'21, Figure 3): 2 stages, steps of 2 microbatches, no
# flush: 1F1B straight through, each step's optimizer step (S) right after the backward of
# the step's last unit, while the next step's units are already in flight.
TWO_BW_2x2 = """\
      |          0 |          1 |          2 |          3 |             4 |             5 |          6 |          7 |             8 |             9
s0.r0 | F0 SA0>1.0 | F1 SA1>1.0 |          . | RG0<1.0 B0 |    F2 SA2>1.0 | RG1<1.0 B1 S1 | F3 SA3>1.0 | RG2<1.0 B2 |             . | RG3<1.0 B3 S3
s1.r0 |          . | RA0<0.0 F0 | B0 SG0>0.0 | RA1<0.0 F1 | B1 SG1>0.0 S1 |    RA2<0.0 F2 | B2 SG2>0.0 | RA3<0.0 F3 | B3 SG3>0.0 S3 |             ."""


def test_interleaved_matches_the_papers_figure() -> None:
    assert (
        draw_grid(build_program("interleaved-1f1b", [1] * 4, 8, microbatches=8, chunks=2))
        == INTERLEAVED_4x2x8
    )


def test_zb_h1_matches_the_papers_figure() -> None:
    assert draw_grid(build_program("zb-h1", [1] * 4, 8, microbatches=8)) == ZB_H1_4x8


def test_2bw_steps_without_a_flush() -> None:
    assert draw_grid(build_program("2bw", [1, 1], 4, microbatches=2), detail=True) == TWO_BW_2x2


def test_messages_name_the_senders_chunk() -> None:
    # s1's chunk 0 (virtual stage 1) sends to s0's chunk 1 (virtual stage 2): both ends say chunk 0.
    program = build_program("interleaved-1f1b", [1, 1], 2, microbatches=2, chunks=2)
    s0, s1 = program[(0, 0)], program[(1, 0)]
    assert s1[s1.index(Instr(Kind.FORWARD, 0)) + 1] == Instr(Kind.SEND_ACT, 0, (0, 0))
    assert s0[s0.index(Instr(Kind.FORWARD, 0, None, 1)) - 1] == Instr(Kind.RECV_ACT, 0, (1, 0))
    assert s0[s0.index(Instr(Kind.FORWARD, 0, None, 1)) + 1] == Instr(Kind.SEND_ACT, 0, (1, 0), 1)
    assert s0[s0.index(Instr(Kind.BACKWARD, 0, None, 1)) + 1] == Instr(Kind.SEND_GRAD, 0, (1, 0), 1)
    assert str(Instr(Kind.SEND_ACT, 0, (1, 0), 1)) == "SA0.1>1.0"


# ---------------------------------------------------------------------------- text form


@pytest.mark.parametrize("text", ["F3.1", "B12.3", "W3", "W3.2", "SA3.1>1.0", "RG0.2<3.0", "F3", "SA3>1.0"])
def test_chunked_and_weight_text_round_trips(text: str) -> None:
    assert str(parse_instr(text)) == text


@pytest.mark.parametrize(
    ("text", "message"), [("F3.0", "not 0"), ("S3.1", "only on compute"), ("W3>1.0", "peer")]
)
def test_bad_chunk_text_is_rejected(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        parse_instr(text)


@pytest.mark.parametrize(
    ("schedule", "kwargs"),
    [
        ("interleaved-1f1b", {"replicas": [1, 1, 1], "units": 6, "microbatches": 3, "chunks": 3}),
        ("zb-h1", {"replicas": [2, 1], "units": 8, "microbatches": 4}),
        ("2bw", {"replicas": [2, 1], "units": 8, "microbatches": 4}),
    ],
)
def test_programs_round_trip_through_text(schedule: str, kwargs: dict[str, object]) -> None:
    program = build_program(schedule, **kwargs)  # type: ignore[arg-type]
    assert program_from_text(program_to_text(program)) == program


# ---------------------------------------------------------------------------- grids of cases


def _keys(instrs: list[Instr], kind: Kind) -> list[tuple[int, int]]:
    return [(i.unit, i.chunk) for i in instrs if i.kind is kind]


@pytest.mark.parametrize("stages", range(2, 6))
@pytest.mark.parametrize("chunks", range(2, 5))
@pytest.mark.parametrize("groups", range(1, 4))
def test_interleaved_invariants_and_bubble(stages: int, chunks: int, groups: int) -> None:
    m = groups * stages
    program = build_program("interleaved-1f1b", [1] * stages, 2 * m, microbatches=m, chunks=chunks)
    validate_program(program)  # sends match receives in order, no deadlock
    every = sorted((u, c) for u in range(2 * m) for c in range(chunks))
    for instrs in program.values():
        assert sorted(_keys(instrs, Kind.FORWARD)) == every and sorted(_keys(instrs, Kind.BACKWARD)) == every
        assert [i.unit for i in instrs if i.kind is Kind.STEP] == [m - 1, 2 * m - 1]
    # Each chunk is 1/V of its stage's layers: the paper's bubble, (S - 1) / (V m) of the ideal
    # 2 m per step, against 1f1b-flush's (S - 1) / m, exactly, in the simulator.
    per_chunk = [1 / chunks] * (stages * chunks)
    run = simulate(program, Costs(forward=per_chunk, backward=per_chunk, chunks=chunks))
    flush = simulate(build_program("1f1b-flush", [1] * stages, 2 * m, microbatches=m), Costs.uniform(stages))
    assert run.makespan == pytest.approx(2 * 2 * m * (1 + (stages - 1) / (chunks * m)))
    assert flush.makespan == pytest.approx(2 * 2 * m * (1 + (stages - 1) / m))
    assert run.bubble < flush.bubble


@pytest.mark.parametrize(
    ("stages", "replicas", "chunks"), [(2, 2, 2), (2, 3, 2), (3, 2, 2), (2, 2, 3), (4, 2, 2)]
)
def test_replicated_interleaved_is_a_pipeline_per_replica_index(
    stages: int, replicas: int, chunks: int
) -> None:
    # Unit u runs on replica u % n of every stage, through every chunk; each replica index is the
    # unreplicated pipeline over M / n microbatches, and a step ends in an all-reduce then the step.
    m = 2 * stages * replicas
    program = build_program("interleaved-1f1b", [replicas] * stages, 2 * m, microbatches=m, chunks=chunks)
    validate_program(program)
    alone = build_program(
        "interleaved-1f1b", [1] * stages, 2 * m // replicas, microbatches=m // replicas, chunks=chunks
    )
    for (stage, r), instrs in program.items():
        own = sorted((u, c) for u in range(r, 2 * m, replicas) for c in range(chunks))
        assert sorted(_keys(instrs, Kind.FORWARD)) == own and sorted(_keys(instrs, Kind.BACKWARD)) == own
        assert all(i.peer is None or i.peer[1] == r for i in instrs)  # peers of its own replica
        ends = [(i.kind, i.unit) for i in instrs if i.kind in (Kind.ALLREDUCE, Kind.STEP)]
        assert ends == [
            (Kind.ALLREDUCE, m - 1),
            (Kind.STEP, m - 1),
            (Kind.ALLREDUCE, 2 * m - 1),
            (Kind.STEP, 2 * m - 1),
        ]
        # The same order as the unreplicated pipeline's, unit k of the replica being unit k n + r.
        mine = [(i.kind, i.unit, i.chunk) for i in instrs if i.kind in (Kind.FORWARD, Kind.BACKWARD)]
        one = [
            (i.kind, i.unit * replicas + r, i.chunk)
            for i in alone[(stage, 0)]
            if i.kind in (Kind.FORWARD, Kind.BACKWARD)
        ]
        assert mine == one


@pytest.mark.parametrize(
    "replicas", [(1,), (1, 1), (1, 1, 1), (1, 1, 1, 1), (1,) * 6, (2, 1), (1, 2, 1), (3, 1, 1)]
)
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6, 8])
def test_zb_h1_invariants_and_memory(replicas: tuple[int, ...], microbatches: int) -> None:
    units = 2 * microbatches
    program = build_program("zb-h1", replicas, units, microbatches=microbatches)
    validate_program(program)
    flush = build_program("1f1b-flush", replicas, units, microbatches=microbatches)
    for w, instrs in program.items():
        mine = sorted(i.unit for i in flush[w] if i.kind is Kind.FORWARD)
        assert sorted(_keys(instrs, Kind.WEIGHT)) == [(u, 0) for u in mine]
        # every W after its B and before its step's optimizer step
        for u in mine:
            b, wi = instrs.index(Instr(Kind.BACKWARD, u)), instrs.index(Instr(Kind.WEIGHT, u))
            step = next(i for i, ins in enumerate(instrs) if ins.kind is Kind.STEP and ins.unit >= u)
            assert b < wi < step
        # forwards and input backwards keep 1F1B's order
        fb = [(i.kind, i.unit) for i in instrs if i.kind in (Kind.FORWARD, Kind.BACKWARD)]
        assert fb == [(i.kind, i.unit) for i in flush[w] if i.kind in (Kind.FORWARD, Kind.BACKWARD)]
    assert max_in_flight(program) == max_in_flight(flush)  # ZB-H1 keeps 1F1B's memory


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("extra", range(0, 7))
def test_zb_h1_bubble_is_the_papers(stages: int, extra: int) -> None:
    # Qi et al.: (S - 1)(T_F + T_B - T_W) per step, against 1F1B's (S - 1)(T_F + T_B + T_W), for m >= S.
    m = stages + extra
    run = simulate(build_program("zb-h1", [1] * stages, 2 * m, microbatches=m), Costs.uniform(stages))
    flush = simulate(
        build_program("1f1b-flush", [1] * stages, 2 * m, microbatches=m), Costs.uniform(stages, backward=2.0)
    )
    assert run.makespan == 2 * (3 * m + stages - 1)
    assert flush.makespan == 2 * (3 * m + 3 * (stages - 1))


@pytest.mark.parametrize("replicas", [(1,), (1, 1), (1, 1, 1), (1, 1, 1, 1), (2, 1), (1, 2), (2, 2, 1)])
@pytest.mark.parametrize("extra", [0, 1, 2, 4])
def test_2bw_invariants(replicas: tuple[int, ...], extra: int) -> None:
    depth = two_bw_depth(pipeline(replicas))
    step = 2 if any(n == 2 for n in replicas) else 1
    m = -(-(depth + extra) // step) * step
    units = 3 * m
    program = build_program("2bw", replicas, units, microbatches=m)
    validate_program(program)
    one_f_one_b = build_program("1f1b", replicas, units)
    for w, instrs in program.items():
        # 1F1B's compute order straight through the steps: no flush
        fb = [(i.kind, i.unit) for i in instrs if i.kind in (Kind.FORWARD, Kind.BACKWARD)]
        assert fb == [(i.kind, i.unit) for i in one_f_one_b[w] if i.kind in (Kind.FORWARD, Kind.BACKWARD)]
        # one optimizer step per m units, labelled with the step's last unit
        assert [i.unit for i in instrs if i.kind is Kind.STEP] == [m - 1, 2 * m - 1, 3 * m - 1]
        assert sum(i.kind is Kind.ALLREDUCE for i in instrs) == (3 if replicas[w[0]] > 1 else 0)
        # the version a unit runs on exists when its forward runs and is still kept at its backward:
        # at most the two newest versions (one step delay), every stage alike
        steps_before = 0
        for ins in instrs:
            if ins.kind is Kind.STEP:
                steps_before += 1
            elif ins.kind in (Kind.FORWARD, Kind.BACKWARD):
                version = two_bw_version(ins.unit, m)
                assert version <= steps_before <= version + 1, (w, ins, steps_before)


def test_2bw_version_is_one_step_late() -> None:
    assert [two_bw_version(u, 4) for u in range(0, 16, 2)] == [0, 0, 0, 0, 1, 1, 2, 2]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("schedule", "kwargs", "message"),
    [
        ("interleaved-1f1b", {"chunks": 1}, "at least 2 model chunks"),
        ("interleaved-1f1b", {"replicas": [2, 1]}, "same number of replicas at every stage"),
        ("interleaved-1f1b", {"microbatches": 3, "units": 6}, "not a multiple of the 2 stages"),
        (
            "interleaved-1f1b",
            {"replicas": [2, 2], "microbatches": 6, "units": 12},
            r"6 is not a multiple of 2 replicas x 2 stages.*use 4",
        ),
        ("interleaved-1f1b", {"replicas": [1]}, "at least 2 stages"),
        ("interleaved-1f1b", {"replicas": [1, 1, 1], "stage_edges": [(0, 1), (1, 2), (0, 2)]}, "chain"),
        ("1f1b-flush", {}, "runs one model chunk per worker, not 2"),
        ("2bw", {"chunks": 1, "microbatches": 1, "units": 4}, r"m >= pipeline depth\), got 1; use 2"),
        ("2bw", {"chunks": 1, "replicas": [2, 1], "microbatches": 5, "units": 10}, "multiple of stage 0's 2"),
    ],
)
def test_bad_arguments_are_user_errors(schedule: str, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"replicas": [1, 1], "units": 4, "microbatches": 4, "chunks": 2}
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=message) as info:
        build_program(schedule, **args)  # type: ignore[arg-type]
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def _copy(program: Program) -> Program:
    return {w: list(instrs) for w, instrs in program.items()}


def test_broken_split_backwards_are_rejected() -> None:
    program = _copy(build_program("zb-h1", [1, 1], 4, microbatches=4))
    program[(1, 0)].remove(Instr(Kind.WEIGHT, 2))
    with pytest.raises(ScheduleError, match=r"^s1\.r0 B2: unit 2 has no weight-gradient instruction \(W\)$"):
        validate_program(program)
    program = _copy(build_program("zb-h1", [1, 1], 4, microbatches=4))
    instrs = program[(0, 0)]
    w = instrs.pop(instrs.index(Instr(Kind.WEIGHT, 1)))
    instrs.insert(instrs.index(Instr(Kind.BACKWARD, 1)), w)
    with pytest.raises(ScheduleError, match="weight gradients of unit 1 before its backward") as info:
        validate_program(program)
    assert "!W1" in info.value.grid


def test_chunked_message_mismatch_is_rejected() -> None:
    program = _copy(build_program("interleaved-1f1b", [1, 1], 2, microbatches=2, chunks=2))
    instrs = program[(1, 0)]
    i = instrs.index(Instr(Kind.RECV_ACT, 1, (0, 0), 1))
    instrs[i] = Instr(Kind.RECV_ACT, 1, (0, 0))  # the chunk-0 message, received a second time
    with pytest.raises(ScheduleError, match=r"s1\.r0 RA1<0\.0: received twice"):
        validate_program(program)


@pytest.mark.parametrize(
    ("schedule", "replicas", "microbatches", "chunks"),
    [
        ("interleaved-1f1b", (1, 1, 1), 6, 2),
        ("interleaved-1f1b", (2, 2), 8, 2),
        ("zb-h1", (2, 1, 1), 4, 1),
        ("2bw", (1, 2, 1), 4, 1),
    ],
)
def test_window_validation_stands_for_a_long_run(
    schedule: str, replicas: tuple[int, ...], microbatches: int, chunks: int
) -> None:
    gen = get_schedule(schedule)
    pipe = make_pipeline(schedule, replicas, microbatches=microbatches, chunks=chunks)
    for units in (microbatches, 7 * microbatches, 10**6 * microbatches):
        assert gen.window(pipe, units) <= 8 * microbatches * max(replicas)
    validate_run(gen, pipe, [microbatches, 7 * microbatches, 10**6 * microbatches])
    whole = {w: list(gen.program(pipe, w, 0, 7 * microbatches)) for w in pipe.workers()}
    validate_program(whole)


def test_cli_draws_the_new_schedules() -> None:
    args = ["schedule", "--schedule", "interleaved-1f1b", "--stages", "4", "--virtual-stages", "2"]
    result = CliRunner().invoke(main, [*args, "--microbatches", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == INTERLEAVED_4x2x8
    assert "4 stages, 4 workers, 2 chunks per worker, 8 units" in result.stderr
    result = CliRunner().invoke(
        main, ["schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == ZB_H1_4x8
    assert "27 slots at f=b=w=1" in result.stderr
    result = CliRunner().invoke(
        main, ["schedule", "--schedule", "2bw", "--stages", "4", "--microbatches", "2"]
    )
    assert result.exit_code == 2
    assert (
        "--microbatches 2: 2bw accumulates a step over at least as many microbatches as a stage holds units in flight, 4 here"
        in result.stderr
    )
    result = CliRunner().invoke(main, ["schedule", "--schedule", "zb-h1", "--virtual-stages", "2"])
    assert result.exit_code == 2 and "--virtual-stages is for interleaved-1f1b" in result.stderr


class _DropReceives(Wrapped):
    """A second-wave generator with every receive of one residue of the period dropped on one worker."""

    def __init__(self, inner: Schedule, target: int, residue: int) -> None:
        super().__init__(inner)
        self.target, self.residue = target, residue

    def program(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        instrs = self.inner.program(pipe, worker, first, stop)
        if pipe.workers().index(worker) != self.target % len(pipe.workers()):
            return instrs
        p = self.period(pipe)
        return (i for i in instrs if not (i.kind in RECVS and i.unit % p == self.residue))


@pytest.mark.parametrize(
    ("schedule", "replicas", "microbatches", "chunks"),
    [
        ("interleaved-1f1b", (1, 1), 2, 2),
        ("interleaved-1f1b", (1, 1, 1), 3, 2),
        ("zb-h1", (1, 1, 1), 3, 1),
        ("zb-h1", (2, 1), 2, 1),
        ("2bw", (1, 1), 2, 1),
        ("2bw", (1, 2, 1), 4, 1),
    ],
)
def test_window_and_whole_validation_agree(
    schedule: str, replicas: tuple[int, ...], microbatches: int, chunks: int
) -> None:
    # As tests/test_schedule_window.py does for PipeDream's three: programs that run, and broken ones.
    gen = get_schedule(schedule)
    pipe = make_pipeline(schedule, replicas, microbatches=microbatches, chunks=chunks)
    cases: list[Schedule] = [gen] + [
        _DropReceives(gen, target, residue)
        for target in range(len(pipe.workers()))
        for residue in range(0, gen.period(pipe), max(1, gen.period(pipe) // 2))
    ]
    for case in cases:
        for steps in range(1, 13):
            units = steps * microbatches
            whole = {w: list(case.program(pipe, w, 0, units)) for w in pipe.workers()}
            try:
                validate_program(whole)
                whole_ok = True
            except ScheduleError:
                whole_ok = False
            try:
                validate_run(case, pipe, [units])
                window_ok = True
            except ScheduleError:
                window_ok = False
            assert whole_ok == window_ok, (case, units)
            # a dropped receive always breaks the program (where the worker had one to drop)
            dropped = any(len(whole[w]) != sum(1 for _ in gen.program(pipe, w, 0, units)) for w in whole)
            assert whole_ok == (not dropped), (case, units)
