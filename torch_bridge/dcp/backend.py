"""The PyTorch backend: training state written and read by torch.distributed.checkpoint (DCP).

Owns: ``DcpBackend``: a state dict of ``name -> object`` (modules, optimizers, schedulers,
anything with ``state_dict``; tensors, DTensors, containers of tensors and JSON-like
values) into a flat ``{key: tensor}`` that DCP writes plus ``objects.json`` (entry kinds,
non-tensor values through jaxckpt's codec, every tensor's path, shape and dtype), and back:
matching a ``like`` dict by tree path, every mismatch reported at once, loading in place
(through ``torch.distributed.checkpoint.state_dict`` so DDP/FSDP models reshard); the
process facts of a ``torch.distributed`` run and the torch RNG. Where the files go (a local
directory renamed into place, or an object store's prefix) is ``dcp.files``'s; the
manager's ``COMMITTED`` marker makes a checkpoint valid. No pickle besides DCP's metadata.

Must not import: jax, orbax. ``torch.distributed.checkpoint`` is imported on first use.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from jaxckpt.backends.base import BackendFeatures, IncrementalBase
from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.core import codec
from jaxckpt.core.extras import requires_extra
from jaxckpt.core.layout import OBJECTS_FILE
from jaxckpt.errors import (
    CheckpointCorruptError,
    ConfigError,
    TreeMismatchError,
)
from jaxckpt.storage.base import Storage

with requires_extra("torch", "torch_bridge's DCP backend (DcpCheckpointManager, DcpBackend)"):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    from torch_bridge import rng
    from torch_bridge.dcp import metadata as dcp_metadata
    from torch_bridge.dcp.files import LocalDcpFiles, StorageDcpFiles
    from torch_bridge.dcp.incremental import Incremental
    from torch_bridge.dcp.overlap import StagingOverlap

__all__ = ["DcpBackend", "DcpWriteHandle", "OBJECTS_FORMAT", "OBJECTS_FORMAT_VERSION"]

#: value of the "format" field of objects.json; identifies the file's owner.
OBJECTS_FORMAT = "jaxckpt.dcp.objects"
#: bumped on any incompatible change of objects.json; readers refuse newer versions.
OBJECTS_FORMAT_VERSION = 1

_OBJECTS_FILE = OBJECTS_FILE

AsyncCheckpointer = Literal["auto", "thread", "process"]


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use (it costs about 1 s)."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _state_dict_api() -> Any:
    import torch.distributed.checkpoint.state_dict as api

    return api


# ------------------------------------------------------------------- flattening the state


def _is_sharded_tensor(value: Any) -> bool:
    """FSDP1's legacy ShardedTensor, which is not a torch.Tensor subclass."""
    return type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards")


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or _is_sharded_tensor(value)


def _tensor_facts(value: Any) -> tuple[list[int], str]:
    """Global shape and dtype name ("float32", "bfloat16") of a tensor-like leaf."""
    if _is_sharded_tensor(value):
        shape, dtype = value.size(), value.metadata().tensor_properties.dtype
    else:
        shape, dtype = value.shape, value.dtype
    return [int(d) for d in shape], str(dtype).removeprefix("torch.")


def _local_nbytes(value: Any) -> int:
    if _is_sharded_tensor(value):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.numel() * local.element_size()


class _Split:
    """One state entry taken apart: a JSON skeleton with ``None`` where tensors were, and
    the tensors by tree path (a tuple of dict keys / list indices)."""

    __slots__ = ("skeleton", "tensors")

    def __init__(self, value: Any):
        self.tensors: dict[tuple[Any, ...], Any] = {}
        self.skeleton = self._walk(value, ())

    def _walk(self, value: Any, path: tuple[Any, ...]) -> Any:
        if _is_tensor(value):
            self.tensors[path] = value
            return None
        if isinstance(value, dict):
            return {key: self._walk(item, path + (key,)) for key, item in value.items()}
        if type(value) is list:
            return [self._walk(item, path + (index,)) for index, item in enumerate(value)]
        if type(value) is tuple:
            return tuple(self._walk(item, path + (index,)) for index, item in enumerate(value))
        return value  # a JSON-like leaf; the codec refuses anything else, naming the path


def _fill(skeleton: Any, tensors: Mapping[tuple[Any, ...], Any], path: tuple[Any, ...] = ()) -> Any:
    """Inverse of :class:`_Split`: the skeleton with each tensor path replaced by its tensor."""
    if path in tensors:
        return tensors[path]
    if isinstance(skeleton, dict):
        return {key: _fill(item, tensors, path + (key,)) for key, item in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(item, tensors, path + (index,)) for index, item in enumerate(skeleton)]
    if isinstance(skeleton, tuple):
        return tuple(_fill(item, tensors, path + (index,)) for index, item in enumerate(skeleton))
    return skeleton


def _storage_key(name: str, path: tuple[Any, ...]) -> str:
    """The key a tensor has in DCP: ``model/fc.weight``, ``optimizer/state/fc.weight/exp_avg``."""
    return "/".join([name, *(str(part) for part in path)])


