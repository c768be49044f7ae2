"""Every import that the package, a test, a notebook or a documentation block makes is
installable from what the project declares: its dependencies plus the extras the README's
test command installs (the Makefile's EXTRAS). A package that only works because a
developer installed it by hand fails here, naming the file and the import."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import tomllib

from support.paths import REPO

# Test modules and the shared helpers import each other by these names.
LOCAL = ({"jaxckpt", "torch_bridge", "support"}
         | {p.stem for p in (REPO / "tests").rglob("*.py")})


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _normalise(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = re.search(r"^EXTRAS\s*:=\s*(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert extras, "the Makefile names the extras `make test` installs (EXTRAS := ...)"
    specs = list(project["dependencies"])
    for extra in extras.group(1).split(","):
        assert extra in project["optional-dependencies"], f"Makefile extra {extra!r} undeclared"
        specs += project["optional-dependencies"][extra]
    return {_requirement_name(spec) for spec in specs}


def notebook_modules() -> set[str]:
    """Modules a notebook writes itself (``%%writefile NAME.py``) and then imports."""
    found = set()
    for path in (REPO / "notebooks").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            first = "".join(cell["source"]).split("\n", 1)[0]
            if first.startswith("%%writefile") and first.endswith(".py"):
                found.add(Path(first.split()[-1]).stem)
    return found


def python_sources() -> dict[str, str]:
    """Every piece of Python the project ships or shows, by where it comes from."""
    sources = {}
    for folder in ("jaxckpt", "torch_bridge", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            sources[str(path.relative_to(REPO))] = path.read_text()
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for number, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                text = "".join(cell["source"])
                # IPython magics and shell lines are not Python.
                text = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                 for line in text.splitlines())
                sources[f"{path.relative_to(REPO)} cell {number}"] = text
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)
        for number, block in enumerate(blocks):
            sources[f"{path.relative_to(REPO)} block {number}"] = block
    return sources


def _optional(tree: ast.AST) -> set[int]:
    """Ids of import nodes guarded by ``except ImportError`` (optional by design)."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                              "ModuleNotFoundError")
                for h in node.handlers):
            guarded |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return guarded


def top_level_imports(source: str) -> set[str]:
    names = set()
    tree = ast.parse(source)
    optional = _optional(tree)
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - {"__future__"}


def test_every_import_is_installed_by_a_declared_dependency_or_extra():
    declared = declared_distributions()
    providers = importlib.metadata.packages_distributions()
    problems = []
    for where, source in python_sources().items():
        for module in sorted(top_level_imports(source)):
            if module in sys.stdlib_module_names or module in LOCAL | notebook_modules():
                continue
            found = {_normalise(d) for d in providers.get(module, [])}
            if not found:
                problems.append(f"{where}: `import {module}` comes from no installed package")
            elif not found & declared:
                problems.append(f"{where}: `import {module}` needs {sorted(found)}, which no "
                                f"declared dependency or extra of the README's install names")
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_the_scan_sees_notebook_and_doc_imports():
    # The scan must reach every kind of source, or the test above proves nothing for it.
    sources = python_sources()
    assert any("notebooks/03_pytorch_dcp.ipynb" in where and "torchdata" in
               top_level_imports(text) for where, text in sources.items())
    assert any(where.startswith("README.md block") for where in sources)
    assert any(where.startswith("docs/") for where in sources)
