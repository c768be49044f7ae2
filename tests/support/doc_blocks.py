"""The ```python blocks of README.md and docs/*.md, with the section each stands in.

Used by tests/system/test_doc_blocks.py (every block runs) and
tests/system/test_doc_kill_resume.py (the training programs resume bit-exact after SIGKILLs).
Owns no behaviour beyond reading the pages; imports nothing from the library.
"""

from __future__ import annotations

from pathlib import Path

from support.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRAGMENT = "# fragment"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of a page."""
    return [(line, code) for line, _, code in sectioned_blocks(page)]


def sectioned_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line number, heading of the section it is in, code) of every ```python block."""
    blocks, code, start, heading = [], None, 0, ""
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if code is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif code is None and line.strip() == "```python":
            code, start = [], number + 1
        elif code is not None and line.strip() == "```":
            blocks.append((start, heading, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    assert code is None, f"{page.name}: a ```python block opened at line {start} never closes"
    return blocks


def program(page: Path, heading: str) -> str:
    """The one complete program in the section ``heading`` of ``page``."""
    found = [code for _, title, code in sectioned_blocks(page)
             if title == heading and not code.startswith(FRAGMENT)]
    assert len(found) == 1, (f"{page.name}: expected one complete ```python program under "
                             f"'{heading}', found {len(found)}; update the test that reads it")
    return found[0]
