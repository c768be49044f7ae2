"""A corpus of wrong uses: each must raise the documented exception TYPE, with a message that
names the field or tree path involved AND says how to fix it.

Every case is one row: the wrong call, the exception type, the words that locate the problem
(field name, tree path, directory) and the words of the fix (any one of them). Rows in FIXED
first failed; each keeps the reason it failed, as a regression.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CodecError,
    ConfigError,
    Every,
    ExportConfig,
    RecoverConfig,
    RootLockedError,
    StepInfo,
    TreeMismatchError,
)
from jaxckpt.backends.base import SingleProcess
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER

from support.loaders import Loader
from support.paths import REPO

TREE_FIX = ("Fix: build like with the same code",)


def state(value: float = 1.0) -> dict:
    return {"params": {"w": jnp.full((4, 3), value, jnp.float32),
                       "b": jnp.zeros((3,), jnp.float32)},
            "step": jnp.int32(7), "key": jax.random.key(0)}


def like() -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state())


class NoProtocol:
    """Has neither state_dict/load_state_dict nor get_state/set_state."""


class Unencodable:
    def __init__(self, value: Any):
        self.value = value

    def state_dict(self) -> dict:
        return {"cache": self.value}

    def load_state_dict(self, saved: dict) -> None:
        pass


class SyncOnlyBackend(SingleProcess):
    name = "orbax"
    supports_async = False


def manager(root: Path, **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("preemption_signals", ())
    return CheckpointManager(root, **kwargs)


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory) -> Path:
    """A root with committed checkpoints at steps 0 and 1 (state(), a loader at 5 and 6)."""
    root = tmp_path_factory.mktemp("bad-input") / "root"
    with manager(root, mode="sync", recover=RecoverConfig(keep_last_n=None)) as mgr:
        for step in (0, 1):
            mgr.save(StepInfo(0, step, step), state(float(step)),
                     stateful={"loader": Loader(5 + step)})
    return root


def copy_root(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def recommit(root: Path, step: int) -> Path:
    """After editing a checkpoint's files, write a manifest that matches them again: the
    checkpoint is then internally consistent, so only the content is wrong."""
    store = CheckpointStore(root)
    path = store.step_path(step)
    os.unlink(os.path.join(path, COMMIT_MARKER))
    store.commit(path, step)
    return Path(path)


def edit_json(path: Path, **changes: Any) -> None:
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def using(root: Path, call: Callable[[CheckpointManager], Any], **kwargs: Any) -> Any:
    """Run ``call`` on a manager that is closed afterwards, whatever happens."""
    with manager(root, **kwargs) as mgr:
        return call(mgr)


def restore(root: Path, like_tree: Any, **kwargs: Any) -> Any:
    with manager(root) as mgr:
        return mgr.restore(like_tree, **kwargs)


def save(root: Path, state_tree: Any, **kwargs: Any) -> Any:
    with manager(root, mode="sync") as mgr:
        return mgr.save(StepInfo(0, 0, 0), state_tree, **kwargs)


# ----------------------------------------------------------------------------- cases

Case = tuple[Callable[[Path, Path], Any], type, tuple[str, ...], tuple[str, ...]]


def _renamed(like_tree: dict) -> dict:
    out = dict(like_tree)
    out["weights"] = out.pop("params")
    return out


def _with(path: tuple[str, ...], leaf: Any) -> Callable[[Path, Path], Any]:
    def run(root: Path, tmp: Path) -> Any:
        tree = like()
        node = tree
        for key in path[:-1]:
            node = node[key]
        if leaf is None:
            del node[path[-1]]
        else:
            node[path[-1]] = leaf
        return restore(root, tree)
    return run


def _other_model(root: Path, tmp: Path) -> Any:
    other = {"encoder": {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32)},
             "decoder": {"kernel": jax.ShapeDtypeStruct((8, 2), jnp.float32)}}
    try:
        restore(root, other)
    except TreeMismatchError as exc:
        # Every path of both trees is listed, not just the first mismatch.
        assert len(exc.problems) == 2 + 4, exc.problems
        raise


def _mismatch_leaves_stateful_untouched(root: Path, tmp: Path) -> Any:
    loader = Loader(99)
    tree = like()
    tree["params"]["w"] = jax.ShapeDtypeStruct((4, 3), jnp.float16)
    try:
        with manager(root) as mgr:
            mgr.restore(tree, stateful={"loader": loader})
    finally:
        assert loader.position == 99, "a failed restore changed the loader"


def _bad_save_writes_nothing(state_tree: Any) -> Callable[[Path, Path], Any]:
    def run(root: Path, tmp: Path) -> Any:
        fresh = tmp / "fresh"
        try:
            save(fresh, state_tree)
        finally:
            assert CheckpointStore(fresh).committed_steps() == []
    return run


def _stateful(obj: Any, name: str = "ev") -> Callable[[Path, Path], Any]:
    return lambda root, tmp: save(tmp / "fresh", state(), stateful={name: obj})


def _stateful_kind_changed(root: Path, tmp: Path) -> Any:
    with manager(root) as mgr:
        mgr.restore(like(), stateful={"loader": np.random.default_rng(0)})


def _edited_driver(**changes: Any) -> Callable[[Path, Path], Any]:
    def run(root: Path, tmp: Path) -> Any:
        copy = copy_root(root, tmp / "copy")
        edit_json(copy / "recover" / "step_00000001" / "driver.json", **changes)
        recommit(copy, 1)
        with manager(copy) as mgr:
            mgr.recover(like())
    return run


def _driver_not_json(root: Path, tmp: Path) -> Any:
    copy = copy_root(root, tmp / "copy")
    (copy / "recover" / "step_00000001" / "driver.json").write_text('{"format": "jaxckpt.dr')
    recommit(copy, 1)
    with manager(copy) as mgr:
        mgr.restore(like(), step=1)


def _tree_json_newer(root: Path, tmp: Path) -> Any:
    copy = copy_root(root, tmp / "copy")
    edit_json(copy / "recover" / "step_00000001" / "state" / "tree.json", version=99)
    recommit(copy, 1)
    restore(copy, like(), step=1)


def _root_is_a_file(root: Path, tmp: Path) -> Any:
    target = tmp / "not-a-dir"
    target.write_text("x")
    manager(target)


def _root_below_a_file(root: Path, tmp: Path) -> Any:
    target = tmp / "not-a-dir"
    target.write_text("x")
    manager(target / "trial-0")


def _step_info_a_tuple(root: Path, tmp: Path) -> Any:
    with manager(tmp / "fresh") as mgr:
        mgr.maybe_save((0, 0, 0), state())


CASES: dict[str, Case] = {
    # --- restore into the wrong tree
    "renamed-subtree": (lambda r, t: restore(r, _renamed(like())), TreeMismatchError,
                        ("['params']['w']", "['weights']['w']", "missing from checkpoint",
                         "not in like"), TREE_FIX),
    "wrong-shape": (_with(("params", "w"), jax.ShapeDtypeStruct((5, 3), jnp.float32)),
                    TreeMismatchError, ("['params']['w']", "(5, 3)", "(4, 3)"), TREE_FIX),
    "wrong-dtype": (_with(("params", "w"), jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)),
                    TreeMismatchError, ("['params']['w']", "bfloat16", "float32"), TREE_FIX),
    "missing-leaf": (_with(("params", "b"), None), TreeMismatchError,
                     ("['params']['b']", "not in like"), TREE_FIX),
    "extra-leaf": (_with(("params", "scale"), jax.ShapeDtypeStruct((3,), jnp.float32)),
                   TreeMismatchError, ("['params']['scale']", "missing from checkpoint"),
                   TREE_FIX),
    "key-as-plain-array": (_with(("key",), jax.ShapeDtypeStruct((2,), jnp.uint32)),
                           TreeMismatchError, ("['key']", "key<fry>", "uint32"), TREE_FIX),
    "another-model": (_other_model, TreeMismatchError,
                      ("['encoder']['kernel']", "['params']['w']", "['key']"), TREE_FIX),
    "mismatch-leaves-loader-untouched": (_mismatch_leaves_stateful_untouched, TreeMismatchError,
                                         ("['params']['w']", "float16"), TREE_FIX),
    "like-leaf-is-not-an-array": (_with(("params", "w"), "float32[4,3]"), TypeError,
                                  ("['params']['w']", "builtins.str"), ("Fix:", "eval_shape")),
    # --- save something that is not a checkpointable state
    "state-leaf-is-a-string": (_bad_save_writes_nothing({"w": jnp.ones(3), "name": "run-7"}),
                               TypeError, ("['name']", "builtins.str"), ("Fix:",)),
    "state-leaf-object-array": (_bad_save_writes_nothing({"w": np.array([object()])}),
                                TypeError, ("['w']", "object"), ("Fix:",)),
    "state-int-beyond-int64": (_bad_save_writes_nothing({"tokens": 2**70}), TypeError,
                               ("['tokens']", "int64"), ("Fix:",)),
    # --- stateful objects
    "stateful-not-a-dict": (lambda r, t: save(t / "fresh", state(), stateful=[Loader()]),
                            ConfigError, ("stateful", "list"), ("stateful={'loader': loader}",)),
    "stateful-without-protocol": (_stateful(NoProtocol(), "sampler"), ConfigError,
                                  ("stateful['sampler']", "NoProtocol"),
                                  ("state_dict()/load_state_dict(d)",)),
    "stateful-object-value": (_stateful(Unencodable(object())), CodecError,
                              ("stateful['ev']", "['cache']", "builtins.object"),
                              ("convert custom objects to dicts", "Store only JSON-like")),
    "stateful-set-value": (_stateful(Unencodable({1, 2})), CodecError,
                           ("stateful['ev']", "['cache']", "builtins.set"),
                           ("Store only JSON-like",)),
    "stateful-huge-array": (_stateful(Unencodable(np.zeros(17 * 2**20, np.float32))), CodecError,
                            ("stateful['ev']", "['cache']", "too large"),
                            ("checkpointed array state",)),
    "stateful-kind-changed": (_stateful_kind_changed, ConfigError,
                              ("stateful['loader']", "'state_dict'", "Generator"),
                              ("Pass the same kind of object",)),
    "metrics-not-a-number": (lambda r, t: save(t / "fresh", state(), metrics={"loss": "low"}),
                             CodecError, ("metrics['loss']", "'low'"), ("float(loss)",)),
    # --- steps and step info
    "step-info-not-a-stepinfo": (_step_info_a_tuple, ConfigError,
                                 ("step_info", "tuple"), ("Write StepInfo(",)),
    "restore-missing-step": (lambda r, t: restore(r, like(), step=42), CheckpointNotFoundError,
                             ("step 42", "recover", "[0, 1]"), ("Pass one of those",)),
    "restore-from-empty-root": (lambda r, t: restore(t / "empty", like()), CheckpointNotFoundError,
                                ("no valid recovery checkpoint", "empty"),
                                ("point the manager at the root",)),
    "stepinfo-negative": (lambda r, t: StepInfo(0, 0, -1), ConfigError,
                          ("StepInfo.global_step", "-1"), ("int >= 0",)),
    "stepinfo-float": (lambda r, t: StepInfo(1.0, 0, 0), ConfigError, ("StepInfo.epoch", "1.0"),
                       ("int >= 0",)),
    "stepinfo-step-past-epoch": (lambda r, t: StepInfo(0, 8, 8, 8), ConfigError,
                                 ("StepInfo.epoch_step=8", "steps_per_epoch=8"), ("must be <",)),
    "stepinfo-counter-not-number": (lambda r, t: StepInfo(0, 0, 0, counters={"tokens": "9"}),
                                    ConfigError, ("StepInfo.counters['tokens']",),
                                    ("must map str to int or float",)),
    # --- config values
    "every-zero-steps": (lambda r, t: Every(steps=0), ConfigError, ("Every.steps", "0"),
                         ("Use None to disable",)),
    "every-fractional-steps": (lambda r, t: Every(epochs=1.5), ConfigError,
                               ("Every.epochs", "1.5"), ("Use None to disable",)),
    "every-bool-steps": (lambda r, t: Every(steps=True), ConfigError, ("Every.steps", "True"),
                         ("Use None to disable",)),
    "every-nan-seconds": (lambda r, t: Every(seconds=float("nan")), ConfigError,
                          ("Every.seconds", "nan"), ("Use None to disable",)),
    "recover-mode-unknown": (lambda r, t: RecoverConfig(mode="resume"), ConfigError,
                             ("RecoverConfig.mode", "'resume'"), ("one of ('on', 'auto'",)),
    "recover-every-an-int": (lambda r, t: RecoverConfig(every=100), ConfigError,
                             ("RecoverConfig.every", "100"), ("every=jaxckpt.Every(",)),
    "recover-keep-negative": (lambda r, t: RecoverConfig(keep_last_n=-1), ConfigError,
                              ("RecoverConfig.keep_last_n", "-1"), ("None (keep all)",)),
    "recover-retries-negative": (lambda r, t: RecoverConfig(retries=-1), ConfigError,
                                 ("RecoverConfig.retries", "-1"), ("int >= 0",)),
    "recover-verify-unknown": (lambda r, t: RecoverConfig(verify="md5"), ConfigError,
                               ("RecoverConfig.verify", "'md5'"), ("'checksums', 'sizes'",)),
    "export-without-exporter": (lambda r, t: ExportConfig(every=Every(steps=10)), ConfigError,
                                ("ExportConfig.exporter", "None"), ("hf_exporter",)),
    "export-mode-unknown": (lambda r, t: ExportConfig(exporter=print, mode="later"),
                            ConfigError, ("ExportConfig.mode", "'later'"), ("'sync', 'async'",)),
    "export-keep-fraction": (lambda r, t: ExportConfig(exporter=print, keep_last_n=0.5),
                             ConfigError, ("ExportConfig.keep_last_n", "0.5"), ("positive int N",)),
    "export-call-without-config": (lambda r, t: using(t / "x",
                                                      lambda m: m.export(StepInfo(0, 0, 0), {})),
                                   ConfigError, ("export()",), ("export=ExportConfig(",)),
    # --- manager arguments
    "manager-root-an-int": (lambda r, t: manager(3), ConfigError, ("root", "3"),
                            ("str or os.PathLike",)),
    "manager-recover-an-every": (lambda r, t: manager(t / "x", recover=Every(steps=1)),
                                 ConfigError, ("recover", "Every"), ("jaxckpt.RecoverConfig",)),
    "manager-export-a-recover": (lambda r, t: manager(t / "x", export=RecoverConfig()),
                                 ConfigError, ("export", "RecoverConfig"),
                                 ("ExportConfig or None",)),
    "manager-mode-unknown": (lambda r, t: manager(t / "x", mode="fast"), ConfigError,
                             ("mode", "'fast'"), ("'sync', 'async', 'auto'",)),
    "manager-on-write-error-unknown": (lambda r, t: manager(t / "x", on_write_error="ignore"),
                                       ConfigError, ("on_write_error", "'ignore'"),
                                       ("'raise' or 'warn'",)),
    "manager-on-report-not-callable": (lambda r, t: manager(t / "x", on_report="log"),
                                       ConfigError, ("on_report", "'log'"), ("callable(report)",)),
    "async-mode-on-sync-only-backend": (lambda r, t: manager(t / "x", mode="async",
                                                             backend=SyncOnlyBackend()),
                                        ConfigError, ("mode='async'",), ("Use 'auto'", "'sync'")),
    "save-mode-async-on-sync-only-backend": (
        lambda r, t: using(t / "x", lambda m: m.save(StepInfo(0, 0, 0), {}, mode="async"),
                           backend=SyncOnlyBackend()),
        ConfigError, ("save(mode=...)='async'",), ("Use 'auto'",)),
    "save-mode-unknown": (lambda r, t: using(t / "x", lambda m: m.save(StepInfo(0, 0, 0), {},
                                                                         mode="now")),
                          ConfigError, ("save(mode=...)", "'now'"), ("'sync', 'async', 'auto'",)),
    # --- checkpoints that are not this manager's to read
    "dcp-written-checkpoint": (_edited_driver(backend="dcp"), CheckpointError,
                               ("'dcp' backend", "'orbax'", "step_00000001"),
                               ("torch_bridge.DcpCheckpointManager",)),
    "driver-json-from-the-future": (_edited_driver(format="jaxckpt.driver/9"),
                                    CheckpointCorruptError,
                                    ("driver.json", "'jaxckpt.driver/9'", "step_00000001"),
                                    ("upgrade jaxckpt",)),
    "tree-json-from-the-future": (_tree_json_newer, CheckpointCorruptError,
                                  ("tree.json", "version 99"), ("upgrade jaxckpt",)),
    "closed-manager": (lambda r, t: using(t / "x", lambda m: (m.close(), m.maybe_save(
        StepInfo(0, 0, 0), {}))), CheckpointError, ("CheckpointManager is closed",),
        ("create a new one",)),
}

# Cases that first failed (each reason says what was wrong), kept as regressions.
FIXED: dict[str, tuple[Case, str]] = {
    "restore-step-a-string": (
        (lambda r, t: restore(r, like(), step="1"), ConfigError, ("step", "'1'"),
         ("step=None", "int")),
        "manager.restore does not validate step: step='1' dies in f-string formatting with "
        "ValueError \"Unknown format code 'd'\", naming neither the argument nor the fix"),
    "restore-step-a-bool": (
        (lambda r, t: restore(r, like(), step=True), ConfigError, ("step", "True"),
         ("step=None", "int")),
        "manager.restore accepts step=True as step 1 (bool is an int): with step 1 on disk "
        "it silently restores it"),
    "manager-backend-a-string": (
        (lambda r, t: manager(t / "x", backend="orbax"), ConfigError, ("backend", "'orbax'"),
         ("Backend", "OrbaxBackend")),
        "CheckpointManager.__init__ does not check backend: a str dies with AttributeError "
        "'str' object has no attribute 'supports_async'"),
    "manager-signals-an-int": (
        (lambda r, t: manager(t / "x", preemption_signals=signal.SIGTERM), ConfigError,
         ("preemption_signals",), ("(signal.SIGTERM,)", "tuple", "()")),
        "CheckpointManager.__init__ iterates preemption_signals unchecked: an int dies with "
        "TypeError \"'int' object is not iterable\" (after taking the root lock)"),
    "manager-negative-commit-timeout": (
        (lambda r, t: using(t / "x", lambda m: None, commit_timeout_s=-5), ConfigError,
         ("commit_timeout_s",),
         ("positive",)),
        "CheckpointManager.__init__ accepts commit_timeout_s=-5: every multi-process commit "
        "would time out at once"),
    "manager-root-is-a-file": (
        (_root_is_a_file, CheckpointError, ("root", "not-a-dir"), ("directory",)),
        "CheckpointManager.__init__ (store.ensure_dirs) lets FileExistsError '[Errno 17] File "
        "exists' escape: not a CheckpointError, does not say the root must be a directory"),
    "manager-root-below-a-file": (
        (_root_below_a_file, CheckpointError, ("root", "not-a-dir"), ("directory",)),
        "CheckpointManager.__init__ (store.ensure_dirs) lets NotADirectoryError escape "
        "without naming the root setting or the fix"),
    "keep-zero-with-a-periodic-trigger": (
        (lambda r, t: RecoverConfig(every=Every(steps=10), keep_last_n=0), ConfigError,
         ("keep_last_n", "every"), ("keep_last_n=1", "Every()", "remove")),
        "RecoverConfig accepts every=Every(steps=10) with keep_last_n=0, which silently "
        "disables that trigger (0 writes only forced saves): conflicting settings, not named"),
    "driver-json-not-json": (
        (_driver_not_json, CheckpointCorruptError, ("driver.json", "step_00000001"),
         ("restore another", "step=", "Fix")),
        "driver.parse_driver: 'driver.json is not valid JSON (...)' gives no fix (e.g. restore "
        "another step / step=None picks the latest valid one)"),
}


def _run_case(case: Case, root: Path, tmp: Path) -> None:
    call, exc_type, names, fixes = case
    with pytest.raises(exc_type) as info:
        call(root, tmp)
    message = str(info.value)
    missing = [n for n in names if n not in message]
    assert not missing, f"message does not name {missing}: {message}"
    assert any(f in message for f in fixes), f"message gives no fix (any of {fixes}): {message}"


CASES.update({name: case for name, (case, _was_wrong) in FIXED.items()})


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrong_use_raises_a_typed_error_naming_the_field_and_the_fix(name, saved_root, tmp_path):
    _run_case(CASES[name], saved_root, tmp_path)


def test_corpus_is_large_enough():
    assert len(CASES) >= 25


# ---------------------------------------------------------- a root held by another job

HOLDER = textwrap.dedent("""
    import sys, time
    from jaxckpt import CheckpointManager
    from jaxckpt.backends.base import SingleProcess

    class Stub(SingleProcess):
        name = "orbax"
        supports_async = False

    with CheckpointManager(sys.argv[1], backend=Stub(), preemption_signals=()):
        print("HOLDING", flush=True)
        time.sleep(120)
