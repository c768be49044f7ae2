"""Write failures done for real: a file-size limit (RLIMIT_FSIZE, in a subprocess with SIGXFSZ
ignored, so writes fail with EFBIG), a full filesystem and a read-only one (a 2 MiB tmpfs,
mounted when this sandbox allows it; skipped otherwise).

For each, in sync and async mode, a save that cannot be written must surface to the loop as a
``CheckpointWriteError`` naming the step and directory (or, with ``on_write_error="warn"``,
as a ``CheckpointWarning`` while training goes on), write no commit marker, and leave every
earlier checkpoint intact and restorable with its values; the next save, once writes work
again, commits.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import (
    CheckpointManager,
    CheckpointWarning,
    CheckpointWriteError,
    RecoverConfig,
    StepInfo,
)
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER

from support.loaders import Loader

CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys, warnings
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    import jax.numpy as jnp
    from jaxckpt import (CheckpointManager, CheckpointWarning, CheckpointWriteError,
                         RecoverConfig, StepInfo)

    root, mode, policy = sys.argv[1:4]

    def state(v):
        return {"w": jnp.full((256, 256), v, jnp.float32),
                "b": jnp.arange(8, dtype=jnp.int32) + int(v)}

    class Loader:  # this script runs in a child process, which cannot import support
        position = 0
        def state_dict(self): return {"position": self.position}
        def load_state_dict(self, d): self.position = d["position"]

    loader = Loader()
    out = {}
    mgr = CheckpointManager(root, recover=RecoverConfig(keep_last_n=None), mode=mode,
                            on_write_error=policy, preemption_signals=())
    loader.position = 11
    mgr.save(StepInfo(0, 0, 0), state(1.0), stateful={"loader": loader})
    mgr.wait()
    # 64 KiB per file: driver.json and metadata fit, the 256 KiB array chunk does not.
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    loader.position = 12
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mgr.save(StepInfo(0, 1, 1), state(2.0), stateful={"loader": loader})
            mgr.wait()  # async: the background failure surfaces here
        except Exception as exc:
            out["error"] = {"type": type(exc).__name__,
                            "write_error": isinstance(exc, CheckpointWriteError),
                            "message": str(exc), "cause": repr(exc.__cause__)}
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    loader.position = 13
    mgr.save(StepInfo(0, 2, 2), state(3.0), stateful={"loader": loader})  # training goes on
    mgr.wait()
    out["committed"] = mgr.committed_steps()
    mgr.close()
    print("RESULT " + json.dumps(out), flush=True)
""")


def state(value: float) -> dict:
    return {"w": jnp.full((256, 256), value, jnp.float32),
            "b": jnp.arange(8, dtype=jnp.int32) + int(value)}


LIKE = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state(0.0))


def assert_restores(root: Path, step: int, value: float, position: int) -> None:
    """Checkpoint ``step`` verifies and restores bit for bit into a fresh manager."""
    store = CheckpointStore(root)
    assert store.verify(store.step_path(step)) == []
    loader = Loader()
    with CheckpointManager(root, preemption_signals=()) as mgr:
        got = mgr.restore(LIKE, step=step, stateful={"loader": loader})
    expected = state(value)
    for name in ("w", "b"):
        assert np.asarray(got.state[name]).tobytes() == np.asarray(expected[name]).tobytes()
    assert got.step_info.global_step == step and loader.position == position


def assert_failed_step_not_committed(root: Path, step: int) -> None:
    path = Path(CheckpointStore(root).step_path(step))
    assert not (path / COMMIT_MARKER).exists(), f"{path} got a commit marker"


# ------------------------------------------------------------------------ RLIMIT_FSIZE

_child_results: dict[tuple[str, str], tuple[Path, dict]] = {}


def run_limited_child(tmp_factory, mode: str, policy: str) -> tuple[Path, dict]:
    key = (mode, policy)
    if key not in _child_results:
        root = tmp_factory.mktemp(f"fsize-{mode}-{policy}") / "root"
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(root), mode, policy],
                              capture_output=True, text=True, timeout=180, env=env,
                              start_new_session=True)
        results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and results, proc.stderr[-3000:]
        _child_results[key] = (root, json.loads(results[-1][len("RESULT "):]))
    return _child_results[key]


@pytest.mark.parametrize("mode", [
    "sync", "async"])
def test_file_size_limit_surfaces_as_checkpoint_write_error(tmp_path_factory, mode):
    root, out = run_limited_child(tmp_path_factory, mode, "raise")
    error = out.get("error")
    assert error is not None, f"the failed save raised nothing: {out}"
    assert error["write_error"], f"raised {error['type']}, not CheckpointWriteError: {error}"
    message = error["message"]
    assert "step 1" in message and str(CheckpointStore(root).step_path(1)) in message
    assert "File too large" in message and "Earlier checkpoints are intact" in message
    assert "File too large" in error["cause"]


@pytest.mark.parametrize("mode", [
    "sync", "async"])
