"""Placing host arrays on devices: the last step of a restore, cheap per array.

Owns: :func:`place`, which turns host numpy arrays into ``jax.Array``s on given shardings,
the same arrays ``jax.device_put(arrays, shardings)`` returns.

Why not just ``jax.device_put``: over a list it still spends 50-150 us of Python per array
(abstract values, sharding checks, deferred handlers), which for a restore of 10,000 small
leaves was most of the restore (0.5-1.6 s for 128 MiB, where 8 leaves of the same bytes
take 0.1 s; docs/performance.md). For the common case, a host array of a canonical dtype
going to one device of this process (``SingleDeviceSharding``: every leaf of a
single-process run), this module makes the two calls ``jax.device_put`` ends in itself
(jaxlib's ``batched_device_put``, then the array's result handler), with their inputs
worked out once per (shape, dtype, sharding) rather than once per array: about a fifth of
the cost. Everything else (other shardings, dtypes jax would convert, device arrays, a jax
whose internals moved) goes through ``jax.device_put``. tests/integration/test_orbax_place.py
holds the two ways to the same results (values, dtype, sharding, abstract value, committed).

Must not import: orbax, torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["place"]

#: (host array, its sharding) -> the jax.Array, or None where the fast way does not apply.
_Put = Callable[[np.ndarray, jax.sharding.Sharding], Any]


@functools.cache
def _fast_put() -> _Put | None:
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
    # (shape, dtype, sharding) -> (abstract value of the host array, result handler,
    # [device]); a state has few distinct shapes, and each costs microseconds to derive.
    plans: dict[tuple[Any, ...], tuple[Any, Any, list[Any]]] = {}

    # The last (shape, dtype, sharding) asked for and its plan: consecutive leaves mostly
    # share them, and a sharding's hash is Python code (several calls) where ``is`` is not.
    last: list[Any] = [None, None, None, None]

    def put(array: np.ndarray, sharding: jax.sharding.Sharding) -> Any:
        if (type(array) is not np.ndarray
                or type(sharding) is not jax.sharding.SingleDeviceSharding):
            return None
        shape, dtype = array.shape, array.dtype
        if sharding is last[2] and dtype is last[1] and shape == last[0]:
            aval, handler, devices = last[3]
            return handler(device_put(aval, sharding, [array], devices, True))
        key = (shape, dtype, sharding)
        plan = plans.get(key)
        if plan is None:
            device: Any
            (device,) = sharding.device_set
            try:
                if (device.process_index != process or array.dtype == dtypes.float0
                        or canonical(array.dtype) != array.dtype):
                    return None  # not ours to place, or a dtype jax converts: jax decides
                aval = abstractify(array)
            except (TypeError, ValueError):
                return None  # a dtype jax refuses: jax.device_put says so
            plan = (aval, result_handler(update_aval(aval, sharding), sharding, True),
                    [device])
            if len(plans) < 4096:
                plans[key] = plan
        last[:] = shape, dtype, sharding, plan
        aval, handler, devices = plan
        return handler(device_put(aval, sharding, [array], devices, True))

    return put


def place(arrays: list[np.ndarray], shardings: list[jax.sharding.Sharding]) -> list[Any]:
    """``jax.device_put(arrays, shardings)``: the arrays on their shardings, committed.
    Host arrays going to a single device of this process take the direct way (see the
    module docstring); the rest go through ``jax.device_put`` in one batch."""
    put = _fast_put()
    placed: list[Any] = [None] * len(arrays)
    rest: list[int] = []
    for index, (array, sharding) in enumerate(zip(arrays, shardings, strict=True)):
        value = None if put is None else put(array, sharding)
        if value is None:
            rest.append(index)
        else:
            placed[index] = value
    if rest:
        values = jax.device_put([arrays[index] for index in rest],
                                [shardings[index] for index in rest])
        for index, value in zip(rest, values, strict=True):
            placed[index] = value
    return placed
