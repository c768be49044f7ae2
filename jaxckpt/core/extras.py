"""Optional dependencies: which extra of the package brings which module, and the error a
feature raises when its extra is not installed.

Owns: the table of extras (``EXTRA_MODULES``) and the two ways a feature states what it
needs: ``requires_extra`` around the imports of a module that needs an extra (it turns "No
module named 'torch'" into a ``MissingExtraError`` naming the extra), and ``check_extra``
for a feature that starts its work elsewhere (the demo's workers) and must fail before it
starts. Part of the pure layer: it exists to run before the frameworks
are imported, and finds modules without importing them.

Must not import: jax, orbax, flax, optax, torch, safetensors, transformers, torch_bridge.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

from ..errors import MissingExtraError

__all__ = ["EXTRA_MODULES", "MissingExtraError", "check_extra", "requires_extra"]

# extra -> the top-level modules its distributions provide that jaxckpt imports. A missing
# module outside this table (a base dependency) is re-raised unchanged: no extra fixes it.
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "jax": frozenset({"jax", "jaxlib", "orbax", "flax", "optax", "etils", "tensorstore"}),
    "torch": frozenset({"torch", "torchdata"}),
    "hf": frozenset({"safetensors", "transformers", "tokenizers"}),
    # transformers' Trainer (torch_bridge.integrations.transformers) runs on accelerate.
    "transformers": frozenset({"transformers", "accelerate"}),
    "grain": frozenset({"grain"}),
    # google-cloud-storage lives in the "google" namespace package (google.cloud.storage).
    "gcs": frozenset({"google"}),
    # jaxckpt.compat reads AReaL and torchtune configs as their tools do, with OmegaConf.
    "compat": frozenset({"omegaconf"}),
    # jaxckpt.integrations.keras: the model.fit callback (Keras 3 on the JAX backend).
    "keras": frozenset({"keras"}),
    # torch_bridge.integrations.lightning: the CheckpointIO plugin.
    "lightning": frozenset({"lightning", "lightning_utilities"}),
}


def _message(feature: str, extra: str, module: str) -> str:
    install = f"pip install 'jaxckpt[{extra}]'"
    if extra == "torch":  # the Makefile's order: the CPU build of torch first, then the extra
        install = f"pip install torch, then {install}"
    return (f"{feature} needs the optional dependencies of the '{extra}' extra, and "
            f"module {module!r} is not installed. Install them with: {install}")


@contextlib.contextmanager
def requires_extra(extra: str, feature: str) -> Iterator[None]:
    """Turn a missing module of ``extra`` imported inside the block into a
    :class:`MissingExtraError` that names ``feature`` and the install command."""
    modules = EXTRA_MODULES[extra]
    try:
        yield
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if isinstance(error, MissingExtraError) or missing not in modules:
            raise
        raise MissingExtraError(_message(feature, extra, missing), extra=extra,
                                name=error.name) from error


def check_extra(extra: str, feature: str, modules: tuple[str, ...]) -> None:
    """Raise :class:`MissingExtraError` unless every one of ``modules`` (top-level names of
    ``extra``) can be found; finds them without importing them."""
    for module in modules:
        if module not in EXTRA_MODULES[extra]:
            raise ValueError(f"module {module!r} does not come with the {extra!r} extra")
        try:
            found = importlib.util.find_spec(module) is not None
        except (ModuleNotFoundError, ValueError):  # an import hook refused it, a broken entry
            found = False
        if not found:
            raise MissingExtraError(_message(feature, extra, module), extra=extra, name=module)
