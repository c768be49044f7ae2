"""Where the Orbax backend's files live: a local path or an object store, and the limits there.

Owns: which ``files.ArrayFiles`` a directory gets (``files_for``: ``chunk_io`` on a local
disk, the attached storage for a URL, none where Orbax does the work), which native write a
save gets (``writer_for``), the directory as a path object (``path_for``), how ``tree.json``
is written there (``write_tree``), and the refusals of an object store (``check_arrays``,
``refuse_uneven``, ``refuse_foreign``): Orbax cannot write ``s3://`` (it finalizes by
renaming directories), so there every array goes through ``StorageArrayFiles`` in
``zarr_format``'s layout, and anything else is refused before a byte is written. Kept apart
from ``files``: this chooses among writers (``write``, ``shards``) that use ``files``.

Must not import: torch.

Concurrency contract: stateless functions; safe from any thread.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable

import jax
import numpy as np
from etils import epath

from jaxckpt.backends.orbax import zarr_format
from jaxckpt.backends.orbax.files import (
    ArrayFiles,
    LocalArrayFiles,
    SharedLocalArrayFiles,
    StorageArrayFiles,
    StoragePath,
)
from jaxckpt.backends.orbax.incremental import Reuse
from jaxckpt.backends.orbax.options import OrbaxOptions
from jaxckpt.backends.orbax.shards import native_writer
from jaxckpt.backends.orbax.tree import TREE_FILE
from jaxckpt.backends.orbax.write import write_durably
from jaxckpt.errors import CheckpointCorruptError, CheckpointRootError

__all__ = ["check_arrays", "files_for", "path_for", "refuse_foreign", "refuse_uneven",
           "write_tree", "writer_for"]


def path_for(remote: StorageArrayFiles | None, directory: str) -> Any:
    """``directory`` as an ``epath.Path``, or a URL of the attached storage as a
    ``StoragePath`` (epath would reach for s3fs, and Orbax's paths are not ours there)."""
    if remote is not None and "://" in directory:
        return StoragePath(remote.storage, directory)
    return epath.Path(directory)


def files_for(remote: StorageArrayFiles | None, directory: str,
              options: OrbaxOptions, *, writing: bool = False) -> ArrayFiles | None:
    """Where the native writer and reader put ``directory``'s files: the attached storage
    for a URL (always: Orbax cannot write there), chunk_io for a local path with
    ``native_io`` (written in place, ``SharedLocalArrayFiles``, by several processes),
    else None (Orbax does the work). With several processes each writes its own shards'
    files or objects (``_orbax_shards``) and reads the chunks under its own devices."""
    process_count = jax.process_count()
    if remote is not None and "://" in directory:
        return remote
    if not options.native_io or "://" in directory:
        return None
    if process_count == 1 or not writing:
        return LocalArrayFiles(direct=options.direct_io)
    return SharedLocalArrayFiles(direct=options.direct_io)


def writer_for(remote: StorageArrayFiles | None, directory: str, arrays: dict[str, Any],
               options: OrbaxOptions, *,
               pool: Callable[[], concurrent.futures.ThreadPoolExecutor],
               reuse: Reuse | None = None) -> Any:
    """The native write of ``arrays`` into ``directory`` (``_orbax_shards.native_writer``,
    through ``files_for``), or None where Orbax writes them; on an object store, where
    Orbax cannot, ``CheckpointRootError`` before any I/O for what the native I/O does not store.
    ``reuse``: an incremental write (``incremental.Reuse``); Orbax's own writes refer to
    nothing."""
    files = files_for(remote, directory, options, writing=True)
    on_storage = files is not None and files is remote
    if on_storage:
        check_arrays(directory, arrays)
    native = native_writer(files, arrays, primary=jax.process_index() == 0,
                           shared=jax.process_count() > 1, pool=pool,
                           collective_timeout_s=options.collective_timeout_s, reuse=reuse)
    if native is None and on_storage:
        refuse_uneven(directory)
    return native


def check_arrays(directory: str, arrays: dict[str, Any]) -> None:
    """``CheckpointRootError`` naming every stored array the native I/O cannot write (sub-byte or
    big-endian dtypes, zero-size arrays outside packs): on an object store there is no
    Orbax to hand them to. Arrays are numpy arrays, or jax.Arrays sharded over processes
    (their dtype and size decide alike)."""
    bad = [f"{name}: {getattr(array, 'dtype', type(array).__name__)} "
           f"{getattr(array, 'shape', '')}" for name, array in sorted(arrays.items())
           if not _storable(array)]
    if bad:
        raise CheckpointRootError(
            f"{directory}: these stored arrays cannot be written to object storage (only "
            f"dtypes {sorted(zarr_format.SUPPORTED_DTYPES)} with at least one element are): "
            f"{'; '.join(bad)}. Nothing was written. Fix: cast such leaves (e.g. int4 to "
            f"int8) or save to a filesystem root.")


def _storable(array: Any) -> bool:
    if isinstance(array, np.ndarray):
        return zarr_format.supported(array)
    if not isinstance(array, jax.Array):
        return False
    return zarr_format.supported(np.empty((1,) if array.size else (0,), array.dtype))


def refuse_uneven(directory: str) -> None:
    """A multi-process write to an object store whose shards do not tile their arrays on a
    regular grid: only Orbax would write those, and it cannot write there."""
    raise CheckpointRootError(
        f"{directory}: some array's shards do not tile it on a regular grid (uneven "
        f"sharding), which only Orbax writes, and Orbax cannot write object storage. "
        f"Nothing was written. Fix: shard such arrays evenly (each dimension a multiple "
        f"of its mesh axes), or save to a shared filesystem root.")


def refuse_foreign(directory: str) -> None:
    """A checkpoint on an object store whose arrays are not in ``zarr_format``'s layout (written by
    Orbax itself, or damaged): nothing here can read it."""
    raise CheckpointCorruptError(
        f"{directory}: its arrays are not stored in the single-chunk zarr3 layout jaxckpt "
        f"reads from object storage (written by another tool, or damaged). Copy it to a "
        f"local disk to read it with Orbax, or restore another checkpoint.")


def write_tree(remote: StorageArrayFiles | None, root: Any, directory: str, tree_json: str,
               *, alongside: bool) -> None:
    """Write ``tree.json`` into the state directory ``root``. On an object store, when the
    native write of arrays follows (``alongside``), it is sent on the small-object threads
    (``StorageArrayFiles.write_small``) and that write's ``finish`` waits for it: a round
    trip the first chunk upload no longer waits for. Elsewhere complete or absent after a
    crash, before returning (``write_durably``)."""
    if alongside and remote is not None and "://" in directory:
        remote.write_small(f"{os.fspath(root).rstrip('/')}/{TREE_FILE}", tree_json)
        return
    write_durably(root / TREE_FILE, tree_json)
