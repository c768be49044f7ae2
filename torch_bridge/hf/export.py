"""Writing a Hugging Face model directory from Flax params: ``export_hf`` and ``hf_exporter``.

Owns: matching a flat Flax tree to a table (stacked or per-index layers) and refusing it,
with every problem listed, before the first byte is written; shards, the index, config.json,
generation_config.json, tokenizer files and ``jaxckpt_provenance.json``; ``HFExporter``, the
manager's exporter. Durability: every file and directory is fsynced; ``export_hf`` writes into
a temporary sibling (``.{name}.tmp-XXXXXXXX``) and renames it into place, so an interrupted
export never leaves a complete-looking model (a SIGKILLed one leaves that hidden directory).

Must not import jax or torch at import time: params may have jax or numpy leaves. Writing an
export's config files imports transformers (and with it torch, when installed); an
``HFExporter`` does so when it is made, on the caller's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxckpt import __version__
from jaxckpt.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from jaxckpt.storage.posix import fsync_dir, fsync_file

from .architectures import (
    ARCHITECTURES,
    Architecture,
    arch_for_model_type,
    flag_of,
    resolve_architecture,
)
from .config_files import CONFIG_FILE, GENERATION_CONFIG_FILE, config_files
from .mapping import expand, flatten, fmt_shape, mismatch_error, table_dims
from .params import check_is_params, parse_params_path, pick_params
from .safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    Planned,
    Progress,
    resolve_dtype,
    shard_limit,
    write_safetensors,
)
from .torch_export import (
    SAVE_PRETRAINED_MAX_SHARD_BYTES,
    StagedModel,
    TorchHFExporter,
    is_torch_value,
    stage_torch,
    write_torch,
)
from .torch_sharded import finish_together

__all__ = ["ExportExistsError", "export_hf", "HFExporter", "hf_exporter", "ParamsOf",
           "EXPORTER_RECORD_FORMAT", "PROVENANCE_FILE", "DEFAULT_MAX_SHARD_BYTES"]

#: written next to the model: where it came from and how it was written.
PROVENANCE_FILE = "jaxckpt_provenance.json"
PROVENANCE_FORMAT = "jaxckpt.hf_export/1"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Files a tokenizer directory may hold (transformers and sentencepiece/tiktoken variants).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                    "tokenizer.model", "spiece.model", "chat_template.jinja",
                    "chat_template.json")


class ExportExistsError(CheckpointError, FileExistsError):
    """``export_hf``'s ``out_dir`` already holds something (pass ``overwrite=True``)."""


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if type(value).__module__ == "torch" and "dtype" in type(value).__name__:
        return str(value).removeprefix("torch.")
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _config_dict(config: Any) -> dict[str, Any]:
    """A deep, JSON-clean copy of a transformers config or its dict."""
    if isinstance(config, Mapping):
        raw = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
    else:
        raise ConfigError(f"config must be a transformers PretrainedConfig or its dict, got "
                          f"{type(config).__name__}.")
    return json.loads(json.dumps(raw, default=_json_default))


def _write_json(path: str, body: Any) -> int:
    return _write_text(path, json.dumps(body, indent=2, sort_keys=True, default=_json_default)
                       + "\n")


def _write_text(path: str, text: str) -> int:
    data = text.encode()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return len(data)


