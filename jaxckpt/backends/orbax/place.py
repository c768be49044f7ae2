"""Placing host arrays on devices: the last step of a restore, cheap per array.

Owns: :func:`place`, which returns the arrays ``jax.device_put(arrays, shardings)`` would.
For a host array of a canonical dtype going to one device of this process it makes the two
calls ``jax.device_put`` ends in (``batched_device_put``, then the result handler) with
their inputs worked out once per (shape, dtype, sharding), since ``jax.device_put`` spends
Python per array; anything else goes through ``jax.device_put``.
tests/integration/test_orbax_place.py holds the two ways to the same results.

Must not import: orbax, torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["place", "default_sharding"]

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
    plans: dict[Any, dict[tuple[Any, ...], tuple[Any, Any, list[Any]] | None]] = {}

    def plan_for(array: np.ndarray, sharding: Any) -> tuple[Any, Any, list[Any]] | None:
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
        return aval, result_handler(update_aval(aval, sharding), sharding, True), [device]

    def put_many(arrays: list[np.ndarray], shardings: list[Any]) -> list[Any]:
        placed: list[Any] = []
        append = placed.append
        last: Any = None  # the sharding of the array before, and its plans
        known: dict[tuple[Any, ...], tuple[Any, Any, list[Any]] | None] = {}
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
            append(handler(device_put(aval, sharding, [array], devices, True)))
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
