"""The Hugging Face bridge: Flax param trees <-> torch-layout safetensors that transformers loads.

Owns, one module each: the architecture tables (``architectures``), the engine that reads them
(``mapping``), safetensors files (``safetensors_io``), writing a model directory (``export``:
``export_hf``, ``hf_exporter``), reading one (``load``: ``load_hf``), the text of config.json
(``config_files``) and picking the params out of a training state (``params``). The Flax
layout the tables map is that of the reference models in ``jaxckpt.llm``.

Must not import jax or torch at import time: params may have jax or numpy leaves and are
converted leaf by leaf with ``np.asarray``; ``load_hf`` returns numpy leaves. Writing an
export's config files imports transformers (and with it torch, when installed).
"""

from __future__ import annotations

# `X as X` marks a re-export of a name outside __all__ (kept importable from torch_bridge.hf).
from .config_files import GENERATION_CONFIG_FILE as GENERATION_CONFIG_FILE
from .export import (
    ARCHITECTURES,
    CONFIG_FILE as CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    EXPORTER_RECORD_FORMAT,
    GPT2,
    INDEX_FILE as INDEX_FILE,
    LLAMA,
    PROVENANCE_FILE,
    PROVENANCE_FORMAT as PROVENANCE_FORMAT,
    QWEN2,
    SINGLE_FILE as SINGLE_FILE,
    Architecture,
    ExportExistsError,
    HFExporter,
    HFMismatchError,
    HFTensor,
    ParamsOf as ParamsOf,
    Progress as Progress,
    arch_for_model_type,
    export_hf,
    hf_exporter,
    load_hf,
    resolve_architecture,
)

__all__ = [
    "HFTensor",
    "Architecture",
    "ARCHITECTURES",
    "LLAMA",
    "QWEN2",
    "GPT2",
    "HFMismatchError",
    "ExportExistsError",
    "HFExporter",
    "EXPORTER_RECORD_FORMAT",
    "export_hf",
    "hf_exporter",
    "load_hf",
    "PROVENANCE_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "resolve_architecture",
    "arch_for_model_type",
]