def _describe_path(name: str, path: tuple[Any, ...]) -> str:
    return f"state[{name!r}]" + "".join(f"[{part!r}]" for part in path)


def _kind_of(name: str, value: Any) -> str:
    if isinstance(value, DataLoader):
        # Its state is per process, but tensors in the state are saved once for all
        # processes (as replicated): each rank's position would be lost but one.
        raise ConfigError(
            f"state[{name!r}] is a data loader; its position differs per process, so it "
            "belongs in the manager's driver state, not in the checkpointed state. Fix: "
            f"pass it as stateful={{{name!r}: loader}} to recover() / maybe_save().")
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if _is_tensor(value):
        return "tensor"
    if (callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None))):
        return "state_dict"  # LR schedulers, torch Stateful objects, anything alike
    if value is None or isinstance(value, (dict, list, tuple, str, int, float, bool)):
        return "value"
    raise TypeError(
        f"state[{name!r}] is a {type(value).__module__}.{type(value).__qualname__}, which the "
        "DCP backend cannot checkpoint. Entries must be nn.Module, torch.optim.Optimizer, an "
        "object with state_dict()/load_state_dict() (LR schedulers, Stateful), a tensor, or a "
        "dict/list of tensors and JSON-like values. Fix: wrap it in an object with "
        "state_dict()/load_state_dict(), or pass per-process objects (data loaders) as "
        "stateful= to the manager instead.")


def _pair_optimizers(state: Mapping[str, Any]) -> dict[str, str]:
    """For each optimizer entry, the module entry holding all of its parameters (the
    smallest such module, so that ``{"model": m, "head": m.head}`` pairs precisely).

    DCP's ``get_optimizer_state_dict`` keys optimizer state by the parameters' names in a
    module, which is what lets it reshard; so every optimizer needs its module in the state.
    """
    modules = {name: value for name, value in state.items() if isinstance(value, nn.Module)}
    module_params = {name: {id(p) for p in module.parameters()} for name, module in modules.items()}
    pairs: dict[str, str] = {}
    problems = []
    for name, value in state.items():
        if not isinstance(value, torch.optim.Optimizer):
            continue
        wanted = {id(p) for group in value.param_groups for p in group["params"]}
        holders = sorted((len(params), module_name) for module_name, params in module_params.items()
                         if wanted <= params)
        if not holders:
            problems.append(name)
            continue
        pairs[name] = holders[0][1]
    if problems:
        raise ConfigError(
            f"optimizer entr{'y' if len(problems) == 1 else 'ies'} {problems} optimize "
            f"parameters that no nn.Module entry of the state holds (modules in the state: "
            f"{sorted(modules) or 'none'}). DCP names optimizer state after the module's "
            "parameter names, so the module must be saved alongside. Fix: "
            "state={'model': model, 'optimizer': optimizer, ...} (wrap several models in one "
            "nn.ModuleDict when one optimizer spans them).")
    return pairs


def _optimizer_is_fresh(optimizer: torch.optim.Optimizer) -> bool:
    return not optimizer.state


def _drop_created_state(optimizer: torch.optim.Optimizer) -> None:
    """Undo DCP's in-place initialisation of a fresh optimizer (its ``get_optimizer_state_dict``
    runs a zero-lr step to create the state, which would, e.g., advance Adam's step count and
    change the bias correction of the first real step)."""
    optimizer.state.clear()


class _Entry:
    """A state entry ready to write or to read into."""

    __slots__ = ("name", "kind", "module", "fresh", "split")

    def __init__(self, name: str, kind: str, split: _Split, module: str | None = None,
                 fresh: bool = False):
        self.name = name
        self.kind = kind
        self.module = module
        self.fresh = fresh
        self.split = split


