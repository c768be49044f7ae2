"""Where things are: the repository root and the worker scripts the system tests run by path.

Owns no behaviour; imports nothing from the library."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
CRASH_WORKER = SUPPORT / "crash_worker.py"
NNX_WORKER = SUPPORT / "nnx_worker.py"
TORCH_WORKER = SUPPORT / "torch_worker.py"
HF_EXPORT_WORKER = SUPPORT / "hf_export_worker.py"
SAMPLER_WORKER = SUPPORT / "sampler_worker.py"
HF_FSDP_WORKER = SUPPORT / "hf_fsdp_worker.py"
KERAS_WORKER = SUPPORT / "keras_worker.py"
TRAINER_WORKER = SUPPORT / "trainer_worker.py"
