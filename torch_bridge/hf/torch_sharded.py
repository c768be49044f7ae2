"""Gathering an FSDP2 (DTensor) state dict onto rank 0, one full tensor at a time.

Owns: checking that every rank stages the same tensors (names, shapes, dtypes, placements,
aliases) before any gather, so a mismatch is an error on every rank rather than a hang;
``gather_to_primary``: each DTensor's ``full_tensor()`` in state order on every rank, kept
(on the CPU) by rank 0 only, tied entries gathered once and kept as one tensor; and
``finish_together``: rank 0 writes, then tells the other ranks how it went.

Must not import jax; torch is imported only when a sharded state is staged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt.errors import CheckpointWriteError, ConfigError

__all__ = ["is_dtensor", "has_dtensors", "gather_to_primary", "finish_together"]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, TP)."""
    return callable(getattr(tensor, "full_tensor", None))


def has_dtensors(state: Mapping[str, Any]) -> bool:
    """Whether any value of ``state`` is a DTensor."""
    return any(is_dtensor(t) for t in state.values())


def _alias_key(tensor: Any) -> Any:
    """Entries with the same key hold the same values: the same object (a module's own
    parameters, tied ones included), or the same non-empty local storage."""
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    if local.numel() == 0:
        return ("object", id(tensor))
    return ("storage", local.untyped_storage().data_ptr(), local.storage_offset(),
            tuple(local.shape), tuple(local.stride()))


def _layout_digest(state: Mapping[str, Any], first_alias: list[int]) -> int:
    """A 63-bit digest of what this rank would gather: names, shapes, dtypes, placements."""
    lines = []
    for (name, tensor), alias in zip(state.items(), first_alias, strict=True):
        placement = (repr(tuple(tensor.placements)), tuple(tensor.device_mesh.shape)) \
            if is_dtensor(tensor) else None
        lines.append(repr((name, tuple(tensor.shape), str(tensor.dtype), placement, alias)))
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _device_of(state: Mapping[str, Any]) -> Any:
    """The device the collectives of this export use: that of the first DTensor's mesh."""
    import torch

    mesh = next(t.device_mesh for t in state.values() if is_dtensor(t))
    return torch.device(mesh.device_type)


def _check_ranks_agree(state: Mapping[str, Any], first_alias: list[int], device: Any) -> None:
    """An all-gather of each rank's digest; every rank raises the same error on a mismatch."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([_layout_digest(state, first_alias)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    differ = [rank for rank, theirs in enumerate(every) if int(theirs) != int(every[0])]
    if differ:
        raise ConfigError(
            f"export of an FSDP2 (DTensor) model: rank(s) {differ} stage other tensors than "
            f"rank 0 (names, shapes, dtypes, placements or tied weights differ). Every rank "
            f"must export the same model, in the same order.")


def gather_to_primary(state: Mapping[str, Any], *, copy_plain: bool) -> tuple[dict[str, Any], bool,
                                                                             Any]:
    """Gather ``state`` (some values DTensors) for the export: returns ``(tensors, primary,
    device)``. Every rank must call this with the same model, in the same order (collectives
    on the default process group and on each DTensor's mesh).

    Rank 0 gets every tensor in full on the CPU (entries that alias one tensor, such as tied
    weights, get one tensor, so transformers' tie rules see them as before); the other ranks
    get an empty dict and ``primary`` False. At any moment each rank holds at most one
    gathered tensor beyond what it already had; rank 0 ends holding a CPU copy of the whole
    model (what the write needs). Plain tensors are copied on rank 0 when ``copy_plain``."""
    import torch
    import torch.distributed as dist

    device = _device_of(state)
    distributed = dist.is_available() and dist.is_initialized()
    primary = not distributed or dist.get_rank() == 0
    firsts: dict[Any, int] = {}
    first_alias = [firsts.setdefault(_alias_key(t), index)
                   for index, t in enumerate(state.values())]
    if distributed:
        _check_ranks_agree(state, first_alias, device)
    gathered: dict[int, Any] = {}
    out: dict[str, Any] = {}
    with torch.no_grad():
        for index, (name, tensor) in enumerate(state.items()):
            first = first_alias[index]
            if first != index:
                if primary:
                    out[name] = gathered[first]
                continue
            if is_dtensor(tensor):
                full = tensor.full_tensor()  # a collective: every rank, in this order
                # Replicated (or 1-rank) placements give back the parameter's own storage.
                shared = (full.untyped_storage().data_ptr()
                          == tensor.to_local().untyped_storage().data_ptr())
                kept = full.detach().to("cpu", copy=shared) if primary else None
                del full
            elif primary:
                kept = tensor.detach().to("cpu", copy=copy_plain)
            else:
                kept = None
            if primary:
                gathered[index] = out[name] = kept
    return out, primary, device


def finish_together(primary: bool, device: Any, write: Callable[[], int]) -> int:
    """Rank 0 runs ``write``; then every rank learns whether it succeeded (a broadcast from
    rank 0 in its ``finally``), so the other ranks return once the export is in place or
    raise when it failed, instead of waiting on a rank that stopped."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        return write()
    outcome = torch.zeros(1, dtype=torch.int64, device=device)
    written = 0
    try:
        if primary:
            written = write()
            outcome += 1
    finally:
        dist.broadcast(outcome, src=0)
    if not primary and int(outcome) != 1:
        raise CheckpointWriteError("rank 0 failed to write the Hugging Face export (see rank 0's "
                              "error); nothing was published.")
    return written
