"""PEFT adapters in a Hugging Face export: the adapter as ``PeftModel.save_pretrained`` writes
it, or the model with its LoRA adapters merged, as ``merge_and_unload()`` would leave it.

Owns: recognising a ``peft.PeftModel`` (no peft import); staging its adapters on the caller's
thread (the tensors peft's ``get_peft_model_state_dict`` selects, copied to the CPU, and the
text of adapter_config.json and README.md fixed then) and writing them; and the merge plan:
the base model's tensors under their merged names plus, per LoRA target, the A/B copies the
write folds in (``W += transpose(B @ A) * scaling``, peft's own order of operations on the
CPU), so the training model is never touched.

Must not import jax; torch and peft are imported only when a PeftModel is staged or merged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from jaxckpt import __version__
from jaxckpt.errors import ConfigError

#: The files ``PeftModel.save_pretrained`` writes per adapter, and its model card.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
MODEL_CARD_FILE = "README.md"

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "MODEL_CARD_FILE", "is_peft_model",
           "StagedAdapter", "stage_adapter", "write_adapter", "LoraMerge", "merge_plan",
           "apply_merges"]


def is_peft_model(value: Any) -> bool:
    """Whether ``value`` is a ``peft.PeftModel`` (or a subclass), without importing peft."""
    return any(cls.__name__ == "PeftModel" and cls.__module__.split(".")[0] == "peft"
               for cls in type(value).__mro__)


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError("exporting a peft PeftModel needs peft: pip install "
                          "'jaxckpt[peft]'") from exc
    return peft


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AdapterFiles:
    """One adapter's files: ``subdir`` is "" for the adapter named "default" (peft's rule)."""

    subdir: str
    tensors: dict[str, Any]
    """Tensor name (adapter name removed, as peft writes it) -> CPU torch tensor."""
    config_text: str
    """adapter_config.json as peft writes it (``inference_mode`` true)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagedAdapter:
    """A host copy of a PeftModel's adapters, ready to write; independent of the model."""

    adapters: tuple[AdapterFiles, ...]
    model_card: str | None
    """README.md, as ``create_or_update_model_card`` writes it at staging time."""
    peft_types: tuple[str, ...]


def _config_text(model: Any, adapter_config: Any) -> str:
    """adapter_config.json for one adapter, from a copy (the model's own config unchanged)."""
    body = copy.deepcopy(adapter_config)
    prompt = body.is_prompt_learning
    if body.base_model_name_or_path is None:
        holder = model.base_model if prompt else model.base_model.model
        body.base_model_name_or_path = holder.__dict__.get("name_or_path", None) or None
    body.inference_mode = True  # peft marks a saved adapter as loaded for inference
    out = body.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = list(value)
    if body.task_type is None:
        # Without a task type, from_pretrained finds the base class through this record.
        cls = type(model.base_model if prompt else model.base_model.model)
        out["auto_mapping"] = {"base_model_class": cls.__name__,
                               "parent_library": cls.__module__}
    return json.dumps(out, indent=2, sort_keys=True)


def stage_adapter(model: Any, *, copy_tensors: bool = True) -> StagedAdapter:
    """Stage every adapter of the (unwrapped) PeftModel ``model`` for writing.

    The tensor selection is peft's own ``get_peft_model_state_dict`` (per-tuner rules:
    LoRA biases, DoRA magnitudes, modules_to_save, targeted embeddings), so the names match
    what ``save_pretrained`` writes for the installed peft."""
    peft = _import_peft()
    adapters = []
    for name, adapter_config in model.peft_config.items():
        selected = peft.get_peft_model_state_dict(model, adapter_name=name)
        tensors = {key: (t.detach().to("cpu", copy=True) if copy_tensors else t.detach())
                   for key, t in selected.items()}
        adapters.append(AdapterFiles(subdir="" if name == "default" else name, tensors=tensors,
                                     config_text=_config_text(model, adapter_config)))
    card = None
    if callable(getattr(model, "create_or_update_model_card", None)):
        with tempfile.TemporaryDirectory(prefix="jaxckpt-peft-card-") as scratch:
            model.create_or_update_model_card(scratch)
            path = os.path.join(scratch, MODEL_CARD_FILE)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as handle:
                    card = handle.read()
    types = tuple(str(getattr(c.peft_type, "value", c.peft_type))
                  for c in model.peft_config.values())
    return StagedAdapter(adapters=tuple(adapters), model_card=card, peft_types=types)


