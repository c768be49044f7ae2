"""Placing host arrays on devices: the last step of a restore, cheap per array.

Owns: :func:`place`, which returns the arrays ``jax.device_put(arrays, shardings)`` would.
For a host array of a canonical dtype going to one device of this process it makes the
calls ``jax.device_put`` ends in (``batched_device_put``, then the result handler where the
sharding changes the aval) with their inputs worked out once per (shape, dtype, sharding),
since ``jax.device_put`` spends Python per array; anything else goes through it.
tests/integration/test_orbax_place.py holds the two ways to the same results.
Also :func:`owned_on_cpu`: an array in memory XLA allocated on a CPU device, for a restore
to read into (a donated step can reuse it; jax's view of a host buffer it cannot).

Must not import: orbax, torch.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["place", "default_sharding", "owned_on_cpu"]

#: (host arrays, their shardings) -> the jax.Arrays, None where the fast way does not apply.
_PutMany = Callable[[list[np.ndarray], list[jax.sharding.Sharding]], list[Any]]


@functools.cache
def _fast_put() -> _PutMany | None:
    """The direct way onto one device, or None where this jax lacks the calls it needs
    (they are jax's internals: checked once, and the public way used without them)."""
    try:
        from jax._src import core, dispatch, dtypes
        from jax._src.interpreters import pxla
        from jax._src.lib import xla_client
    except ImportError:
        return None
    needed: tuple[Any, ...] = (getattr(core, "shaped_abstractify", None),
              getattr(dispatch, "update_dp_aval", None),
              getattr(pxla, "global_aval_to_result_handler", None),
              getattr(xla_client, "batched_device_put", None),
              getattr(dtypes, "canonicalize_dtype", None))
    if any(part is None for part in needed):
        return None
    abstractify, update_aval, result_handler, device_put, canonical = needed
    process = jax.process_index()
    # sharding -> {(shape, dtype) -> (abstract value of the host array, result handler,
    # [device]), or None where the fast way does not apply}: a state has few distinct
    # shapes, and each costs microseconds to derive. Keyed by the sharding first because a
    # sharding's hash and equality are Python code (several calls), asked only when the
    # sharding changes from one array to the next, where (shape, dtype)'s are not.
    plans: dict[Any, dict[tuple[Any, ...], tuple[Any, Any | None, list[Any]] | None]] = {}

    def plan_for(array: np.ndarray, sharding: Any) -> tuple[Any, Any | None, list[Any]] | None:
        if type(sharding) is not jax.sharding.SingleDeviceSharding:
            return None
        device: Any
        (device,) = sharding.device_set
        try:
            # Not ours to place, or a dtype jax converts (or refuses): jax decides.
            if (device.process_index != process or array.dtype == dtypes.float0
                    or canonical(array.dtype) != array.dtype):
                return None
            aval = abstractify(array)
        except (TypeError, ValueError):
            return None
        # The result handler only re-wraps what batched_device_put returns, for an aval
        # that the sharding changes (a memory kind, a mesh); where it changes nothing, the
        # array returned is already the one jax.device_put gives: no handler (a call less).
        placed_aval = update_aval(aval, sharding)
        handler = (None if placed_aval == aval else
                   result_handler(placed_aval, sharding, True))
        return aval, handler, [device]

    def put_many(arrays: list[np.ndarray], shardings: list[Any]) -> list[Any]:
        placed: list[Any] = []
        append = placed.append
        last: Any = None  # the sharding of the array before, and its plans
        known: dict[tuple[Any, ...], tuple[Any, Any | None, list[Any]] | None] = {}
        for array, sharding in zip(arrays, shardings, strict=True):
            if type(array) is not np.ndarray:
                append(None)
                continue
            if sharding is not last:
                found = plans.get(sharding)
                if found is None:
                    if len(plans) >= 64:
                        plans.clear()
                    found = plans[sharding] = {}
                last, known = sharding, found
            key = (array.shape, array.dtype)
            if key in known:  # ``in`` and item access: no call, for each array
                plan = known[key]
            elif len(known) < 4096:
                plan = known[key] = plan_for(array, sharding)
            else:
                plan = None  # too many shapes to remember: jax.device_put
            if plan is None:
                append(None)  # not for the fast way
                continue
            aval, handler, devices = plan
            value = device_put(aval, sharding, [array], devices, True)
            append(value if handler is None else handler(value))
        return placed

    return put_many


def place(arrays: list[np.ndarray], shardings: list[jax.sharding.Sharding]) -> list[Any]:
    """``jax.device_put(arrays, shardings)``: the arrays on their shardings, committed.
    Host arrays going to a single device of this process take the direct way (see the
    module docstring), in one loop; the rest go through ``jax.device_put`` in one batch."""
    put_many = _fast_put()
    placed = [None] * len(arrays) if put_many is None else put_many(arrays, shardings)
    rest = [index for index, value in enumerate(placed) if value is None]
    if rest:
        values = jax.device_put([arrays[index] for index in rest],
                                [shardings[index] for index in rest])
        for index, value in zip(rest, values, strict=True):
            placed[index] = value
    return placed


def default_sharding() -> jax.sharding.Sharding:
    """Where ``jax.device_put(x)`` puts ``x``: the default device (``jax_default_device``,
    else this process's first), asked of jax's own function for it; where that moved, by
    putting a scalar there (which can take milliseconds when the device is busy)."""
    try:
        from jax._src.interpreters.pxla import get_default_device
    except ImportError:
        return jax.device_put(np.zeros((), np.int8)).sharding
    return jax.sharding.SingleDeviceSharding(get_default_device())


# A private anonymous map that is only ever read: every page of it is the system's zero
# page (a huge one where transparent huge pages are asked for), so it holds no memory of
# its own. Grown, never shrunk; the source of ``owned_on_cpu``'s copies.
_zeros: tuple[mmap.mmap, np.ndarray] | None = None
_zeros_lock = threading.Lock()
_HUGE_PAGE = 2 << 20


def _zero_source(nbytes: int) -> np.ndarray:
    global _zeros
    with _zeros_lock:
        if _zeros is None or _zeros[1].size < nbytes:
            size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
            memory = mmap.mmap(-1, size + _HUGE_PAGE,
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                               prot=mmap.PROT_READ)
            raw = np.frombuffer(memory, np.uint8)
            start = (-raw.ctypes.data) % _HUGE_PAGE
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None:
                try:
                    memory.madvise(advice, start, size)
                except OSError:
                    pass
            _zeros = (memory, raw[start:start + size])
        return _zeros[1][:nbytes]


@functools.cache
def _owned_put() -> Callable[[np.ndarray, Any, Any], Any] | None:
    """``batched_device_put`` told to copy (the memory it returns is XLA's own), or None
    where this jax lacks the internals it needs."""
    try:
        from jax._src import core, dispatch
        from jax._src.interpreters import pxla
        from jax._src.lib import xla_client
    except ImportError:
        return None
    semantics = getattr(getattr(xla_client, "HostBufferSemantics", None),
                        "IMMUTABLE_ONLY_DURING_CALL", None)
    needed: tuple[Any, ...] = (getattr(core, "shaped_abstractify", None),
                               getattr(dispatch, "update_dp_aval", None),
                               getattr(pxla, "global_aval_to_result_handler", None),
                               getattr(xla_client, "batched_device_put", None))
    if semantics is None or any(part is None for part in needed):
        return None
    abstractify, update_aval, result_handler, device_put = needed

    def put(source: np.ndarray, sharding: Any, device: Any) -> Any:
        aval = abstractify(source)
        handler = result_handler(update_aval(aval, sharding), sharding, True)
        return handler(device_put(aval, sharding, [source], [device], True, True, semantics))

    return put


def owned_on_cpu(shape: tuple[int, ...], dtype: np.dtype,
                 sharding: jax.sharding.Sharding) -> tuple[jax.Array, np.ndarray] | None:
    """A committed ``jax.Array`` of ``shape`` and ``dtype`` on ``sharding`` in memory XLA
    allocated (zeros), and a writable uint8 view of that memory for a reader to fill
    before anyone else sees the array; None where ``sharding`` is not one CPU device of
    this process in its default memory, or the dtype is one jax converts.

    Why: jax adopts an aligned host buffer as it is (``place``), but XLA does not write a
    donated step's output into memory it did not allocate, so the first training step after
    such a restore allocates (and faults in) all of its outputs afresh. Here the pages are
    faulted in by the copy from a zero page, on the reader's thread, before the read.

    Args:
        shape: The array's shape.
        dtype: Its dtype (canonical for jax, or None is returned).
        sharding: Where it goes.
    """
    if type(sharding) is not jax.sharding.SingleDeviceSharding:
        return None
    device: Any
    (device,) = sharding.device_set
    put = _owned_put()
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if (put is None or nbytes == 0 or device.platform != "cpu"
            or device.process_index != jax.process_index()
            or jax.dtypes.canonicalize_dtype(dtype) != dtype):
        return None
    if sharding.memory_kind is not None and sharding.memory_kind != device.default_memory().kind:
        return None
    source = _zero_source(nbytes).view(dtype).reshape(shape)
    array = put(source, sharding, device).block_until_ready()
    address = array.unsafe_buffer_pointer()
    if address == source.ctypes.data:  # adopted after all: not memory XLA owns
        return None
    return array, np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))
