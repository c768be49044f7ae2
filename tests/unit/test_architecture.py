"""The shape of the code, enforced by reading the source (no module under test is imported).

Rules, each with a self-test on a synthetic source so that it can be seen to fail:

(a) the pure layer (every module of a folder whose row in FOLDERS bans the frameworks, the
    flat modules of PURE_BY_NAME until they move into a folder, and any module whose
    docstring says it is part of the pure layer) imports no framework (jax, jaxlib, orbax,
    flax, optax, torch, tensorstore), at module level or inside functions; every module's
    docstring line "Must not import ..." holds as written;
(b) edges point inward: jaxckpt's library modules never import torch_bridge or jaxckpt.tools;
    torch_bridge imports no JAX framework at module level (nor through the modules it imports
    at module level) and never imports jaxckpt.tools;
(c) no package imports another package's private module or private name (a leading
    underscore); jaxckpt.tools counts as a package of its own;
(d) no ``__getattr__`` outside a package ``__init__.py``;
(e) no class over 400 lines and no function over 80 lines;
(f) the folder table (FOLDERS): a module under a folder imports of jaxckpt only what its row
    allows, never a framework its row bans, and of the rest only the standard library and
    the third-party modules its row names;
(g) a folder is entered from outside through its ``__init__`` or a public module its row
    names: jaxckpt's library modules may import any of a folder's modules, but torch_bridge
    and jaxckpt.tools only its public ones, and a private module (a leading underscore) is
    imported from inside its folder only.

Imports under ``if TYPE_CHECKING:`` never run: they count for the direction rules (b, c), not
for what a module loads (a).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from collections.abc import Iterable, Iterator

import pytest

from support.paths import REPO

PACKAGES = ("jaxckpt", "torch_bridge")
TOOLS = "jaxckpt.tools"

FRAMEWORKS = frozenset({"jax", "jaxlib", "orbax", "flax", "optax", "torch", "tensorstore"})
JAX_FRAMEWORKS = frozenset({"jax", "jaxlib", "orbax", "flax", "optax"})
# Flat modules of the pure layer that are not in a folder yet (the folders are in FOLDERS).
PURE_BY_NAME = frozenset({"config", "errors"})


@dataclasses.dataclass(frozen=True)
class Folder:
    """One row of the folder table: what a subpackage of jaxckpt may import, and its face."""

    may_import: tuple[str, ...]  # jaxckpt modules and packages (the folder itself included)
    never: frozenset[str]  # frameworks, at module level or inside functions
    third_party: frozenset[str]  # besides the standard library
    public: frozenset[str]  # the modules torch_bridge and the tools may import
    open_to: tuple[str, ...] = ("jaxckpt",)  # packages (package_of) that may import any module


FOLDERS = {
    "jaxckpt.core": Folder(
        may_import=("jaxckpt.core", "jaxckpt.errors", "jaxckpt.config"),
        never=FRAMEWORKS,
        third_party=frozenset({"numpy", "ml_dtypes", "google_crc32c", "xxhash"}),
        public=frozenset({"checksum", "codec", "content_hash", "extras", "layout", "retention",
                          "tree_record"}),
    ),
    "jaxckpt.storage": Folder(
        may_import=("jaxckpt.storage", "jaxckpt.core", "jaxckpt.errors"),
        never=FRAMEWORKS,
        third_party=frozenset({"boto3", "botocore", "google", "requests", "urllib3", "numpy"}),
        public=frozenset({"base", "posix", "url", "readers", "buffers", "s3.storage",
                          "gcs.storage"}),
    ),
    "jaxckpt.manager": Folder(
        may_import=("jaxckpt.manager", "jaxckpt.core", "jaxckpt.storage", "jaxckpt.commit",
                    "jaxckpt.backends.base", "jaxckpt._version", "jaxckpt.errors",
                    "jaxckpt.config"),
        never=FRAMEWORKS,
        third_party=frozenset({"numpy"}),
        public=frozenset({"manager", "reports", "driver_state", "root", "restore"}),
    ),
    "jaxckpt.backends": Folder(
        may_import=("jaxckpt.backends", "jaxckpt.core", "jaxckpt.storage", "jaxckpt.commit",
                    "jaxckpt.errors"),
        never=FRAMEWORKS,
        third_party=frozenset(),
        public=frozenset({"base"}),
    ),
    "jaxckpt.backends.orbax": Folder(
        may_import=("jaxckpt.backends", "jaxckpt.core", "jaxckpt.storage", "jaxckpt.commit",
                    "jaxckpt.manager", "jaxckpt._version", "jaxckpt.errors", "jaxckpt.config"),
        never=frozenset({"torch"}),
        third_party=frozenset({"jax", "jaxlib", "orbax", "flax", "optax", "tensorstore", "numpy",
                               "ml_dtypes", "etils"}),
        public=frozenset({"backend", "chunk_io", "import_orbax", "tree"}),
    ),
    "jaxckpt.integrations": Folder(
        may_import=("jaxckpt.integrations", "jaxckpt.manager", "jaxckpt.core", "jaxckpt.config",
                    "jaxckpt.errors"),
        never=frozenset({"torch"}),
        third_party=frozenset({"keras", "numpy"}),
        public=frozenset({"keras"}),
    ),
    "jaxckpt.commit": Folder(
        may_import=("jaxckpt.commit", "jaxckpt.core", "jaxckpt.storage", "jaxckpt.errors",
                    "jaxckpt.config"),
        never=FRAMEWORKS,
        third_party=frozenset(),
        public=frozenset({"store", "ownership", "deferred_checks", "pins", "object_steps"}),
    ),
}
# Framework imports a pure module may make inside a function, with the reason its docstring gives.
LAZY_ALLOWED = {
    # Decoding a value that was written from a torch tensor gives a torch tensor back.
    "jaxckpt.core.codec": frozenset({"torch"}),
    # The default backend, loaded when a manager is made without one.
    "jaxckpt.manager.manager": frozenset({"jaxckpt.backends.orbax.backend"}),
}
# Names a "Must not import" line may mention that the scanner can check.
CHECKABLE = FRAMEWORKS | {"torch_bridge", "transformers", "safetensors", "jaxckpt"}
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


# ------------------------------------------------------------------------------ the scanner


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's effect: ``targets`` are the absolute dotted names it binds
    (``from a import b`` gives ``a.b``), ``module`` the module it loads."""

    module: str
    names: tuple[str, ...]
    line: int
    in_function: bool
    type_checking: bool

    @property
    def targets(self) -> tuple[str, ...]:
        if not self.names:
            return (self.module,)
        return tuple(f"{self.module}.{name}" for name in self.names)

    @property
    def runs_on_import(self) -> bool:
        return not self.in_function and not self.type_checking