def write_adapter(staged: StagedAdapter, directory: str, *,
                  provenance: Mapping[str, Any] | None) -> int:
    """Write ``staged`` into the existing, empty ``directory``; return the bytes written."""
    from .export import PROVENANCE_FILE, PROVENANCE_FORMAT, _step_of, _write_json, _write_text
    from .torch_export import write_tensor_file

    written = 0
    files = []
    for adapter in staged.adapters:
        where = os.path.join(directory, adapter.subdir) if adapter.subdir else directory
        os.makedirs(where, exist_ok=True)
        written += write_tensor_file(os.path.join(where, ADAPTER_WEIGHTS_FILE), adapter.tensors)
        written += _write_text(os.path.join(where, ADAPTER_CONFIG_FILE), adapter.config_text)
        files += [os.path.join(adapter.subdir, ADAPTER_WEIGHTS_FILE),
                  os.path.join(adapter.subdir, ADAPTER_CONFIG_FILE)]
    if staged.model_card is not None:
        written += _write_text(os.path.join(directory, MODEL_CARD_FILE), staged.model_card)
        files.append(MODEL_CARD_FILE)
    tensors = [t for adapter in staged.adapters for t in adapter.tensors.values()]
    written += _write_json(os.path.join(directory, PROVENANCE_FILE), {
        "format": PROVENANCE_FORMAT,
        "jaxckpt_version": __version__,
        "framework": "torch",
        "arch": None,
        "peft_types": list(staged.peft_types),
        "tensors": len(tensors),
        "tensor_bytes": sum(int(t.numel()) * t.element_size() for t in tensors),
        "files": files,
        "created_unix": time.time(),
        "source": {**_step_of(directory), **dict(provenance or {})},
    })
    return written


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoraMerge:
    """One LoRA adapter folded into one base weight at write time (peft's vanilla merge)."""

    weight: str
    """The merged model's name of the base weight (and ``bias`` its bias, when merged)."""
    lora_a: Any
    lora_b: Any
    scaling: float
    transpose: bool
    """Linear: ``fan_in_fan_out``; Embedding: always (peft stores its A/B transposed)."""
    embedding: bool
    bias: str | None = None
    lora_b_bias: Any = None

    def delta(self) -> Any:
        """``transpose(B @ A) * scaling`` as peft computes it on the CPU: half-precision
        factors are multiplied in float32 and the product cast back."""
        import torch

        a, b = self.lora_a, self.lora_b
        half = (a if self.embedding else b).dtype in (torch.float16, torch.bfloat16)
        if half:
            a, b = a.float(), b.float()
        product = b @ a
        out = (product.T if self.transpose else product) * self.scaling
        return out.to(self.lora_b.dtype if not self.embedding else self.lora_a.dtype) \
            if half else out

    def copied(self) -> LoraMerge:
        """The same merge on CPU copies (the model may train on right after staging)."""
        def host(t: Any) -> Any:
            return None if t is None else t.detach().to("cpu", copy=True)

        return dataclasses.replace(self, lora_a=host(self.lora_a), lora_b=host(self.lora_b),
                                   lora_b_bias=host(self.lora_b_bias))


def _refuse(what: str) -> ConfigError:
    return ConfigError(
        f"merge_adapters=True cannot merge {what}: jaxckpt merges plain LoRA adapters on "
        f"Linear and Embedding layers. Export the adapter instead (drop merge_adapters), or "
        f"merge it yourself (model.merge_and_unload()) and export the result.")


