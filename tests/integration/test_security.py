"""Security: loading a checkpoint never executes code from it.

A checkpoint is data from wherever it was copied from. These tests plant a malicious pickle
(unpickling it runs ``os.system("touch MARKER")``) under every name a careless loader might
open, rewrite the manifest so the checkpoint is internally consistent (an attacker controls
every file), and run ``recover``, ``restore``, ``jaxckpt verify`` and ``jaxckpt ls`` on it in
a fresh interpreter that records the ``pickle.find_class`` / ``os.system`` / ``subprocess``
audit events. The marker must never appear and no unpickling may start; each operation
either succeeds (ignoring the planted file, with the original values) or fails with an error.

Plus a source scan of jaxckpt/ and torch_bridge/ (no pickle-family imports, no
``np.load(allow_pickle=True)``, no ``torch.load`` without ``weights_only=True``, no
eval/exec), and manifests / tree.json files / symlinks that point outside their checkpoint.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.paths import REPO

SCANNED = [p for pkg in ("jaxckpt", "torch_bridge") for p in sorted((REPO / pkg).glob("**/*.py"))]


def child_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


# ---------------------------------------------------------------------------- source scan

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve",
                  "marshal", "pickletools", "copyreg"}


def scan_source(source: str, filename: str) -> list[str]:
    """Every unsafe deserialisation construct in ``source``, as 'file:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{where}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLE_MODULES:
                found.append(f"{where}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = func.value if isinstance(func, ast.Attribute) else None
            owner_name = getattr(owner, "id", None) or getattr(owner, "attr", None)
            keywords = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec") and isinstance(func, ast.Name):
                found.append(f"{where}: calls {name}()")
            if name in ("__import__",) and isinstance(func, ast.Name):
                found.append(f"{where}: calls __import__()")
            if name == "load" and owner_name in ("np", "numpy"):
                value = keywords.get("allow_pickle")
                if value is not None and not (isinstance(value, ast.Constant)
                                              and value.value is False):
                    found.append(f"{where}: np.load with allow_pickle={ast.unparse(value)}")
            if name == "load" and owner_name == "torch":
                value = keywords.get("weights_only")
                if not (isinstance(value, ast.Constant) and value.value is True):
                    found.append(f"{where}: torch.load without weights_only=True")
            if name in ("loads", "load", "Unpickler") and owner_name in PICKLE_MODULES:
                found.append(f"{where}: calls {owner_name}.{name}")
    return found


def test_the_scanner_finds_every_forbidden_construct():
    bad = textwrap.dedent("""
        import pickle
        import cloudpickle as cp
        from dill import loads
        import numpy as np
        import torch
        np.load(f, allow_pickle=True)
        np.load(f, allow_pickle=flag)
        torch.load(f)
        torch.load(f, weights_only=False)
        pickle.loads(b"")
        eval("1")
        exec("x = 1")
    """)
    found = scan_source(bad, "bad.py")
    assert len(found) == 10, found
    good = "import numpy as np\nimport torch\nnp.load(f)\nnp.load(f, allow_pickle=False)\n" \
           "torch.load(f, weights_only=True)\nmodel.eval()\n"
    assert scan_source(good, "good.py") == []


# DCP's index (.metadata) is a pickle by design; this module reads it with an allow-listed
# find_class (tested below), and is the only file allowed to touch pickle.
RESTRICTED_UNPICKLER = "torch_bridge/dcp/metadata.py"


# DCP's tensor records are read without unpickling: this module only lists the opcodes of a
# record's data.pkl with pickletools.genops (a decoder that builds nothing), so importing
# pickletools is the one thing allowed there (the test below pins that genops is all it uses).
OPCODE_LISTER = "torch_bridge/dcp/records.py"


def test_no_module_of_the_library_can_unpickle_or_evaluate():
    assert len(SCANNED) >= 10, "the scan would prove nothing: package sources not found"
    problems = [p for path in SCANNED
                if str(path.relative_to(REPO)) != RESTRICTED_UNPICKLER
                for p in scan_source(path.read_text(), str(path.relative_to(REPO)))
                if not (str(path.relative_to(REPO)) == OPCODE_LISTER
                        and p.endswith(": imports pickletools"))]
    assert problems == [], "\n".join(problems)


def test_the_record_reader_only_lists_opcodes():
    """``dcp_records`` may import pickletools for ``genops`` alone: no ``dis``, no
    unpickler, no ``pickle`` import, no other attribute of the module."""
    tree = ast.parse((REPO / OPCODE_LISTER).read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "pickletools"}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert used == {"genops"}
    assert not imported & (PICKLE_MODULES - {"pickletools"})


def test_the_one_restricted_unpickler_admits_only_dcp_metadata_classes():
    pytest.importorskip("torch")
    import pickle

    from jaxckpt.errors import CheckpointCorruptError
    from torch_bridge.dcp import metadata as dcp_metadata

    source = (REPO / RESTRICTED_UNPICKLER).read_text()
    assert "def find_class" in source
    assert "pickle.load(" not in source and "pickle.loads(" not in source
    modules = {module for module, _ in dcp_metadata.ALLOWED_GLOBALS}
    assert modules <= {"torch.distributed.checkpoint.metadata",
                       "torch.distributed.checkpoint.filesystem",
                       "torch.serialization", "torch", "pathlib"}, modules

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo should-never-run",))

    for evil in (Payload(), {"x": eval}, [print], type):
        with pytest.raises(CheckpointCorruptError, match="refusing"):
            dcp_metadata.load_metadata(pickle.dumps(evil), "x/.metadata")


# --------------------------------------------------------------------- planted payloads

PLANT = textwrap.dedent(r"""
    import contextlib, glob, io, json, os, pickle, shutil, sys, warnings
    import numpy as np
    import jax, jax.numpy as jnp
    from jaxckpt import CheckpointError, CheckpointManager, RecoverConfig, StepInfo
    from jaxckpt.tools.cli import main as cli
    from jaxckpt.commit.store import CheckpointStore
    from jaxckpt.core.layout import COMMIT_MARKER

    base = sys.argv[1]
    variants = json.loads(sys.argv[2])
    marker = os.path.join(base, "MARKER")

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Payload())

    def state(v):
        return {"w": jnp.full((4, 3), v, jnp.float32), "b": jnp.arange(3, dtype=jnp.int32),
                "key": jax.random.key(1)}

    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state(0.0))
    source = os.path.join(base, "source")
    with CheckpointManager(source, recover=RecoverConfig(keep_last_n=None), mode="sync",
                           preemption_signals=()) as mgr:
        mgr.save(StepInfo(0, 0, 0), state(1.0))
        mgr.save(StepInfo(0, 1, 1), state(2.0))

    def resolve(step, name):
        # Orbax-internal files of the array holding ['w'], whatever the backend's layout.
        if name.startswith("@w/"):
            tree = json.load(open(os.path.join(step, "state", "tree.json")))
            array = next(e["name"] for e in tree["leaves"] if e["path"] == "['w']")
            folder = os.path.join(step, "state", "arrays", array)
            if name == "@w/zarr.json":
                return os.path.join(folder, "zarr.json")
            chunks = sorted(p for p in glob.glob(folder + "/c/**", recursive=True)
                            if os.path.isfile(p))
            return chunks[0]
        return os.path.join(step, name)

    events = []
    # Installed after every import and the legitimate saves: from here on, nothing may even
    # start unpickling (find_class fires for any global a pickle names) or spawn a shell.
    sys.addaudithook(lambda event, args: events.append(event) if event in (
        "pickle.find_class", "os.system", "subprocess.Popen", "os.posix_spawn",
        "os.exec") else None)

    results = {}
    for variant in variants:
        name, how = variant["name"], variant["how"]
        root = os.path.join(base, "v" + str(len(results)))
        shutil.copytree(source, root, ignore=shutil.ignore_patterns(".lock"))
        step = os.path.join(root, "recover", "step_00000001")
        target = resolve(step, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if how == "npy-object":
            np.save(target, np.array([Payload()], dtype=object), allow_pickle=True)
        else:
            with open(target, "wb") as handle:
                handle.write(payload)
        if name != COMMIT_MARKER:  # the attacker also rewrites the manifest to match
            os.unlink(os.path.join(step, COMMIT_MARKER))
            CheckpointStore(root).commit(step, 1)
        ops = {}
        for op in ("recover", "restore"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with CheckpointManager(root, preemption_signals=()) as mgr:
                        got = mgr.recover(like) if op == "recover" else mgr.restore(like, step=1)
                ops[op] = {"step": got.step_info.global_step, "w": float(got.state["w"][0, 0]),
                           "b": np.asarray(got.state["b"]).tolist()}
            except Exception as exc:
                ops[op] = {"error": type(exc).__name__, "message": str(exc)[:500],
                           "checkpoint_error": isinstance(exc, CheckpointError)}
        for command in ("verify", "ls"):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    ops[command] = {"exit": cli([command, step if command == "verify" else root])}
                except Exception as exc:
                    ops[command] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name] = {"ops": ops, "marker": os.path.exists(marker), "events": list(events),
                         "planted": os.path.relpath(target, step), "step_dir": step}
    print("RESULT " + json.dumps(results), flush=True)
""")

# (name in the newest checkpoint, how the payload is written). "@w/..." are Orbax's files
# of the array that holds leaf ['w'].
REPLACED = ["driver.json", "COMMITTED", "state/tree.json", "state/arrays/_METADATA",
            "state/arrays/_CHECKPOINT_METADATA", "state/arrays/commit_success.txt",
            "@w/zarr.json", "@w/chunk"]
ADDED = ["state.pkl", "checkpoint.pickle", "driver.pkl", "state/arrays/state.pickle",
         "state/arrays/_METADATA.pkl", "state/.metadata", "driver.p00001.json",
         "state/arrays/leaf_000000.npy", "state/arrays/w.npy"]
VARIANTS = ([{"name": n, "how": "pickle"} for n in REPLACED]
            + [{"name": n, "how": "npy-object" if n.endswith(".npy") else "pickle"} for n in ADDED])

@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("planted")
    proc = subprocess.run([sys.executable, "-c", PLANT, str(base), json.dumps(VARIANTS)],
                          capture_output=True, text=True, timeout=300, env=child_env(),
                          cwd=REPO, start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    results["__marker__"] = str(base / "MARKER")
    return results


@pytest.mark.parametrize("name", [v["name"] for v in VARIANTS])
def test_planted_pickle_is_never_unpickled(planted, name):
    result = planted[name]
    assert not result["marker"] and not os.path.exists(planted["__marker__"]), \
        f"{result['planted']}: the payload RAN"
    assert result["events"] == [], f"{result['planted']}: audit events {result['events']}"
    for op in ("recover", "restore"):
        outcome = result["ops"][op]
        if "error" in outcome:
            continue  # refusing the checkpoint is fine; its clarity is checked below
        if op == "restore" or outcome["step"] == 1:
            assert (outcome["step"], outcome["w"], outcome["b"]) == (1, 2.0, [0, 1, 2]), outcome
        else:  # recover fell back over the checkpoint it judged corrupt
            assert (outcome["step"], outcome["w"]) == (0, 1.0), outcome
    for command in ("verify", "ls"):
        assert "error" not in result["ops"][command], result["ops"][command]


@pytest.mark.parametrize("name", [v["name"] for v in VARIANTS])
def test_a_checkpoint_refused_over_a_planted_file_says_which_and_why(planted, name):
    result = planted[name]
    for op in ("recover", "restore"):
        outcome = result["ops"][op]
        if "error" in outcome:
            assert outcome["checkpoint_error"], f"{op}: {outcome['error']}: {outcome['message']}"
            assert result["step_dir"] in outcome["message"] or "step 1" in outcome["message"], \
                outcome["message"]


def test_files_added_next_to_a_valid_checkpoint_are_ignored(planted):
    for name in ADDED:
        ops = planted[name]["ops"]
        assert ops["recover"] == ops["restore"] == {"step": 1, "w": 2.0, "b": [0, 1, 2]}, name
        assert ops["verify"] == {"exit": 0}


# -------------------------------------------------------- paths outside the checkpoint

OUTSIDE = textwrap.dedent(r"""
    import json, os, shutil, sys, warnings, zlib
    import jax, jax.numpy as jnp
    from jaxckpt import CheckpointError, CheckpointManager, RecoverConfig, StepInfo
    from jaxckpt.commit.store import CheckpointStore
    from jaxckpt.core.layout import COMMIT_MARKER

    base, case = sys.argv[1], sys.argv[2]
    # Large enough (1.6 MB) to be an Orbax array of its own, never packed with small leaves.
    shape = (640, 640)
    like = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    roots = {}
    for name, value in (("victim", 1.0), ("other", 666.0)):
        roots[name] = os.path.join(base, name)
        with CheckpointManager(roots[name], recover=RecoverConfig(keep_last_n=None), mode="sync",
                               preemption_signals=()) as mgr:
            mgr.save(StepInfo(0, 0, 0), {"w": jnp.full(shape, value - 1, jnp.float32)})
            mgr.save(StepInfo(0, 1, 1), {"w": jnp.full(shape, value, jnp.float32)})
    step = os.path.join(roots["victim"], "recover", "step_00000001")
    other = os.path.join(roots["other"], "recover", "step_00000001")
    secret = os.path.join(base, "SECRET")
    with open(secret, "wb") as handle:
        handle.write(b"secret bytes")
    tree_file = os.path.join(step, "state", "tree.json")
    tree = json.load(open(tree_file))
    entry = next(e for e in tree["leaves"] if e["path"] == "['w']")
    other_tree = json.load(open(os.path.join(other, "state", "tree.json")))
    other_name = next(e["name"] for e in other_tree["leaves"] if e["path"] == "['w']")
    recommit = True
    if case == "manifest-parent":
        body = json.load(open(os.path.join(step, COMMIT_MARKER)))
        body["files"]["../../../SECRET"] = {"size": 12, "crc32": "00000000"}
        open(os.path.join(step, COMMIT_MARKER), "w").write(json.dumps(body))
        recommit = False
    elif case == "manifest-absolute":
        body = json.load(open(os.path.join(step, COMMIT_MARKER)))
        body["files"][secret] = {"size": 12, "crc32": "00000000"}
        open(os.path.join(step, COMMIT_MARKER), "w").write(json.dumps(body))
        recommit = False
    elif case in ("tree-parent", "tree-absolute"):
        target = os.path.join(other, "state", "arrays", other_name)
        if case == "tree-parent":
            target = os.path.relpath(target, os.path.join(step, "state", "arrays"))
        # Rename the storage array everywhere tree.json names it (leaf entries and, when
        # small leaves are packed, the list of packs), as a crafted file would.
        old = entry["name"]
        for item in tree["leaves"] + tree.get("packs", []):
            if item.get("name") == old:
                item["name"] = target
        open(tree_file, "w").write(json.dumps(tree))
    elif case == "symlink":
        # Replace the array directory by a symlink to the other job's array of the same
        # layout; the manifest lists the files through the link, as a crafted one would.
        mine = os.path.join(step, "state", "arrays", entry["name"])
        shutil.rmtree(mine)
        os.symlink(os.path.join(other, "state", "arrays", other_name), mine)
        os.unlink(os.path.join(step, COMMIT_MARKER))
        CheckpointStore(roots["victim"]).commit(step, 1)
        body = json.load(open(os.path.join(step, COMMIT_MARKER)))
        for dirpath, _, files in os.walk(mine, followlinks=True):
            for f in files:
                full = os.path.join(dirpath, f)
                data = open(full, "rb").read()
                body["files"][os.path.relpath(full, step)] = {
                    "size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        open(os.path.join(step, COMMIT_MARKER), "w").write(json.dumps(body))
        recommit = False
    if recommit:
        os.unlink(os.path.join(step, COMMIT_MARKER))
        CheckpointStore(roots["victim"]).commit(step, 1)

    opened = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open"
                     and "SECRET" in str(args[0]) else None)
    out = {}
    store = CheckpointStore(roots["victim"])
    try:
        out["verify"] = store.verify(step)
    except CheckpointError as exc:
        out["verify"] = [str(exc)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with CheckpointManager(roots["victim"], preemption_signals=()) as mgr:
                got = mgr.recover(like)
        out["recover"] = {"step": got.step_info.global_step, "w": float(got.state["w"][0, 0]),
                          "warnings": [str(w.message)[:400] for w in caught]}
    except Exception as exc:
        out["recover"] = {"error": type(exc).__name__, "message": str(exc)[:600],
                          "checkpoint_error": isinstance(exc, CheckpointError)}
    out["opened_secret"] = opened
    print("RESULT " + json.dumps(out), flush=True)
""")


_outside_results: dict[str, dict] = {}


def run_outside(tmp_factory, case: str) -> dict:
    if case not in _outside_results:
        _outside_results[case] = _run_outside(tmp_factory.mktemp(f"outside-{case}"), case)
    return _outside_results[case]


def _run_outside(tmp_path: Path, case: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", OUTSIDE, str(tmp_path), case],
                          capture_output=True, text=True, timeout=180, env=child_env(),
                          cwd=REPO, start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", ["manifest-parent", "manifest-absolute"])
def test_manifest_naming_a_path_outside_is_rejected_without_opening_it(tmp_path_factory, case):
    out = run_outside(tmp_path_factory, case)
    assert out["opened_secret"] == [], f"opened {out['opened_secret']}"
    assert out["recover"]["step"] == 0 and out["recover"]["w"] == 0.0, out  # fell back
    assert any("outside the checkpoint" in w for w in out["recover"]["warnings"]), out


@pytest.mark.parametrize("case", ["tree-parent", "tree-absolute", "symlink"])
def test_data_outside_the_checkpoint_is_never_restored(tmp_path_factory, case):
    out = run_outside(tmp_path_factory, case)
    recovered = out["recover"]
    assert recovered.get("w") != 666.0, f"restored another job's data through {case}: {out}"


@pytest.mark.parametrize("case", [
    "tree-parent",
    "tree-absolute",
    "symlink",
])
def test_a_checkpoint_pointing_outside_itself_is_refused_as_corrupt(tmp_path_factory, case):
    out = run_outside(tmp_path_factory, case)
    recovered = out["recover"]
    refused = ("error" in recovered and recovered["checkpoint_error"]) or (
        recovered.get("step") == 0 and any("corrupt" in w for w in recovered["warnings"]))
    assert refused, out
    if "error" in recovered:
        assert "tree.json" in recovered["message"] or "outside" in recovered["message"], out


# ---------------------------------------------------------------- DCP's pickled metadata

DCP = textwrap.dedent(r"""
    import os, pickle, sys
    base = sys.argv[1]
    marker = os.path.join(base, "MARKER")
    try:
        import torch
        from torch import nn
        import torch_bridge
        from jaxckpt import CheckpointError, RecoverConfig, StepInfo
        from jaxckpt.commit.store import CheckpointStore
        from jaxckpt.core.layout import COMMIT_MARKER
        root = os.path.join(base, "root")
        with torch_bridge.DcpCheckpointManager(root, recover=RecoverConfig(keep_last_n=None),
                                               mode="sync") as mgr:
            mgr.save(StepInfo(0, 0, 0), {"model": nn.Linear(2, 2)})
        step = os.path.join(root, "recover", "step_00000000")
        metadata = [os.path.join(d, f) for d, _, fs in os.walk(step) for f in fs
                    if f == ".metadata"]
        assert metadata, "no DCP .metadata file found"
    except Exception as exc:  # the torch bridge is being reworked: nothing to attack here
        print(f"SKIP cannot write a DCP checkpoint: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(0)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(metadata[0], "wb") as handle:
        handle.write(pickle.dumps(Payload()))
    os.unlink(os.path.join(step, COMMIT_MARKER))
    CheckpointStore(root).commit(step, 0)   # the attacker rewrites the manifest too
    print("PLANTED", flush=True)
    try:
        with torch_bridge.DcpCheckpointManager(root) as mgr:
            mgr.restore({"model": nn.Linear(2, 2)})
        print("RESTORED", flush=True)
    except BaseException as exc:
        print(f"ERROR {type(exc).__name__} {isinstance(exc, CheckpointError)}", flush=True)
    print("MARKER", os.path.exists(marker), flush=True)
    os._exit(0)
""")


def test_dcp_metadata_pickle_is_never_executed(tmp_path):
    proc = subprocess.run([sys.executable, "-c", DCP, str(tmp_path)], capture_output=True,
                          text=True, timeout=240, env=child_env(), cwd=REPO,
                          start_new_session=True)
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert "PLANTED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    ran = (tmp_path / "MARKER").exists()
    assert not ran, "restoring a DCP checkpoint executed the pickle planted in its .metadata"
    assert "RESTORED" in proc.stdout or "ERROR" in proc.stdout, proc.stdout + proc.stderr[-2000:]