def _kinds(state: Any) -> dict[str, str]:
    """Each entry's kind, after checking ``state`` is a dict of valid names and values."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"the DCP backend's state must be a dict of name -> object, got "
            f"{type(state).__module__}.{type(state).__qualname__}. Fix: "
            "state={'model': model, 'optimizer': optimizer, 'scheduler': scheduler}.")
    bad_names = [name for name in state if not isinstance(name, str) or not name or "/" in name]
    if bad_names:
        raise ConfigError(f"state keys must be non-empty str without '/', got {bad_names!r}.")
    return {name: _kind_of(name, value) for name, value in state.items()}


def _values_now(state: Any) -> dict[str, _Entry]:
    """The entries other than modules and optimizers (schedulers, Stateful objects, tensors,
    plain values) taken apart now, on the calling thread: an overlapped write reads modules
    and optimizers on its worker, before the step that changes them."""
    return {name: _Entry(name, kind, _Split(value.state_dict() if kind == "state_dict"
                                            else value))
            for (name, kind), value in zip(_kinds(state).items(), state.values(), strict=True)
            if kind not in ("module", "optimizer")}


def _entries(state: Any, taken: Mapping[str, _Entry] | None = None) -> list[_Entry]:
    """Take every entry of ``state`` apart (on the calling thread: this reads the live
    objects; DCP's ``get_*_state_dict`` shares storage with parameters, it does not copy);
    entries in ``taken`` (``_values_now``'s) are used as they are."""
    kinds = _kinds(state)
    pairs = _pair_optimizers(state)
    api: Any = None  # torch's state-dict functions, imported on first need
    out = []
    for name, value in state.items():
        kind = kinds[name]
        if taken is not None and name in taken:
            out.append(taken[name])
            continue
        if kind in ("module", "optimizer") and api is None:
            api = _state_dict_api()
        if kind == "module":
            out.append(_Entry(name, kind, _Split(api.get_model_state_dict(value))))
        elif kind == "optimizer":
            module = state[pairs[name]]
            fresh = _optimizer_is_fresh(value)
            taken = api.get_optimizer_state_dict(module, value)
            if fresh:
                _drop_created_state(value)
            out.append(_Entry(name, kind, _Split(taken), module=pairs[name], fresh=fresh))
        elif kind == "state_dict":
            out.append(_Entry(name, kind, _Split(value.state_dict())))
        else:  # "tensor" and "value"
            out.append(_Entry(name, kind, _Split(value)))
    return out


def _flat_tensors(entries: list[_Entry]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for entry in entries:
        for path, tensor in entry.split.tensors.items():
            key = _storage_key(entry.name, path)
            if key in flat:
                raise ValueError(
                    f"{_describe_path(entry.name, path)} and {owner[key]} map to the same DCP "
                    f"key {key!r}; rename one of them (keys are joined with '/').")
            flat[key] = tensor
            owner[key] = _describe_path(entry.name, path)
    return flat


def _objects_document(entries: list[_Entry]) -> bytes:
    body: dict[str, Any] = {"format": OBJECTS_FORMAT, "version": OBJECTS_FORMAT_VERSION,
                            "entries": {}}
    for entry in entries:
        tensors = []
        for path, tensor in entry.split.tensors.items():
            shape, dtype = _tensor_facts(tensor)
            tensors.append({"path": codec.encode(list(path)),
                            "key": _storage_key(entry.name, path),
                            "shape": shape, "dtype": dtype})
        record: dict[str, Any] = {
            "kind": entry.kind,
            "skeleton": codec.encode(entry.split.skeleton, f"state[{entry.name!r}]"),
            "tensors": tensors,
        }
        if entry.kind == "optimizer":
            record.update(module=entry.module, fresh=entry.fresh)
        body["entries"][entry.name] = record
    # Compact: with indent= json.dumps runs its pure-Python encoder, slower than the C one
    # on the training thread (this document lists every tensor).
    return json.dumps(body, allow_nan=False).encode()


# -------------------------------------------------------------------------------- handle


class DcpWriteHandle:
    """A write started by :meth:`DcpBackend.write`.

    Concurrency contract: ``wait`` may be called from any thread, any number of times; the
    first call that finds the write finished publishes the directory (primary process), and
    every later call returns at once or re-raises the same error.
    """

    __slots__ = ("directory", "nbytes", "_backend", "_future", "_staging_dir", "_finished",
                 "_error", "_writer")

    def __init__(self, backend: DcpBackend, directory: str, staging_dir: str, nbytes: int,
                 future: Any = None, writer: Any = None):
        #: the directory this write fills.
        self.directory = directory
        #: bytes of tensor data this process handed to DCP (local shards), known at staging
        #: time; the manager reports sizes from its commit manifest instead.
        self.nbytes = nbytes
        self._backend = backend
        self._future = future
        self._staging_dir = staging_dir
        self._finished = future is None
        self._error: BaseException | None = None
        self._writer = writer

    @property
    def references(self) -> dict[str, dict[str, Any]] | None:
        """The base's files whose byte ranges this process's records point at instead of
        writing those tensors again (``{key: the base's entry}``), once the write finished;
        None before, after a failure, or where nothing was referred to."""
        if not self._finished or self._error is not None or self._writer is None:
            return None
        incremental = getattr(self._writer, "incremental", None)
        return dict(incremental.references) if incremental and incremental.references else None

    @property
    def checksums(self) -> dict[str, dict[str, Any]] | None:
        """The manifest entries of the files this process wrote, computed from the bytes
        written (uploaded, or written and fsynced on a local disk); None where the files
        were written by DCP's checkpoint process with its plain writer, so the commit
        checksums them."""
        if not self._finished or self._error is not None or self._writer is None:
            return None
        return self._backend._files_for(self.directory).known_checksums(self._writer,
                                                                       self.directory)

    def done(self) -> bool:
        """Whether the write is known to have finished (successfully or not)."""
        return self._finished

    def wait(self) -> None:
        """Block until DCP finished this write and the directory is in place; re-raise
        whatever made it fail."""
        if not self._finished:
            self._backend._finish(self)
        if self._error is not None:
            raise self._error


# ------------------------------------------------------------------------------- backend


class DcpBackend:
    """Writes and reads torch training state with DCP (see the module docstring).

    Process facts come from ``torch.distributed`` when its default group is initialised at
    construction (initialise it first), else this is a single process. In a distributed run
    the constructor is a collective: it creates two gloo groups over all ranks, one for the
    manager's barriers and broadcasts (training thread) and one for DCP's own collectives
    (which run on DCP's background thread during an async save). Separate groups keep those
    from interleaving with each other and with the training loop's collectives on the
    default group (e.g. DDP's all-reduce, possibly NCCL), and give async saves the CPU group
    DCP requires.

    Concurrency contract: ``write``, ``read`` and ``close`` are called from one thread (the
    training loop's); a handle's ``wait`` may run on another thread. At most one save is in
    flight: ``write`` first waits for the previous one (its outcome stays on its handle).
    Multi-process: every process calls ``write``/``read`` with the same directory and an
    equal set of entries; only process 0 writes objects.json. Across jobs: a directory is
    written once and never modified.
    """

    name = "dcp"
    #: Async writes. Exporters get state dicts (host copies), never live modules, in every
    #: mode. read() loads into the caller's live modules and tensors, which cannot be taken
    #: back, so it checks each data file it claims before loading any (verifies_reads);
    #: in a run of several processes the manager checks every file before reading.
    #: Object-store roots through the storage the manager attaches; there the reader
    #: takes the data files the manager fetched ahead (takes_read_ahead). Incremental: an
    #: unchanged tensor's record points into the base's data file.
    features = BackendFeatures(supports_async=True, export_needs_copy=True,
                               reads_in_place=True, verifies_reads=True, object_storage=True,
                               takes_read_ahead=True, incremental=True)

    def __init__(self, *, async_checkpointer: AsyncCheckpointer = "auto",
                 reuse_staging_memory: bool = True, sync_files: bool = False,
                 collective_timeout_s: float = 300.0, write_timeout_s: float = 1800.0):
        """
        Args:
          async_checkpointer: where DCP writes in async mode. "thread": a background thread
            of this process; "process": DCP's checkpoint daemon process (torch >= 2.8; the
            first save starts it, which takes seconds in the background, and the launched
            script needs an ``if __name__ == "__main__":`` guard); "auto": "process" where
            CUDA is available, a default process group is initialised (the daemon joins it)
            and this torch has it, else "thread" (on CPU the process costs total time and
            saves no blocking time: docs/torch.md).
          reuse_staging_memory: keep the host copy made at staging time between saves and
            copy into it again (pinned, with CUDA): no allocation on the training thread
            after the first save, at the cost of one host copy of the state held for the
            run. False allocates a fresh copy per save and frees it after the write.
          sync_files: let DCP fsync each file it writes, where DCP's plain writer writes
            (async saves in DCP's checkpoint process). Off by default: the manager's commit
            fsyncs every file and directory of a checkpoint before it writes the COMMITTED
            marker, so DCP's fsyncs would be paid twice. Everywhere else the backend's own
            writer fsyncs each file as it closes it, whatever this says.
          collective_timeout_s: timeout of barriers and broadcasts between processes.
          write_timeout_s: timeout of DCP's collectives during a save (they wait for the
            slowest process's write) and of waiting for an in-flight save.
        """
        if async_checkpointer not in ("auto", "thread", "process"):
            raise ConfigError(f"DcpBackend(async_checkpointer=...) must be 'auto', 'thread' or "
                              f"'process', got {async_checkpointer!r}.")
        for field, value in (("collective_timeout_s", collective_timeout_s),
                             ("write_timeout_s", write_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"DcpBackend({field}=...) must be a number > 0, got {value!r}.")
        self._cuda = torch.cuda.is_available()
        self._checkpointer = _resolve_checkpointer(
            async_checkpointer, self._cuda, dist.is_available() and dist.is_initialized())
        self._reuse_staging_memory = reuse_staging_memory
        self._sync_files = sync_files
        self._collective_timeout_s = float(collective_timeout_s)
        self._write_timeout_s = float(write_timeout_s)
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            self._rank = dist.get_rank()
            self._world = dist.get_world_size()
            # Collectives: every rank creates these, in this order, in its constructor.
            self._control_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self._collective_timeout_s))
            self._io_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self._write_timeout_s))
        else:
            self._rank, self._world = 0, 1
            self._control_group = self._io_group = None
            _quiet_single_process_notice()
        self._stager: Any = None
        self._local_files = LocalDcpFiles()
        self._remote_files: StorageDcpFiles | None = None  # attach_storage: an object store
        self._lock = threading.Lock()
        self._pending: DcpWriteHandle | None = None
        self._closed = False
        self._overlap: StagingOverlap | None = None  # dcp.overlap.attach sets it

    # ------------------------------------------------------------- features and facts

    @property
    def supports_async(self) -> bool:
        """``features.supports_async``, for code that reads the attribute."""
        return self.features.supports_async

    @property
    def export_needs_copy(self) -> bool:
        """``features.export_needs_copy``, for code that reads the attribute."""
        return self.features.export_needs_copy

    @property
    def reads_in_place(self) -> bool:
        """``features.reads_in_place``, for code that reads the attribute."""
        return self.features.reads_in_place

    @property
    def process_index(self) -> int:
        return self._rank

    @property
    def process_count(self) -> int:
        return self._world

    @property
    def async_checkpointer(self) -> str:
        """The DCP executor async saves use: "thread" or "process"."""
        return self._checkpointer

    def barrier(self, name: str, timeout_s: float) -> None:
        """Block until every process reached the barrier (gloo's monitored barrier names the
        ranks that did not arrive). Called from the training thread."""
        if self._world == 1:
            return
        dist.monitored_barrier(group=self._control_group,
                               timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast_int(self, value: int) -> int:
        """Process 0's ``value`` on every process (a collective: all call it, in order)."""
        if self._world == 1:
            return int(value)
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        dist.broadcast(tensor, src=0, group=self._control_group)
        return int(tensor.item())

    def attach_storage(self, storage: Storage) -> None:
        """Write and read URLs of ``storage`` (an object-store root) through it."""
        self._remote_files = StorageDcpFiles(storage)

    def _files_for(self, directory: str) -> LocalDcpFiles | StorageDcpFiles:
        """Where ``directory`` lives: the attached storage for a URL, else the local disk."""
        if "://" not in directory:
            return self._local_files
        if self._remote_files is None:
            raise ConfigError(f"{directory}: this DcpBackend has no storage for URLs; the "
                              "manager attaches one for an s3:// or gs:// root. Fix: use "
                              "DcpCheckpointManager(url, storage_options=...).")
        return self._remote_files

    # -------------------------------------------------------------------------- write

    def write(self, directory: str, state: Any, *, asynchronous: bool,
              base: IncrementalBase | None = None) -> DcpWriteHandle:
        """Write ``state`` into the new directory ``directory``.

        Returns once DCP has staged (copied) every tensor into host memory: from then on the
        caller may run optimizer steps, free or donate the tensors. With
        ``asynchronous=False`` the data is written and the directory in place on return.
        Raises TypeError/ConfigError/CodecError, before any I/O, naming the entry or tree
        path that cannot be checkpointed.
        ``base``: tensors equal to the base's records are not written (``dcp.incremental``).
        With a ``dcp.overlap.StagingOverlap`` attached an async write returns at once and
        stages on its worker: the caller fences before the tensors change.
        """
        self._check_open()
        if asynchronous and self._overlap is not None:
            return self._write_overlapped(directory, state, base)
        with self._lock:
            self._drain_locked()
            staging_dir, nbytes, writer, upload = self._start(directory, state, asynchronous,
                                                              base)
            handle = DcpWriteHandle(self, directory, staging_dir, nbytes, upload, writer)
            if asynchronous:
                self._pending = handle
            else:
                self._publish(handle)
            return handle

    def _write_overlapped(self, directory: str, state: Any,
                          base: IncrementalBase | None) -> DcpWriteHandle:
        """The whole staging on the overlap's worker; the handle's fields are set there."""
        assert self._overlap is not None
        taken = _values_now(state)  # what no fence covers is read before returning
        with self._lock:
            self._drain_locked()
            handle = DcpWriteHandle(self, directory, "", 0)

            def stage() -> Any:
                handle._staging_dir, handle.nbytes, handle._writer, upload = self._start(
                    directory, state, True, base, taken)
                return upload

            handle._future = self._overlap.submit(stage)
            handle._finished = False
            self._pending = handle
            return handle

    def _start(self, directory: str, state: Any, asynchronous: bool,
               base: IncrementalBase | None,
               taken: Mapping[str, _Entry] | None = None) -> tuple[str, int, Any, Any]:
        """State dicts, planning and staging of one write (no other write in flight); returns
        (staging directory, bytes, writer, DCP's upload future or None when written)."""
        entries = _entries(state, taken)
        flat = _flat_tensors(entries)
        document = _objects_document(entries)  # validates every non-tensor value first
        nbytes = sum(_local_nbytes(tensor) for tensor in flat.values()) + len(document)
        files = self._files_for(directory)
        staging_dir = files.staging_path(directory)
        dcp = _dcp()
        # DCP's checkpoint process writes with a copy of the writer: its checksums would
        # stay in that process, so it gets DCP's plain writer.
        in_process = (not asynchronous or files is self._remote_files
                      or self._checkpointer == "thread" or base is not None)
        writer = files.writer(staging_dir, sync_files=self._sync_files, in_process=in_process)
        if in_process and base is not None:  # hash every tensor, keep unchanged ones
            writer.incremental = Incremental(base, directory, files.read_content)
        if self._rank == 0:
            files.prepare(directory, staging_dir, document, writer)
        common = dict(storage_writer=writer, process_group=self._io_group,
                      no_dist=not self._distributed)
        if not asynchronous:
            dcp.save(flat, **common)
            return staging_dir, nbytes, writer, None
        response = dcp.async_save(flat, async_checkpointer_type=_checkpointer_type(
                                      self._checkpointer, in_process),
                                  async_stager=self._get_stager(), **common)
        # torch 2.13 returns a plain Future when staging is synchronous (our stager's
        # setting: the copy is done when async_save returns) and an AsyncSaveResponse
        # when staging runs in the background: then wait for it here, because the caller
        # may update parameters as soon as the staging is over.
        if hasattr(response, "staging_completion"):
            response.staging_completion.result()
            return staging_dir, nbytes, writer, response.upload_completion
        return staging_dir, nbytes, writer, response

    def _get_stager(self) -> Any:
        if self._stager is not None and self._reuse_staging_memory:
            return self._stager
        if self._stager is not None:
            self._stager.close()
        self._stager = _new_stager(self._cuda, self._checkpointer == "process")
        return self._stager

    def _publish(self, handle: DcpWriteHandle) -> None:
        """Primary: move the finished staging directory to its final name. DCP's save returns
        on every rank only after the coordinator wrote the metadata, which it does after
        every rank reported its data written: so the directory is complete here."""
        if self._rank != 0:
            return
        self._files_for(handle.directory).publish(handle._staging_dir, handle.directory)

    def _finish(self, handle: DcpWriteHandle) -> None:
        with self._lock:
            self._finish_locked(handle)

    def _finish_locked(self, handle: DcpWriteHandle) -> None:
        if handle._finished:
            return
        try:
            handle._future.result(timeout=self._write_timeout_s)
            self._publish(handle)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it
            handle._error = error
        finally:
            handle._finished = True
            if self._pending is handle:
                self._pending = None

    def _drain_locked(self) -> None:
        """Wait for the in-flight save, if any, recording its outcome on its handle."""
        if self._pending is not None:
            self._finish_locked(self._pending)

    def close(self) -> None:
        """Wait for an in-flight save (its error stays on its handle) and free the staging
        memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drain_locked()
            if self._overlap is not None:
                self._overlap.close()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DcpBackend is closed; create a new one.")

    # --------------------------------------------------------------------------- read

    def read(self, directory: str, like: Any, *, claims: DeferredChecks | None = None,
             partial: bool = False,
             references: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
        """Load ``directory`` into the live objects of ``like`` and return ``like``.

        Modules, optimizers, schedulers/Stateful objects and tensor entries are loaded in
        place (tensors keep their identity, device and sharding: DCP reshards DTensors and
        reads only what each process needs); plain-value entries are replaced by the saved
        values. Entries and tensors are matched by name and tree path; every mismatch
        (missing, extra, kind, shape, dtype) is collected first and raised as one
        ``TreeMismatchError`` before any tensor is read.

        ``partial``: ``like`` may leave out saved entries (``{"model": model}`` of a
        checkpoint of model, optimizer and scheduler) and saved tensors of an entry; DCP
        then reads only the tensors ``like`` holds. An entry or tensor of ``like`` that was
        never saved is still a mismatch, named in the error.

        ``claims`` (a single-process restore with checksums on): the reader claims the
        offered data files it loads from and checks each one before DCP copies anything
        into the live tensors; on an object store it fetches a claimed file once, whole,
        checks those bytes and loads from them (``dcp_files``). A mismatch loads nothing
        and raises ``CheckpointCorruptError`` (the manager reports the files, from the
        claims). Without claims the manager checked every file before calling this.
        """
        self._check_open()
        with self._lock:
            self._drain_locked()
        files = self._files_for(directory)
        saved = _parse_objects(directory, files.read_document(directory))
        if not isinstance(like, dict):
            raise TypeError(
                f"like must be the dict of live objects to load into (the same names as the "
                f"saved state), got {type(like).__module__}.{type(like).__qualname__}. Fix: "
                "recover({'model': model, 'optimizer': optimizer, ...}).")
        entries = _entries(like)
        problems = _compare(entries, saved, partial=partial)
        if problems:
            hint = ("" if partial or not all(": not in like " in line for line in problems)
                    else " To load only the entries like holds, pass partial=True.")
            raise TreeMismatchError(
                f"cannot restore {directory} into like: {len(problems)} path(s) do not "
                "match:\n" + "\n".join(f"  {line}" for line in problems) + "\nFix: build the "
                "model, optimizer and other entries with the same code and configuration as "
                "the run that saved the checkpoint, under the same names." + hint, problems)
        targets = {}
        for entry in entries:
            for path, tensor in entry.split.tensors.items():
                # detach(): DCP copies into the target in place; a Parameter's autograd
                # history is irrelevant to that and must not see the copy.
                targets[_storage_key(entry.name, path)] = (
                    tensor.detach() if isinstance(tensor, torch.Tensor) else tensor)
        if targets:
            reader = files.reader(directory, claims, partial, references)
            if not reader.damaged:  # else the claimed files did not match: load nothing
                safe_load(targets, directory, reader, self._io_group, not self._distributed)
            if reader.damaged:
                raise CheckpointCorruptError(
                    f"{directory}: {', '.join(reader.damaged)} do not match the checksums of "
                    "the commit manifest; nothing was loaded into the live objects. Restore "
                    "another checkpoint.")
        if claims is not None:
            claims.close()  # nothing was claimed (no tensors): the checks go on without us
        _apply_entries(like, entries, saved, partial=partial)
        return like

    @staticmethod
    def finish_read(value: Any) -> Any:
        """``value``: read() already loaded everything in place."""
        return value

    @staticmethod
    def left_out(saved: Any, scope: dict[str, Any]) -> str | None:
        """None: no check of torch objects left out of a save."""
        return None

    # ---------------------------------------------------------------------- the rest

    def host_copy(self, state: Any) -> dict[str, Any]:
        """A host (CPU) copy of the model-like entries of ``state``, for background exports:
        modules become their full (unsharded) state dicts without wrapper prefixes, tensors
        CPU copies; optimizers are left out (exports are model-only) and other objects
        become copies of their state dicts. Gathering sharded modules is a collective:
        every process calls this."""
        return _host_copy(state)

    def versions(self) -> dict[str, str]:
        """Versions of the libraries a checkpoint is written with."""
        found: dict[str, str] = {"torch": torch.__version__}
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["torchdata"] = importlib.metadata.version("torchdata")
        return found

    def rng_state(self) -> dict[str, Any]:
        """This process's torch generators: CPU, and every CUDA device in one entry."""
        return rng.capture_torch_rng()

    def set_rng_state(self, state: Any) -> None:
        """Restore :meth:`rng_state`'s result; a missing entry warns and keeps the current
        state (checkpoints written without CUDA restore on a CUDA machine)."""
        rng.restore_torch_rng(state, "the checkpoint")


def _host_copy(state: Any) -> dict[str, Any]:
    """``DcpBackend.host_copy``'s work (see there)."""
    api = _state_dict_api()
    options = api.StateDictOptions(full_state_dict=True, cpu_offload=True)
    out: dict[str, Any] = {}
    for name, value in state.items():
        kind = _kind_of(name, value)
        if kind == "module":
            out[name] = _copy_tensors(api.get_model_state_dict(value, options=options))
        elif kind == "optimizer":
            continue
        elif kind == "state_dict":
            out[name] = _copy_tensors(value.state_dict())
        else:
            out[name] = _copy_tensors(value)
    return out


def _new_stager(cuda: bool, shared: bool) -> Any:
    """DCP's stager, staging synchronously (the copy is finished when async_save returns).
    Non-blocking copies and pinned memory need CUDA (DefaultStager raises on CPU without
    this); shared memory only helps hand the copy to DCP's checkpoint process."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=shared,
                                        use_async_staging=False, use_non_blocking_copy=cuda))


def _checkpointer_type(choice: str, on_thread: bool) -> Any:
    """DCP's executor for ``choice`` ("thread"/"process"); a thread where ``on_thread``: an
    object store, whose writer holds the storage's client (DCP's checkpoint process would
    need it pickled), or an incremental save, whose references this process reads."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return getattr(AsyncCheckpointerType, "THREAD" if on_thread else choice.upper())


