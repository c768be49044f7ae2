"""Per-epoch training loops that resume mid-epoch: ``batches``.

Owns: numbering the batches of an epoch loop with ``StepInfo`` (the step about to run),
starting where a recovered checkpoint stopped (the loader resumes itself, or the batches
the resumed epoch already trained are skipped, once), calling ``set_epoch`` before each
epoch, and stopping after ``epochs`` or ``total_steps``. Works with any manager: it reads
only the ``StepInfo`` of what ``recover`` returned. Part of the pure layer: it never sees
arrays.

Must not import: jax, orbax, torch, jaxckpt.manager.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .config import StepInfo
from .errors import ConfigError

__all__ = ["batches"]


def batches(loader: Any, *, epochs: int | None = None, total_steps: int | None = None,
            start: Any = None, steps_per_epoch: int | None = None,
            skip: bool | None = None) -> Iterator[tuple[StepInfo, Any]]:
    """``(step, batch)`` for every step still to run, epoch after epoch, resuming mid-epoch.

    ``step`` is the ``StepInfo`` of the step about to run on ``batch``: train on the batch,
    then call ``mgr.maybe_save(step, state)``. The last step of each epoch has
    ``step.is_epoch_end`` true, so ``Every(epochs=...)`` saves fire there (and per-epoch code,
    say an evaluation, goes under ``if step.is_epoch_end:``). Each epoch calls ``set_epoch``
    of the loader, its ``sampler`` and its ``batch_sampler`` (those that have it), then
    ``iter(loader)``, and takes ``steps_per_epoch`` batches from it; nothing is drawn past an
    epoch's last step, so a stateful loader's position stays that of the last step trained.

    Resuming (``start`` given): the first step is the one after the checkpoint's. Two kinds
    of loader, told apart by ``skip``:

    - the loader resumes mid-epoch itself (its position was restored by
      ``mgr.recover(..., stateful={"loader": loader})``: ``StatefulDataLoader``,
      ``IndexSampler``, any object with ``load_state_dict``): nothing is skipped. If its first
      epoch after a checkpoint taken at an epoch end is empty, it is iterated once more;
    - the loader restarts each epoch from its first batch (a plain ``DataLoader``, a list):
      the first ``step.epoch_step`` batches of the resumed epoch are drawn and dropped, in that
      epoch only. The resume is exact when the rerun gives that epoch the same order (no
      shuffle, or a sampler ordered by ``set_epoch`` such as ``DistributedSampler``).

    Args:
        loader: re-iterable: each ``iter(loader)`` yields the (rest of the) current epoch.
        epochs: (keyword) stop after this many epochs in all (counting those already trained).
        total_steps: (keyword) stop after this many steps in all. At least one of ``epochs``
            and ``total_steps`` is needed; with both, the first reached stops.
        start: (keyword) what ``mgr.recover`` returned (a ``Recovered``, or None: start at step
            0), or the ``StepInfo`` of the last completed step.
        steps_per_epoch: (keyword) batches per epoch; default ``len(loader)``, needed when the
            loader has no ``len``.
        skip: (keyword) True: skip the batches already trained in the resumed epoch; False:
            the loader resumes itself; None (default): False when the loader has
            ``load_state_dict``, True otherwise.
    """
    epochs = _optional_count("epochs", epochs, minimum=1)
    total_steps = _optional_count("total_steps", total_steps, minimum=0)
    if epochs is None and total_steps is None:
        raise ConfigError("batches(): give epochs=N or total_steps=N (or both): without them "
                          "the loop would never end.")
    per_epoch = _steps_per_epoch(loader, steps_per_epoch)
    first = _first_step(start, per_epoch)
    if skip is None:
        skip = not callable(getattr(loader, "load_state_dict", None))
    elif not isinstance(skip, bool):
        raise ConfigError(f"batches(): skip must be True, False or None, got {skip!r}.")
    return _walk(loader, first, epochs, total_steps,
                 skip_first=first.epoch_step if skip else 0,
                 resumed_itself=start is not None and not skip)


def _optional_count(name: str, value: Any, *, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"batches(): {name} must be an int >= {minimum} or None, got {value!r}.")
    return value


def _steps_per_epoch(loader: Any, given: int | None) -> int:
    if given is not None:
        checked = _optional_count("steps_per_epoch", given, minimum=1)
        assert checked is not None
        return checked
    try:
        length = len(loader)
    except TypeError:
        raise ConfigError(
            f"batches(): the loader ({type(loader).__name__}) has no len(), and batches() "
            f"needs the batches per epoch to number the steps, to mark epoch ends "
            f"(Every(epochs=...)) and to resume mid-epoch. Pass steps_per_epoch=N.") from None
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ConfigError(f"batches(): len(loader) is {length!r}, an epoch needs at least one "
                          f"batch. Pass steps_per_epoch=N, or a loader that yields batches.")
    return length


def _first_step(start: Any, per_epoch: int) -> StepInfo:
    """The StepInfo of the first step to run."""
    if start is None:
        return StepInfo(0, 0, 0, per_epoch)
    saved = start if isinstance(start, StepInfo) else getattr(start, "step_info", None)
    if not isinstance(saved, StepInfo):
        raise ConfigError(
            f"batches(): start must be what mgr.recover returned (a Recovered, or None) or the "
            f"StepInfo of the last completed step, got {type(start).__name__}.")
    if saved.steps_per_epoch is None:
        saved = saved.replace(steps_per_epoch=per_epoch)  # raises if epoch_step is too big
    elif saved.steps_per_epoch != per_epoch:
        raise ConfigError(
            f"batches(): the checkpoint was saved with steps_per_epoch="
            f"{saved.steps_per_epoch} but this loop has {per_epoch} batches per epoch, so "
            f"its epochs and positions do not match. Use the loader (batch size, dataset) of "
            f"the run being resumed, or pass steps_per_epoch={saved.steps_per_epoch}.")
    return saved.next()


def _set_epoch(loader: Any, epoch: int) -> None:
    seen: list[Any] = []
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch) and not any(obj is other for other in seen):
            seen.append(obj)
            set_epoch(epoch)


def _done(step: StepInfo, epochs: int | None, total_steps: int | None) -> bool:
    return ((epochs is not None and step.epoch >= epochs)
            or (total_steps is not None and step.global_step >= total_steps))


_END = object()


def _walk(loader: Any, step: StepInfo, epochs: int | None, total_steps: int | None, *,
          skip_first: int, resumed_itself: bool) -> Iterator[tuple[StepInfo, Any]]:
    while not _done(step, epochs, total_steps):
        epoch = step.epoch
        _set_epoch(loader, epoch)
        batch_iter = iter(loader)
        for dropped in range(skip_first):
            if next(batch_iter, _END) is _END:
                raise ConfigError(
                    f"batches(): resuming epoch {epoch} at batch {skip_first}, but the loader "
                    f"ended after {dropped} batches. Use the loader of the run being resumed.")
        skip_first = 0
        batch = next(batch_iter, _END)
        if batch is _END and resumed_itself and step.epoch_step == 0:
            # Restored at the end of the previous epoch: its iterator is spent, the next one
            # starts this epoch.
            _set_epoch(loader, epoch)
            batch_iter = iter(loader)
            batch = next(batch_iter, _END)
        resumed_itself = False
        while True:
            if batch is _END:
                raise ConfigError(
                    f"batches(): the loader ended epoch {epoch} after {step.epoch_step} "
                    f"batches, but steps_per_epoch is {step.steps_per_epoch}. Pass the true "
                    f"steps_per_epoch, or a loader whose iter() yields a whole epoch (a "
                    f"re-iterable object, not a one-shot iterator).")
            yield step, batch
            step = step.next()
            if step.epoch != epoch or _done(step, epochs, total_steps):
                break
            batch = next(batch_iter, _END)
