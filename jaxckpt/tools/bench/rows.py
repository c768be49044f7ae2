"""The runner of ``jaxckpt bench`` and its JAX rows.

Owns: ``run_bench`` (every selected section, ``repeats`` rounds) and ``_Bench`` (one run: the
states, the long-lived managers, the floors, Orbax's defaults, jaxckpt's saves and restores,
host memory over repeated saves), and the auxiliary-item rows (``_aux_rows``). The other
sections' rows live in ``rows_leaves``, ``rows_torch``, ``rows_hf_torch``, ``training``,
``local``, ``multiprocess``, ``rows_incremental``. Every row is measured once per round and
the rounds repeat; reads are cold where the page cache may be dropped (root), else warm for
every row alike.

Must not import at module level: jax, orbax, torch.

Concurrency contract: ``run_bench`` is called from one thread; it creates and removes files
only under a fresh subdirectory of ``directory``, and waits for the processes it starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxckpt.core.extras import requires_extra

from . import rows_leaves as bench_rows_leaves
from .config import _READ_THREADS, BenchConfig, _MiB
from .floors import (
    _direct_refused,
    _files_under,
    _raw_read,
    _raw_read_direct,
    _raw_write,
    _raw_write_direct,
    _read_all,
    _touch_fresh,
)
from .local import local_tier_rows
from .results import BenchResult
from .rows_back import back_rows
from .rows_hf_dcp import row_export_hf_dcp
from .rows_hf_torch import _TorchHFRows
from .rows_incremental import incremental_checks, incremental_rows
from .rows_torch import _TorchRows
from .states import _abstract, _jax_state, _leaf_arrays, _random_bytes, _tree_bytes
from .timing import _drop_page_cache, _host_copies, _quiet, _rss, _settle, _timed
from .training import train_rows

__all__ = ["run_bench"]


class _Bench:
    """One run: the states, the long-lived managers, one method per group of JAX rows that
    uses them (the other sections' rows take this object: ``rows_leaves``, ``rows_torch``,
    ``training``; the auxiliary-item rows need only the state: ``_aux_rows``).

    Args:
        config: what to measure.
        workdir: the run's own directory (every file goes below it).
        result: where the rows' seconds, facts and checks go.
        log: progress lines.
    """

    def __init__(self, config: BenchConfig, workdir: str, result: BenchResult,
                 log: Callable[[str], None]):
        self.config = config
        self.workdir = workdir
        self.result = result
        self.log = log
        self.cold = True
        self._counter = 0
        self.closers: list[Callable[[], None]] = []
        self.direct_refused: str | None = None
        """Why the O_DIRECT floor rows cannot run here ("" when they can), once asked."""

    def fresh(self, name: str) -> str:
        self._counter += 1
        return os.path.join(self.workdir, f"{name}-{self._counter:04d}")

    def before_read(self) -> None:
        if self.cold:
            self.cold = _drop_page_cache()

    def close(self) -> None:
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):
                closer()

    # --- state ---------------------------------------------------------------------------
    def build_states(self) -> None:
        config = self.config
        data = _random_bytes(config.size_mb * _MiB, seed=0)
        self.arrays = _leaf_arrays(data, config.leaves)
        self.state = _jax_state(self.arrays)
        self.arrays = [np.asarray(leaf["w"]) for leaf in self.state.values()]  # zero-copy views
        self.result.nbytes["jax"] = sum(a.nbytes for a in self.arrays)
        self.many_state = None
        if "many" in config.sections and config.many_leaves:
            self.many_state = _jax_state(_leaf_arrays(data, config.many_leaves))
        del data
        # Reused buffers are aligned whole blocks, so the O_DIRECT floor writes from them.
        from jaxckpt.storage.buffers import aligned_blocks

        self.blocks = [aligned_blocks(a.nbytes) for a in self.arrays]
        self.reused = [block[:a.nbytes].view(a.dtype).reshape(a.shape)
                       for block, a in zip(self.blocks, self.arrays, strict=True)]

    # --- floors, Orbax defaults, jaxckpt on the main state ----------------------------------
    def floors(self) -> None:
        result = self.result
        result.add("copy", _timed(lambda: [np.array(a, copy=True) for a in self.arrays]))

        def copy_reused() -> None:
            for a, b in zip(self.arrays, self.reused, strict=True):
                np.copyto(b, a)

        result.add("copy_reused", _timed(copy_reused))
        path = self.fresh("raw")
        result.add("write", _timed(lambda: _raw_write(path, self.arrays)))
        self.before_read()
        result.add("read", _timed(lambda: _raw_read(path, self.result.nbytes["jax"])))
        os.unlink(path)
        # The same bytes the way Orbax lays them out: one file per leaf, written and read
        # by several threads. On this kind of machine that is faster than one stream, and
        # much steadier when other processes use the disk.
        directory = self.fresh("raw-files")
        os.makedirs(directory)
        paths = [os.path.join(directory, str(i)) for i in range(len(self.arrays))]
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            result.add("write_files", _timed(lambda: list(pool.map(
                lambda i: _raw_write(paths[i], [self.arrays[i]]), range(len(paths))))))
            self.before_read()
            result.add("read_files", _timed(lambda: list(pool.map(
                lambda i: _raw_read(paths[i], self.arrays[i].nbytes), range(len(paths))))))
            shutil.rmtree(directory)
            # And with O_DIRECT (what OrbaxBackend's native I/O uses): the device copies
            # from aligned memory, no page cache. Skipped where the filesystem refuses it.
            os.makedirs(directory)
            if self.direct_refused is None:
                self.direct_refused = _direct_refused(directory)
            if self.direct_refused:
                for key in ("write_direct", "read_direct", "read_direct_numpy"):
                    result.unavailable[key] = self.direct_refused
            else:
                self.direct_floors(pool, paths)
        shutil.rmtree(directory)

    def direct_floors(self, pool: concurrent.futures.Executor, paths: list[str]) -> None:
        """The ``O_DIRECT`` floors: written on ``pool`` from the reused buffers filled by
        the copy row, read on as many threads as a restore reads with (``_READ_THREADS``)
        into the memory a restore reads into; then the same read into numpy's memory,
        shown but not a floor: its huge pages are cheap only when freed moments before
        (benchmarks/results/restore-read-floor_cpu2core_2026-11-25.md)."""
        result = self.result
        result.add("write_direct", _timed(lambda: list(pool.map(
            lambda i: _raw_write_direct(paths[i], self.blocks[i]), range(len(paths))))))
        sizes = [block.nbytes for block in self.blocks]
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as readers:

            def read_all(numpy_memory: bool) -> list[np.ndarray]:
                read = functools.partial(_raw_read_direct, numpy_memory=numpy_memory)
                return list(readers.map(read, paths, sizes))

            for key, numpy_memory in (("read_direct", False), ("read_direct_numpy", True)):
                self.before_read()
                result.add(key, _timed(functools.partial(read_all, numpy_memory)))

    def orbax_defaults(self, state: Any, prefix: str) -> None:
        import orbax.checkpoint as ocp

        directory = self.fresh(f"orbax{prefix}")
        manager = ocp.CheckpointManager(directory)  # every option at its default
        try:
            _settle()
            start = time.perf_counter()
            manager.save(0, args=ocp.args.StandardSave(state))
            blocking = time.perf_counter() - start
            manager.wait_until_finished()
            total = time.perf_counter() - start
            if not prefix:
                self.result.add("orbax_blocking", blocking)
            self.result.add(f"{prefix}orbax_save", total)
            like = _abstract(state)
            self.before_read()
            self.result.add(f"{prefix}orbax_restore", _timed(
                lambda: manager.restore(0, args=ocp.args.StandardRestore(like))))
        finally:
            manager.close()
            shutil.rmtree(directory, ignore_errors=True)

    def jaxckpt_manager(self, name: str) -> Any:
        import jaxckpt

        manager = getattr(self, f"_manager_{name}", None)
        if manager is None:
            from ..backend_hooks import TimedBackend

            backend = TimedBackend()
            self.closers.append(backend.close)
            manager = jaxckpt.CheckpointManager(
                os.path.join(self.workdir, f"jaxckpt-{name}"),
                recover=jaxckpt.RecoverConfig(keep_last_n=1), mode="async",
                backend=backend, preemption_signals=())
            setattr(self, f"_manager_{name}", manager)
            self.closers.append(manager.close)
            setattr(self, f"_step_{name}", 0)
        return manager

    def jaxckpt_save(self, manager: Any, name: str, state: Any, *, mode: str) -> Any:
        import jaxckpt

        step = getattr(self, f"_step_{name}")
        setattr(self, f"_step_{name}", step + 1)
        _settle()
        report = manager.save(jaxckpt.StepInfo(0, step, step), state, mode=mode)
        report.wait()
        manager.wait()  # retention of the previous checkpoint is not the next row's cost
        return report

    def jaxckpt_rows(self, state: Any, prefix: str) -> None:
        from jaxckpt.core.layout import STATE_DIR

        name = prefix or "main"
        manager = self.jaxckpt_manager(name)
        if getattr(self, f"_step_{name}") == 0:  # first save: buffers, caches, directories
            self.jaxckpt_save(manager, name, state, mode="async")
        report = self.jaxckpt_save(manager, name, state, mode="sync")
        self.result.add(f"{prefix}jx_sync", report.total_s)
        if not prefix:  # the same save in its two parts: the backend's write, the rest
            write_s = manager.backend.write_s[-1]
            self.result.add("jx_write", write_s)
            self.result.add("jx_commit", report.total_s - write_s)
        report = self.jaxckpt_save(manager, name, state, mode="async")
        self.result.add(f"{prefix}jx_blocking", report.blocking_s)
        if not prefix:
            self.result.add("jx_async", report.total_s)
        like = _abstract(state)
        if prefix:
            self.before_read()
            self.result.add(f"{prefix}jx_restore", _timed(lambda: manager.restore(like)))
            return
        # The restore, the backend's read and a bare read of the very same files take turns
        # going first. Each must produce the state in fresh memory, and on this kind of VM
        # what fresh memory costs swings from one moment to the next (page faults; the
        # "fresh_memory" row), so the figures to compare are the ones taken side by side.
        files = _files_under(os.path.join(report.path, STATE_DIR))
        bare = _raw_read_direct if self.direct_refused == "" else _raw_read  # "": it works
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            rows = [("jx_restore", lambda: manager.restore(like)),
                    ("jx_read", lambda: manager.backend.read(
                        os.path.join(report.path, STATE_DIR), like)),
                    ("jx_read_bare", lambda: _read_all(pool, bare, files))]
            self._restore_turn = getattr(self, "_restore_turn", -1) + 1
            for key, action in rows[::-1] if self._restore_turn % 2 else rows:
                self.before_read()
                self.result.add(key, _timed(action))
        self.result.add("fresh_memory", _timed(lambda: _touch_fresh(self.result.nbytes["jax"])))
        self.before_read()
        self.result.add("jx_verify", _timed(
            lambda: manager.store.verify(report.path, checksums=True)))

    # --- host memory over repeated saves -------------------------------------------------
    def memory_rows(self) -> None:
        name = "memory"
        manager = self.jaxckpt_manager(name)
        rss = []
        step_state = self.state
        for _ in range(self.config.memory_saves):
            # A changed leaf per save, as in training (the arrays are new every step).
            first = next(iter(step_state))
            step_state = {**step_state, first: {"w": step_state[first]["w"] + 0}}
            self.jaxckpt_save(manager, name, step_state, mode="async")
            gc.collect()
            rss.append(_rss())
        settle = min(4, len(rss) - 1)
        growth = rss[-1] - rss[settle]
        # "Flat": allocator noise of a few MiB is not growth; a leak of one staged copy per
        # save (the failure this guards against) would be a whole state's worth.
        limit = max(16 * _MiB, self.result.nbytes["jax"] // 50)
        self.result.facts["memory"] = {
            "saves": len(rss),
            "rss_mib_sampled": [round(r / _MiB) for r in rss[::max(1, len(rss) // 10)]],
            f"growth_mib_after_save_{settle + 1}": round(growth / _MiB, 1),
            "max_minus_min_mib": round((max(rss[settle:]) - min(rss[settle:])) / _MiB, 1)}
        self.result.checks.append({
            "target": f"RSS growth over {len(rss)} async saves, MiB", "op": "<=",
            "value": growth / _MiB, "limit": limit / _MiB, "met": growth <= limit,
            "note": f"from save {settle + 1} to save {len(rss)}; limit max(16 MiB, 2% of "
                    f"the state)"})


# ------------------------------------------------------------------- auxiliary items


def _aux_rows(state: dict[str, Any], workdir: str, result: BenchResult) -> None:
    """A GRPO-style reference policy as a versioned item (``items=``), updated every
    ``every`` steps: bytes written and blocking time on saves where it did not change,
    against saves where it did. Half the state is the policy, half the reference."""
    import jaxckpt

    every = 4
    keys = list(state)
    half = max(1, len(keys) // 2)
    policy = {k: state[k] for k in keys[:half]}
    reference = {k: state[k] for k in keys[half:]}
    policy_bytes, reference_bytes = _tree_bytes(policy), _tree_bytes(reference)
    manager = jaxckpt.CheckpointManager(
        os.path.join(workdir, "jaxckpt-aux"),
        recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=1),
        mode="async", items={"ref": jaxckpt.Every(steps=every)}, preemption_signals=())
    changed: list[tuple[int, float]] = []
    unchanged: list[tuple[int, float]] = []
    try:
        for index in range(2 * every):
            step = jaxckpt.StepInfo(0, index, index)
            report = manager.save(step, policy, items={"ref": reference})
            report.wait()
            manager.wait()
            # Version v = (step + 1) // every is new at step 0 and when (step+1) % every == 0.
            fresh = index == 0 or (index + 1) % every == 0
            assert report.bytes is not None  # set when the save finished (waited for above)
            (changed if fresh else unchanged).append((report.bytes, report.blocking_s))
    finally:
        manager.close()
    rewritten = statistics.median(b for b, _ in unchanged) - policy_bytes
    result.facts["aux"] = {
        "policy_mib": round(policy_bytes / _MiB, 1),
        "reference_mib": round(reference_bytes / _MiB, 1), "reference_every": every,
        "mib_written_when_reference_changed": [round(b / _MiB, 1) for b, _ in changed],
        "mib_written_when_unchanged": [round(b / _MiB, 1) for b, _ in unchanged],
        "blocking_s_changed": [round(t, 4) for _, t in changed],
        "blocking_s_unchanged": [round(t, 4) for _, t in unchanged]}
    share = max(0.0, rewritten) / reference_bytes
    result.checks.append({
        "target": "unchanged reference item: bytes rewritten / its size", "op": "<=",
        "value": share, "limit": 0.01, "met": share <= 0.01,
        "note": f"{rewritten / 1024:.0f} KiB a save beyond the policy's bytes: driver, "
                "tree and manifest metadata"})


def run_bench(config: BenchConfig, *, log: Callable[[str], None] | None = None) -> BenchResult:
    """Run every selected row ``config.repeats`` times.

    Every row is measured once per round, so the rows of one round ran side by side under
    the same load; a target's ratio is taken within each round and the median over rounds
    reported (``BenchResult.ratio``). Every save row is durable (data fsynced) unless its
    label says otherwise. Importing this module costs numpy; this imports jax and orbax, and
    the torch rows import torch and torch_bridge (without them, those rows read
    "unavailable")."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with requires_extra("jax", "jaxckpt bench"):
        from jax.tree_util import tree_leaves as jax_leaves

    result = BenchResult(config=config)
    parent = config.directory or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="jaxckpt-bench-", dir=parent)
    result.facts.update(directory=workdir, cpus=os.cpu_count(),
                        load_start=round(os.getloadavg()[0], 2))
    bench = _Bench(config, workdir, result, log)
    torch_rows = _TorchRows(bench)
    torch_hf_rows = _TorchHFRows(bench)
    sections = config.sections
    try:
        with _quiet():
            bench.cold = _drop_page_cache()
            result.facts["reads"] = ("cold (page cache dropped before each read)" if bench.cold
                                     else "warm: drop_caches is not permitted here, every "
                                          "read row is warm alike")
            log("jaxckpt bench: building the states")
            bench.build_states()
            for round_index in range(config.repeats):
                log(f"jaxckpt bench: round {round_index + 1} of {config.repeats}")
                if "jax" in sections:
                    bench.floors()
                    bench.orbax_defaults(bench.state, "")
                    bench.jaxckpt_rows(bench.state, "")
                if "many" in sections and bench.many_state is not None:
                    many = jax_leaves(bench.many_state)
                    result.add("many_copy", _timed(functools.partial(_host_copies, many)))
                    bench.orbax_defaults(bench.many_state, "many_")
                    bench.jaxckpt_rows(bench.many_state, "many_")
                if "leaves" in sections:
                    bench_rows_leaves.leaves_rows(bench, round_index)
                if "first" in sections:
                    bench_rows_leaves.first_save_rows(bench, round_index)
                if "back" in sections:
                    back_rows(bench)
                if "torch" in sections:
                    torch_rows.torch_rows()
                if "hf" in sections:
                    torch_rows.hf_rows()
                    row_export_hf_dcp(config, bench)
                    torch_hf_rows.rows()
                if "local" in sections:
                    local_tier_rows(bench.state, workdir, result)
                if "incremental" in sections:
                    incremental_rows(bench, round_index)
            if "train" in sections:
                log("jaxckpt bench: training loop")
                train_rows(bench)
            if "memory" in sections:
                log(f"jaxckpt bench: host memory over {config.memory_saves} saves")
                bench.memory_rows()
            if "aux" in sections:
                _aux_rows(bench.state, workdir, result)
            if "multiprocess" in sections:
                from .multiprocess import measure

                measure(config.size_mb, workdir, result, log)
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    incremental_checks(bench)
    result.derive_floors()
    result.facts["load_end"] = round(os.getloadavg()[0], 2)
    return result