def safe_load(targets: dict[str, Any], directory: str, reader: Any, group: Any,
              no_dist: bool) -> None:
    """``dcp.load`` of ``targets`` from ``directory`` through ``reader`` with the restricted
    planner (byte items are never trusted: ``dcp.metadata``), re-raising the
    ``CheckpointCorruptError`` DCP wraps in its ``CheckpointException`` (e.g. a record
    pointing outside the checkpoint and its references) as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _dcp().load(targets, checkpoint_id=directory, storage_reader=reader,
                    planner=dcp_metadata.safe_planner(), process_group=group, no_dist=no_dist)
    except CheckpointException as error:
        for found, _ in error.failures.values():
            if isinstance(found, CheckpointCorruptError):
                raise found from error
        raise


def _copy_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):  # a DTensor: gather (collective)
            value = value.full_tensor()
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _copy_tensors(item) for key, item in value.items()}
    if type(value) is list:
        return [_copy_tensors(item) for item in value]
    if type(value) is tuple:
        return tuple(_copy_tensors(item) for item in value)
    return value


def _quiet_single_process_notice() -> None:
    """DCP warns on every save and load without a process group that it "assumes the intent
    is to save in a single process". Here that is the intent, so the notice is noise; the
    filter matches only that message (and is added once: filterwarnings de-duplicates)."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or "
                            r"uninitialized, assuming the intent is to (save|load) in a single "
                            r"process", category=UserWarning)


