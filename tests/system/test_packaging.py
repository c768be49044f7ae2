"""The distributions as a user gets them: the sdist is built from a copy of the source tree,
the wheel from the unpacked sdist (the release path: whatever the sdist lacks, the wheel
lacks), both archives' file lists are checked, and the wheel is installed with pip into a
fresh virtual environment whose ``jaxckpt`` and ``torch_bridge`` are then imported and run.

Offline: the build uses the setuptools installed here (no build isolation), and the fresh
environment gets the package alone (``--no-deps --no-index``); its dependencies (numpy and
the others already installed here) are made visible through one ``.pth`` line naming this
interpreter's site-packages, after its own, so the package itself must come from the wheel.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import jaxckpt

from support.paths import REPO

PACKAGES = ("jaxckpt", "torch_bridge")
# What a local checkout may hold that no distribution may carry.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                     "__pycache__", "*.pyc", ".pytest_cache",
                                     ".ipynb_checkpoints")
# Planted in the copy before the sdist is built: a checkout's local artefacts.
ARTEFACTS = (".venv/lib/site.py", "build/lib/jaxckpt/stale.py", "dist/old-1.0.tar.gz",
             "tests/unit/__pycache__/test_policy.cpython-311.pyc",
             "notebooks/.ipynb_checkpoints/01_quickstart-checkpoint.ipynb")


def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return out.stdout


# The project's sources: these files, and every file under these folders. (Other files of a
# checkout, e.g. the checkpoints the README's examples write into the working directory, are
# not the project's.)
TOP_FILES = ("LICENSE", "MANIFEST.in", "Makefile", "README.md", "pyproject.toml", ".ci/run")
FOLDERS = (*PACKAGES, "tests", "docs", "notebooks", "benchmarks")


def source_files() -> set[str]:
    """Every file of the project that the sdist must carry, relative to the root."""
    found = {name for name in TOP_FILES if (REPO / name).is_file()}
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*"):
            relative = path.relative_to(REPO)
            if path.is_file() and not any(NOT_SOURCES(str(REPO), [part])
                                          for part in relative.parts):
                found.add(relative.as_posix())
    return found


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("packaging")
    tree, out = base / "tree", base / "dist"
    shutil.copytree(REPO, tree, ignore=NOT_SOURCES)
    for name in ARTEFACTS:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("a local artefact\n")
    run(sys.executable, "-c", f"from setuptools import build_meta; "
                              f"build_meta.build_sdist({str(out)!r})", cwd=tree)
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        # The "data" filter where this Python has it (3.10.12+, 3.11.4+): plain files only.
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(base / "unpacked", **extra)
    (unpacked,) = (base / "unpacked").iterdir()
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--no-index", "-q", "-w", out, ".", cwd=unpacked)
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "unpacked": unpacked, "base": base}


def sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as archive:
        return {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}


def test_the_sdist_holds_every_source_file_and_nothing_local(dists):
    names = sdist_names(dists["sdist"])
    missing = sorted(source_files() - names)
    assert missing == [], f"files of the checkout missing from the sdist: {missing}"
    for needed in ("LICENSE", "README.md", "Makefile", "pyproject.toml", "tests/conftest.py",
                   "tests/support/crash_worker.py", "jaxckpt/py.typed", "torch_bridge/py.typed"):
        assert needed in names
    assert any(n.startswith("tests/integration/data/golden_root/") for n in names)
    leaked = sorted(n for n in names
                    if n in ARTEFACTS or n.split("/")[0] in (".venv", "build", "dist")
                    or "__pycache__" in n or n.endswith(".pyc") or ".ipynb_checkpoints" in n)
    assert leaked == []


def test_the_wheel_holds_the_two_packages_typed_the_license_and_the_command(dists):
    with zipfile.ZipFile(dists["wheel"]) as archive:
        names = set(archive.namelist())
        dist_info = f"jaxckpt-{jaxckpt.__version__}.dist-info"
        metadata = email.message_from_string(archive.read(f"{dist_info}/METADATA").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert {n.split("/")[0] for n in names} == {*PACKAGES, dist_info}
    sources = {n for n in source_files() if n.split("/")[0] in PACKAGES}
    assert sources <= names and {"jaxckpt/py.typed", "torch_bridge/py.typed"} <= sources
    assert {n for n in names if not n.startswith(dist_info)} == sources
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "[console_scripts]\njaxckpt = jaxckpt.tools.cli:main" in entry_points
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    classifiers = metadata.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert metadata["Author"] == "jaxckpt developers"
    assert metadata["Keywords"]
    assert metadata.get_all("Project-URL") is None  # no hosted home to point at
    assert set(metadata.get_all("Provides-Extra")) >= {"jax", "torch", "hf"}


SMOKE = """\
import sys, jaxckpt, torch_bridge, jaxckpt.tools.cli
from importlib import resources
assert jaxckpt.__file__.startswith(sys.prefix), jaxckpt.__file__
assert torch_bridge.__file__.startswith(sys.prefix), torch_bridge.__file__
assert resources.files("jaxckpt").joinpath("py.typed").is_file()
assert resources.files("torch_bridge").joinpath("py.typed").is_file()
assert not {"jax", "torch"} & set(sys.modules), "the plain imports load no framework"
print(jaxckpt.__version__, sorted(torch_bridge.__all__)[0])
"""


def test_the_wheel_installs_into_a_fresh_venv_and_runs(dists):
    venv = dists["base"] / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=dists["base"])
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "-q", dists["wheel"], cwd=dists["base"])
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                    cwd=dists["base"]).strip())
    (site / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    assert run(python, "-c", SMOKE, cwd=dists["base"], env=env).split() == [
        jaxckpt.__version__, "ARCHITECTURES"]
    command = venv / "bin" / "jaxckpt"
    assert run(command, "--version", cwd=dists["base"], env=env).strip() == \
        f"jaxckpt {jaxckpt.__version__}"
    golden = dists["unpacked"] / "tests" / "integration" / "data" / "golden_root"
    run(command, "verify", golden, cwd=dists["base"], env=env)  # exit 0: it verifies


def test_twine_accepts_both_distributions(dists):
    """What the package index checks on upload: the metadata renders and nothing required is
    missing (``--strict`` turns its warnings, e.g. a missing long description type, into
    failures)."""
    pytest.importorskip("twine", reason="twine comes with the lint extra")
    out = run(sys.executable, "-m", "twine", "check", "--strict", dists["sdist"],
              dists["wheel"], cwd=dists["base"])
    assert out.count("PASSED") == 2, out


def test_a_test_module_runs_from_the_unpacked_sdist(dists):
    """conftest.py, the support package and the pytest settings travel with the tests."""
    unpacked = dists["unpacked"]
    env = dict(os.environ, PYTHONPATH=str(unpacked))
    out = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/unit/test_architecture.py", "tests/unit/core/test_extras.py", cwd=unpacked,
              env=env)
    assert " passed" in out and "failed" not in out


def test_the_package_page_needs_no_checkout(dists):
    """The README is the package index page (the wheel's long description), where a link to
    a file of the repository resolves nowhere: it links to none, and it shows the install
    of each extra."""
    with zipfile.ZipFile(dists["wheel"]) as archive:
        metadata = email.message_from_string(  # text: the page is UTF-8
            archive.read(f"jaxckpt-{jaxckpt.__version__}.dist-info/METADATA").decode())
    page = metadata.get_payload()
    assert page.strip() == (REPO / "README.md").read_text().strip()
    links = re.findall(r"\]\(([^)]*)\)|<a\s[^>]*href=\"([^\"]*)\"", page)
    relative = [target for pair in links for target in pair
                if target and not re.match(r"[a-z]+://", target)]
    assert relative == [], f"links that resolve only in a checkout: {relative}"
    for extra in ("jax", "torch", "jax,hf"):
        assert f"pip install 'jaxckpt[{extra}]'" in page
