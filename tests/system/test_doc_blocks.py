"""The documentation runs as written: every ```python block of README.md and docs/*.md is a
complete program, run here in a fresh empty directory in its own process, unless its first
line says ``# fragment`` (a piece of a larger program, shown for its shape)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support.doc_blocks import FRAGMENT, PAGES, python_blocks
from support.paths import REPO

HANG_GUARD_S = 600  # a guard against hangs, not a speed target (that is `jaxckpt bench`)

ALL_BLOCKS = [(page, line, code) for page in PAGES for line, code in python_blocks(page)]
RUNNABLE = [pytest.param(code, id=f"{page.relative_to(REPO)}:{line}")
            for page, line, code in ALL_BLOCKS if not code.startswith(FRAGMENT)]


@pytest.mark.parametrize("code", RUNNABLE)
def test_block_runs_as_written_in_an_empty_directory(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, (
        f"the block exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-6000:]}")


def test_every_readme_block_is_a_complete_program():
    readme = [code for page, _, code in ALL_BLOCKS if page.name == "README.md"]
    assert len(readme) >= 3
    assert not [code for code in readme if code.startswith(FRAGMENT)]


def test_fragments_are_marked_on_their_first_line_only():
    # A marker further down would not make the test skip the block: it would run and fail,
    # so a misplaced marker shows up; this catches the spelling the runner skips on.
    for page, line, code in ALL_BLOCKS:
        marked = [n for n, text in enumerate(code.splitlines()) if text.strip() == FRAGMENT]
        assert marked in ([], [0]), f"{page.name}:{line}: '{FRAGMENT}' belongs on the first line"
        assert not re.match(r"#\s*fragment", code) or code.startswith(FRAGMENT), (
            f"{page.name}:{line}: write the marker exactly as '{FRAGMENT}'")