def _plan_export(flat: Mapping[str, Any], arch: Architecture, flags: Mapping[str, Any],
                 dtype: np.dtype | None) -> list[Planned]:
    """Match the flat Flax tree to the table; raise HFMismatchError listing every problem."""
    dims = table_dims(arch, flags)
    num_layers = dims[arch.layers]
    active, inactive = expand(arch, flags, dims, num_layers)
    # Stacked (scanned) layers: the first per-layer key exists only without its index.
    first = next((e for e in active if e.layer is not None), None)
    stacked = (first is not None and first.flax[0] not in flat and first.stacked[0] in flat)
    problems: list[str] = []
    used: set[str] = set()
    checked: set[str] = set()
    planned: list[Planned] = []
    for entry in active:
        # Sized: table_dims above gave every size (or raised).
        assert entry.part_shapes is not None and entry.hf_shape is not None
        sources = []
        for index, expected in enumerate(entry.part_shapes):
            key = entry.stacked[index] if stacked and entry.layer is not None else entry.flax[index]
            want = (num_layers, *expected) if stacked and entry.layer is not None else expected
            used.add(key)
            leaf = flat.get(key)
            if leaf is None:
                if key not in checked:
                    problems.append(f"missing {key}: expected {fmt_shape(want)} (for {entry.hf})")
            elif tuple(leaf.shape) != want:
                if key not in checked:
                    problems.append(f"mis-shaped {key}: expected {fmt_shape(want)}, found "
                                    f"{fmt_shape(leaf.shape)} (for {entry.hf})")
            else:
                sources.append((leaf, entry.layer if stacked and entry.layer is not None else None))
            checked.add(key)
        if len(sources) == len(entry.part_shapes):
            out_dtype = dtype or np.result_type(*[np.dtype(leaf.dtype) for leaf, _ in sources])
            planned.append(Planned(hf=entry.hf, shape=entry.hf_shape, dtype=np.dtype(out_dtype),
                                    sources=tuple(sources), transpose=entry.row.transpose,
                                    fuse_axis=entry.row.fuse_axis))
    why_inactive: dict[str, bool | str] = {}
    for entry in inactive:
        for key in (*entry.flax, *entry.stacked):
            why_inactive[key] = entry.row.when
    for key in sorted(set(flat) - used):
        line = f"unexpected {key}: found {fmt_shape(flat[key].shape)} {np.dtype(flat[key].dtype)}"
        flag, _ = flag_of(why_inactive.get(key, False))
        if flag is not None:  # a row the config turns off (not one that never exists)
            line += (f" (not part of the model: the config has {flag}={flags.get(flag)!r}; "
                     f"set {flag}={not flags.get(flag)} if the model uses this param)")
        problems.append(line)
    if problems:
        raise mismatch_error(
            "the params do not match", arch, problems,
            "Fix: export the params of the model built from this config (e.g. "
            "jaxckpt.llm.params_of(model)), or fix the config so it describes them.")
    return planned


