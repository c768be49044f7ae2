"""The Hugging Face bridge: Flax param trees <-> torch-layout safetensors that transformers loads,
and torch models written as their ``save_pretrained`` writes them.

Owns, one module each: the architecture tables (``architectures``), the engine that reads them
(``mapping``), safetensors files (``safetensors_io``), writing a model directory (``export``:
``export_hf``, ``hf_exporter``; ``torch_export`` for torch models, with no table, and
``torch_sharded`` gathering FSDP2 ones), reading
one (``load``: ``load_hf``), the text of config.json
(``config_files``) and picking the params out of a training state (``params``). The Flax
layout the tables map is that of the reference models in ``jaxckpt.llm``.

Must not import jax or torch at import time: params may have jax or numpy leaves and are
converted leaf by leaf with ``np.asarray``; ``load_hf`` returns numpy leaves. Writing an
export's config files imports transformers (and with it torch, when installed).
"""

from __future__ import annotations

# `X as X` marks a re-export of a name outside __all__ (kept importable from torch_bridge.hf).
from .architectures import (
    ARCHITECTURES,
    GPT2,
    LLAMA,
    QWEN2,
    Architecture,
    HFTensor,
    arch_for_model_type,
    resolve_architecture,
)
from .config_files import (
    CONFIG_FILE as CONFIG_FILE,
    GENERATION_CONFIG_FILE as GENERATION_CONFIG_FILE,
)
from .export import (
    DEFAULT_MAX_SHARD_BYTES,
    EXPORTER_RECORD_FORMAT,
    PROVENANCE_FILE,
    PROVENANCE_FORMAT as PROVENANCE_FORMAT,
    ExportExistsError,
    HFExporter,
    ParamsOf as ParamsOf,
    export_hf,
    hf_exporter,
)
from .load import load_hf
from .mapping import HFMismatchError
from .safetensors_io import (
    INDEX_FILE as INDEX_FILE,
    SINGLE_FILE as SINGLE_FILE,
    Progress as Progress,
)
from .torch_export import TorchHFExporter as TorchHFExporter

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
