"""Drawing a program as a step-by-worker grid, for ``pdrun schedule`` and for validation errors."""

from __future__ import annotations

from collections.abc import Sequence

from shared.schedule import COMPUTE, RECVS, Instr, Program, Worker, worker_name
from shared.simulate import Costs, run_timeline


def draw_grid(program: Program, *, detail: bool = False, marks: Sequence[tuple[Worker, int]] = ()) -> str:
    """A step-by-worker grid of a unit-time run (forward = backward = 1, messages instant).

    Rows are workers, columns time slots, cells the compute op run there (``F3``, ``B3``)
    or ``.``. With ``detail`` a cell holds all the instructions around its compute op:
    the receives before it, the sends, all-reduce and step after it. ``marks`` point at
    instructions (worker, index) to flag with ``!``; one that never ran is drawn in the
    slot after its worker's last op.
    """
    stages = 1 + max((s for s, _ in program), default=0)
    timeline = run_timeline(program, Costs.uniform(stages))
    slot_of = {(op.worker, op.position): int(op.start) for op in timeline.ops if op.instr.kind in COMPUTE}
    marked = set(marks)
    rows: dict[Worker, dict[int, list[str]]] = {w: {} for w in program}
    lasts: dict[Worker, int] = {}
    for (ww, _), at in slot_of.items():
        lasts[ww] = max(lasts.get(ww, -1), at)
    for w, instrs in program.items():
        last = lasts.get(w, -1)
        for group in _groups(instrs):
            compute = next((i for i in group if instrs[i].kind in COMPUTE), None)
            slot = slot_of.get((w, compute)) if compute is not None else None
            flagged = [i for i in group if (w, i) in marked]
            if slot is None:
                if not flagged:
                    continue
                last += 1
                slot = last
            shown = [i for i in group if detail or i == compute or i in flagged]
            rows[w].setdefault(slot, []).extend(("!" if i in flagged else "") + str(instrs[i]) for i in shown)
    width = 1 + max((s for cells in rows.values() for s in cells), default=-1)
    cols = [[" ".join(rows[w].get(c, ["."])) for c in range(width)] for w in sorted(program)]
    col_w = [max([len(str(c))] + [len(r[c]) for r in cols]) for c in range(width)]
    names = [worker_name(w) for w in sorted(program)]
    name_w = max([len(n) for n in names] + [4])
    sep = " | " if detail else " "  # detailed cells hold spaces themselves
    lines = [sep.join([" " * name_w] + [str(c).rjust(col_w[c]) for c in range(width)]).rstrip()]
    for name, row in zip(names, cols, strict=True):
        lines.append(sep.join([name.ljust(name_w)] + [row[c].rjust(col_w[c]) for c in range(width)]).rstrip())
    if marked:
        lines.append("(! marks the failing instruction)")
    return "\n".join(lines)


def _groups(instrs: Sequence[Instr]) -> list[list[int]]:
    """Indices grouped around compute ops: receives before one, sends/all-reduce/step after it."""
    groups: list[list[int]] = [[]]
    has_compute = False
    for i, ins in enumerate(instrs):
        if ins.kind in RECVS and has_compute:
            groups.append([])
            has_compute = False
        elif ins.kind in COMPUTE:
            if has_compute:
                groups.append([])
            has_compute = True
        groups[-1].append(i)
    return [g for g in groups if g]