def test_file_size_limit_with_warn_policy_warns_and_training_goes_on(tmp_path_factory, mode):
    root, out = run_limited_child(tmp_path_factory, mode, "warn")
    assert "error" not in out, f"on_write_error='warn' still raised: {out['error']}"
    assert any("step 1" in w and "File too large" in w for w in out["warnings"]), out
    assert out["committed"] == [0, 2]


@pytest.mark.parametrize("policy", ["raise", "warn"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_file_size_limit_never_commits_and_earlier_checkpoint_stays_restorable(
        tmp_path_factory, mode, policy):
    root, out = run_limited_child(tmp_path_factory, mode, policy)
    assert out["committed"] == [0, 2], out
    assert_failed_step_not_committed(root, 1)
    assert_restores(root, 0, 1.0, 11)
    assert_restores(root, 2, 3.0, 13)  # the save after the failure is complete too


# ------------------------------------------------------------------ real small filesystem


@pytest.fixture
def small_fs(tmp_path: Path):
    mount = tmp_path / "fs"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def break_writes(fs: Path, how: str) -> contextlib.AbstractContextManager:
    """Fill the filesystem (all but 200 KiB) or make recover/ read-only, until exit."""

    @contextlib.contextmanager
    def broken():
        if how == "full":
            ballast = fs / "ballast"
            ballast.write_bytes(b"\0" * (_free_bytes(fs) - 200 * 1024))
            try:
                yield
            finally:
                ballast.unlink()
        else:
            # The root's lock file stays open for writing, so the filesystem cannot be
            # remounted read-only; a read-only bind mount over recover/ can.
            recover = str(fs / "root" / "recover")
            subprocess.run(["mount", "--bind", recover, recover], check=True, timeout=30)
            try:
                subprocess.run(["mount", "-o", "remount,ro,bind", recover], check=True,
                               timeout=30)
                yield
            finally:
                subprocess.run(["umount", recover], check=True, timeout=30)

    return broken()


def fail_one_save(fs: Path, mode: str, how: str, policy: str = "raise") -> tuple[Path, dict]:
    """Step 0 commits, step 1 is saved while writes fail, step 2 after they work again."""
    root = fs / "root"
    loader = Loader()
    out: dict = {}
    with CheckpointManager(root, recover=RecoverConfig(keep_last_n=None), mode=mode,
                           on_write_error=policy, preemption_signals=()) as mgr:
        loader.position = 11
        mgr.save(StepInfo(0, 0, 0), state(1.0), stateful={"loader": loader})
        mgr.wait()
        loader.position = 12
        with break_writes(fs, how), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                mgr.save(StepInfo(0, 1, 1), state(2.0), stateful={"loader": loader})
                mgr.wait()
            except Exception as exc:  # noqa: BLE001 - examined by the tests
                out["error"] = exc
        out["warnings"] = [str(w.message) for w in caught
                           if issubclass(w.category, CheckpointWarning)]
        loader.position = 13
        mgr.save(StepInfo(0, 2, 2), state(3.0), stateful={"loader": loader})
        mgr.wait()
        out["committed"] = mgr.committed_steps()
    return root, out


FS_CASES = [
    ("sync", "full"),
    pytest.param("async", "full"),
    ("sync", "read-only"),
    ("async", "read-only"),
]
REASONS = {"full": "No space left", "read-only": "Read-only file system"}


@pytest.mark.parametrize("mode, how", FS_CASES)
def test_failing_filesystem_surfaces_as_checkpoint_write_error(small_fs, mode, how):
    root, out = fail_one_save(small_fs, mode, how)
    error = out.get("error")
    assert isinstance(error, CheckpointWriteError), f"raised {error!r}"
    assert "step 1" in str(error) and str(CheckpointStore(root).step_path(1)) in str(error)
    assert REASONS[how] in str(error) or "RESOURCE_EXHAUSTED" in str(error), str(error)
    assert error.__cause__ is not None


@pytest.mark.parametrize("mode, how", [
    ("sync", "full"),
    ("async", "full"),
    ("sync", "read-only"),
    ("async", "read-only"),
])
def test_failing_filesystem_with_warn_policy_keeps_training(small_fs, mode, how):
    _, out = fail_one_save(small_fs, mode, how, policy="warn")
    assert "error" not in out, f"on_write_error='warn' still raised {out['error']!r}"
    assert any("step 1" in w for w in out["warnings"]), out
    assert out["committed"] == [0, 2]


@pytest.mark.parametrize("how", ["full", "read-only"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failing_filesystem_never_commits_and_earlier_checkpoint_stays_restorable(
        small_fs, mode, how):
    root, out = fail_one_save(small_fs, mode, how)
    assert "error" in out, "the save on a broken filesystem raised nothing"
    assert out["committed"] == [0, 2], out
    assert_failed_step_not_committed(root, 1)
    assert_restores(root, 0, 1.0, 11)
    assert_restores(root, 2, 3.0, 13)
