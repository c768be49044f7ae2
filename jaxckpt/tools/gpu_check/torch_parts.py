"""The PyTorch parts of ``make gpu-check``, each run in a child process by the runner.

Owns: (4) ``DcpCheckpointManager`` saving and restoring a CUDA model and its Adam state
bit-exact, every device's CUDA RNG state put back, the pinned staging memory of async saves
looked at, and an async save's blocking time against a ``.cpu()`` copy of the same bytes;
(5) two ranks (NCCL; gloo with ``--cpu``) with an FSDP2-sharded model saving and restoring
their shards bit-exact, and :func:`rank_worker`, one such rank.

Must not import at module level: jax, orbax, torch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .rows import Row, error_row, median, ratio_row
from .runner import PartContext, child_env

__all__ = ["dcp_roundtrip", "two_ranks", "rank_worker"]

_MiB = 1 << 20


def _model(width: int, layers: int, device: Any) -> tuple[Any, Any]:
    """A stack of ``layers`` Linear(width, width) on ``device`` and its Adam optimizer,
    after one step (so the optimizer has state)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train_step(model, optimizer, device)
    return model, optimizer


def _train_step(model: Any, optimizer: Any, device: Any) -> None:
    import torch

    width = model[0].in_features
    loss = model(torch.randn(4, width, device=device)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state dicts of ``state``'s entries, by path, as stored."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if hasattr(value, "detach"):
            out[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)

    for name, entry in state.items():
        walk(name, entry.state_dict())
    return out


def _snapshot(state: dict[str, Any]) -> dict[str, tuple[str, bytes]]:
    """{path: (device, raw bytes)} of every tensor (local shards of a DTensor)."""
    snap = {}
    for path, tensor in _tensors(state).items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        raw = local.detach().cpu().contiguous().reshape(-1).view(dtype=_uint8())
        snap[path] = (str(local.device), raw.numpy().tobytes())
    return snap


def _uint8() -> Any:
    import torch

    return torch.uint8


def _compare(expected: dict[str, tuple[str, bytes]], actual: dict[str, tuple[str, bytes]]
             ) -> list[str]:
    problems = [f"{path}: missing" for path in expected if path not in actual]
    for path in expected.keys() & actual.keys():
        if expected[path][0] != actual[path][0]:
            problems.append(f"{path}: on {actual[path][0]}, saved from {expected[path][0]}")
        elif expected[path][1] != actual[path][1]:
            problems.append(f"{path}: bytes differ")
    return sorted(problems)


def _advance_rngs(device_count: int) -> None:
    """Draw on the CPU generator and on every CUDA device's, so a restore that forgot one
    shows."""
    import torch

    torch.rand(3)
    for index in range(device_count):
        torch.rand(3, device=f"cuda:{index}")


def _rng_problems(saved: Any, cuda_saved: list[Any]) -> list[str]:
    import torch

    problems = [] if torch.equal(torch.get_rng_state(), saved) else ["CPU RNG state differs"]
    now = torch.cuda.get_rng_state_all() if cuda_saved else []
    problems += [f"CUDA RNG state of device {index} differs"
                 for index, (a, b) in enumerate(zip(cuda_saved, now, strict=True))
                 if not torch.equal(a, b)]
    return problems


def _pinned(manager: Any) -> tuple[int, int]:
    """(pinned bytes, staged bytes) of the host copy an async save staged into and keeps.
    The stager is the backend's own and so is DCP's cache in it: private attributes, read
    here only (a check, not a use), through getattr so a change shows as (0, 0)."""
    stager = getattr(manager.backend, "_stager", None)
    inner = getattr(stager, "_state_dict_stager", None)
    cache = getattr(inner, "_cached_storage_mapping", None)
    storages = list(getattr(cache, "values", list)())
    total = sum(storage.nbytes() for storage in storages)
    return sum(storage.nbytes() for storage in storages if storage.is_pinned()), total


def _roundtrip(context: PartContext, state: dict[str, Any], mode: str, saves: int,
               cuda_count: int, on_open: Callable[[Any], None] | None = None
               ) -> tuple[list[str], list[float]]:
    """``saves`` saves in ``mode``, a training step before each; then a step and fresh
    draws of every generator, and a recover in a fresh manager (as a restarted process):
    the problems (tensors and RNG states vs the last save) and each save's blocking time."""
    import torch

    import jaxckpt
    from torch_bridge import DcpCheckpointManager

    root = os.path.join(context.workdir, mode)
    recover = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=1)
    blocking = []
    device = next(state["model"].parameters()).device
    with DcpCheckpointManager(root, recover=recover, mode=mode) as manager:
        for step in range(1, saves + 1):
            _train_step(state["model"], state["optimizer"], device)
            if step == saves:  # what the restore must give back
                expected = _snapshot(state)
                cpu_rng = torch.get_rng_state()
                cuda_rng = list(torch.cuda.get_rng_state_all()) if cuda_count else []
            report = manager.save(jaxckpt.StepInfo(0, step, step, None), state)
            blocking.append(report.blocking_s)
        manager.wait()
        if on_open is not None:
            on_open(manager)
    _train_step(state["model"], state["optimizer"], device)
    _advance_rngs(cuda_count)
    with DcpCheckpointManager(root, recover=recover, mode=mode) as manager:
        recovered = manager.recover(state)
    if recovered is None or recovered.step_info.global_step != saves:
        return [f"recovered {recovered and recovered.step_info}, not step {saves}"], blocking
    problems = _compare(expected, _snapshot(state)) + _rng_problems(cpu_rng, cuda_rng)
    return problems, blocking


