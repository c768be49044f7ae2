"""What kind of memory an array lies in, for tests that pin where reads put their bytes.

``mapping_flags`` reads the ``VmFlags`` of the mapping holding an address from
/proc/self/smaps (``hg``: advised to use huge pages); ``numpy_huge_page_advice`` switches
numpy's own advice of huge pages (on by default on Linux) on for a block of code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest


def mapping_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the memory mapping that holds ``address`` (/proc/self/smaps):
    ``hg`` marks memory advised to use huge pages (``MADV_HUGEPAGE``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):  # a mapping's header: "start-end perms ..."
                start, end = (int(bound, 16) for bound in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@contextlib.contextmanager
def numpy_huge_page_advice() -> Iterator[None]:
    """numpy's advice of huge pages for its arrays of 4 MiB or more, switched on inside
    (skips the test where this numpy has no such switch)."""
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        pytest.skip("this numpy has no huge page advice")
    previous = switch(True)
    try:
        yield
    finally:
        switch(previous)
