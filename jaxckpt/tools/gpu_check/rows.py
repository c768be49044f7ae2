"""The rows of ``make gpu-check``: one result each, the markdown table, and the JSON a part's
child process hands back.

Owns: :class:`Row` and its statuses, :func:`format_table`, :func:`write_rows` /
:func:`read_rows`, and the small helpers the parts share to time and compare (``median``,
``ratio_row``).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Sequence
from typing import Literal

__all__ = ["Row", "Status", "format_table", "write_rows", "read_rows", "ratio_row", "median",
           "error_row", "short_error"]

#: pass: the check held. FAIL: it did not, or the part raised (fails the run). skipped: the
#: part could not run here (the reason is the result). missed: a measured target not
#: reached; reported, never a failure of the run (the disk and the load are the machine's).
Status = Literal["pass", "FAIL", "skipped", "missed"]
_STATUSES = ("pass", "FAIL", "skipped", "missed")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One line of the results table.

    Args:
        part: the part it belongs to, e.g. "1 jax round trip".
        what: what was checked or measured.
        result: what came out, in words (or why it was skipped, or the error).
        figure: the number behind it (a ratio, seconds, bytes), "" when none.
        status: see :data:`Status`.
    """

    part: str
    """The part it belongs to."""
    what: str
    """What was checked or measured."""
    result: str
    """What came out, in words."""
    figure: str = ""
    """The number behind it, "" when none."""
    status: Status = "pass"
    """pass, FAIL, skipped or missed."""

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"Row(status=...) must be one of {_STATUSES}, got {self.status!r}.")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio_row(part: str, what: str, ratio: float, *, at_most: float | None = None,
              at_least: float | None = None, detail: str = "") -> Row:
    """A measured ratio against its target: ``missed`` (not FAIL) when outside it."""
    met = ((at_most is None or ratio <= at_most) and (at_least is None or ratio >= at_least))
    target = f"<= {at_most}" if at_most is not None else f">= {at_least}"
    return Row(part=part, what=f"{what}, target {target}", result=detail,
               figure=f"{ratio:.2f}", status="pass" if met else "missed")


def short_error(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:limit]


def error_row(part: str, what: str, error: BaseException) -> Row:
    """A check that raised: FAIL with the error; its traceback goes to the part's log."""
    import traceback

    traceback.print_exception(error)
    return Row(part=part, what=what, result=short_error(error), status="FAIL")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def format_table(rows: Sequence[Row], *, heading: str = "") -> str:
    """The rows as a markdown table, ``heading`` (a line of facts) above it."""
    lines = [heading, ""] if heading else []
    lines += ["| part | what | result | figure | status |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {_cell(r.part)} | {_cell(r.what)} | {_cell(r.result)} | {_cell(r.figure)} "
              f"| {r.status} |" for r in rows]
    return "\n".join(lines) + "\n"


def write_rows(path: str, rows: Sequence[Row]) -> None:
    """Write ``rows`` as JSON to ``path`` atomically (a reader sees all of them or none)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump([dataclasses.asdict(row) for row in rows], handle)
    os.replace(tmp, path)


def read_rows(path: str) -> list[Row]:
    """The rows :func:`write_rows` wrote; [] when the file is missing."""
    try:
        with open(path) as handle:
            items = json.load(handle)
    except FileNotFoundError:
        return []
    return [Row(**item) for item in items]
