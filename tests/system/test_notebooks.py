"""The notebooks in notebooks/ run top to bottom, and are stored without outputs.

Each notebook is executed with nbclient in a fresh Jupyter kernel running this interpreter
(the ``python3`` kernel resolves to ``sys.executable``; checked by a test), from an empty
temporary working directory, and any cell error fails the test with the cell's traceback.
The notebooks carry their own assertions (bit-identical resumes, logit parity, bytes written).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from support import paths

REPO = str(paths.REPO)
NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
EXPECTED = ["01_quickstart.ipynb", "02_export_to_hf.ipynb", "03_pytorch_dcp.ipynb",
            "04_rl_reference_policy.ipynb"]
CELL_TIMEOUT_S = 300
NOTEBOOK_TIMEOUT_S = 420


def _notebooks() -> list[str]:
    return sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))


def _tracked_notebooks() -> list[str]:
    """Notebooks git knows about (all of notebooks/ when git is unavailable)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", "notebooks/*.ipynb"], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return _notebooks()
    tracked = [os.path.join(REPO, line) for line in out.splitlines() if line.strip()]
    return sorted(set(tracked) | set(_notebooks()))


def _client_modules():
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed "
                                   "(pip install -e '.[notebooks]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed "
                                   "(pip install -e '.[notebooks]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed "
                        "(pip install -e '.[notebooks]')")
    return nbformat, nbclient


def _execute(nb, workdir: str):
    _, nbclient = _client_modules()
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, allow_errors=False,
        resources={"metadata": {"path": workdir}})
    client.execute()
    return nb


def test_every_expected_notebook_is_there():
    assert [os.path.basename(p) for p in _notebooks()] == EXPECTED


@pytest.mark.parametrize("path", _tracked_notebooks(), ids=os.path.basename)
def test_notebook_is_stored_without_outputs(path):
    with open(path, encoding="utf-8") as handle:
        nb = json.load(handle)
    dirty = [f"cell {i}: {len(cell.get('outputs', []))} output(s), execution_count "
             f"{cell.get('execution_count')!r}"
             for i, cell in enumerate(nb["cells"])
             if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{os.path.basename(path)} has outputs; clear them before committing "
                       f"(e.g. jupyter nbconvert --clear-output --inplace):\n" + "\n".join(dirty))
    first, second = nb["cells"][0], nb["cells"][1]
    assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# ")
    assert second["cell_type"] == "code" and "google.colab" in "".join(second["source"])


def test_kernel_runs_this_interpreter(tmp_path):
    nbformat, _ = _client_modules()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os, sys\nprint(sys.executable)\nprint(os.getcwd())")]
    _execute(nb, str(tmp_path))
    # The kernel sends what a cell prints in pieces, each flushed 0.2 s after its first
    # write: a kernel stalled between the two prints sends two stream outputs. Read them all.
    lines = "".join(output["text"] for output in nb.cells[0].outputs
                    if output.get("name") == "stdout").splitlines()
    assert os.path.realpath(lines[0]) == os.path.realpath(sys.executable)
    assert os.path.realpath(lines[1]) == os.path.realpath(str(tmp_path))


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", _notebooks(), ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    nbformat, _ = _client_modules()
    nb = nbformat.read(path, as_version=4)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    _execute(nb, str(workdir))
    # The notebooks keep their files in a temporary directory of their own and remove it.
    assert os.listdir(workdir) == []
    errors = [o for cell in nb.cells for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