def _shards(planned: list[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    shards: list[list[Planned]] = []
    size = 0
    for item in planned:
        if not shards or (size + item.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards or [[]]


def _check_model_type(config: Mapping[str, Any], arch: Architecture) -> None:
    model_type = config.get("model_type")
    if model_type is not None and model_type not in arch.model_types:
        suggestion = arch_for_model_type(model_type)
        raise ConfigError(
            f"the config's model_type is {model_type!r} but arch={arch.name!r} writes "
            f"{arch.model_types[0]!r}."
            + (f" Pass arch={suggestion!r}." if suggestion else " Pass the matching config."))


def _hf_config_body(config: Mapping[str, Any], arch: Architecture,
                    flags: Mapping[str, Any]) -> dict[str, Any]:
    """The config dict to serialise: model_type set, every table flag explicit (so no
    library default can flip a tied head)."""
    body = dict(config)
    _check_model_type(body, arch)
    body["model_type"] = body.get("model_type") or arch.model_types[0]
    for flag in arch.defaults:
        body[flag] = flags[flag]
    return body


def _copy_tokenizer(tokenizer: Any, directory: str) -> list[str]:
    if hasattr(tokenizer, "save_pretrained"):  # a transformers tokenizer object
        before = set(os.listdir(directory))
        tokenizer.save_pretrained(directory)
        return sorted(set(os.listdir(directory)) - before)
    source = os.fspath(tokenizer)
    if not os.path.isdir(source):
        raise CheckpointNotFoundError(f"tokenizer_dir {source!r} is not a directory.")
    names = [n for n in sorted(os.listdir(source))
             if n in _TOKENIZER_FILES or n.endswith(".tiktoken")]
    if not names:
        raise CheckpointNotFoundError(
            f"tokenizer_dir {source!r} holds none of {list(_TOKENIZER_FILES)}; point it at the "
            f"directory a tokenizer's save_pretrained wrote.")
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
        fsync_file(os.path.join(directory, name))
    return names


def _step_of(directory: str) -> dict[str, int]:
    """The manager names exports epoch{E}epochstep{S}globalstep{G} (its temp name too)."""
    match = re.search(r"epoch(\d+)epochstep(\d+)globalstep(\d+)", os.path.basename(directory))
    if not match:
        return {}
    return {"epoch": int(match[1]), "epoch_step": int(match[2]), "global_step": int(match[3])}


def _write_export(params: Any, directory: str, *, arch: str | Architecture, config: Any,
                  dtype: Any, max_shard_bytes: int, tokenizer_dir: Any, generation_config: Any,
                  provenance: Mapping[str, Any] | None, progress: Progress | None) -> int:
    """Write an HF model into the existing, empty ``directory``; return the bytes written."""
    table = resolve_architecture(arch)
    max_shard_bytes = shard_limit(max_shard_bytes, DEFAULT_MAX_SHARD_BYTES)
    cast = resolve_dtype(dtype)
    config_body = _config_dict(config)
    _check_model_type(config_body, table)
    flags = {**table.defaults, **{k: v for k, v in config_body.items() if v is not None}}
    # Everything is validated before the first byte is written.
    planned = _plan_export(flatten(params), table, flags, cast)
    # config.json's dtype: the cast, else the dtype holding most of the bytes.
    by_dtype: dict[str, int] = {}
    for item in planned:
        by_dtype[item.dtype.name] = by_dtype.get(item.dtype.name, 0) + item.nbytes
    dtype_name = cast.name if cast is not None else max(by_dtype, key=by_dtype.__getitem__)
    config_text, generation_text = config_files(
        _hf_config_body(config_body, table, flags), hf_class=table.hf_class,
        dtype_name=dtype_name, generation_config=generation_config)

    shards = _shards(planned, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)])
    total = sum(p.nbytes for p in planned)
    done = 0
    written = 0
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, names, strict=True):

        def on_tensor(item: Planned, name: str = name) -> None:
            nonlocal done
            weight_map[item.hf] = name
            done += item.nbytes
            if progress is not None:
                progress(done, total)

        written += write_safetensors(os.path.join(directory, name), shard, on_tensor)
    if len(shards) > 1:
        params_count = sum(int(np.prod(p.shape, dtype=np.int64)) for p in planned)
        written += _write_json(os.path.join(directory, INDEX_FILE), {
            "metadata": {"total_size": total, "total_parameters": params_count},
            "weight_map": dict(sorted(weight_map.items()))})
    written += _write_text(os.path.join(directory, CONFIG_FILE), config_text)
    extra_files = []
    if generation_text is not None:
        written += _write_text(os.path.join(directory, GENERATION_CONFIG_FILE), generation_text)
        extra_files.append(GENERATION_CONFIG_FILE)
    if tokenizer_dir is not None:
        copied = _copy_tokenizer(tokenizer_dir, directory)
        written += sum(os.path.getsize(os.path.join(directory, n)) for n in copied)
        extra_files.extend(copied)
    source = {**_step_of(directory), **dict(provenance or {})}
    written += _write_json(os.path.join(directory, PROVENANCE_FILE), {
        "format": PROVENANCE_FORMAT,
        "jaxckpt_version": __version__,
        "arch": table.name,
        "architectures": [table.hf_class],
        "dtype": dtype_name,
        "tensors": len(planned),
        "tensor_bytes": total,
        "files": names + ([INDEX_FILE] if len(shards) > 1 else []) + [CONFIG_FILE] + extra_files,
        "created_unix": time.time(),
        "source": source,
    })
    fsync_dir(directory)
    return written


