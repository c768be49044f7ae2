"""Runs a training program taken from the docs as it is, with kill points and a final dump,
for tests/system/test_doc_kill_resume.py.

Run as ``python tests/support/doc_program.py PROGRAM DUMP NAME [NAME ...]`` in the directory
the program should run in (a NAME is a global of the program or a dotted attribute of one).
The program runs unchanged (``runpy``, as ``__main__``); the manager's methods are wrapped to
announce where the program is, on stdout, one line per ``os.write`` (``worker_lines``):

- ``STEP n`` after each ``maybe_save`` of step n returned; ``SAVING n`` before it when that
  call started a checkpoint;
- ``COMMITTED n`` when ``JAXCKPT_DOC_COMMIT_AT`` names step n: its ``maybe_save`` then waits
  (``mgr.wait()``) until the checkpoint committed before the program goes on, so a kill at
  that line finds it on disk;
- ``FINAL SAVE`` as ``save()`` (the program's final save) starts, ``FINAL SAVED`` when it
  returned; ``DONE`` once the program ended and the dump is written.

The dump (JSON) describes the program's globals ``NAME ...`` after it ended, and torch's
global RNG (``global_rngs``): every array or tensor by kind, dtype, shape and a digest of
its bytes, every other value by type and ``repr``, so that two dumps are equal exactly when
the states are bit for bit (a Python ``int`` where a saved array belongs shows up too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import runpy
import sys
from typing import Any

import numpy as np
from worker_lines import claim_stdout, emit  # a sibling: workers run by path


def _digest(kind: str, dtype: Any, shape: Any, data: bytes) -> list[Any]:
    return [kind, str(dtype), list(shape), hashlib.sha256(data).hexdigest()]


def _array(value: Any) -> list[Any] | None:
    """The description of an array or tensor, or None when ``value`` is neither."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        raw = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
        return _digest("torch", tensor.dtype, tensor.shape, raw.numpy().tobytes())
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)  # tobytes(): C order; ascontiguousarray would make 0-d 1-d
        return _digest("numpy", array.dtype, array.shape, array.tobytes())
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(value, jax.Array):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
            kind = "jax-key"
        else:
            kind = "jax"
        array = np.asarray(value)
        return _digest(kind, array.dtype, array.shape, array.tobytes())
    return None


def describe(value: Any, path: str, out: dict[str, Any]) -> None:
    """Every leaf of ``value`` into ``out`` under ``path``."""
    found = _array(value)
    if found is not None:
        out[path] = found
        return
    if isinstance(value, (bool, int, float, str, bytes, type(None))):
        out[path] = [type(value).__name__, repr(value)]
        return
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            describe(value[key], f"{path}/{key}", out)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            describe(item, f"{path}/{index}", out)
        return
    if dataclasses.is_dataclass(value) and not _is_pytree_node(value):
        describe(dataclasses.asdict(value), path, out)  # StepInfo
        return
    if _is_nnx(value):
        from flax import nnx

        describe(nnx.to_pure_dict(nnx.state(value)), path, out)
        return
    if callable(getattr(value, "state_dict", None)):
        describe(value.state_dict(), path, out)
        generator = getattr(value, "generator", None)
        if callable(getattr(generator, "get_state", None)):
            describe(generator.get_state(), f"{path}/.generator", out)
        return
    if callable(getattr(value, "get_state", None)):  # a torch.Generator
        describe(value.get_state(), path, out)
        return
    if _is_pytree_node(value):  # a Linen TrainState, a flax struct
        import jax

        for key_path, leaf in jax.tree_util.tree_leaves_with_path(
                value, is_leaf=lambda x: x is None):
            describe(leaf, path + jax.tree_util.keystr(key_path), out)
        return
    raise TypeError(f"{path}: cannot describe a {type(value).__qualname__}")


def _is_nnx(value: Any) -> bool:
    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx

    return isinstance(value, nnx.Pytree)  # every NNX object (flax >= 0.11)


def _is_pytree_node(value: Any) -> bool:
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: x is None)
    return not (len(leaves) == 1 and leaves[0] is value)


def global_rngs(out: dict[str, Any]) -> None:
    """torch's global RNG, when the program uses torch. (Python's and NumPy's are left out:
    the programs never seed them, so two runs start them differently.)"""
    torch = sys.modules.get("torch")
    if torch is not None:
        describe(torch.get_rng_state(), "rng/torch", out)


def hook_manager() -> None:
    """Wrap the manager's maybe_save and save to announce the kill points."""
    from jaxckpt.manager.manager import CheckpointManager

    commit_at = int(os.environ.get("JAXCKPT_DOC_COMMIT_AT", "-1"))
    maybe_save, save = CheckpointManager.maybe_save, CheckpointManager.save

    def announced_maybe_save(self: Any, step_info: Any, *args: Any, **kwargs: Any) -> Any:
        reports = maybe_save(self, step_info, *args, **kwargs)
        step = step_info.global_step
        if reports:
            emit(f"SAVING {step}")
        if step == commit_at:
            self.wait()
            emit(f"COMMITTED {step}")
        emit(f"STEP {step}")
        return reports

    def announced_save(self: Any, *args: Any, **kwargs: Any) -> Any:
        emit("FINAL SAVE")
        report = save(self, *args, **kwargs)
        emit("FINAL SAVED")
        return report

    CheckpointManager.maybe_save = announced_maybe_save  # type: ignore[method-assign]
    CheckpointManager.save = announced_save  # type: ignore[method-assign]


def main() -> None:
    claim_stdout()
    program, dump, *names = sys.argv[1:]
    hook_manager()
    scope = runpy.run_path(program, run_name="__main__")
    out: dict[str, Any] = {}
    for name in names:  # a global, or an attribute of one: "sampler.generator"
        first, *attributes = name.split(".")
        value = scope[first]
        for attribute in attributes:
            value = getattr(value, attribute)
        describe(value, name, out)
    global_rngs(out)
    with open(dump, "w") as stream:
        json.dump(out, stream, indent=1, sort_keys=True)
    emit("DONE")


if __name__ == "__main__":
    main()