def _resolve_checkpointer(choice: str, cuda: bool, grouped: bool) -> str:
    if choice == "thread" or (choice == "auto" and not (cuda and grouped)):
        # On CPU-only machines the checkpoint process's seconds of start-up are not worth it
        # (and deciding this imports nothing: DCP loads at the first save). DCP's checkpoint
        # process joins the default process group: without one it cannot start.
        return "thread"
    if not grouped:
        raise ConfigError(
            "DcpBackend(async_checkpointer='process') needs torch.distributed's default "
            "process group (DCP's checkpoint process joins it), and none is initialised. Call "
            "torch.distributed.init_process_group first, or use 'thread' or 'auto'.")
    if not _has_process_checkpointer():
        if choice == "process":
            raise ConfigError(
                f"DcpBackend(async_checkpointer='process') needs a torch whose DCP has "
                f"AsyncCheckpointerType.PROCESS (>= 2.8); this is {torch.__version__}. Use "
                f"'thread' or 'auto'.")
        return "thread"
    # With CUDA the daemon process takes serialisation and writing off this process's GIL.
    return "process"


def _has_process_checkpointer() -> bool:
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return False
    return hasattr(AsyncCheckpointerType, "PROCESS")


def _parse_objects(directory: str, data: bytes) -> dict[str, Any]:
    """The entries of ``directory``'s objects.json (its bytes ``data``)."""
    file = f"{directory}/{_OBJECTS_FILE}"
    try:
        document = json.loads(data)
        if document.get("format") != OBJECTS_FORMAT:
            raise ValueError(f"format is {document.get('format')!r}, not {OBJECTS_FORMAT!r}")
        if document.get("version", 0) > OBJECTS_FORMAT_VERSION:
            raise ValueError(f"version {document['version']} is newer than this jaxckpt reads "
                             f"({OBJECTS_FORMAT_VERSION}); upgrade jaxckpt")
        entries = document["entries"]
        if not isinstance(entries, dict):
            raise ValueError("entries is not a dict")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointCorruptError(f"{file} is unreadable: {error}") from error
    return entries


