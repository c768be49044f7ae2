"""The exception hierarchy: one base, each class mixed with the built-in it resembles;
``MissingExtraError`` (an uninstalled extra: the environment, not a checkpoint) stands apart.

Owns: every exception jaxckpt raises on purpose. Must not import: jax, orbax, torch.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "TreeMismatchError",
    "RootLockedError",
    "CheckpointRootError",
    "ConditionalWritesError",
    "ObjectStoreError",
    "CheckpointWriteError",
    "CodecError",
    "CheckpointWarning",
    "MissingExtraError",
]


class CheckpointError(Exception):
    """Base of every error jaxckpt raises on purpose."""


class ConfigError(CheckpointError, ValueError):
    """A configuration field has a bad value; the message names the field and the fix."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (or no valid one) where one was asked for."""


class CheckpointCorruptError(CheckpointError, OSError):
    """A committed checkpoint fails verification (missing, truncated or altered files)."""


class CheckpointFormatError(CheckpointCorruptError):
    """Written in a newer format than this jaxckpt reads: not damaged, so recovery never
    skips it silently (that would drop the newest progress); upgrade jaxckpt to read it."""


class TreeMismatchError(CheckpointError, ValueError):
    """The ``like`` tree does not match the saved tree; lists every mismatching path."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class RootLockedError(CheckpointError, BlockingIOError):
    """Another running job holds the checkpoint root."""


class CheckpointRootError(CheckpointError, OSError):
    """The checkpoint root cannot be used: it holds files jaxckpt did not write (nothing is
    written into it then), is not a directory, or cannot be written."""


class ConditionalWritesError(CheckpointRootError):
    """An object-store root refused at open: its server does not refuse a create-only write
    over an existing object, or a write conditional on a version the object is not at (both
    answered 200 and overwrote). The commit marker and the root lease rely on those refusals;
    the message names the server, what it did, and the opt-in that skips the check."""


class ObjectStoreError(CheckpointError, OSError):
    """A request to an object store failed after its retries; the message names the server's
    endpoint, the request and the location it was about (chained to the client's error)."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed (possibly in the background); chained to the original error."""


class CodecError(CheckpointError, TypeError):
    """A value cannot be stored safely: in (or from) the JSON driver state, or as an array
    of a dtype the array backend cannot write; the message names the value's path."""


class MissingExtraError(ModuleNotFoundError):
    """A feature was used whose optional dependencies (an extra of the package) are not
    installed; the message names the feature, the missing module and the install command.

    A ``ModuleNotFoundError`` (so an ``ImportError``), as the bare error it replaces was; not
    a ``CheckpointError``: nothing is wrong with any checkpoint, the environment lacks a
    package (the command line exits with its usage/environment code, 2)."""

    def __init__(self, message: str, *, extra: str, name: str | None = None):
        super().__init__(message, name=name)
        self.extra = extra


class CheckpointWarning(UserWarning):
    """Something was skipped or defaulted on restore or save; training can go on."""
