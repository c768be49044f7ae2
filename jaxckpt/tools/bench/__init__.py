"""``jaxckpt bench``: what checkpointing costs on this machine, measured in one run.

The package's modules, by concept: ``config`` (``BenchConfig``, ``SECTIONS``), ``results``
(rows, targets, ``BenchResult``, the one table formatter), ``timing`` and ``states`` (how a
row is timed, the synthetic states), ``rows`` (the runner and the JAX rows), ``rows_torch``,
``rows_leaves``, ``training``, ``local``, ``multiprocess``, ``floors``; ``scale``
(``--scale``), ``remote`` and ``dcp_remote`` (object stores). This module re-exports what
the CLI, the tests and ``benchmarks/experiments`` use.

Importing this package imports numpy only; ``run_bench`` imports jax and orbax, and the
torch rows import torch and torch_bridge lazily.
"""

from __future__ import annotations

# The private names (``as`` themselves) are those the tests and benchmarks/experiments use.
from .floors import (
    _direct_refused as _direct_refused,
    _raw_read as _raw_read,
    _raw_read_direct as _raw_read_direct,
    _touch_fresh as _touch_fresh,
)
from .rows import (
    _READ_THREADS as _READ_THREADS,
    MARGIN,
    SECTIONS,
    BenchConfig,
    BenchResult,
    _abstract as _abstract,
    _columns as _columns,
    _drop_page_cache as _drop_page_cache,
    _jax_state as _jax_state,
    _leaf_arrays as _leaf_arrays,
    _MiB as _MiB,
    _random_bytes as _random_bytes,
    _Row as _Row,
    _rss as _rss,
    _settle as _settle,
    _Target as _Target,
    _target_line as _target_line,
    _timed as _timed,
    _train_worker as _train_worker,
    _tree_bytes as _tree_bytes,
    format_table,
    held,
    label_of,
    run_bench,
)

__all__ = ["BenchConfig", "BenchResult", "MARGIN", "SECTIONS", "format_table", "held", "label_of",
           "run_bench"]
