"""A Hugging Face directory written from a DCP checkpoint's files, one tensor at a time.

Owns: ``export_dcp``: the model entry of a ``DcpCheckpointManager`` checkpoint (``params_of``,
e.g. "model": DCP keys ``model/<name>``) written as ``save_pretrained`` writes that model.
The tensors are listed from objects.json and read one at a time, through the restricted
reader (``torch_bridge.dcp.saved_tensors``), when the shard being written reaches them;
tied aliases are dropped by transformers' rule, applied to the model built on the meta
device from the config; config.json is the text the exporter recorded at save time
(``TorchHFExporter.checkpoint_record``) or is made from a config the caller gives.

Must not import: jax. Imports torch and transformers: import it only to export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from jaxckpt.errors import ConfigError
from jaxckpt.storage.base import Storage
from torch_bridge.dcp.saved_tensors import SavedTensor, SavedTensors

from .config_files import CONFIG_FILE, GENERATION_CONFIG_FILE
from .export import _publish
from .mapping import HFMismatchError
from .safetensors_io import Progress, resolve_dtype
from .torch_export import (
    SAVE_PRETRAINED_MAX_SHARD_BYTES,
    TORCH_EXPORTER_RECORD_FORMAT,
    StagedModel,
    as_saved,
    config_object,
    meta_model,
    model_texts,
    write_staged,
)

__all__ = ["export_dcp", "recorded_export"]


def recorded_export(driver: Mapping[str, Any]) -> dict[str, Any] | None:
    """The torch exporter's record in a checkpoint's driver.json, or None."""
    record = driver.get("export")
    if isinstance(record, Mapping) and record.get("format") == TORCH_EXPORTER_RECORD_FORMAT:
        return dict(record)
    return None


def _given_config(config: Any) -> tuple[dict[str, Any] | Any, str | None]:
    """(config dict or object, generation_config.json beside it or None) from a config.json
    path, an HF directory, a dict or a transformers config."""
    if not isinstance(config, (str, os.PathLike)):
        return config, None
    path = os.fspath(config)
    generation = None
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, GENERATION_CONFIG_FILE)):
            generation = os.path.join(path, GENERATION_CONFIG_FILE)
        path = os.path.join(path, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle), generation
    except FileNotFoundError:
        raise ConfigError(f"--config {config!r}: no config file at {path!r}; give the "
                          f"model's config.json or its Hugging Face directory.") from None


def _model_tensors(saved: SavedTensors, params_of: str | None, where: str
                   ) -> tuple[str, dict[str, SavedTensor]]:
    """(params_of, HF name -> saved tensor) of the model entry; params_of None picks the
    one module entry of the checkpoint."""
    modules = sorted(name for name, entry in saved.entries.items() if entry.get("kind") == "module")
    if params_of is None:
        if len(modules) != 1:
            raise ConfigError(
                f"{where}: the checkpoint records no exporter settings and holds "
                f"{len(modules)} module entries {modules}; say which is the model with "
                f"params_of= (--params-of on the command line), e.g. --params-of model.")
        params_of = modules[0]
    entry, *inner = params_of.strip("/").split("/")
    if entry not in saved.entries:
        raise ConfigError(f"{where}: params_of={params_of!r} names the entry {entry!r}, which "
                          f"was not saved (saved entries: {sorted(saved.entries)}); pass "
                          f"--params-of with one of {modules or sorted(saved.entries)}.")
    prefix = tuple(inner)
    found = {".".join(str(p) for p in t.path[len(prefix):]): t for t in saved.tensors(entry)
             if t.path[:len(prefix)] == prefix and len(t.path) > len(prefix)}
    if not found:
        raise ConfigError(f"{where}: params_of={params_of!r} holds no tensors.")
    return params_of, found


def _check_against(reference: Any, tensors: Mapping[str, SavedTensor], where: str) -> None:
    """Every saved tensor is one of the config's model, with its shape; and the reverse."""
    expected = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
    problems = [f"missing {name}" for name in expected if name not in tensors]
    problems += [f"unexpected {name}" for name in tensors if name not in expected]
    problems += [f"{name}: saved {tuple(t.shape)}, config's model {expected[name]}"
                 for name, t in tensors.items() if name in expected
                 and tuple(t.shape) != expected[name]]
    if problems:
        shown = "; ".join(problems[:12]) + (f" (+{len(problems) - 12} more)"
                                           if len(problems) > 12 else "")
        raise HFMismatchError(f"{where}: the checkpoint's model does not match the config's "
                              f"{type(reference).__name__}: {shown}. Pass the config of the "
                              f"model that was trained (--config).", problems)


