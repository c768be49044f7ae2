"""``jaxckpt bench``: what checkpointing costs on this machine, measured in one run.

The package's modules, by concept: ``config`` (``BenchConfig``, ``SECTIONS``), ``results``
(rows, targets, ``BenchResult``, the one table formatter), ``timing`` and ``states`` (how a
row is timed, the synthetic states), ``rows`` (the runner and the JAX rows), ``rows_torch``,
``rows_hf_torch``, ``rows_leaves``, ``rows_incremental``, ``rows_back``, ``training``,
``local``, ``multiprocess``, ``floors``;
``scale`` (``--scale``), ``remote`` and ``dcp_remote`` (object stores). This module re-exports what
the CLI, the tests and ``benchmarks/experiments`` use.

Importing this package imports numpy only; ``run_bench`` imports jax and orbax, and the
torch rows import torch and torch_bridge lazily.
"""

from __future__ import annotations

# Names imported ``as`` themselves are private: the tests and benchmarks/experiments use them.
from .config import _READ_THREADS as _READ_THREADS, SECTIONS, BenchConfig, _MiB as _MiB
from .floors import (
    _direct_refused as _direct_refused,
    _raw_read as _raw_read,
    _raw_read_direct as _raw_read_direct,
    _touch_fresh as _touch_fresh,
)
from .results import (
    MARGIN,
    BenchResult,
    _Row as _Row,
    _Target as _Target,
    format_table,
    held,
    label_of,
)
from .rows import run_bench
from .states import (
    _abstract as _abstract,
    _jax_state as _jax_state,
    _leaf_arrays as _leaf_arrays,
    _random_bytes as _random_bytes,
    _tree_bytes as _tree_bytes,
)
from .timing import _drop_page_cache as _drop_page_cache, _settle as _settle, _timed as _timed

__all__ = ["BenchConfig", "BenchResult", "MARGIN", "SECTIONS", "format_table", "held", "label_of",
           "run_bench"]