def _saved_paths(record: Mapping[str, Any]) -> set[tuple[Any, ...]]:
    """The tree paths of the tensors of one saved entry (objects.json)."""
    return {tuple(codec.decode(item["path"], "path")) for item in record.get("tensors", [])}


def _prune(skeleton: Any, drop: set[tuple[Any, ...]], path: tuple[Any, ...] = ()) -> Any:
    """``skeleton`` without the dict keys at the tree paths in ``drop`` (tensors a partial
    restore leaves out); list and tuple slots stay, since removing one would shift the
    rest."""
    if not drop:
        return skeleton
    if isinstance(skeleton, dict):
        return {key: _prune(item, drop, path + (key,)) for key, item in skeleton.items()
                if path + (key,) not in drop}
    if isinstance(skeleton, list):
        return [_prune(item, drop, path + (index,)) for index, item in enumerate(skeleton)]
    if isinstance(skeleton, tuple):
        return tuple(_prune(item, drop, path + (index,)) for index, item in enumerate(skeleton))
    return skeleton


def _apply_entries(like: Any, entries: list[_Entry], saved: Mapping[str, Any], *,
                   partial: bool) -> None:
    """Put what was loaded into the tensors of ``entries`` (and the saved non-tensor
    values) into the live objects of ``like``: modules and optimizers through DCP's
    state-dict functions, other objects through ``load_state_dict``, values replaced."""
    api: Any = None  # torch's state-dict functions, imported only if needed
    if any(e.kind in ("module", "optimizer") for e in entries):
        api = _state_dict_api()
    for entry in entries:
        record = saved[entry.name]
        skeleton = codec.decode(record["skeleton"], f"state[{entry.name!r}]")
        if partial:  # saved tensors that like leaves out were not read: no place for them
            skeleton = _prune(skeleton, _saved_paths(record) - set(entry.split.tensors))
        value = _fill(skeleton, entry.split.tensors)
        if entry.kind == "module":
            api.set_model_state_dict(like[entry.name], value)
        elif entry.kind == "optimizer":
            optimizer = like[entry.name]
            api.set_optimizer_state_dict(like[entry.module], optimizer, value)
            if record.get("fresh"):
                _drop_created_state(optimizer)
        elif entry.kind == "state_dict":
            like[entry.name].load_state_dict(value)
        elif entry.kind == "value":
            like[entry.name] = value
        # "tensor": loaded in place by DCP