def _copy_seconds(state: dict[str, Any], cuda: bool) -> float:
    """Median of 3: a host copy of every tensor (``.cpu()`` on CUDA; a copy on CPU)."""
    import time

    import torch

    tensors = list(_tensors(state).values())
    seconds = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        copies = [tensor.to("cpu", copy=True) for tensor in tensors]
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del copies
    return median(seconds)


def _pinned_row(label: str, pinned: tuple[int, int], cuda: bool) -> Row:
    what = "async staging into pinned host memory (DcpBackend with CUDA)"
    if not cuda:
        return Row(part=label, what=what, status="skipped",
                   result="skipped: no CUDA here (pinned memory needs it)")
    done, total = pinned
    share = done / total if total else 0.0
    return Row(part=label, what=what, status="pass" if share >= 0.99 else "FAIL",
               result=f"{done / _MiB:.0f} of {total / _MiB:.0f} MiB staged are pinned"
               if total else "no staged copy found in the backend's stager",
               figure=f"{share:.2f}")


def dcp_roundtrip(context: PartContext) -> list[Row]:
    """Part 4: a model + Adam on the first GPU (the CPU with ``--cpu``): a sync save and
    restore, then 4 async saves (the first one warms up: staging memory, DCP's checkpoint
    process) and a restore, each bit-exact with the RNG of every device; blocking of the
    async saves 2-4 against a ``.cpu()`` copy of the same tensors."""
    import torch

    from torch_bridge import DcpBackend

    cuda = not context.cpu
    cuda_count = torch.cuda.device_count() if cuda else 0
    if cuda:
        torch.cuda.manual_seed_all(1)
    device = torch.device("cuda:0" if cuda else "cpu")
    width = 2048 if context.mib >= 256 else 256
    layers = max(2, context.mib * _MiB // 3 // (width * width * 4))
    model, optimizer = _model(width, layers, device)
    state = {"model": model, "optimizer": optimizer}
    nbytes = sum(t.nelement() * t.element_size() for t in _tensors(state).values())
    where = f"{nbytes / _MiB:.0f} MiB (model + Adam) on {device}"
    rng = f"RNG of CPU and {cuda_count} CUDA device(s)" if cuda else "CPU RNG"
    rows = []
    what = f"sync save + restore in place, bit-exact, {rng} restored"
    try:
        problems, _ = _roundtrip(context, state, "sync", 1, cuda_count)
        rows.append(Row(part=context.label, what=what, status="FAIL" if problems else "pass",
                        result="; ".join(problems[:4]) or f"{where}: identical"))
    except Exception as error:  # noqa: BLE001 - recorded; the async check still runs
        rows.append(error_row(context.label, what, error))
    pinned: list[tuple[int, int]] = []

    def look(manager: Any) -> None:
        pinned.append(_pinned(manager))

    probe = DcpBackend()  # what the managers below get by default
    choice = probe.async_checkpointer
    probe.close()
    what = (f"async saves (DcpBackend's choice of DCP checkpointer: {choice}) + restore, "
            f"bit-exact, {rng} restored")
    try:
        problems, blocking = _roundtrip(context, state, "async", 4, cuda_count, on_open=look)
    except Exception as error:  # noqa: BLE001 - recorded; the part ends here
        return [*rows, error_row(context.label, what, error)]
    rows.append(Row(part=context.label, what=what, status="FAIL" if problems else "pass",
                    result="; ".join(problems[:4]) or f"{where}: identical"))
    rows.append(_pinned_row(context.label, pinned[0], cuda))
    copy_s = _copy_seconds(state, cuda)
    steady = median(blocking[1:])
    rows.append(ratio_row(context.label, "async save blocking / .cpu() copy of the same "
                                         "tensors", steady / copy_s, at_most=1.5,
                          detail=f"median of saves 2-4 {steady * 1e3:.0f} ms (first "
                                 f"{blocking[0] * 1e3:.0f} ms), copy {copy_s * 1e3:.0f} ms"))
    return rows


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def two_ranks(context: PartContext) -> list[Row]:
    """Part 5: two ranks (one GPU each, NCCL; gloo on CPU with ``--cpu``), an FSDP2 model
    sharded over both, a sync and an async save each restored bit-exact per rank."""
    what = "2 ranks, FSDP2 model + Adam, DCP sync and async save, restore, bit-exact shards"
    if not context.cpu and context.gpus < 2:
        return [Row(part=context.label, what=what, status="skipped",
                    result=f"skipped: {context.gpus} GPU here, 2 ranks need 2")]
    port = _free_port()
    procs, results = [], []
    for rank in range(2):
        result = os.path.join(context.workdir, f"rank{rank}.json")
        spec = json.dumps({"rank": rank, "port": port, "cpu": context.cpu, "result": result,
                           "workdir": context.workdir, "label": context.label})
        log = open(os.path.join(context.workdir, f"rank{rank}.log"), "wb")  # noqa: SIM115
        procs.append((subprocess.Popen([sys.executable, "-m", "jaxckpt.tools.gpu_check",
                                        "--rank-worker", spec], stdout=log,
                                       stderr=subprocess.STDOUT, env=child_env(context.cpu)),
                      log))
        results.append(result)
    problems = []
    for rank, (proc, log) in enumerate(procs):
        code = proc.wait()
        log.close()
        try:
            with open(results[rank]) as handle:
                found = json.load(handle)
        except (OSError, ValueError):
            with open(log.name, errors="replace") as handle:
                tail = " / ".join(handle.read().splitlines()[-3:])[-300:]
            problems.append(f"rank {rank} exited {code} without a result: {tail}")
            continue
        problems += [f"rank {rank}: {problem}" for problem in found["problems"]]
        backend = found["backend"]
    return [Row(part=context.label, what=what, status="FAIL" if problems else "pass",
                result="; ".join(problems[:4]) or
                f"process group {backend}; every rank's shards and RNG identical")]


def rank_worker(spec_json: str) -> int:
    """One rank of part 5 (``--rank-worker SPEC``): writes {"problems", "backend"}."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    spec = json.loads(spec_json)
    rank, cpu = spec["rank"], spec["cpu"]
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{spec['port']}",
                            timeout=datetime.timedelta(seconds=60))
    try:
        device = torch.device("cpu" if cpu else f"cuda:{rank}")
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(device)
        mesh = init_device_mesh(device.type, (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        state = {"model": model, "optimizer": optimizer}
        context = PartContext(cpu=cpu, workdir=spec["workdir"], mib=1, label=spec["label"])
        cuda_count = 0 if cpu else torch.cuda.device_count()
        problems = []
        for mode in ("sync", "async"):
            found, _ = _roundtrip(context, state, mode, 2, cuda_count)
            problems += [f"{mode}: {problem}" for problem in found]
        backend = str(dist.get_backend())
    finally:
        dist.destroy_process_group()
    with open(spec["result"], "w") as handle:
        json.dump({"problems": problems, "backend": backend}, handle)
    return 0
