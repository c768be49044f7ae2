"""The Lightning checkpoint dict split into tensors and a JSON skeleton, and joined back.

Owns: walking the ``checkpoint`` dict that Lightning hands a ``CheckpointIO`` (tensors and
plain Python), moving every tensor into a flat ``{key: tensor}`` dict for DCP and leaving a
placeholder with its shape and dtype, so that a restore can allocate the tensors before
reading them; refusing any other object with the key path that holds it and the fix.

Must not import: jax, orbax, lightning.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from jaxckpt import ConfigError

__all__ = ["split", "join", "empty_like_saved", "TENSOR_TAG"]

#: The placeholder key of a tensor in the skeleton.
TENSOR_TAG = "__jaxckpt_lightning_tensor__"
_PLAIN = (str, int, float, bool, type(None), bytes, np.ndarray, np.generic)


def split(checkpoint: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: the checkpoint with each tensor replaced by a placeholder
    ``{TENSOR_TAG: key, "shape": [...], "dtype": "float32"}`` and the tensors by key."""
    tensors: dict[str, torch.Tensor] = {}
    return _split(checkpoint, "checkpoint", tensors), tensors


def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors):06d}"
        tensors[key] = value.detach()
        return {TENSOR_TAG: key, "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ConfigError(f"{path}: a key of type {type(key).__name__} ({key!r}); "
                                  "JaxckptCheckpointIO stores keys that are str or int.")
            out[key] = _split(item, f"{path}[{key!r}]", tensors)
        return out
    if isinstance(value, (list, tuple)):
        items = [_split(item, f"{path}[{index}]", tensors) for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, _PLAIN):
        return value
    raise ConfigError(
        f"{path} holds a {type(value).__module__}.{type(value).__qualname__}, which "
        "JaxckptCheckpointIO cannot store: it writes tensors through DCP and everything else "
        "as JSON, never pickle. Fix: return only tensors, dicts, lists and JSON values from "
        "the state_dict()/on_save_checkpoint() that put it there (convert the object to a "
        "dict of plain values, and rebuild it in load_state_dict()/on_load_checkpoint()).")


def empty_like_saved(skeleton: Any) -> dict[str, torch.Tensor]:
    """Uninitialised CPU tensors of the saved shapes and dtypes, by key: the ``like`` that
    DCP reads into."""
    out: dict[str, torch.Tensor] = {}
    _collect(skeleton, out)
    return out


def _collect(value: Any, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"checkpoint skeleton names an unknown dtype "
                                  f"{value['dtype']!r} for tensor {value[TENSOR_TAG]!r}.")
            out[str(value[TENSOR_TAG])] = torch.empty(
                [int(size) for size in value["shape"]], dtype=dtype)
            return
        for item in value.values():
            _collect(item, out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, out)


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The checkpoint dict again: each placeholder replaced by its loaded tensor."""
    if isinstance(skeleton, dict):
        if TENSOR_TAG in skeleton:
            return tensors[str(skeleton[TENSOR_TAG])]
        return {key: join(item, tensors) for key, item in skeleton.items()}
    if isinstance(skeleton, list):
        return [join(item, tensors) for item in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join(item, tensors) for item in skeleton)
    return skeleton
