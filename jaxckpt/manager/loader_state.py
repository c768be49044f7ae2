"""Torch data loaders as ``stateful`` objects: what their own state leaves out.

Owns: a ``StatefulDataLoader``'s ``generator``, saved beside its ``state_dict`` and set back
by ``after_load``, which makes the restored iterator at once (inside ``recover``, before
the global RNGs are restored) so that the loader resumes exactly; and refusing samplers
whose order such a loader cannot resume. Part of the pure layer: it recognises loaders by
their attributes. Why the loader's own state is not enough: docs/design.md, Driver files.

Must not import: jax, orbax, torch.

Concurrency: called on the training thread by ``manager.driver_state``; no state of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxckpt.errors import ConfigError

__all__ = ["GENERATOR_KEY", "is_loader", "generator_state", "check_resumable", "after_load"]

#: The key of the loader's generator state in a stateful object's saved record.
GENERATOR_KEY = "generator"

#: The module of torch's own samplers; those that shuffle draw a new order from their
#: generator's state at ``iter()``, which no loader state records.
_TORCH_SAMPLERS = "torch.utils.data.sampler"


def is_loader(obj: Any) -> bool:
    """True for a loader of the torch ``DataLoader`` family: it has a ``generator`` attribute
    (None or an RNG), a ``sampler`` and a ``state_dict``."""
    return (hasattr(obj, "generator") and hasattr(obj, "sampler")
            and callable(getattr(obj, "state_dict", None)))


def _rng(obj: Any) -> Any:
    generator = getattr(obj, "generator", None)
    if (callable(getattr(generator, "get_state", None))
            and callable(getattr(generator, "set_state", None))):
        return generator
    return None


def generator_state(obj: Any) -> Any:
    """The state of the loader's generator now (a tensor), or None when it has none. Taken
    after the loader's ``state_dict()``, which may itself draw from the generator."""
    generator = _rng(obj) if is_loader(obj) else None
    return None if generator is None else generator.get_state()


def check_resumable(name: str, obj: Any) -> None:
    """Refuse a loader whose sampling order cannot resume exactly, naming the fix."""
    if not is_loader(obj):
        return
    sampler = obj.sampler
    kind = type(sampler)
    if kind.__module__ == _TORCH_SAMPLERS and hasattr(sampler, "generator"):
        raise ConfigError(
            f"stateful[{name!r}]: the loader's sampler is torch.utils.data.{kind.__name__}, "
            f"whose order the loader's state_dict does not record (a resumed run replays the "
            f"epoch from the generator's current state and the data order differs from the "
            f"uninterrupted run). Use StatefulDataLoader(..., shuffle=True, generator=...) or "
            f"torchdata.stateful_dataloader.sampler.RandomSampler, which resume exactly.")
    generator = _rng(obj)
    if (getattr(sampler, "replacement", False) is True and generator is not None
            and getattr(sampler, "generator", None) is generator):
        raise ConfigError(
            f"stateful[{name!r}]: the loader's RandomSampler(replacement=True) draws from the "
            f"loader's own generator, which the loader also draws its base seed from in "
            f"between; a resumed run cannot replay that interleaving and the data order would "
            f"differ from the uninterrupted run. Give the sampler its own generator: "
            f"RandomSampler(dataset, replacement=True, generator=torch.Generator()"
            f".manual_seed(seed)).")


def _ordered_by_epoch(obj: Any) -> bool:
    """True when the loader's order depends on what the loop sets before ``iter()``: a
    sampler with ``set_epoch`` (``DistributedSampler``) orders the epoch the loop sets."""
    return any(callable(getattr(getattr(obj, name, None), "set_epoch", None))
               for name in ("sampler", "batch_sampler"))


def after_load(obj: Any, saved: Mapping[str, Any]) -> None:
    """After ``obj.load_state_dict``: put the loaded state into use now and set the
    generator back to its state at the save (docs/design.md: why). Not for a loader whose
    order the loop sets with ``set_epoch`` before ``iter()``: its restored iterator must be
    made by that ``iter()`` (such a sampler draws nothing from the loader's generator, and
    with a ``generator=`` the loader draws nothing from torch's global RNG either)."""
    if not is_loader(obj) or _ordered_by_epoch(obj):
        return
    obj.state_dict()  # makes the iterator from the loaded state; iter() returns it next
    generator = _rng(obj)
    if generator is not None and GENERATOR_KEY in saved:
        generator.set_state(saved[GENERATOR_KEY])
