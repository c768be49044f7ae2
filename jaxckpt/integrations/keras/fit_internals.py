"""The few Keras internals the ``BackupAndRestore`` callback relies on, kept in one place.

Owns: importing Keras on the JAX backend (a clear error otherwise), the variables the JAX
trainer carries through ``fit`` (its four lists), the starting epoch of ``fit``
(``model._initial_epoch``, as Keras's own BackupAndRestore sets it), skipping the batches a
resumed epoch already trained (``model.train_function`` wrapped: a skipped call consumes its
batch from the epoch's iterator and leaves the state alone), noticing a ``fit`` that raised
(``model.jax_state_sync`` wrapped), and Keras's global SeedGenerator. ``check_model``
fails with a clear error when the pinned Keras (3.15) and the installed one disagree on any
of these.

Must not import: torch, torch_bridge.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from jaxckpt.core.extras import requires_extra
from jaxckpt.errors import ConfigError

__all__ = ["FIT_STATE", "check_model", "fit_variables", "get_global_seed", "import_keras",
           "set_global_seed", "set_initial_epoch", "skip_batches", "stop_skipping",
           "watch_fit_error", "unwatch_fit_error"]

# The groups of variables the JAX trainer threads through each step of fit, in its order.
FIT_STATE = ("trainable", "non_trainable", "optimizer", "metrics")
# Attributes of a compiled Keras model that fit resumption depends on (Keras 3.15, JAX).
_MODEL_ATTRIBUTES = ("_initial_epoch", "train_function", "jax_state_sync", "steps_per_execution",
                     "metrics_variables", "optimizer")


def import_keras() -> Any:
    """Import Keras and check that it runs on the JAX backend."""
    backend = os.environ.get("KERAS_BACKEND")
    if backend is not None and backend != "jax" and "keras" not in sys.modules:
        raise ConfigError(_backend_message(backend))  # Keras would pick it: fail before
    try:
        with requires_extra("keras", "jaxckpt.integrations.keras"):
            import keras
    except ModuleNotFoundError as error:
        if backend == "jax" or getattr(error, "extra", None) == "keras":
            raise
        raise ConfigError(_backend_message(backend or "(unset)")) from error
    if keras.backend.backend() != "jax":
        raise ConfigError(_backend_message(keras.backend.backend()))
    return keras


def _backend_message(found: str) -> str:
    return (f"jaxckpt.integrations.keras needs Keras on the JAX backend, but Keras's backend "
            f"is {found!r} (KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set the "
            f"environment variable before Keras is first imported: KERAS_BACKEND=jax "
            f"(os.environ['KERAS_BACKEND'] = 'jax' at the top of the program, or in the shell).")


def check_model(model: Any) -> None:
    """Raise ConfigError unless ``model`` has what resuming ``fit`` needs."""
    missing = [name for name in _MODEL_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        import keras
        raise ConfigError(
            f"BackupAndRestore: the model ({type(model).__name__}) lacks {missing}, which "
            f"exact resume relies on; it was written for Keras 3.15 on the JAX backend and "
            f"Keras {keras.__version__} is installed. Install keras>=3.8,<4 as the "
            f"'jaxckpt[keras]' extra pins, or report the version.")
    if model.steps_per_execution != 1:
        raise ConfigError(
            f"BackupAndRestore needs compile(steps_per_execution=1), got "
            f"{model.steps_per_execution}: a checkpoint records the step after each batch.")
    if model.optimizer is None:
        raise ConfigError("BackupAndRestore: compile the model with an optimizer before fit.")


def fit_variables(model: Any) -> dict[str, list[Any]]:
    """The Keras Variables fit trains, by group (``FIT_STATE``). Reads ``model`` after
    ``jax_state_sync`` so that the values are those of the last completed step."""
    model.jax_state_sync()
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return {
        "trainable": list(model.trainable_variables),
        "non_trainable": list(model.non_trainable_variables),
        "optimizer": list(model.optimizer.variables),
        "metrics": list(model.metrics_variables),
    }


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """The epoch ``fit`` starts at (it reads ``model._initial_epoch`` after on_train_begin)."""
    model._initial_epoch = epoch


def skip_batches(model: Any, count: int) -> None:
    """Make the next ``count`` calls of ``model.train_function`` consume their batch without
    training on it; then the original function is put back."""
    original: Callable[..., Any] = model.train_function
    remaining = [count]

    def skipping(state: Any, iterator: Any) -> Any:
        if remaining[0] == 0:
            model.train_function = original
            return original(state, iterator)
        remaining[0] -= 1
        next(iterator)  # the batch is drawn (the shuffle and the data stay in step), not used
        if remaining[0] == 0:
            model.train_function = original
        return {}, state

    skipping.jaxckpt_original = original  # type: ignore[attr-defined]
    model.train_function = skipping


def stop_skipping(model: Any) -> None:
    """Put back the original train function if ``skip_batches`` left its wrapper."""
    original = getattr(model.train_function, "jaxckpt_original", None)
    if original is not None:
        model.train_function = original


def watch_fit_error(model: Any, on_error: Callable[[BaseException], None]) -> None:
    """Call ``on_error(error)`` once when the running ``fit`` ends with an error: Keras then
    calls no callback (``on_train_end`` runs only when training finished), but fit's
    ``finally`` always calls ``model.jax_state_sync()``. That method is wrapped on the
    instance; an error propagating through it that is not the one already being handled when
    fit began (fit called inside an ``except``) is fit's own."""
    unwatch_fit_error(model)
    handled_before = sys.exc_info()[1]
    original: Callable[..., Any] = model.jax_state_sync

    def syncing(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        error = sys.exc_info()[1]
        if error is not None and error is not handled_before:
            unwatch_fit_error(model)
            on_error(error)
        return result

    syncing.jaxckpt_original = original  # type: ignore[attr-defined]
    model.jax_state_sync = syncing


def unwatch_fit_error(model: Any) -> None:
    """Remove ``watch_fit_error``'s wrapper (the class's method is used again)."""
    if hasattr(vars(model).get("jax_state_sync"), "jaxckpt_original"):
        del vars(model)["jax_state_sync"]


def _global_seed_generator() -> Any:
    from keras.src.backend.common import global_state
    return global_state.get_global_attribute("global_seed_generator")


def get_global_seed() -> list[int] | None:
    """The state of Keras's global SeedGenerator (``keras.random`` ops without a seed), or
    None when it was never created."""
    generator = _global_seed_generator()
    if generator is None:
        return None
    import numpy as np
    return [int(value) for value in np.asarray(generator.state.value).ravel()]


def set_global_seed(values: list[int] | None) -> None:
    """Restore the global SeedGenerator's state (created first when it does not exist)."""
    if values is None:
        return
    import numpy as np
    from keras.src.random.seed_generator import global_seed_generator
    generator = global_seed_generator()
    state = generator.state
    state.assign(np.asarray(values, dtype=state.dtype).reshape(state.shape))
