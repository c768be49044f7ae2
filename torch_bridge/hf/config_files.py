"""The text of an export's config.json and generation_config.json.

Owns: producing both files as transformers' ``model.save_pretrained`` would for the same
config. With transformers installed (the ``hf`` extra) the config dict is loaded into its
own config class (chosen by ``model_type``), ``architectures`` and ``dtype`` are set as a
model's save sets them, and the class serialises itself (only what differs from its
defaults); generation_config.json is the generation config a generative model of that class
derives from its config, unless the caller gives one. Without transformers, config.json is
the given dict plus ``model_type``, ``architectures`` and ``dtype``, and generation_config.json
is written only when given; the same for a ``model_type`` transformers has no class for (a
custom ``Architecture``).

Must not import jax; transformers (which loads torch when torch is installed) is imported
only when a file is produced, never at import time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jaxckpt.errors import ConfigError

__all__ = ["config_files", "CONFIG_FILE", "GENERATION_CONFIG_FILE"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def _dumps(body: Any) -> str:
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def _config_object(transformers: Any, body: Mapping[str, Any]) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if body["model_type"] not in CONFIG_MAPPING:
        return None  # a custom table for a model transformers does not know: written as given
    config_class = CONFIG_MAPPING[body["model_type"]]
    try:
        return config_class.from_dict(dict(body))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the config does not load as a {config_class.__name__}: {exc}") from exc


def _given_generation_config(value: Any) -> str:
    """generation_config.json text from a GenerationConfig, a dict or a path."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if os.path.isdir(path):
            path = os.path.join(path, GENERATION_CONFIG_FILE)
        with open(path, encoding="utf-8") as handle:
            return _dumps(json.load(handle))
    if callable(getattr(value, "to_json_string", None)) and hasattr(value, "to_diff_dict"):
        # As GenerationConfig.save_pretrained writes it.
        return value.to_json_string(use_diff=True, keys_to_pop=["compile_config"])
    if isinstance(value, Mapping):
        return _dumps(dict(value))
    raise ConfigError(f"generation_config must be a transformers GenerationConfig, its dict or "
                      f"a path to its json, got {type(value).__name__}.")


def config_files(body: Mapping[str, Any], *, hf_class: str, dtype_name: str,
                 generation_config: Any = None) -> tuple[str, str | None]:
    """(config.json text, generation_config.json text or None) for a model of class
    ``hf_class`` whose tensors are mostly ``dtype_name``. ``body`` is the config dict with
    ``model_type`` set."""
    transformers = _transformers()
    given = None if generation_config is None else _given_generation_config(generation_config)
    config = None if transformers is None else _config_object(transformers, body)
    if config is None:
        plain = {k: v for k, v in body.items() if k != "torch_dtype"}
        plain.update(architectures=[hf_class], dtype=dtype_name)
        return _dumps(plain), given
    generation = None
    if given is None:
        # A generative model derives its generation config from its config when it is built,
        # before save_pretrained sets the dtype and architectures.
        derived = transformers.GenerationConfig.from_model_config(config)
        generation = derived.to_json_string(use_diff=True, keys_to_pop=["compile_config"])
    config.architectures = [hf_class]
    config.dtype = dtype_name
    if callable(getattr(config, "validate", None)):
        config.validate()  # as config.save_pretrained does
    return config.to_json_string(use_diff=True), given if given is not None else generation