@dataclasses.dataclass(frozen=True)
class Module:
    name: str
    path: str
    tree: ast.Module
    is_init: bool

    @property
    def docstring(self) -> str:
        return ast.get_docstring(self.tree) or ""

    @property
    def package(self) -> str:
        return package_of(self.name)

    @property
    def is_library(self) -> bool:
        return self.package in PACKAGES

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"


def package_of(name: str) -> str:
    """The unit the privacy and direction rules speak of: a top-level package, or the tools."""
    if name == TOOLS or name.startswith(TOOLS + "."):
        return TOOLS
    return name.split(".")[0]


def parse(name: str, source: str, *, path: str | None = None, is_init: bool = False) -> Module:
    return Module(name=name, path=path or f"<{name}>", tree=ast.parse(source), is_init=is_init)


def load_modules() -> list[Module]:
    modules = []
    for package in PACKAGES:
        for file in sorted((REPO / package).rglob("*.py")):
            parts = list(file.relative_to(REPO).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts.pop()
            modules.append(parse(".".join(parts), file.read_text(encoding="utf-8"),
                                 path=str(file.relative_to(REPO)), is_init=is_init))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_by_call(call: ast.Call) -> str:
    """The module an ``importlib.import_module("x")`` or ``__import__("x")`` call names
    literally ("" for any other call, or a name computed at run time)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in ("import_module", "__import__") or not call.args:
        return ""
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str) \
            and not first.value.startswith("."):
        return first.value
    return ""


def imports_of(module: Module) -> list[Import]:
    package_parts = module.name.split(".") if module.is_init else module.name.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, (), node.lineno, in_function, type_checking))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(Import(target, tuple(a.name for a in node.names), node.lineno,
                                in_function, type_checking))
        elif isinstance(node, ast.Call) and _imported_by_call(node):
            found.append(Import(_imported_by_call(node), (), node.lineno, in_function,
                                type_checking))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_checking)
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_checking)

    visit(module.tree, False, False)
    return found


def _within(name: str, prefixes: Iterable[str]) -> str | None:
    for prefix in prefixes:
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return None


def _is_private(component: str) -> bool:
    return component.startswith("_") and not (component.startswith("__")
                                              and component.endswith("__"))


# (a) frameworks ---------------------------------------------------------------------------


def framework_imports(module: Module, banned: Iterable[str], *, module_level_only: bool,
                      allowed_in_functions: Iterable[str] = ()) -> list[str]:
    """Every import of a ``banned`` name (a package and its submodules) that can run."""
    banned, allowed = tuple(banned), tuple(allowed_in_functions)
    problems = []
    for imp in imports_of(module):
        if imp.type_checking or (module_level_only and imp.in_function):
            continue
        for target in imp.targets:
            hit = _within(target, banned)
            if hit and not (imp.in_function and _within(target, allowed)):
                where = "inside a function" if imp.in_function else "at module level"
                problems.append(f"{module.where(imp.line)}: {module.name} imports {target} "
                                f"{where}")
                break
    return problems


def folder_of(name: str) -> str | None:
    """The folder of FOLDERS that holds the module (or names the package) ``name``."""
    found = [folder for folder in FOLDERS if name == folder or name.startswith(folder + ".")]
    return max(found, key=len) if found else None


def is_pure(module: Module) -> bool:
    if not module.is_library or module.package != "jaxckpt":
        return False
    folder = folder_of(module.name)
    if folder is not None:
        return FOLDERS[folder].never >= FRAMEWORKS
    short = module.name.split(".")[-1]
    return short in PURE_BY_NAME or re.search(r"\bpure (layer|decisions?|functions?)\b",
                                              module.docstring, re.IGNORECASE) is not None


def pure_layer_problems(module: Module) -> list[str]:
    return framework_imports(module, FRAMEWORKS, module_level_only=False,
                             allowed_in_functions=LAZY_ALLOWED.get(module.name, ()))


@dataclasses.dataclass(frozen=True)
class Ban:
    names: frozenset[str]
    module_level_only: bool
    sentence: str


def docstring_bans(docstring: str) -> list[Ban]:
    """What each "Must not import ..." clause of a docstring forbids. The clause runs to the
    end of its sentence (or a ';' or ':' after the list); "at module level" or "at import
    time" in it limits it to imports that run when the module is imported."""
    bans = []
    for match in re.finditer(r"must not import(\s+at module level|\s+at import time)?\s*:?"
                             r"\s*(.*?)(?:\.\s|\.$|;|:|\Z)", docstring,
                             flags=re.IGNORECASE | re.DOTALL):
        # ``code spans`` quote statements (``import jaxckpt``), they are not a list of bans
        clause = re.sub(r"``.*?``", "", " ".join(match.group(2).split()))
        names = frozenset(word for word in re.findall(r"[A-Za-z_][\w.]*", clause)
                          if word.split(".")[0] in CHECKABLE)
        scope = re.search(r"at module level|at import time", match.group(0), re.IGNORECASE)
        bans.append(Ban(names, scope is not None, " ".join(match.group(0).split())))
    return bans


def docstring_problems(module: Module) -> list[str]:
    problems = []
    for ban in docstring_bans(module.docstring):
        if not ban.names:
            problems.append(f"{module.path}: the docstring's {ban.sentence!r} names nothing "
                            f"this test can check (one of {sorted(CHECKABLE)})")
            continue
        found = framework_imports(module, ban.names, module_level_only=ban.module_level_only,
                                  allowed_in_functions=LAZY_ALLOWED.get(module.name, ()))
        problems += [f"{problem} (its docstring: {ban.sentence!r})" for problem in found]
    return problems


# (b) direction ----------------------------------------------------------------------------


def direction_problems(module: Module) -> list[str]:
    if module.package == "jaxckpt":
        banned, what = ("torch_bridge", TOOLS), "the jaxckpt library"
    elif module.package == "torch_bridge":
        banned, what = (TOOLS,), "torch_bridge"
    else:
        return []
    problems = []
    for imp in imports_of(module):
        for target in imp.targets:
            hit = _within(target, banned)
            if hit:
                problems.append(f"{module.where(imp.line)}: {what} ({module.name}) imports "
                                f"{target}; only {TOOLS} may use {hit}")
                break
    return problems


def _resolve(name: str, known: dict[str, Module]) -> str | None:
    """The module of ours that importing ``name`` loads (a name in a package: the package)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def loaded_on_import(root: str, known: dict[str, Module]) -> dict[str, tuple[str, int]]:
    """Every module name (ours and foreign) that ``import root`` loads through imports at
    module level, each with the (module, line) that first imports it."""
    seen: dict[str, tuple[str, int]] = {}
    pending = [root]
    done: set[str] = set()
    while pending:
        name = pending.pop()
        if name in done:
            continue
        done.add(name)
        parents = name.split(".")
        pending += [".".join(parents[:i]) for i in range(1, len(parents))
                    if ".".join(parents[:i]) in known]
        module = known[name]
        for imp in imports_of(module):
            if not imp.runs_on_import:
                continue
            for target in (imp.module, *imp.targets):
                ours = _resolve(target, known)
                if ours is not None:
                    pending.append(ours)
                else:
                    seen.setdefault(target, (module.path, imp.line))
    return seen


def heavy_on_import(root: str, banned: Iterable[str], known: dict[str, Module]) -> list[str]:
    banned = tuple(banned)
    return [f"{path}:{line}: `import {root}` loads {target}"
            for target, (path, line) in sorted(loaded_on_import(root, known).items())
            if _within(target, banned)]


# (c) privacy ------------------------------------------------------------------------------


def privacy_problems(module: Module) -> list[str]:
    problems = []
    aliases: dict[str, str] = {}  # local name -> the other package it refers into
    for imp in imports_of(module):
        other = package_of(imp.module)
        if other.split(".")[0] not in PACKAGES or other == module.package:
            continue
        private = [part for part in imp.module.split(".") if _is_private(part)]
        private += [name for name in imp.names if _is_private(name)]
        if private:
            problems.append(f"{module.where(imp.line)}: {module.name} imports {private[0]} "
                            f"from {imp.module}, private to {other}")
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if package_of(alias.name) != module.package:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if package_of(node.module) != module.package:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    aliases = {local: target for local, target in aliases.items()
               if target.split(".")[0] in PACKAGES}
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        base = node.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            target = aliases[base.id]
            if package_of(target) != module.package:
                problems.append(f"{module.where(node.lineno)}: {module.name} uses "
                                f".{node.attr} of {target}, private to {package_of(target)}")
    return problems


# (f) the folder table ---------------------------------------------------------------------


def folder_problems(module: Module) -> list[str]:
    folder = folder_of(module.name)
    if folder is None:
        return []
    row, lazy = FOLDERS[folder], LAZY_ALLOWED.get(module.name, frozenset())
    problems = []
    for imp in imports_of(module):
        for target in imp.targets:
            top = target.split(".")[0]
            allowed_lazily = imp.in_function and _within(target, lazy) is not None
            if top in PACKAGES:
                bad = _within(target, row.may_import) is None and not allowed_lazily
            elif imp.type_checking or allowed_lazily:
                bad = False  # never loaded, or loaded where the row's reason allows
            else:
                bad = _within(target, row.never) is not None or not (
                    top in sys.stdlib_module_names or top in row.third_party)
            if bad:
                problems.append(f"{module.where(imp.line)}: {module.name} imports {target}; "
                                f"{folder} may import {', '.join(row.may_import)}, the "
                                f"standard library and {', '.join(sorted(row.third_party))}")
                break
    return problems


# (g) a folder's public surface ------------------------------------------------------------


def surface_problems(module: Module, known: Iterable[str]) -> list[str]:
    known = set(known)
    problems = []
    for imp in imports_of(module):
        for name in (imp.module, *imp.targets):
            folder = folder_of(name)
            if folder is None or name == folder or folder_of(module.name) == folder:
                continue
            inner = name[len(folder) + 1:].split(".")[0]
            if f"{folder}.{inner}" not in known:
                continue  # a name the folder's __init__ exports
            row = FOLDERS[folder]
            if _is_private(inner):
                why = "private to its folder"
            elif package_of(module.name) in row.open_to or inner in row.public:
                continue
            else:
                why = f"not one of {folder}'s public modules ({', '.join(sorted(row.public))})"
            problems.append(f"{module.where(imp.line)}: {module.name} imports "
                            f"{folder}.{inner}, {why}")
            break
    return problems


# (d) __getattr__ --------------------------------------------------------------------------


def getattr_problems(module: Module) -> list[str]:
    if module.is_init:
        return []
    return [f"{module.where(node.lineno)}: __getattr__ outside a package __init__ "
            f"(write the forwarded methods out, or subclass)"
            for node in ast.walk(module.tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == "__getattr__"]


# (e) sizes --------------------------------------------------------------------------------


def _definitions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            yield name, child
            yield from _definitions(child, name + ".")
        else:
            yield from _definitions(child, prefix)


def size_problems(module: Module) -> list[str]:
    problems = []
    for name, node in _definitions(module.tree):
        lines = node.end_lineno - node.lineno + 1
        limit, kind = ((MAX_CLASS_LINES, "class") if isinstance(node, ast.ClassDef)
                       else (MAX_FUNCTION_LINES, "function"))
        if lines > limit:
            problems.append(f"{module.where(node.lineno)}: {kind} {name} is {lines} lines "
                            f"(limit {limit})")
    return problems


# ------------------------------------------------------------------------- the real source


MODULES = load_modules()
BY_NAME = {module.name: module for module in MODULES}


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_the_scan_sees_every_package_and_the_tools():
    names = set(BY_NAME)
    assert {"jaxckpt", "jaxckpt.manager", "torch_bridge", TOOLS, f"{TOOLS}.cli",
            f"{TOOLS}.hf_cli"} <= names
    assert "jaxckpt.cli" not in names and "torch_bridge.hf_cli" not in names


def test_pure_layer_imports_no_framework():
    pure = [module for module in MODULES if is_pure(module)]
    assert {"jaxckpt.core.policy", "jaxckpt.core.layout", "jaxckpt.commit.store",
            "jaxckpt.manager", "jaxckpt.manager.manager"} <= {m.name for m in pure}
    problems = [problem for module in pure for problem in pure_layer_problems(module)]
    assert not problems, _report(problems)


def test_every_docstring_must_not_import_line_holds():
    problems = [problem for module in MODULES for problem in docstring_problems(module)]
    assert not problems, _report(problems)


def test_library_never_imports_the_tools_and_jaxckpt_never_imports_torch_bridge():
    problems = [problem for module in MODULES for problem in direction_problems(module)]
    assert not problems, _report(problems)


def test_torch_bridge_imports_no_jax_at_module_level():
    problems = [f"{problem} (module level)" for module in MODULES
                if module.package == "torch_bridge"
                for problem in framework_imports(module, JAX_FRAMEWORKS, module_level_only=True)]
    problems += heavy_on_import("torch_bridge", FRAMEWORKS, BY_NAME)
    for module in MODULES:  # nor through the jaxckpt modules each one imports
        if module.package == "torch_bridge":
            problems += heavy_on_import(module.name, JAX_FRAMEWORKS, BY_NAME)
    assert not problems, _report(problems)


def test_import_jaxckpt_loads_no_framework():
    problems = heavy_on_import("jaxckpt", FRAMEWORKS, BY_NAME)
    assert not problems, _report(problems)


def test_no_package_uses_another_packages_private_names():
    problems = [problem for module in MODULES for problem in privacy_problems(module)]
    assert not problems, _report(problems)


def test_each_folder_imports_what_its_row_allows():
    assert {f"{folder}.{name}" for folder, row in FOLDERS.items() for name in row.public} \
        <= set(BY_NAME), "a public module named in FOLDERS does not exist"
    assert "jaxckpt.core.policy" in BY_NAME and folder_of("jaxckpt.core.policy") == "jaxckpt.core"
    problems = [problem for module in MODULES for problem in folder_problems(module)]
    assert not problems, _report(problems)


def test_folders_are_entered_through_their_public_face():
    problems = [problem for module in MODULES for problem in surface_problems(module, BY_NAME)]
    assert not problems, _report(problems)


def test_no_getattr_outside_package_init():
    problems = [problem for module in MODULES for problem in getattr_problems(module)]
    assert not problems, _report(problems)


def test_size_limits():
    problems = [problem for module in MODULES for problem in size_problems(module)]
    assert not problems, _report(problems)


def test_size_limits_in_the_tools():
    problems = [problem for module in MODULES if module.package == TOOLS
                for problem in size_problems(module)]
    assert not problems, _report(problems)


# ------------------------------------------------- the scanner fails where it should


def test_self_pure_layer_flags_frameworks_anywhere_but_type_checking():
    source = ('"""Pure."""\nimport os\nfrom typing import TYPE_CHECKING\n'
              "if TYPE_CHECKING:\n    import jax\n"
              "def f():\n    import torch.distributed\n"
              "class C:\n    from orbax import checkpoint\n")
    problems = pure_layer_problems(parse("jaxckpt.core.policy", source))
    assert [p.split(": ", 1)[1] for p in problems] == [
        "jaxckpt.core.policy imports torch.distributed inside a function",
        "jaxckpt.core.policy imports orbax.checkpoint at module level"]
    assert is_pure(parse("jaxckpt.core.policy", source))
    assert is_pure(parse("jaxckpt.parts.x", '"""Part of the pure layer."""'))
    assert is_pure(parse("jaxckpt.config", '"""By name, outside the folders."""'))
    assert not is_pure(parse("jaxckpt.backends.orbax.backend", '"""Imports orbax."""'))
    assert pure_layer_problems(parse("jaxckpt.store", "import importlib\n"
                                                      "importlib.import_module('orbax')\n"))
    assert pure_layer_problems(parse("jaxckpt.store", "def f():\n    __import__('jax')\n"))
    assert is_pure(parse("jaxckpt.x", '"""Retention as pure functions of the list."""'))
    assert not is_pure(parse("jaxckpt.x", '"""Falls back to its pure Python code."""'))
    assert pure_layer_problems(parse("jaxckpt.core.codec", "def f():\n    import torch\n")) == []
    assert pure_layer_problems(parse("jaxckpt.core.codec", "import torch\n"))
    assert pure_layer_problems(parse("jaxckpt.store", "import torch_bridge\nimport jaxckpt\n")) \
        == []


def test_self_docstring_bans_are_read_as_written():
    bans = docstring_bans("Owns x.\n\nMust not import: jax, orbax. torch.distributed.checkpoint"
                          " is imported when needed.")
    assert [(sorted(b.names), b.module_level_only) for b in bans] == [(["jax", "orbax"], False)]
    bans = docstring_bans("Must not import jax, torch or flax at import time: flax is imported"
                          " only for values that are flax.")
    assert [(sorted(b.names), b.module_level_only) for b in bans] == [
        (["flax", "jax", "torch"], True)]
    bans = docstring_bans("It must not import torch (nor\ntorch_bridge): a JAX run never pays.")
    assert [sorted(b.names) for b in bans] == [["torch", "torch_bridge"]]
    bans = docstring_bans("Must not import at module level: jax (``import jaxckpt`` loads it).")
    assert [(sorted(b.names), b.module_level_only) for b in bans] == [(["jax"], True)]
    lazy = parse("m", '"""Must not import at module level: jax."""\ndef f():\n    import jax\n')
    assert docstring_problems(lazy) == []
    eager = parse("m", '"""Must not import: jax; x."""\ndef f():\n    import jax.numpy\n')
    assert "imports jax.numpy inside a function" in docstring_problems(eager)[0]
    vague = parse("m", '"""Must not import: anything that does I/O."""\n')
    assert "names nothing" in docstring_problems(vague)[0]


def test_self_direction_rules():
    assert direction_problems(parse("jaxckpt.store", "import torch_bridge.hf\n"))
    assert direction_problems(parse("jaxckpt.store", "def f():\n    from jaxckpt import tools\n"))
    assert direction_problems(parse("jaxckpt.store", "from .tools.cli import main\n"))
    assert direction_problems(parse("torch_bridge.hf", "from jaxckpt.tools import hf_cli\n"))
    assert direction_problems(parse("torch_bridge.hf", "from jaxckpt.errors import X\n")) == []
    assert direction_problems(parse(f"{TOOLS}.cli", "import torch_bridge\n")) == []
    bridge = parse("torch_bridge.hf", "import jax\ndef f():\n    import flax\n")
    assert len(framework_imports(bridge, JAX_FRAMEWORKS, module_level_only=True)) == 1


def test_self_import_closure_follows_module_level_imports_only():
    known = {m.name: m for m in [
        parse("pkg_a", "from . import b\nfrom .c import thing\n", is_init=True),
        parse("pkg_a.b", "import numpy\ndef f():\n    import torch\n"),
        parse("pkg_a.c", "from pkg_a.d import y\n"),
        parse("pkg_a.d", "import jax.numpy as jnp\n"),
    ]}
    problems = heavy_on_import("pkg_a", FRAMEWORKS, known)
    assert problems == ["<pkg_a.d>:1: `import pkg_a` loads jax.numpy"]


def test_self_privacy_rules():
    tool = f"{TOOLS}.x"
    assert privacy_problems(parse(tool, "from jaxckpt.backends.orbax.chunk_io import _pwrite\n"))
    assert privacy_problems(parse(tool, "from jaxckpt import _version\n"))
    assert privacy_problems(parse(tool, "from jaxckpt._version import __version__\n"))
    assert privacy_problems(parse(tool, "from torch_bridge import hf\nhf._architecture('x')\n"))
    assert privacy_problems(parse(tool, "import torch_bridge.hf\ntorch_bridge.hf._x\n"))
    assert privacy_problems(parse("torch_bridge.m", "from jaxckpt.store import _lock\n"))
    assert privacy_problems(parse("jaxckpt.m", "from .tools._helpers import f\n"))
    # inside one package, and public or dunder names, are fine
    assert privacy_problems(parse("jaxckpt.m", "from ._version import __version__\n")) == []
    assert privacy_problems(parse("torch_bridge.hf", "from ._hf_params import _x\n")) == []
    assert privacy_problems(parse(tool, "from .demo import _emit\nself._x\n")) == []
    assert privacy_problems(parse(tool, "from jaxckpt import __version__\n")) == []


def test_self_folder_rules():
    core = "jaxckpt.core.m"
    assert folder_problems(parse(core, "import os, re\nimport numpy as np\n"
                                       "from ..errors import E\nfrom .layout import X\n"
                                       "from jaxckpt import config\n"
                                       "if TYPE_CHECKING:\n    import pandas\n")) == []
    assert folder_problems(parse("jaxckpt.store", "import boto3\n")) == []  # not a folder
    for source, target in [("from .. import store\n", "jaxckpt.store"),
                           ("from ..storage import PosixStorage\n", "jaxckpt.storage."),
                           ("if TYPE_CHECKING:\n    from ..store import S\n", "jaxckpt.store."),
                           ("import jaxckpt\n", "jaxckpt;"),
                           ("import boto3\n", "boto3"),
                           ("def f():\n    import jax.numpy\n", "jax.numpy"),
                           ("def f():\n    import torch\n", "torch")]:
        problems = folder_problems(parse(core, source))
        assert len(problems) == 1 and f"imports {target}" in problems[0], (source, problems)
    assert folder_problems(parse("jaxckpt.core.codec", "def f():\n    import torch\n")) == []
    assert is_pure(parse(core, '"""Anything."""')) and not is_pure(parse("jaxckpt.x", ""))


def test_self_public_surface_rule():
    known = {"jaxckpt.core", "jaxckpt.core.layout", "jaxckpt.core.policy",
             "jaxckpt.core._helpers"}
    tool, bridge = f"{TOOLS}.cli", "torch_bridge.dcp_backend"
    for name in (tool, bridge, "jaxckpt.store"):  # the package and its public modules
        assert surface_problems(parse(name, "from jaxckpt.core.layout import X\n"
                                            "from jaxckpt.core import layout\n"
                                            "from jaxckpt.core import NAME\n"), known) == []
    assert surface_problems(parse("jaxckpt.store", "from .core.policy import S\n"), known) == []
    assert surface_problems(parse("jaxckpt.core.layout", "from . import _helpers\n"), known) \
        == []
    for name, source in [(tool, "from jaxckpt.core.policy import S\n"),
                         (bridge, "from jaxckpt.core import layout, policy\n"),
                         ("jaxckpt.store", "from .core._helpers import h\n"),
                         (tool, "import jaxckpt.core._helpers\n")]:
        problems = surface_problems(parse(name, source), known)
        assert len(problems) == 1, (name, source, problems)


def test_self_getattr_rule():
    assert getattr_problems(parse("jaxckpt.m", "class A:\n    def __getattr__(s, n): ...\n"))
    assert getattr_problems(parse("jaxckpt.m", "def __getattr__(n): ...\n"))
    assert getattr_problems(parse("jaxckpt", "def __getattr__(n): ...\n", is_init=True)) == []


@pytest.mark.parametrize("kind,limit", [("class", MAX_CLASS_LINES),
                                        ("function", MAX_FUNCTION_LINES)])
def test_self_size_rule(kind, limit):
    header = "class Big:\n" if kind == "class" else "def big():\n"
    at_limit = parse("m", header + "    x = 1\n" * (limit - 1))
    over = parse("m", header + "    x = 1\n" * limit)
    assert size_problems(at_limit) == []
    name = "Big" if kind == "class" else "big"
    assert size_problems(over) == [f"<m>:1: {kind} {name} is {limit + 1} lines (limit {limit})"]


def test_self_size_rule_names_nested_functions():
    limit = MAX_FUNCTION_LINES
    nested = parse("m", "class A:\n    def f(self):\n" + "        x = 1\n" * limit)
    assert size_problems(nested) == [f"<m>:2: function A.f is {limit + 1} lines "
                                     f"(limit {MAX_FUNCTION_LINES})"]