def export_hf(params: Any, out_dir: str | os.PathLike[str], *,
              arch: str | Architecture | None = None, config: Any = None, dtype: Any = None,
              max_shard_bytes: int | None = None,
              tokenizer_dir: Any = None, generation_config: Any = None,
              provenance: Mapping[str, Any] | None = None, overwrite: bool = False,
              progress: Progress | None = None, merge_adapters: bool = False) -> int:
    """Write Flax params or a PyTorch model as a Hugging Face model directory that
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads; return bytes written.

    Args:
      params: the Flax param tree (nested dicts/lists with jax or numpy leaves, an
        ``nnx.State`` or an ``nnx.Module``), laid out as ``jaxckpt.llm``'s models; decoder
        layers one per index or stacked on a leading axis. Or a torch value: a
        ``transformers.PreTrainedModel`` of any architecture (bare, DDP-, FSDP2- or
        ``torch.compile``-wrapped; ``arch`` not needed, ``config`` read from the model) or
        a torch state dict with ``config``; written as ``save_pretrained`` writes it
        (tokenizer_dir is the Flax path's only). An FSDP2 (DTensor) model: call this on
        every rank; tensors are gathered one at a time, rank 0 writes, and every rank
        returns once the directory is in place (0 bytes on the others). A peft
        ``PeftModel`` writes its adapters as its ``save_pretrained`` does
        (adapter_config.json, adapter_model.safetensors).
      out_dir: the model directory; written under a temporary sibling name and renamed into
        place at the end, so it appears complete or not at all.
      arch: a name in ``ARCHITECTURES`` ("llama", "qwen2", "gpt2") or an ``Architecture``
        (Flax params only; required there).
      config: the transformers config (object or dict) of the model; written as config.json
        with ``architectures``, ``model_type``, ``dtype`` set. Required for Flax params and
        torch state dicts; a torch model's own config is used when None.
      dtype: cast every tensor (e.g. "bfloat16"); None keeps the params' dtypes.
      max_shard_bytes: above this, tensors go to ``model-0000k-of-0000N.safetensors`` files
        with ``model.safetensors.index.json``; None: 5 GiB for Flax params, and for a torch
        model ``save_pretrained``'s default (50 GB), split by its rule.
      tokenizer_dir: a directory with tokenizer files (copied) or a tokenizer object.
      generation_config: a ``GenerationConfig``, its dict, or a path to its json.
      provenance: facts to record in ``jaxckpt_provenance.json`` under "source" (e.g.
        ``{"checkpoint": path, "step": 1200}``).
      overwrite: replace an existing ``out_dir`` (swapped in by rename, then deleted).
      progress: ``progress(bytes_done, bytes_total)`` after each tensor.
      merge_adapters: for a peft ``PeftModel``, write the model with its LoRA adapters
        merged, as ``save_pretrained`` writes the result of ``merge_and_unload()``; the
        model itself is not changed.

    Raises ``HFMismatchError`` (a ``TreeMismatchError``) listing every missing, unexpected
    and mis-shaped param before anything is written; ``ExportExistsError`` when ``out_dir``
    exists and is not empty (and ``overwrite`` is False).
    """
    if is_torch_value(params):
        return _export_torch(params, os.fspath(out_dir), arch=arch, config=config, dtype=dtype,
                             max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir,
                             generation_config=generation_config, provenance=provenance,
                             overwrite=overwrite, progress=progress,
                             merge_adapters=merge_adapters)
    if merge_adapters:
        raise ConfigError("merge_adapters=True applies to a peft PeftModel (torch); Flax "
                          "params have no adapters to merge: drop merge_adapters.")
    if arch is None or config is None:
        raise ConfigError(
            "export_hf of Flax params needs arch= (one of "
            f"{sorted(ARCHITECTURES)}) and config= (the model's transformers config). "
            "A torch model (a transformers PreTrainedModel) needs neither.")

    def write(directory: str) -> int:
        assert arch is not None
        return _write_export(params, directory, arch=arch, config=config, dtype=dtype,
                             max_shard_bytes=(DEFAULT_MAX_SHARD_BYTES if max_shard_bytes
                                              is None else max_shard_bytes),
                             tokenizer_dir=tokenizer_dir,
                             generation_config=generation_config, provenance=provenance,
                             progress=progress)
    return _publish(os.fspath(out_dir), overwrite, write)


def _export_torch(value: Any, out_dir: str, *, arch: Any, config: Any, dtype: Any,
                  max_shard_bytes: int | None, tokenizer_dir: Any, generation_config: Any,
                  provenance: Mapping[str, Any] | None, overwrite: bool,
                  progress: Progress | None, merge_adapters: bool) -> int:
    """``export_hf`` of a torch model, peft model or state dict (see there)."""
    if arch is not None:
        raise ConfigError("export_hf of a torch model takes no arch= (the tensor names are "
                          "the model's own); drop it.")
    if tokenizer_dir is not None:
        raise ConfigError("export_hf of a torch model takes no tokenizer_dir=; save the "
                          "tokenizer with tokenizer.save_pretrained(out_dir) afterwards.")
    limit = shard_limit(max_shard_bytes, SAVE_PRETRAINED_MAX_SHARD_BYTES)
    # Written right here, on this thread: no host copy of the whole model first (the writer
    # reads one tensor at a time, copying only one that is not a contiguous CPU tensor).
    staged = stage_torch(value, config=config, dtype=dtype, copy_tensors=False,
                         generation_config=generation_config, merge_adapters=merge_adapters)

    def write(directory: str) -> int:
        return write_torch(staged, directory, max_shard_bytes=limit,
                           provenance=provenance, progress=progress)

    if isinstance(staged, StagedModel) and staged.collective_device is not None:
        # FSDP2: every rank is here, rank 0 writes, all return once it is in place.
        return finish_together(staged.primary, staged.collective_device,
                               lambda: _publish(out_dir, overwrite, write))
    return _publish(out_dir, overwrite, write)