def _kept_names(reference: Any, tensors: Mapping[str, SavedTensor]) -> dict[str, str]:
    """Saved name -> name in the export, as save_pretrained keeps them: ignored keys and
    tied aliases dropped; a model whose weights transformers converts on save is refused."""
    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for name, t in tensors.items()}
    by_id = {id(t): name for name, t in meta.items()}
    reverted = as_saved(reference, dict(meta))
    if any(id(t) not in by_id for t in reverted.values()):
        raise ConfigError(
            f"{type(reference).__name__} is saved by transformers with its weights converted "
            f"(fused or split), which an export from DCP files cannot stream yet; export "
            f"during training with hf_exporter(params_of=...) instead.")
    return {by_id[id(t)]: name for name, t in reverted.items()}


def export_dcp(state_dir: str, out_dir: str, *, storage: Storage | None = None,
               record: Mapping[str, Any] | None = None, config: Any = None,
               params_of: str | None = None, dtype: Any = None, overwrite: bool = False,
               max_shard_bytes: int | None = None, generation_config: Any = None,
               provenance: Mapping[str, Any] | None = None, progress: Progress | None = None,
               references: Mapping[str, Any] | None = None) -> int:
    """Write the model of a DCP checkpoint as ``save_pretrained`` writes it; return bytes.

    Args:
      state_dir: the checkpoint's ``state`` directory (a local path, or a URL read through
        ``storage``).
      out_dir: the local HF directory, written under a temporary name and renamed in place.
      storage: the object store of a URL ``state_dir``; None for a local one.
      record: the exporter's record of that save (``recorded_export``); None: ``config``
        is required.
      config: the model's config.json, HF directory, dict or transformers config; wins over
        the record's.
      params_of: the model's place in the saved state ("model"); None: the recorded one,
        else the checkpoint's one module entry.
      dtype: cast floating tensors; None: the recorded cast, else the saved dtypes.
      max_shard_bytes: shard size limit; None: the recorded one, else save_pretrained's 50 GB.
      generation_config: generation_config.json to write; None: the recorded one, else the
        one beside ``config`` or the model's.
      overwrite: replace an existing ``out_dir``.
      provenance: facts recorded in ``jaxckpt_provenance.json`` under "source".
      progress: ``progress(bytes_done, bytes_total)`` after each tensor.
      references: the manifest's refs (files of earlier steps an incremental save uses).
    """
    record = dict(record or {})
    where = state_dir.rstrip("/").rpartition("/")[0] or state_dir
    if config is None and not record.get("config"):
        raise ConfigError(
            f"{where}: this DCP checkpoint records no model config (it was saved without "
            f"ExportConfig(exporter=torch_bridge.hf_exporter(params_of=...)), or before "
            f"export-hf read DCP roots). Pass the model's config: --config path/to/config.json "
            f"(or its Hugging Face directory; config= in Python).")
    saved = SavedTensors(state_dir, storage, references=references)
    params_of, tensors = _model_tensors(saved, params_of or record.get("params_of"), where)
    given_generation = None
    if config is not None:
        config, given_generation = _given_config(config)
    hf_config = config_object(json.loads(record["config"]) if config is None else config)
    if not getattr(hf_config, "architectures", None):
        # config.save_pretrained of a model never saved whole: its causal-LM class, which
        # _check_against then holds to the checkpoint's tensor names.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        found = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(getattr(hf_config, "model_type", "")))
        hf_config.architectures = [found] if found else None
    reference = meta_model(hf_config)
    _check_against(reference, tensors, where)
    names = _kept_names(reference, tensors)
    cast = resolve_dtype(dtype if dtype is not None else record.get("dtype"))
    cast_torch = None if cast is None else getattr(torch, cast.name)
    floating = [t.dtype for t in tensors.values() if t.dtype.is_floating_point]
    dtype_name = str(cast_torch or (floating[0] if floating else torch.float32))
    generation = generation_config if generation_config is not None else given_generation
    if config is None and generation is None and dtype_name.removeprefix("torch.") == \
            json.loads(record["config"]).get("dtype"):
        config_text, generation_text = record["config"], record.get("generation_config")
    else:
        if config is None and generation is None and record.get("generation_config"):
            generation = json.loads(record["generation_config"])
        config_text, generation_text = model_texts(
            reference, hf_config, dtype_name.removeprefix("torch."), generation)
    staged = StagedModel(
        tensors={names[name]: torch.empty(tensors[name].shape, dtype=tensors[name].dtype,
                                          device="meta") for name in tensors if name in names},
        config_text=config_text, generation_text=generation_text, dtype=cast_torch,
        total_parameters=int(reference.num_parameters()),
        architectures=tuple(json.loads(config_text).get("architectures") or ()))
    by_export_name = {exported: tensors[name] for name, exported in names.items()}
    limit = max_shard_bytes or record.get("max_shard_bytes") or SAVE_PRETRAINED_MAX_SHARD_BYTES

    def write(directory: str) -> int:
        return write_staged(staged, directory, max_shard_bytes=int(limit),
                            provenance={"params_of": params_of, **dict(provenance or {})},
                            progress=progress, read=lambda name: saved.read(by_export_name[name]))

    return _publish(os.fspath(out_dir), overwrite, write)