def _compare(entries: list[_Entry], saved: Mapping[str, Any], *,
             partial: bool = False) -> list[str]:
    """Every difference between the live entries and the checkpoint, one line per path.
    With ``partial``, saved entries and tensors that ``entries`` leave out are none."""
    problems = []
    names = set()
    for entry in entries:
        names.add(entry.name)
        record = saved.get(entry.name)
        if record is None:
            problems.append(f"state[{entry.name!r}]: missing from checkpoint (like has a "
                            f"{entry.kind})")
            continue
        if record.get("kind") != entry.kind:
            problems.append(f"state[{entry.name!r}]: like has a {entry.kind}, checkpoint has a "
                            f"{record.get('kind')}")
            continue
        saved_tensors = {}
        for item in record.get("tensors", []):
            path = tuple(codec.decode(item["path"], "path"))
            saved_tensors[path] = (list(item["shape"]), item["dtype"])
        for path, tensor in entry.split.tensors.items():
            where = _describe_path(entry.name, path)
            shape, dtype = _tensor_facts(tensor)
            found = saved_tensors.pop(path, None)
            if found is None:
                problems.append(f"{where}: missing from checkpoint (like has shape "
                                f"{tuple(shape)} {dtype})")
            elif found != (shape, dtype):
                problems.append(f"{where}: expected shape {tuple(shape)} {dtype}, checkpoint "
                                f"has shape {tuple(found[0])} {found[1]}")
        for path, (shape, dtype) in saved_tensors.items():
            if partial:
                break
            problems.append(f"{_describe_path(entry.name, path)}: not in like (checkpoint has "
                            f"shape {tuple(shape)} {dtype})")
    for name, record in saved.items():
        if not partial and name not in names:
            problems.append(f"state[{name!r}]: not in like (checkpoint has a "
                            f"{record.get('kind')})")
    return sorted(problems)