def _publish(out_dir: str, overwrite: bool, write: Callable[[str], int]) -> int:
    """Run ``write(tmp)`` in a temporary sibling of ``out_dir``, fsync it and rename it into
    place, so ``out_dir`` appears complete or not at all."""
    out_dir = os.path.abspath(out_dir)
    if os.path.lexists(out_dir) and not overwrite:
        if not os.path.isdir(out_dir) or os.listdir(out_dir):
            raise ExportExistsError(
                f"{out_dir} already exists; pass overwrite=True to replace it, or pick a new "
                f"directory.")
    parent, base = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = os.path.join(parent, f".{base}.tmp-{tag}")
    os.mkdir(tmp)
    try:
        written = write(tmp)
        fsync_dir(tmp)
        old = None
        if os.path.lexists(out_dir):
            old = os.path.join(parent, f".{base}.old-{tag}")
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(old)
    return written


#: ``HFExporter.checkpoint_metadata["format"]``: what export-hf reads from driver.json.
EXPORTER_RECORD_FORMAT = "jaxckpt.hf_exporter/1"

ParamsOf = Callable[[Any], Any] | str
"""A callable ``state -> params`` or a '/'-separated tree path such as ``"model/params"``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HFExporter:
    """``ExportConfig(exporter=...)`` callable: ``exporter(state, out_dir) -> bytes``.

    Writes straight into ``out_dir`` (the manager hands over a fresh temporary directory and
    renames it into place). In async mode it receives the backend's host copy of the state.
    Stateless: safe to call from the manager's background thread. Made by
    :func:`hf_exporter`, whose ``Args:`` are its fields (keyword only).
    """

    arch: str | Architecture
    """Table name or Architecture."""
    config: Any
    """transformers config (object or dict) of the exported model."""
    dtype: Any = None
    """Cast tensors (e.g. "bfloat16"); None keeps the params' dtypes."""
    params_of: ParamsOf | None = None
    """Where the params are in the state given to ``maybe_save``/``export``: a tree path of
    '/'-separated keys (``"model/params"``; ``"0"`` for ``nnx.state((model, optimizer))``;
    ``"model"`` for a live nnx.Module under "model") or a callable ``state -> params``. The
    value found may be a param pytree, an ``nnx.State`` or a live ``nnx.Module`` (its
    ``nnx.Param`` variables). None: the state is the params (checked at each export)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Shard size limit."""
    tokenizer_dir: Any = None
    """Tokenizer files copied into every export."""
    generation_config: Any = None
    """generation_config.json of every export; None writes the one transformers derives from
    ``config``."""
    provenance: Mapping[str, Any] | None = None
    """Extra provenance facts; the epoch and steps are read from the export's name."""

    def __post_init__(self) -> None:
        table = resolve_architecture(self.arch)
        resolve_dtype(self.dtype)
        body = _config_dict(self.config)
        _check_model_type(body, table)
        flags = {**table.defaults, **{k: v for k, v in body.items() if v is not None}}
        table_dims(table, flags)
        if isinstance(self.params_of, str):
            parse_params_path(self.params_of)
        elif self.params_of is not None and not callable(self.params_of):
            raise ConfigError(f"params_of must be a tree path such as 'model/params' or a "
                              f"callable(state) -> params, got {self.params_of!r}.")
        # Builds config.json once now, on the caller's thread: a config transformers
        # refuses fails here, and transformers is imported before training starts.
        config_files(_hf_config_body(body, table, flags), hf_class=table.hf_class,
                     dtype_name="float32", generation_config=self.generation_config)

    @property
    def checkpoint_metadata(self) -> dict[str, Any]:
        """What ``jaxckpt export-hf ROOT OUT_DIR`` needs, JSON-safe: the manager records it
        in every recovery checkpoint's driver.json (under "export")."""
        table = resolve_architecture(self.arch)
        path = self.params_of if isinstance(self.params_of, str) else None
        return {"format": EXPORTER_RECORD_FORMAT, "arch": table.name,
                "arch_known": ARCHITECTURES.get(table.name) is table,
                "config": _config_dict(self.config), "params_path": path,
                "params_of": ("path" if path is not None else
                              "callable" if self.params_of is not None else "state")}

    def __call__(self, state: Any, out_dir: str) -> int:
        if is_torch_value(pick_params(state, self.params_of)):
            raise ConfigError(
                f"hf_exporter(arch={resolve_architecture(self.arch).name!r}, ...) maps Flax "
                f"params; the state holds a torch model (or its state dict). Fix: drop arch= "
                f"(and config=, which a transformers model carries): "
                f"hf_exporter(params_of={self.params_of!r}).")
        if self.params_of is None:
            table = resolve_architecture(self.arch)
            anchor = next(row.parts[0] for row in table.tensors if not row.per_layer)
            check_is_params(state, arch_name=table.name,
                            roots={p.split(".")[0] for row in table.tensors for p in row.parts},
                            anchor=tuple(anchor.split(".")))
        params = pick_params(state, self.params_of)
        return _write_export(params, os.fspath(out_dir), arch=self.arch, config=self.config,
                             dtype=self.dtype, max_shard_bytes=self.max_shard_bytes,
                             tokenizer_dir=self.tokenizer_dir,
                             generation_config=self.generation_config,
                             provenance=self.provenance, progress=None)


