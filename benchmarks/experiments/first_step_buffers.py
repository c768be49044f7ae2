"""``python benchmarks/experiments/first_step_buffers.py MODE FILE``: the first donated step
after a restore, by how the restored leaves' memory was made.

Owns: the first-step table of benchmarks/results/back-to-training_cpu2core_2026-11-28.md.
``FILE`` holds at least 1 GiB (e.g. ``head -c 1G /dev/urandom``); 64 float32 leaves of
16 MiB are read from it with ``pread`` into memory made by MODE: "numpy" (``np.empty`` per
leaf, then ``jax.device_put``), "callback" (the same through ``make_array_from_callback``),
"off<N>" (a view N bytes into a page-aligned, larger ``np.empty``), "xla" (``jnp.empty``,
written through its buffer pointer). Prints, for the read, the compile and two donated
steps: wall seconds, CPU seconds, minor page faults; and how many output buffers are the
inputs'. Run each MODE in its own process.

Must not import: torch, jaxckpt. A one-off experiment, outside the wheel.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LEAVES, LEAF_BYTES = 64, (1 << 30) // 64


def _clock() -> tuple[float, float, int]:
    return (time.perf_counter(), time.process_time(),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _since(start: tuple[float, float, int]) -> list[float]:
    now = _clock()
    return [round(now[0] - start[0], 3), round(now[1] - start[1], 3), now[2] - start[2]]


def _leaf(mode: str, fd: int, index: int, device: Any) -> jax.Array:
    shape = (LEAF_BYTES // 4,)
    if mode == "xla":
        array = jnp.empty(shape, jnp.float32, device=device).block_until_ready()
        memory = (ctypes.c_char * LEAF_BYTES).from_address(array.unsafe_buffer_pointer())
        os.preadv(fd, [memoryview(memory).cast("B")], index * LEAF_BYTES)
        return array
    if mode.startswith("off"):
        larger = np.empty(LEAF_BYTES // 4 + 2048, np.float32)
        start = ((-larger.ctypes.data) % 4096 + int(mode[3:])) // 4
        host = larger[start:start + LEAF_BYTES // 4]
    else:
        host = np.empty(shape, np.float32)
    os.preadv(fd, [memoryview(host).cast("B")], index * LEAF_BYTES)
    if mode == "callback":
        sharding = jax.sharding.SingleDeviceSharding(device)
        return jax.make_array_from_callback(shape, sharding, host.__getitem__)
    return jax.device_put(host, device, may_alias=True)


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    device = jax.devices()[0]
    out: dict[str, Any] = {"mode": mode}
    start = _clock()
    fd = os.open(path, os.O_RDONLY)
    try:
        leaves = [_leaf(mode, fd, index, device) for index in range(LEAVES)]
    finally:
        os.close(fd)
    jax.block_until_ready(leaves)
    out["read"] = _since(start)
    inputs = {leaf.unsafe_buffer_pointer() for leaf in leaves}
    step = jax.jit(lambda s: jax.tree.map(lambda w: w - 1e-3 * w, s), donate_argnums=0)
    start = _clock()
    compiled = step.lower(leaves).compile()
    out["compile"] = _since(start)
    for name in ("step1", "step2"):
        start = _clock()
        leaves = jax.block_until_ready(compiled(leaves))
        out[name] = _since(start)
        if name == "step1":
            out["reused"] = len(inputs & {leaf.unsafe_buffer_pointer() for leaf in leaves})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