""")


def test_root_held_by_another_running_job_is_refused_naming_the_holder(tmp_path):
    root = tmp_path / "trial-0"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING", holder.stderr.read()
        with pytest.raises(RootLockedError) as info:
            manager(root)
        message = str(info.value)
        assert str(root) in message and f'"pid": {holder.pid}' in message, message
        assert "its own root" in message and "stop the other job" in message
        assert isinstance(info.value, BlockingIOError)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    # The kernel dropped the lock with its holder: the root is usable at once.
    deadline = time.monotonic() + 10
    while True:
        try:
            manager(root).close()
            break
        except RootLockedError:
            assert time.monotonic() < deadline, "lock of a killed job was never released"
            time.sleep(0.05)


def test_rejected_constructor_does_not_keep_the_root_locked(tmp_path):
    with pytest.raises(ConfigError, match="preemption_signals"):
        manager(tmp_path, preemption_signals=signal.SIGTERM)
    manager(tmp_path).close()  # RootLockedError today: the lock leaked


UNREADABLE = textwrap.dedent("""
    import json, sys
    from jaxckpt import CheckpointError, CheckpointManager
    from jaxckpt.backends.base import SingleProcess

    class Stub(SingleProcess):
        name = "orbax"
        supports_async = False

    try:
        CheckpointManager(sys.argv[1], backend=Stub(), preemption_signals=()).close()
        print(json.dumps({"error": None}))
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                          "typed": isinstance(exc, CheckpointError),
                          "os_error": isinstance(exc, OSError)}))
""")


def run_without_permissions(root: Path) -> dict:
    """Open a manager on ``root`` in a process that permission bits apply to (as root:
    without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, via setpriv)."""
    argv = [sys.executable, "-c", UNREADABLE, str(root)]
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        argv = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *argv]
    repo = str(REPO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    except FileNotFoundError:
        pytest.skip("setpriv is not available to drop root's permission override")
    if done.returncode != 0 or not done.stdout.strip():
        pytest.skip(f"cannot run without permissions here: {done.stderr[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["root-unreadable", "parent-unwritable"])
def test_root_without_permissions_raises_a_clear_error(tmp_path, layout):
    locked = tmp_path / "locked"
    locked.mkdir()
    root = locked if layout == "root-unreadable" else locked / "trial-0"
    locked.chmod(0)
    try:
        out = run_without_permissions(root)
    finally:
        locked.chmod(0o755)
    assert out["error"] is not None and out["os_error"], out
    assert out["typed"], f"raised {out['error']}, not a CheckpointError: {out['message']}"
    assert "root" in out["message"] and str(root) in out["message"], out
    assert "permission" in out["message"].lower() and (
        "chmod" in out["message"] or "another root" in out["message"] or "Fix" in out["message"])
