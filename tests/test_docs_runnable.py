"""The documentation runs as written: every shell block of README.md and docs/*.md marked runnable.

A block is runnable when its fence's info string is ``sh runnable`` (GitHub still highlights it as
``sh``). Each runs under ``bash -eu -o pipefail`` in a fresh temporary folder that holds links to the
checkout's ``.venv`` and ``profiles/`` (what a user's clone has beside the commands), with the
checkout's packages first on ``PYTHONPATH`` and its ``.venv/bin`` first on ``PATH``; what a block
writes stays in its folder. A block that fails shows its command and the end of its output.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = "sh runnable"
# A fence of three or more backticks, with the info string after it.
FENCE = re.compile(r"^(`{3,})\s*(.*?)\s*$")


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, body) of each block of ``text`` whose info string is ``MARK``."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, info = opened.groups()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if info == MARK:
            out.append((i + 1, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return out


BLOCKS = [
    pytest.param(page, body, id=f"{page.relative_to(REPO)}:{line}")
    for page in PAGES
    for line, body in runnable_blocks(page.read_text())
]


def test_the_marker_is_found_where_the_docs_use_it() -> None:
    # The README's pipeline, PipeDream-profile import and own-model blocks, and pdplan's page's import.
    pages = {page.relative_to(REPO).as_posix() for page in PAGES if runnable_blocks(page.read_text())}
    assert {"README.md", "docs/pdplan.md"} <= pages
    assert len(runnable_blocks((REPO / "README.md").read_text())) >= 3
    # A block in another fence, or not marked, is left alone; a marked one inside a longer fence is found.
    text = "```\nfalse\n```\n```sh runnable\ntrue\n```\n````sh runnable\n```\necho\n```\n````\n"
    assert runnable_blocks(text) == [(4, "true\n"), (7, "```\necho\n```\n")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("page", "body"), BLOCKS)
def test_block_runs_as_written(page: Path, body: str, tmp_path: Path) -> None:
    for name in (".venv", "profiles"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(REPO / ".venv" / "bin"), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(
        ["bash", "-eu", "-o", "pipefail", "-c", body],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, (
        f"{page.relative_to(REPO)}: block exited {done.returncode}:\n{body}\n--- stdout ---\n"
        f"{done.stdout[-2000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    )