def _layer_merges(layer: Any, prefix: str) -> list[LoraMerge]:
    from peft.tuners import lora

    if type(layer) not in (lora.Linear, lora.Embedding):
        raise _refuse(f"{prefix} (a {type(layer).__module__}.{type(layer).__name__} layer)")
    embedding = type(layer) is lora.Embedding
    merges = []
    for adapter in layer.active_adapters:
        if adapter in layer.merged_adapters:
            continue  # already in the base weight, as peft's merge skips it
        factors = layer.lora_embedding_A if embedding else layer.lora_A
        if adapter not in factors:
            continue
        if adapter in getattr(layer, "lora_variant", {}):
            raise _refuse(f"{prefix}: adapter {adapter!r} is a LoRA variant (e.g. DoRA)")
        if embedding:
            a, b = layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]
        else:
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        with_bias = bool(getattr(layer, "lora_bias", {}).get(adapter, False))
        if with_bias and getattr(layer.get_base_layer(), "bias", None) is None:
            raise _refuse(f"{prefix}: lora_bias=True on a layer without a bias")
        merges.append(LoraMerge(
            weight=f"{prefix}.weight", lora_a=a, lora_b=b,
            scaling=layer.scaling[adapter],
            transpose=embedding or bool(layer.fan_in_fan_out), embedding=embedding,
            bias=f"{prefix}.bias" if with_bias else None,
            lora_b_bias=layer.lora_B[adapter].bias if with_bias else None))
    return merges


def merge_plan(model: Any) -> tuple[Any, dict[str, Any], list[LoraMerge], int]:
    """What ``merge_and_unload()`` of the (unwrapped) PeftModel ``model`` would save, without
    merging: ``(base model, {merged name: live base tensor}, merges, parameter count)``.

    Raises ``ConfigError`` for an adapter type other than LoRA, prompt learning, wrapped
    modules (modules_to_save, trainable tokens) and LoRA variants."""
    _import_peft()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    for name in model.active_adapters:
        peft_type = str(getattr(model.peft_config[name].peft_type, "value", ""))
        if peft_type != "LORA":
            raise _refuse(f"adapter {name!r} of peft_type {peft_type or '?'}")
    base = model.get_base_model()
    layers: dict[str, Any] = {}
    merges: list[LoraMerge] = []
    for prefix, module in base.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            raise _refuse(f"{prefix} (modules_to_save / trainable tokens)")
        if isinstance(module, BaseTunerLayer):
            layers[prefix] = module
            merges += _layer_merges(module, prefix)

    def merged_name(key: str) -> str | None:
        """``{layer}.base_layer.{rest}`` -> ``{layer}.{rest}``; adapter tensors -> None."""
        parts = key.split(".")
        for end in range(1, len(parts)):  # the ancestors of the key, outermost first
            prefix = ".".join(parts[:end])
            if prefix in layers:
                if parts[end] != "base_layer":
                    return None
                return ".".join(parts[:end] + parts[end + 1:])
        return key

    state = {}
    for key, tensor in base.state_dict().items():
        new = merged_name(key)
        if new is not None:
            state[new] = tensor
    total = sum(int(p.numel()) for key, p in base.named_parameters()
                if merged_name(key) is not None)
    return base, state, merges, total


def apply_merges(tensors: Mapping[str, Any], merges: tuple[LoraMerge, ...], *,
                 owned: bool) -> dict[str, Any]:
    """``tensors`` with every merge folded in, in order, as peft adds in place (the sum in
    the common dtype, stored in the weight's dtype). ``owned``: the tensors are this
    export's own copies and may be changed in place; otherwise each is cloned first."""
    out = dict(tensors)
    fresh: set[str] = set()
    for merge in merges:
        for name in (merge.weight, merge.bias):
            if name is None:
                continue
            if name not in out:
                raise ConfigError(f"merge_adapters=True: the merged model has no tensor "
                                  f"{name!r} to fold its LoRA adapter into; export the "
                                  f"adapter instead (drop merge_adapters).")
            if not owned and name not in fresh:
                out[name] = out[name].clone()
                fresh.add(name)
        delta = merge.delta()
        out[merge.weight] += delta.to(out[merge.weight].dtype) if merge.embedding else delta
        if merge.bias is not None:
            out[merge.bias] += merge.lora_b_bias * merge.scaling
    return out
