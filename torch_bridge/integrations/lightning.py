"""JaxckptCheckpointIO: Lightning's checkpoint files as committed, verified jaxckpt checkpoints.

Owns: the ``CheckpointIO`` plugin (``lightning.Trainer(plugins=[JaxckptCheckpointIO()])``);
the mapping of Lightning's checkpoint paths to jaxckpt steps (a small JSON pointer file at
each path, written once the checkpoint it names has committed); the global RNGs saved with
each checkpoint and restored on load; loading a path whose checkpoint is damaged from the
newest valid one before it, with a warning; in single-process fits, the staging of each
save overlapped with the next step (``overlap.StagingFence``: no update or buffer-changing
forward before the copy). The dict Lightning passes is split by ``lightning_tree`` (tensors through
DCP, the rest as JSON; never pickle).

Must not import: jax, orbax.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import warnings
from typing import Any

import torch

from jaxckpt import CheckpointWarning, ConfigError, RecoverConfig, StepInfo
from jaxckpt.core import codec
from jaxckpt.core.extras import requires_extra
from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from torch_bridge import rng as torch_rng
from torch_bridge.dcp import overlap
from torch_bridge.dcp.backend import DcpBackend
from torch_bridge.integrations import lightning_tree
from torch_bridge.manager import DcpCheckpointManager

with requires_extra("lightning", "torch_bridge.integrations.lightning"):
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.trainer.states import TrainerStatus

__all__ = ["JaxckptCheckpointIO", "POINTER_FORMAT"]

#: The ``format`` field of a pointer file.
POINTER_FORMAT = "jaxckpt-lightning/1"
_MAX_POINTER_BYTES = 16 * 1024 * 1024


class JaxckptCheckpointIO(CheckpointIO):
    """Every checkpoint Lightning writes, as an asynchronous jaxckpt checkpoint.

    A Lightning path (``.../epoch=0-step=9.ckpt``, ``.../last.ckpt``) becomes a small JSON
    pointer file naming the jaxckpt root and the step (Lightning's ``global_step``) of the
    checkpoint under ``{root}/recover/step_…``; two paths saved at one step (a top-k file and
    ``last.ckpt``) share one checkpoint. The pointer is written once that checkpoint has
    committed, so a path exists only for a complete checkpoint and ``ckpt_path="last"``
    never finds a partial one. Loading a path whose checkpoint fails verification loads the
    newest valid checkpoint before it, with a ``CheckpointWarning``.

    Args:
        root: the jaxckpt root (a local path or ``s3://``/``gs://`` URL); None: a folder
            ``jaxckpt`` beside the first path Lightning saves or loads.
        recover: the ``RecoverConfig``; default keeps every checkpoint (Lightning's
            ``ModelCheckpoint`` decides which to remove, through ``remove_checkpoint``).
        manager_kwargs: further keywords of ``torch_bridge.DcpCheckpointManager``
            (``mode``, ``on_report``, ``storage_options``...).

    Concurrency contract: called from Lightning's training thread; pointer files are written
    by the manager's background thread after each commit. One training job per root.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 recover: RecoverConfig | None = None, **manager_kwargs: Any) -> None:
        super().__init__()
        if recover is not None and not isinstance(recover, RecoverConfig):
            raise ConfigError(f"JaxckptCheckpointIO(recover=...) must be a jaxckpt.RecoverConfig, "
                              f"got {type(recover).__name__}.")
        self._root = None if root is None else os.fspath(root)
        self._recover = recover if recover is not None else RecoverConfig(keep_last_n=None)
        self._user_on_report = manager_kwargs.pop("on_report", None)
        self._manager_kwargs = manager_kwargs
        self._manager: DcpCheckpointManager | None = None
        self._lock = threading.Lock()
        # step -> (path, its own skeleton or None) waiting for the step's commit
        self._pending: dict[int, list[tuple[str, Any]]] = {}
        self._committed: set[int] = set()
        self._saved: set[int] = set()  # steps this process saved (later paths are aliases)
        self._exit_hook = False
        self._fence: overlap.StagingFence | None = None

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Start an asynchronous save of ``checkpoint``; returns once tensors are staged."""
        if storage_options is not None:
            raise ConfigError("JaxckptCheckpointIO.save_checkpoint(storage_options=...) is not "
                              "supported: pass storage_options to JaxckptCheckpointIO(...).")
        path = os.fspath(path)
        if "://" in path:
            raise ConfigError(f"JaxckptCheckpointIO writes a small pointer file at each path "
                              f"Lightning names, which must be local; got {path!r}. Fix: a "
                              "local ModelCheckpoint(dirpath=...) and the object store as "
                              "JaxckptCheckpointIO(root='s3://...').")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"the checkpoint for {path} has global_step={step!r}; "
                              "JaxckptCheckpointIO needs Lightning's global step (an int >= 0).")
        skeleton, tensors = lightning_tree.split(checkpoint)
        manager = self._open(path)
        # Lightning leaves the folder to its CheckpointIO; the pointer is written there later,
        # from the manager's thread.
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with self._lock:
            alias = step in self._saved
            self._saved.add(step)
        if not alias:
            self._save_step(manager, checkpoint, step, skeleton, tensors, path)
        # A second path at one step (last.ckpt after the top-k file, or save_checkpoint after
        # fit) shares the first one's tensors (the same values: nothing trained between the
        # two saves); its own plain values (ModelCheckpoint's last_model_path...) go into
        # its pointer.
        own = skeleton if alias else None
        with self._lock:
            if step in self._committed:
                write_pointer(path, self._root_for_pointer(path), step, own)
            else:
                self._pending.setdefault(step, []).append((path, own))

    def _save_step(self, manager: DcpCheckpointManager, checkpoint: dict[str, Any], step: int,
                   skeleton: Any, tensors: dict[str, torch.Tensor], path: str) -> None:
        """Write the jaxckpt checkpoint of ``step``: asynchronously while ``fit`` runs (its
        teardown waits), synchronously otherwise (``trainer.save_checkpoint`` after ``fit``:
        no teardown follows, and a write left to interpreter exit would be refused)."""
        if step in self._committed:  # an earlier run's checkpoint of this step: replaced
            manager.store.delete(manager.store.step_path(step))
            with self._lock:
                self._committed.discard(step)
        trainer = _calling_trainer()
        rng = torch_rng.capture_rng()
        rng["loaders"] = [_generator_bytes(g) for g in _loader_generators(trainer)]
        state = {"tensors": tensors, "lightning": {"checkpoint": skeleton, "rng": rng,
                                                   "path": path}}
        epoch = checkpoint.get("epoch", 0)
        info = StepInfo(epoch=epoch if isinstance(epoch, int) else 0, global_step=step)
        running = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        self._overlap_staging(manager, trainer if running else None)
        manager.save(info, state, mode=None if running else "sync")

    def _overlap_staging(self, manager: DcpCheckpointManager, trainer: Any) -> None:
        """Let this save stage on the backend's worker while the next step's forward and
        backward run, fenced (``overlap.StagingFence``) before anything changes the tensors
        handed over, which are the live parameters, buffers and optimizer state. Only in a
        single-process fit (``overlap.single_process`` says why) with torch optimizers;
        otherwise the copy is made here, before ``save_checkpoint`` returns."""
        backend = manager.backend
        if (trainer is None or not isinstance(backend, DcpBackend)
                or not overlap.single_process()
                or not all(hasattr(o, "register_step_pre_hook") for o in trainer.optimizers)):
            if self._fence is not None:
                self._fence.remove()
                self._fence = None
            overlap.detach(backend)
            return
        if self._fence is None:
            self._fence = overlap.StagingFence(overlap.attach(backend))
        module = trainer.lightning_module
        self._fence.install(trainer.optimizers, [] if module is None else [module])

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved at ``path`` (tensors on the CPU); the global RNGs are
        set to their state at that save."""
        path = os.fspath(path)
        pointer = read_pointer(path)
        manager = self._open(path, pointer_root=pointer["root"])
        manager.wait()
        step, saved, tensors = self._read_newest_valid(manager, int(pointer["step"]), path)
        skeleton = saved["checkpoint"]
        if step == pointer["step"] and "checkpoint" in pointer:  # this path's own values
            skeleton = codec.decode(pointer["checkpoint"], f"{path}['checkpoint']")
            missing = set(lightning_tree.empty_like_saved(skeleton)) - set(tensors)
            if missing:
                raise CheckpointCorruptError(f"{path} names tensors {sorted(missing)[:5]} that "
                                             f"step {step} under {manager.root} does not hold.")
        trainer = _calling_trainer()
        if trainer is None:
            torch_rng.restore_rng(saved["rng"], path)
        else:  # after Lightning has made the restored loader iterator (see _RestoreRng)
            trainer.callbacks.append(_RestoreRng(saved["rng"]))
        return lightning_tree.join(skeleton, tensors)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the pointer at ``path`` and, once no other path names its step, the jaxckpt
        checkpoint (through the root's deletion: its commit marker first)."""
        path = os.fspath(path)
        if self._manager is not None:
            self._manager.wait()  # a pointer still pending is written now
        if not os.path.exists(path):
            return
        pointer = read_pointer(path)
        os.remove(path)
        step = int(pointer["step"])
        folder = os.path.dirname(path) or "."
        for name in os.listdir(folder):
            other = os.path.join(folder, name)
            if name.endswith(".ckpt") and os.path.isfile(other):
                try:
                    if int(read_pointer(other)["step"]) == step:
                        return  # still named by another path (e.g. last.ckpt)
                except ConfigError:
                    continue
        manager = self._open(path, pointer_root=pointer["root"])
        manager.store.delete(manager.store.step_path(step))

    def teardown(self) -> None:
        """Wait for the saves in flight and release the root."""
        self.close()

    def close(self) -> None:
        """As ``teardown``; also called at interpreter exit."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()
        fence, self._fence = self._fence, None
        if fence is not None:
            fence.remove()

    # ------------------------------------------------------------------ internals
    def _open(self, path: str, pointer_root: str | None = None) -> DcpCheckpointManager:
        root = self._root
        if root is None:
            root = os.path.normpath(
                os.path.join(os.path.dirname(path), pointer_root) if pointer_root
                else os.path.join(os.path.dirname(path), "jaxckpt"))
            self._root = root
        if self._manager is None:
            self._manager = DcpCheckpointManager(root, recover=self._recover,
                                                 on_report=self._on_report,
                                                 **{"mode": "async", **self._manager_kwargs})
            self._committed = set(self._manager.committed_steps())
            if not self._exit_hook:
                atexit.register(self.close)
                self._exit_hook = True
        return self._manager

    def _root_for_pointer(self, path: str) -> str:
        assert self._root is not None
        if "://" in self._root:
            return self._root
        return os.path.relpath(self._root, os.path.dirname(os.path.abspath(path)))

    def _on_report(self, report: Any) -> None:
        if report.kind == "recover":
            with self._lock:
                self._committed.add(report.step)
                paths = self._pending.pop(report.step, [])
            for path, own in paths:
                write_pointer(path, self._root_for_pointer(path), report.step, own)
        if self._user_on_report is not None:
            self._user_on_report(report)

    @staticmethod
    def _read_newest_valid(manager: DcpCheckpointManager, step: int, path: str
                           ) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        """``(step, saved plain values, tensors)`` of ``step``, or of the newest older step
        that passes verification (with a warning), read by the manager's restore (which
        checks every file against the commit manifest before anything is used)."""
        skipped: list[str] = []
        for candidate in sorted((s for s in manager.committed_steps() if s <= step),
                                reverse=True):
            try:
                head = manager.restore({"lightning": None}, step=candidate, partial=True)
                saved = head.state["lightning"]
                tensors = lightning_tree.empty_like_saved(saved["checkpoint"])
                manager.restore({"tensors": tensors, "lightning": None}, step=candidate)
            except CheckpointCorruptError as exc:
                skipped.append(f"step {candidate}: {exc}")
                continue
            if candidate != step:
                warnings.warn(f"{path}: the jaxckpt checkpoint of step {step} under "
                              f"{manager.root} is not valid; loading the newest valid one "
                              f"before it, step {candidate}.", CheckpointWarning, stacklevel=3)
            return candidate, saved, tensors
        raise CheckpointNotFoundError(
            f"{path} names jaxckpt step {step} under {manager.root}, but neither it nor any "
            "older committed checkpoint there is valid" + (": " if skipped else ".")
            + "; ".join(skipped))


def write_pointer(path: str, root: str, step: int, skeleton: Any = None) -> None:
    """Write the pointer file at ``path`` atomically (a temporary file renamed into place);
    ``skeleton``: this path's own plain values, where they differ from the step's."""
    pointer: dict[str, Any] = {"format": POINTER_FORMAT, "root": root, "step": step}
    if skeleton is not None:
        pointer["checkpoint"] = codec.encode(skeleton, "checkpoint")
    data = json.dumps(pointer).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_pointer(path: str) -> dict[str, Any]:
    """The pointer at ``path``; ``ConfigError`` for a file that is not one."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint") from None
    try:
        pointer = json.loads(data) if len(data) <= _MAX_POINTER_BYTES else None
    except ValueError:
        pointer = None
    if (not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT
            or not isinstance(pointer.get("root"), str)
            or isinstance(pointer.get("step"), bool) or not isinstance(pointer.get("step"), int)):
        raise ConfigError(f"{path} is not a checkpoint written by JaxckptCheckpointIO (a "
                          "Lightning .ckpt file from torch.save?). Load it with Lightning's "
                          "default checkpoint IO (a Trainer without this plugin).")
    return pointer


class _RestoreRng(Callback):
    """Sets the global RNGs and the train loaders' generators to their state at the save,
    once, at ``on_train_start``: after ``fit_loop.setup_data`` has loaded the loader's state
    and made the iterator that replays the rest of its epoch (which draws from the generator
    and, without one, from torch's RNG), before any batch or the next epoch's shuffle."""

    def __init__(self, rng: dict[str, Any]) -> None:
        self._rng: dict[str, Any] | None = rng

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        rng, self._rng = self._rng, None
        if rng is None:
            return
        torch_rng.restore_rng(rng)
        generators = _loader_generators(trainer)
        saved = rng.get("loaders", [])
        if len(saved) != len(generators):
            warnings.warn(f"the checkpoint holds {len(saved)} train loader generator state(s) "
                          f"but the trainer has {len(generators)} loader generator(s); they "
                          "keep their current state, so the shuffle order may differ from the "
                          "interrupted run's.", CheckpointWarning, stacklevel=2)
            return
        for generator, state in zip(generators, saved, strict=True):
            generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _calling_trainer() -> Any:
    """The ``lightning.pytorch.Trainer`` up the call stack (``Trainer.save_checkpoint`` when
    saving, ``_CheckpointConnector.resume_start`` when loading), or None. A CheckpointIO has
    no reference to its trainer; this is the one place that relies on Lightning's call path
    (tested against the pinned version)."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        trainer = getattr(owner, "trainer", None)
        if isinstance(trainer, Trainer):
            return trainer
        frame = frame.f_back
    return None


def _loader_generators(trainer: Any) -> list[torch.Generator]:
    """The distinct ``torch.Generator``s of the train loaders and their samplers."""
    if trainer is None:
        return []
    try:
        loaders = trainer.train_dataloader
    except Exception:  # noqa: BLE001 - no loader attached yet: nothing to save
        return []
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    found: dict[int, torch.Generator] = {}
    for loader in loaders:
        for owner in (loader, getattr(loader, "sampler", None),
                      getattr(loader, "batch_sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator):
                found.setdefault(id(generator), generator)
    return list(found.values())


def _generator_bytes(generator: torch.Generator) -> bytes:
    return bytes(generator.get_state().numpy().tobytes())