def hf_exporter(*, arch: str | Architecture | None = None, config: Any = None,
                dtype: Any = None, params_of: ParamsOf | None = None,
                max_shard_bytes: int | None = None, tokenizer_dir: Any = None,
                generation_config: Any = None,
                provenance: Mapping[str, Any] | None = None,
                merge_adapters: bool = False) -> HFExporter | TorchHFExporter:
    """An exporter for ``jaxckpt.ExportConfig(exporter=...)`` writing HF directories; see
    :class:`HFExporter` (Flax params, ``arch`` given) and ``TorchHFExporter`` (no ``arch``:
    the value at ``params_of`` is a transformers PreTrainedModel, bare, DDP-, FSDP2- or
    ``torch.compile``-wrapped, a peft PeftModel, or a torch state dict with ``config``;
    written as ``save_pretrained`` writes it, from a host copy staged on the training thread;
    FSDP2: every rank stages, one tensor gathered at a time, and rank 0 writes).
    Configuration errors raise now, not at the first export.

    Args:
      arch: a name in ``ARCHITECTURES`` ("llama", "qwen2", "gpt2") or an ``Architecture``;
        None for a torch model.
      config: the transformers config (object or dict) of the exported model; for a torch
        PreTrainedModel None reads the model's own.
      dtype: cast every tensor (e.g. "bfloat16"); None keeps the params' dtypes.
      params_of: where the model params are in the training state: a '/'-separated tree
        path (``"model/params"``) or ``lambda state: ...``; None: the state is the params.
      max_shard_bytes: shard size limit; None: 5 GiB for Flax params, and for a torch model
        ``save_pretrained``'s default (50 GB).
      tokenizer_dir: tokenizer files (or a tokenizer object) copied into every export.
      generation_config: generation_config.json of every export; None writes the one
        transformers derives from ``config``.
      provenance: extra facts for ``jaxckpt_provenance.json``; the epoch and steps are read
        from the export's name.
      merge_adapters: the picked value is a peft ``PeftModel``: False (the default) writes
        its adapters as peft's ``save_pretrained`` does; True writes the model with its LoRA
        adapters merged (computed from the staged copy; the training model is untouched).
    """
    if arch is None:
        if tokenizer_dir is not None:
            raise ConfigError("hf_exporter for a torch model (no arch=) takes no "
                              "tokenizer_dir=; it is the Flax path's only.")
        return TorchHFExporter(params_of=params_of, config=config, dtype=dtype,
                               max_shard_bytes=max_shard_bytes,
                               generation_config=generation_config, provenance=provenance,
                               merge_adapters=merge_adapters)
    if merge_adapters:
        raise ConfigError("merge_adapters=True applies to torch peft models, exported with no "
                          "arch=: use hf_exporter(params_of=..., merge_adapters=True).")
    return HFExporter(arch=arch, config=config, dtype=dtype, params_of=params_of,
                      max_shard_bytes=(DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None
                                       else max_shard_bytes),
                      tokenizer_dir=tokenizer_dir,
                      generation_config=generation_config, provenance=provenance)
