"""Helpers shared by the test layers (unit, integration, system), importable as ``support``
from every test folder (pyproject's ``[tool.pytest.ini_options] pythonpath``).

- ``paths``: where the repository and the worker scripts are.
- ``doc_blocks``: the ```python blocks of README.md and docs/*.md, by section;
  ``doc_program.py`` runs one as it is, announcing kill points and dumping its final state.
- ``loaders``: the one stateful test loader (``state_dict``/``load_state_dict``).
- ``models``: the tiny NNX model and the tiny Hugging Face configs tests build.
- ``harness``: a worker subprocess in its own session, read line by line, SIGKILLed at a
  chosen line or time, bounded by a timeout.
- ``two_processes``: two cooperating JAX worker processes on localhost.
- ``storage_contract``: the checks every Storage implementation must pass.
- ``held_writes``: a real backend whose asynchronous writes stay in flight a while.
- ``crash_worker.py``, ``nnx_worker.py``, ``torch_worker.py``: training scripts the system
  tests run by path (``paths.WORKERS``) with the repository on PYTHONPATH;
  ``hf_fsdp_worker.py``: one rank of a 2-rank FSDP2 Hugging Face export (its ``build`` makes
  the same tiny models for the test's references).

Nothing here imports jaxckpt at import time except the modules that test it directly
(``storage_contract``); ``models`` needs flax.
"""
