"""Writing a Hugging Face model directory from a PyTorch model, as ``save_pretrained`` does.

Owns: recognising a torch value (a ``transformers.PreTrainedModel``, bare or wrapped by DDP,
FSDP2 or ``torch.compile``, or a state dict with ``config=``; peft models go on to
``peft_export``, FSDP2 gathers to ``torch_sharded``); staging it (``stage_torch``: tied
weights dropped by transformers' own rule, tensors detached and copied to the CPU, config.json
and generation_config.json text fixed at that moment) on the caller's thread; and writing the
staged copy (``write_staged``): shards split by huggingface_hub's rule, the index, the config
files. ``TorchHFExporter`` is the manager's exporter; its ``stage`` runs on the training
thread and its call (the write) may run on the background thread.

Must not import jax; torch, transformers and huggingface_hub are imported only when a torch
value is staged or written, never at import time.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxckpt import __version__
from jaxckpt.errors import ConfigError

from .config_files import CONFIG_FILE, GENERATION_CONFIG_FILE, _given_generation_config
from .params import pick_params
from .peft_export import (
    LoraMerge,
    StagedAdapter,
    apply_merges,
    is_peft_model,
    merge_plan,
    stage_adapter,
    write_adapter,
)
from .safetensors_io import (
    INDEX_FILE,
    Planned,
    Progress,
    resolve_dtype,
    shard_limit,
    write_safetensors,
)
from .torch_sharded import gather_to_primary, has_dtensors

#: ``save_pretrained``'s default ``max_shard_size`` ("50GB").
SAVE_PRETRAINED_MAX_SHARD_BYTES = 50 * 10**9

__all__ = ["SAVE_PRETRAINED_MAX_SHARD_BYTES", "TORCH_EXPORTER_RECORD_FORMAT", "is_torch_value",
           "StagedModel", "stage_torch", "as_saved", "model_texts", "config_object", "meta_model",
           "write_staged", "write_torch", "write_tensor_file", "TorchHFExporter"]

#: ``TorchHFExporter.checkpoint_record(state)["format"]``: the model's config.json text and
#: where the model is, recorded per save in driver.json (under "export"); export-hf reads
#: it to export a DCP checkpoint without flags. Readers of the Flax record skip it.
TORCH_EXPORTER_RECORD_FORMAT = "jaxckpt.torch_hf_exporter/1"


def _is_torch_object(value: Any) -> bool:
    return any(cls.__module__.split(".")[0] == "torch" for cls in type(value).__mro__)


def is_torch_value(value: Any) -> bool:
    """Whether ``value`` is a torch module or a state dict of torch tensors (no torch import:
    a torch value exists only where the caller imported torch)."""
    if _is_torch_object(value):
        return True
    return (isinstance(value, Mapping) and bool(value)
            and all(_is_torch_object(v) for v in value.values()))


def _unwrap(module: Any) -> Any:
    """The model inside DDP / DataParallel / ``torch.compile`` wrappers (any nesting)."""
    import torch

    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel,
                               torch.nn.DataParallel)):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
            module = module._orig_mod  # torch.compile's OptimizedModule
        else:
            return module


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagedModel:
    """A host copy of one model, ready to write: nothing in it changes when training goes on."""

    tensors: dict[str, Any]
    """HF tensor name -> CPU torch tensor (tied aliases already dropped), in the model's order;
    meta tensors where ``write_staged`` is given ``read=`` (a DCP checkpoint's export)."""
    config_text: str
    """config.json, as ``config.save_pretrained`` writes it (``dtype`` and ``architectures``
    set)."""
    generation_text: str | None
    """generation_config.json, or None when the model does not generate."""
    dtype: Any
    """The torch dtype every floating tensor is cast to when written; None keeps each."""
    total_parameters: int
    """The model's parameter count (the index's ``total_parameters``)."""
    architectures: tuple[str, ...]
    """config.json's ``architectures`` (the model's class), for the provenance record."""
    primary: bool = True
    """False on the ranks other than 0 of a sharded (FSDP2) model: they took part in the
    gathers but hold no tensors, and write nothing."""
    collective_device: Any = None
    """The device of the ranks' collectives when the model was sharded; None otherwise."""
    merges: tuple[LoraMerge, ...] = ()
    """LoRA adapters the write folds into ``tensors`` (``merge_adapters=True``)."""
    owned: bool = True
    """Whether ``tensors`` are this export's own copies (a merge may then change them in
    place: a staged model is written once)."""


def config_object(config: Any) -> Any:
    """A transformers config from a PretrainedConfig or its dict (deep-copied)."""
    if isinstance(config, Mapping):
        from transformers import AutoConfig

        body = dict(config)
        model_type = body.pop("model_type", None)
        if model_type is None:
            raise ConfigError("config= dict has no 'model_type'; pass the model's "
                              "PretrainedConfig or its to_dict().")
        return AutoConfig.for_model(model_type, **body)
    if callable(getattr(config, "to_json_string", None)):
        return copy.deepcopy(config)
    raise ConfigError(f"config must be a transformers PretrainedConfig or its dict, got "
                      f"{type(config).__name__}.")


def meta_model(config: Any) -> Any:
    """The transformers model ``config.architectures`` names, built on the meta device (no
    memory): what save_pretrained would consult for tied weights and generation config."""
    import torch
    import transformers

    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ConfigError(
            f"config= names architectures={names!r}; set it to the transformers class of "
            f"the model (e.g. ['LlamaForCausalLM']) so the export knows its tied weights.")
    with torch.device("meta"):
        return model_class(copy.deepcopy(config))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(dtype: Any) -> Any:
    import torch

    resolved = resolve_dtype(dtype)
    return None if resolved is None else getattr(torch, resolved.name)


def _source_of(value: Any, config: Any) -> tuple[Any, dict[str, Any], Any, Any]:
    """``(reference model, state dict, config copy, model dtype)`` of a torch value; a
    module's own parameters stay themselves (``keep_vars``) only when some are DTensors."""
    import torch

    model = _unwrap(value) if isinstance(value, torch.nn.Module) else None
    if model is not None and callable(getattr(model, "save_pretrained", None)):
        state = model.state_dict(keep_vars=True)
        if not has_dtensors(state):
            state = {name: t.detach() for name, t in state.items()}
        hf_config = copy.deepcopy(model.config) if config is None else config_object(config)
        return model, state, hf_config, model.dtype
    if model is not None:
        state = model.state_dict()
    elif isinstance(value, Mapping) and is_torch_value(value):
        state = dict(value)
    else:
        raise ConfigError(
            f"export of a {type(value).__module__}.{type(value).__qualname__}: expected a "
            f"transformers PreTrainedModel (bare, DDP-, FSDP2- or torch.compile-wrapped) or a "
            f"torch state dict with config=. For Flax params pass arch= and config=.")
    if config is None:
        raise ConfigError(
            "a torch state dict (or a module that is not a transformers PreTrainedModel) "
            "needs config=: pass the model's transformers PretrainedConfig or its dict.")
    hf_config = config_object(config)
    floating = [t for t in state.values() if t.is_floating_point()]
    return (meta_model(hf_config), state, hf_config,
            floating[0].dtype if floating else torch.float32)


def stage_torch(value: Any, *, config: Any = None, dtype: Any = None,
                generation_config: Any = None, copy_tensors: bool = True,
                merge_adapters: bool = False) -> StagedModel | StagedAdapter:
    """Stage a torch model (or a state dict with ``config``) for writing.

    On the caller's thread: tied weights are dropped as ``save_pretrained`` drops them, and
    with ``copy_tensors`` every tensor is detached and copied to the CPU (a fresh copy, so
    the model may change right after). A peft ``PeftModel`` stages its adapters
    (``StagedAdapter``), or with ``merge_adapters`` its base model with the LoRA merges the
    write folds in. Raises ``ConfigError`` for a value that is not a torch model or state
    dict, a state dict without ``config``, and ``merge_adapters`` without adapters.

    FSDP2 (DTensor) parameters: every rank must call this, with the same model, in the same
    order (it runs collectives; ranks that disagree get a ``ConfigError``, all of them). Each
    tensor is gathered in turn with ``full_tensor()``, so a rank holds at most one full tensor
    beyond its shards at a time; rank 0 keeps a CPU copy of each, so its staged copy costs
    host memory equal to the whole model, once; the other ranks keep nothing and get a
    ``StagedModel`` with ``primary`` False, which writes nothing."""
    import torch

    cast = _torch_dtype(dtype)
    model = _unwrap(value) if isinstance(value, torch.nn.Module) else None
    if model is not None and is_peft_model(model):
        if not merge_adapters:
            if cast is not None:
                raise ConfigError("dtype= does not apply to a peft adapter export (peft writes "
                                  "each adapter tensor in its own dtype); drop dtype=, or pass "
                                  "merge_adapters=True to export the merged model.")
            return stage_adapter(model, copy_tensors=copy_tensors)
        base, state, merges, total = merge_plan(model)
        hf_config = copy.deepcopy(base.config) if config is None else config_object(config)
        return _stage_state(state, base, hf_config, base.dtype, cast=cast,
                            generation_config=generation_config, copy_tensors=copy_tensors,
                            total_parameters=total, merges=merges)
    if merge_adapters:
        raise ConfigError(
            f"merge_adapters=True, but the exported {type(value).__name__} has no peft "
            f"adapters (it is not a peft PeftModel); drop merge_adapters, or export the model "
            f"returned by peft.get_peft_model.")
    reference, state, hf_config, model_dtype = _source_of(value, config)
    return _stage_state(state, reference, hf_config, model_dtype, cast=cast,
                        generation_config=generation_config, copy_tensors=copy_tensors)


def _stage_state(state: dict[str, Any], reference: Any, hf_config: Any, model_dtype: Any, *,
                 cast: Any, generation_config: Any, copy_tensors: bool,
                 total_parameters: int | None = None,
                 merges: list[LoraMerge] | None = None) -> StagedModel:
    """The common part of staging: what save_pretrained drops and reverts, the FSDP2 gathers,
    then the copy."""
    for ignore in getattr(reference, "_keys_to_ignore_on_save", None) or ():
        state.pop(ignore, None)  # before the gathers: an ignored tensor is not gathered
    primary, device, owned = True, None, copy_tensors
    if has_dtensors(state):
        if merges:
            raise ConfigError("merge_adapters=True on an FSDP2-sharded peft model is not "
                              "supported; export its adapters (merge_adapters=False), or merge "
                              "from an unsharded copy.")
        state, primary, device = gather_to_primary(state, copy_plain=copy_tensors)
        copy_tensors, owned = False, True  # the gathered tensors are already host copies
    state = as_saved(reference, state)
    if total_parameters is None:
        total_parameters = int(reference.num_parameters())
    if copy_tensors:
        state = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
    else:
        state = {name: t.detach() for name, t in state.items()}
    config_text, generation_text = model_texts(
        reference, hf_config, _dtype_name(cast if cast is not None else model_dtype),
        generation_config)
    return StagedModel(tensors=state, config_text=config_text,
                       generation_text=generation_text, dtype=cast,
                       total_parameters=total_parameters,
                       architectures=tuple(hf_config.architectures), primary=primary,
                       collective_device=device,
                       merges=tuple(m.copied() if copy_tensors else m for m in merges or ()),
                       owned=owned)


def as_saved(reference: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (name -> tensor of ``reference``, a transformers model) as ``save_pretrained``
    keeps it: ignored keys out (``state`` loses them), tied aliases dropped (the kept name is
    the one transformers expects), weight conversions reverted to the checkpoint layout."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    for ignore in getattr(reference, "_keys_to_ignore_on_save", None) or ():
        state.pop(ignore, None)
    state = remove_tied_weights_from_state_dict(state, reference)
    return revert_weight_conversion(reference, state)


def model_texts(reference: Any, hf_config: Any, dtype_name: str,
                generation_config: Any = None) -> tuple[str, str | None]:
    """(config.json, generation_config.json or None) as ``save_pretrained`` of ``reference``
    writes them; ``hf_config`` (the caller's copy) gets ``dtype`` and ``architectures`` set.
    A given ``generation_config`` replaces the model's own."""
    hf_config.dtype = dtype_name
    hf_config.architectures = [type(reference).__name__.removeprefix("FSDP")]
    if hasattr(hf_config, "validate"):
        hf_config.validate()
    generation = reference.generation_config if reference.can_generate() else None
    generation_text = (None if generation is None and generation_config is None else
                       _given_generation_config(generation_config if generation_config is not None
                                                else generation))
    return hf_config.to_json_string(use_diff=True), generation_text


def _as_numpy(tensor: Any) -> np.ndarray:
    """A numpy view of a tensor: zero-copy for a contiguous CPU tensor, else one copy of
    this tensor alone (bfloat16 and float8 through ml_dtypes, which numpy lacks)."""
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu().contiguous()
    special = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
               torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
               torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
    if tensor.dtype in special:
        raw, np_dtype = special[tensor.dtype]
        return tensor.view(raw).numpy().view(np_dtype)
    return tensor.numpy()


class _Deferred:
    """A tensor read only when its shard's writer asks for its array (``np.asarray``)."""

    __slots__ = ("read", "name")

    def __init__(self, read: Callable[[str], Any], name: str):
        self.read, self.name = read, name

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = _as_numpy(self.read(self.name))
        return array if dtype is None else array.astype(dtype, copy=False)


def _numpy_dtype(dtype: Any) -> np.dtype:
    import torch

    return _as_numpy(torch.empty(0, dtype=dtype)).dtype


def write_tensor_file(path: str, tensors: Mapping[str, Any], *, cast: Any = None,
                      on_tensor: Any = None, read: Callable[[str], Any] | None = None) -> int:
    """Write CPU torch ``tensors`` (in their order) as one safetensors file, floating ones
    cast to ``cast`` when given; return the bytes written. With ``read``, ``tensors`` may be
    meta tensors (names, shapes and dtypes only): ``read(name)`` gives each CPU tensor when
    the writer reaches it."""
    planned = []
    for key, tensor in tensors.items():
        out = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
        source = _as_numpy(tensor) if read is None else _Deferred(read, key)
        planned.append(Planned(hf=key, shape=tuple(tensor.shape), dtype=_numpy_dtype(out),
                               sources=((source, None),), transpose=False, fuse_axis=0))
    return write_safetensors(path, planned, on_tensor or (lambda _: None))


def write_torch(staged: StagedModel | StagedAdapter, directory: str, *, max_shard_bytes: int,
                provenance: Mapping[str, Any] | None, progress: Progress | None) -> int:
    """Write a staged model or adapter into the existing, empty ``directory``."""
    if isinstance(staged, StagedAdapter):
        return write_adapter(staged, directory, provenance=provenance)
    return write_staged(staged, directory, max_shard_bytes=max_shard_bytes,
                        provenance=provenance, progress=progress)


def write_staged(staged: StagedModel, directory: str, *, max_shard_bytes: int,
                 provenance: Mapping[str, Any] | None, progress: Progress | None,
                 read: Callable[[str], Any] | None = None) -> int:
    """Write ``staged`` into the existing, empty ``directory``; return the bytes written.
    Only rank 0 writes a sharded model's export (the other ranks' copies hold no tensors).

    With ``read``, ``staged.tensors`` may be meta tensors (names, shapes and dtypes only):
    ``read(name)`` gives each CPU tensor when the shard being written reaches it, so no more
    than two tensors are held at once (``write_safetensors`` prepares the next while it writes
    this one)."""
    if not staged.primary:
        raise ConfigError("this rank's staged copy of a sharded (FSDP2) model holds no "
                          "tensors: only rank 0 writes the export.")
    from huggingface_hub import split_state_dict_into_shards_factory

    from .export import PROVENANCE_FILE, PROVENANCE_FORMAT, _step_of, _write_json, _write_text

    tensors = (apply_merges(staged.tensors, staged.merges, owned=staged.owned)
               if staged.merges else staged.tensors)

    def out_dtype(tensor: Any) -> Any:
        return staged.dtype if staged.dtype is not None and tensor.is_floating_point() \
            else tensor.dtype

    def nbytes(tensor: Any) -> int:
        return int(tensor.numel()) * out_dtype(tensor).itemsize

    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=nbytes, get_storage_id=lambda _: None,
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_bytes)
    total = sum(nbytes(t) for t in tensors.values())
    done = 0
    written = 0

    def on_tensor(item: Planned) -> None:
        nonlocal done
        done += item.nbytes
        if progress is not None:
            progress(done, total)

    for name, tensor_names in split.filename_to_tensors.items():
        written += write_tensor_file(os.path.join(directory, name),
                                     {key: tensors[key] for key in tensor_names},
                                     cast=staged.dtype, on_tensor=on_tensor, read=read)
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        written += _write_json(os.path.join(directory, INDEX_FILE), {
            "metadata": {"total_parameters": staged.total_parameters, **split.metadata},
            "weight_map": split.tensor_to_filename})
        files.append(INDEX_FILE)
    written += _write_text(os.path.join(directory, CONFIG_FILE), staged.config_text)
    files.append(CONFIG_FILE)
    if staged.generation_text is not None:
        written += _write_text(os.path.join(directory, GENERATION_CONFIG_FILE),
                               staged.generation_text)
        files.append(GENERATION_CONFIG_FILE)
    dtypes = sorted({_dtype_name(out_dtype(t)) for t in tensors.values()})
    written += _write_json(os.path.join(directory, PROVENANCE_FILE), {
        "format": PROVENANCE_FORMAT,
        "jaxckpt_version": __version__,
        "framework": "torch",
        "arch": None,
        "architectures": list(staged.architectures),
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "tensors": len(tensors),
        "tensor_bytes": total,
        "files": files,
        "created_unix": time.time(),
        "source": {**_step_of(directory), **dict(provenance or {})},
    })
    return written


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TorchHFExporter:
    """``ExportConfig(exporter=...)`` for PyTorch models: ``stage(state)`` on the training
    thread (the host copy), then ``exporter(staged, out_dir) -> bytes`` (the write; on the
    manager's background thread in async mode). Stateless: safe across threads. Made by
    ``hf_exporter`` when it is given no ``arch``. For an FSDP2 model every rank stages (the
    manager calls ``stage`` on every process) and rank 0 writes."""

    params_of: str | Any = None
    """Where the model is in the state: a '/'-separated tree path ("model") or a callable
    ``state -> model``; None: the state is the model (or its state dict)."""
    config: Any = None
    """The transformers config, required for a plain state dict; None reads the model's."""
    dtype: Any = None
    """Cast floating tensors (e.g. "bfloat16"); None keeps the model's dtypes."""
    max_shard_bytes: int | None = None
    """Shard size limit, applied as ``save_pretrained(max_shard_size=...)`` applies it; None
    is its default, 50 GB."""
    generation_config: Any = None
    """generation_config.json of every export; None writes the model's own."""
    provenance: Mapping[str, Any] | None = None
    """Extra provenance facts; the epoch and steps are read from the export's name."""
    merge_adapters: bool = False
    """For a peft ``PeftModel``: False writes its adapters as ``save_pretrained`` does;
    True writes the model with its LoRA adapters merged (the training model untouched)."""

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        object.__setattr__(self, "max_shard_bytes",
                           shard_limit(self.max_shard_bytes, SAVE_PRETRAINED_MAX_SHARD_BYTES))
        if not (self.params_of is None or isinstance(self.params_of, str)
                or callable(self.params_of)):
            raise ConfigError(f"params_of must be a tree path such as 'model' or a "
                              f"callable(state) -> model, got {self.params_of!r}.")

    def stage(self, state: Any, *, copy: bool = True) -> StagedModel | StagedAdapter:
        """The host copy of the model in ``state`` (the training thread's only work)."""
        return stage_torch(pick_params(state, self.params_of), config=self.config, dtype=self.dtype,
                           generation_config=self.generation_config, copy_tensors=copy,
                           merge_adapters=self.merge_adapters)

    def checkpoint_record(self, state: Any) -> dict[str, Any] | None:
        """What ``jaxckpt export-hf`` needs to export a DCP checkpoint of ``state`` with no
        flags, JSON-safe: config.json and generation_config.json as this exporter writes them
        for the model now, and where the model is (``params_of``). The manager records it in
        each recovery checkpoint's driver.json at save time. None where ``params_of`` is not
        a tree path or the value is not a transformers PreTrainedModel."""
        if not isinstance(self.params_of, str):
            return None
        model = pick_params(state, self.params_of)
        if not _is_torch_object(model):
            return None
        model = _unwrap(model)
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel) or self.config is not None:
            return None
        cast = _torch_dtype(self.dtype)
        config_text, generation_text = model_texts(
            model, copy.deepcopy(model.config), _dtype_name(cast if cast is not None
                                                            else model.dtype),
            self.generation_config)
        return {"format": TORCH_EXPORTER_RECORD_FORMAT, "params_of": self.params_of,
                "config": config_text, "generation_config": generation_text,
                "dtype": None if cast is None else _dtype_name(cast),
                "max_shard_bytes": self.max_shard_bytes}

    def __call__(self, state: Any, out_dir: str) -> int:
        staged = (state if isinstance(state, (StagedModel, StagedAdapter))
                  else self.stage(state))
        if isinstance(staged, StagedModel) and not staged.primary:
            return 0  # a sharded model: rank 0 writes
        assert self.max_shard_bytes is not None  # set in __post_init__
        return write_torch(staged, os.fspath(out_dir), max_shard_bytes=self.max_shard_bytes,
                           provenance=self.provenance, progress=None)
