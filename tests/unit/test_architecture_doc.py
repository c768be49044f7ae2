"""docs/architecture.md is the map of the code: checked against the tree and FOLDERS.

- Every package folder (a folder with an ``__init__.py``) of jaxckpt and torch_bridge has a
  line in the map's tree, and every folder the tree names is such a folder.
- Every module the tree names exists.
- The import table's rows are FOLDERS' rows (tests/unit/test_architecture.py): the same
  folders, what each may import of jaxckpt, its third-party modules and its public modules.

Each check has a self-test on a synthetic map and tree, so that it can be seen to fail.
"""

from __future__ import annotations

from pathlib import Path

from test_architecture import FOLDERS, FRAMEWORKS, Folder

from support.paths import REPO

MAP = REPO / "docs" / "architecture.md"
PACKAGES = ("jaxckpt", "torch_bridge")
TREE_HEADING = "## The tree"
TABLE_HEADING = "## Who may import whom"


def _section(text: str, heading: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def tree_paths(text: str) -> list[str]:
    """The first word of every line of the ```text block under the tree heading."""
    paths, inside = [], False
    for line in _section(text, TREE_HEADING):
        if line.strip().startswith("```"):
            if inside:
                break
            inside = True
        elif inside and line.strip():
            paths.append(line.split()[0])
    return paths


def package_folders(root: Path) -> set[str]:
    return {f"{init.parent.relative_to(root).as_posix()}/"
            for package in PACKAGES for init in (root / package).rglob("__init__.py")}


def tree_problems(text: str, root: Path) -> list[str]:
    named = tree_paths(text)
    folders = {path for path in named if path.endswith("/")}
    modules = [path for path in named if not path.endswith("/")]
    actual = package_folders(root)
    problems = [f"{folder}: a package folder the map's tree does not name"
                for folder in sorted(actual - folders)]
    problems += [f"{folder}: named in the map's tree, but no package folder there"
                 for folder in sorted(folders - actual)]
    problems += [f"{module}: named in the map's tree, but no such module"
                 for module in modules
                 if not module.endswith(".py") or not (root / module).is_file()]
    problems += [f"{path}: named twice in the map's tree"
                 for path in sorted({p for p in named if named.count(p) > 1})]
    return problems


def _cell(cell: str) -> frozenset[str]:
    words = {word.strip(" `") for word in cell.split(",")}
    return frozenset(word for word in words if word and word != "-")


def table_rows(text: str) -> dict[str, tuple[frozenset[str], ...]]:
    """folder -> (may import, frameworks, third party, public) of the map's import table.
    A folder of jaxckpt is written without ``jaxckpt.``, as are the modules it may import."""
    rows = {}
    for line in _section(text, TABLE_HEADING):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue
        folder = cells[0].strip("`")
        if not folder.startswith(PACKAGES):  # jaxckpt's folders are named without the package
            folder = f"jaxckpt.{folder}"
        rows[folder] = tuple(_cell(cell) for cell in cells[1:])
    return rows


def _frameworks_cell(row: Folder) -> frozenset[str]:
    allowed = FRAMEWORKS - row.never
    if not allowed:
        return frozenset({"none"})
    return frozenset({"all but " + ", ".join(sorted(row.never))})


def table_problems(text: str, folders: dict[str, Folder]) -> list[str]:
    rows = table_rows(text)
    problems = [f"{name}: a FOLDERS row the map's import table lacks"
                for name in sorted(set(folders) - set(rows))]
    problems += [f"{name}: a row of the map's import table that FOLDERS lacks"
                 for name in sorted(set(rows) - set(folders))]
    for name in sorted(set(rows) & set(folders)):
        row = folders[name]
        expected = (frozenset(m.removeprefix("jaxckpt.") for m in row.may_import),
                    _frameworks_cell(row), row.third_party, row.public)
        for column, got, want in zip(("may import", "frameworks", "third party", "public"),
                                     rows[name], expected, strict=True):
            if got != want:
                problems.append(f"{name}, {column}: the map says {sorted(got)}, FOLDERS "
                                f"says {sorted(want)}")
    return problems


# ------------------------------------------------------------------------- the real map


def test_the_map_names_every_package_folder_and_only_modules_that_exist():
    text = MAP.read_text(encoding="utf-8")
    assert {"jaxckpt/", "jaxckpt/core/", "torch_bridge/dcp/"} <= set(tree_paths(text))
    problems = tree_problems(text, REPO)
    assert not problems, "docs/architecture.md's tree is stale:\n" + "\n".join(problems)


def test_the_maps_import_table_is_the_folder_table():
    problems = table_problems(MAP.read_text(encoding="utf-8"), FOLDERS)
    assert not problems, ("docs/architecture.md's import table and FOLDERS in "
                          "tests/unit/test_architecture.py disagree:\n" + "\n".join(problems))


# ------------------------------------------------- the checks fail where they should


SYNTHETIC_MAP = """# Map

## The tree

```text
jaxckpt/                  the library
jaxckpt/config.py         configs
jaxckpt/core/             pure
jaxckpt/core/policy.py    decisions
torch_bridge/             torch
```

## Who may import whom

| folder | may import (jaxckpt.) | frameworks | third party | public |
| --- | --- | --- | --- | --- |
| `core` | core, errors | none | numpy | policy |
"""


def _synthetic_tree(root: Path, folders: list[str], modules: list[str]) -> Path:
    for folder in folders:
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    for module in modules:
        (root / module).write_text("")
    return root


def test_self_the_tree_check(tmp_path):
    base = ["jaxckpt", "jaxckpt/core", "torch_bridge"]
    modules = ["jaxckpt/config.py", "jaxckpt/core/policy.py"]
    assert tree_problems(SYNTHETIC_MAP, _synthetic_tree(tmp_path / "same", base, modules)) == []
    added = _synthetic_tree(tmp_path / "added", [*base, "jaxckpt/storage"], modules)
    assert tree_problems(SYNTHETIC_MAP, added) == [
        "jaxckpt/storage/: a package folder the map's tree does not name"]
    removed = _synthetic_tree(tmp_path / "removed", ["jaxckpt", "torch_bridge"],
                              ["jaxckpt/config.py"])
    assert tree_problems(SYNTHETIC_MAP, removed) == [
        "jaxckpt/core/: named in the map's tree, but no package folder there",
        "jaxckpt/core/policy.py: named in the map's tree, but no such module"]
    plain_dir = _synthetic_tree(tmp_path / "plain", ["jaxckpt", "torch_bridge"],
                                ["jaxckpt/config.py"])
    (plain_dir / "jaxckpt" / "core").mkdir()  # a folder without __init__ is no package
    (plain_dir / "jaxckpt" / "core" / "policy.py").write_text("")
    assert tree_problems(SYNTHETIC_MAP, plain_dir) == [
        "jaxckpt/core/: named in the map's tree, but no package folder there"]
    twice = SYNTHETIC_MAP.replace("torch_bridge/ ", "jaxckpt/config.py\ntorch_bridge/ ")
    assert tree_problems(twice, _synthetic_tree(tmp_path / "twice", base, modules)) == [
        "jaxckpt/config.py: named twice in the map's tree"]


def test_self_the_table_check():
    row = Folder(may_import=("jaxckpt.core", "jaxckpt.errors"), never=FRAMEWORKS,
                 third_party=frozenset({"numpy"}), public=frozenset({"policy"}))
    assert table_problems(SYNTHETIC_MAP, {"jaxckpt.core": row}) == []
    wider = Folder(may_import=("jaxckpt.core", "jaxckpt.errors", "jaxckpt.config"),
                   never=frozenset({"torch"}), third_party=frozenset({"numpy"}),
                   public=frozenset({"policy"}))
    problems = table_problems(SYNTHETIC_MAP, {"jaxckpt.core": wider})
    assert [p.split(": ")[0] for p in problems] == ["jaxckpt.core, may import",
                                                     "jaxckpt.core, frameworks"]
    assert table_problems(SYNTHETIC_MAP, {"jaxckpt.core": row, "jaxckpt.commit": row}) == [
        "jaxckpt.commit: a FOLDERS row the map's import table lacks"]
    assert table_problems(SYNTHETIC_MAP, {}) == [
        "jaxckpt.core: a row of the map's import table that FOLDERS lacks"]
    bridge = SYNTHETIC_MAP + ("| `torch_bridge.dcp` | torch_bridge.dcp, errors | all but jax "
                              "| - | backend |\n")
    dcp = Folder(may_import=("torch_bridge.dcp", "jaxckpt.errors"), never=frozenset({"jax"}),
                 third_party=frozenset(), public=frozenset({"backend"}))
    assert table_problems(bridge, {"jaxckpt.core": row, "torch_bridge.dcp": dcp}) == []
