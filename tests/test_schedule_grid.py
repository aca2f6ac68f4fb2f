"""The drawn grid equals tables drawn by hand, and `pdrun schedule` prints it."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from pdrun.cli import main
from pdrun.partition import partition
from pdrun.plans import cut_plan, traced_for
from shared.plan import save_plan
from shared.schedule import build_program, parse_instr, program_from_text
from shared.schedule_grid import draw_grid
from tests.test_run_flush import RESMLP

# PipeDream's 1F1B, 4 stages, 8 minibatches, forward = backward = 1 slot. Stage s warms up
# with S - s forwards; the last stage alternates from its first unit; the first backward
# reaches stage 0 at slot 2S - 1 = 7; then every worker alternates B and F; then drains.
ONE_F_ONE_B_4x8 = """\
       0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21
s0.r0 F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2 F6 B3 F7 B4  . B5  . B6  . B7
s1.r0  . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5  . B6  . B7  .
s2.r0  .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6  . B7  .  .
s3.r0  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7  .  .  ."""

# GPipe, 3 stages, 3 microbatches: all forwards, then backwards in reverse order;
# (M + S - 1) * 2 = 10 slots.
GPIPE_3x3 = """\
       0  1  2  3  4  5  6  7  8  9
s0.r0 F0 F1 F2  .  .  .  . B2 B1 B0
s1.r0  . F0 F1 F2  .  . B2 B1 B0  .
s2.r0  .  . F0 F1 F2 B2 B1 B0  .  ."""

# Stage 0 replicated: units alternate between s0.r0 and s0.r1 (round-robin); NOAM =
# ceil(3 workers / 2) = 2 units per input replica; the all-reduce after each backward
# makes the replicas wait for each other.
REPLICATED_2_1 = """\
       0  1  2  3  4  5  6  7  8  9
s0.r0 F0 F2  . B0  .  .  . B2  .  .
s0.r1 F1 F3  .  .  . B1  .  .  . B3
s1.r0  . F0 B0 F1 B1 F2 B2 F3 B3  ."""


def test_1f1b_4_stages_8_microbatches_matches_the_hand_drawn_table() -> None:
    assert draw_grid(build_program("1f1b", [1, 1, 1, 1], 8)) == ONE_F_ONE_B_4x8


def test_gpipe_and_replicated_grids_match_hand_drawn_tables() -> None:
    assert draw_grid(build_program("gpipe", [1, 1, 1], 3, microbatches=3)) == GPIPE_3x3
    assert draw_grid(build_program("1f1b", [2, 1], 4)) == REPLICATED_2_1


def test_detailed_grid_shows_communication_and_steps() -> None:
    grid = draw_grid(build_program("1f1b", [2, 1], 2), detail=True)
    rows = {
        line.split(" | ")[0].strip(): [c.strip() for c in line.split(" | ")[1:]] for line in grid.splitlines()
    }
    assert rows["s0.r0"][0] == "F0 SA0>1.0"
    assert rows["s1.r0"][1] == "RA0<0.0 F0"
    assert rows["s1.r0"][2] == "B0 SG0>0.0 S0"
    assert rows["s0.r0"][3] == "RG0<1.0 B0 AR0 S0"


def test_cli_draws_the_grid_and_summarises_on_stderr() -> None:
    result = CliRunner().invoke(
        main, ["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == ONE_F_ONE_B_4x8
    summary = result.stderr.strip()
    assert "\n" not in summary
    assert "bubble 27.3%" in summary  # 6 idle slots of 22 per worker: 1 - 16/22
    assert "peak in-flight s0.r0=4 s1.r0=3 s2.r0=2 s3.r0=1" in summary


def test_cli_json_lists_each_workers_instructions() -> None:
    result = CliRunner().invoke(
        main, ["schedule", "--schedule", "1f1b-flush", "--replicas", "2,1", "--microbatches", "4", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert sorted(data) == ["s0.r0", "s0.r1", "s1.r0"]
    assert program_from_text(data) == build_program("1f1b-flush", [2, 1], 4, microbatches=4)
    assert data["s0.r1"][-2:] == ["AR3", "S3"]
    assert all(str(parse_instr(t)) == t for t in data["s1.r0"])


def test_cli_errors_are_one_line_with_exit_status_2() -> None:
    result = CliRunner().invoke(main, ["schedule", "--replicas", "2,1", "--microbatches", "3"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "pdrun: error: units: 3 is not a multiple of stage 0's 2 replicas "
        "(1f1b all-reduces one unit per replica at a time); use 2"
    )
    result = CliRunner().invoke(main, ["schedule", "--stages", "3", "--replicas", "2,1"])
    assert result.exit_code == 2 and "--stages 3 but --replicas names 2 stages" in result.stderr


def test_cli_draws_a_plans_program_with_the_stage_dag_its_layers_make(tmp_path: Path) -> None:
    """`pdrun schedule PLAN` draws what `pdrun PLAN` runs: the residual MLP cut inside a block sends
    the block's input from stage 0 straight to stage 2, an edge no option names, and the program has
    its messages (the chain's program does not)."""
    plan = cut_plan(RESMLP, [5, 7], batch_size=8, schedule="1f1b-flush", microbatches=4)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    result = CliRunner().invoke(main, ["schedule", str(path), "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    edges = sorted(partition(traced_for(RESMLP), plan).edges())
    assert (0, 2) in edges
    drawn = program_from_text(json.loads(result.stdout))
    assert drawn == build_program("1f1b-flush", [1, 1, 1], 8, microbatches=4, stage_edges=edges)
    assert drawn != build_program("1f1b-flush", [1, 1, 1], 8, microbatches=4)
    assert "1f1b-flush: 3 stages, 3 workers, 8 units (4 per step)" in result.stderr

    result = CliRunner().invoke(main, ["schedule", str(path), "--microbatches", "2", "--json"])
    assert result.exit_code == 0, result.output
    drawn = program_from_text(json.loads(result.stdout))
    assert drawn == build_program("1f1b-flush", [1, 1, 1], 2, microbatches=2, stage_edges=edges)

    for option in (["--schedule", "gpipe"], ["--stages", "3"], ["--virtual-stages", "2"]):
        result = CliRunner().invoke(main, ["schedule", str(path), *option])
        assert result.exit_code == 2
        assert result.stderr.strip() == (
            f"pdrun: error: {option[0]}: the plan {path} sets it; draw without the plan to choose it, "
            "or plan again with pdplan"
        )
