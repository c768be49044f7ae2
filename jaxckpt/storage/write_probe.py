"""Does an object store honour conditional writes? The check a root's opening makes.

Owns: ``check_conditional_writes`` (from ``manager.root.prepare_root``, for an object-store
root, before the lease is taken), the probe's requests on S3 and GCS (a plain write of
``{root}/.tmp-write-probe.{token}``, then a create-only write and one conditional on
another version, both of which must be refused with 412, then a delete), the
``conditional_writes`` option (``"check"`` or ``"unsafe_skip_check"``, which warns) and
the message of ``ConditionalWritesError``. Why and which servers: docs/cloud.md.

Must not import: jax, orbax, torch, boto3, google (the stores' clients come through their
storages).

Concurrency: the primary, as it opens the root; each probe object is its own, so any
number of jobs may probe one root at once.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Protocol

from jaxckpt.core.layout import tmp_name
from jaxckpt.errors import CheckpointWarning, ConditionalWritesError, ConfigError
from jaxckpt.storage.url import root_scheme

if TYPE_CHECKING:
    from jaxckpt.storage.base import Storage
    from jaxckpt.storage.gcs.storage import GCSStorage
    from jaxckpt.storage.s3.storage import S3Storage

__all__ = ["CHECK", "OPTION", "UNSAFE_SKIP_CHECK", "check_conditional_writes",
           "conditional_writes_mode"]

log = logging.getLogger("jaxckpt")

#: The ``storage_options`` key, and its two values.
OPTION = "conditional_writes"
CHECK = "check"
UNSAFE_SKIP_CHECK = "unsafe_skip_check"
_MODES = (CHECK, UNSAFE_SKIP_CHECK)

_REFUSED = "refused"
_OVERWROTE = "answered 200 and overwrote the object"
_BODY = b"jaxckpt conditional-write probe\n"


def conditional_writes_mode(value: Any) -> str:
    """``storage_options["conditional_writes"]`` checked: "check" or "unsafe_skip_check"."""
    if value not in _MODES:
        raise ConfigError(
            f"storage_options[{OPTION!r}]={value!r}: must be {CHECK!r} (the default: the "
            f"object store is checked, at open, to refuse conditional writes that do not "
            f"hold) or {UNSAFE_SKIP_CHECK!r} (no check; one job per root, on your honour)")
    return str(value)


class _Probe(Protocol):
    """The requests of one probe on one object."""

    endpoint: str
    create_only: str
    """How the store spells a create-only write (for the message)."""
    wrong_version: str
    """How it spells a write conditional on another version (for the message)."""

    def put(self) -> str:
        """Write the object plainly; its version."""

    def create(self) -> str:
        """Write it create-only: ``_REFUSED``, ``_OVERWROTE``, or what else the server did."""

    def replace(self, version: str) -> str:
        """Write it conditional on a version other than ``version``: as ``create``."""

    def delete(self) -> None:
        """Delete it."""


def check_conditional_writes(storage: Storage, root: str) -> None:
    """Refuse (``ConditionalWritesError``) an object-store ``root`` whose server does not
    refuse a create-only write over an existing object and a write conditional on a version
    the object is not at, unless its storage was made with ``conditional_writes=
    "unsafe_skip_check"`` (then one ``CheckpointWarning``). Nothing for a local root. The
    probe's object is deleted whatever the outcome."""
    kind = root_scheme(root)
    if kind == "local":
        return
    probe: _Probe = _S3Probe(storage, root) if kind == "s3" else _GCSProbe(storage, root)
    if getattr(storage, "conditional_writes", CHECK) == UNSAFE_SKIP_CHECK:
        warnings.warn(
            f"jaxckpt: {root}: storage_options[{OPTION!r}]={UNSAFE_SKIP_CHECK!r}: the object "
            f"store at {probe.endpoint} was not checked for conditional writes. If it does "
            f"not honour them, the root lease does not keep a second job out and two writers "
            f"of one step both commit: run one job per root at a time, on your honour.",
            CheckpointWarning, stacklevel=2)
        return
    version = probe.put()
    try:
        created = probe.create()
        replaced = probe.replace(version)
    finally:
        try:
            probe.delete()
        except Exception as exc:  # noqa: BLE001 - a leftover probe object harms nothing
            log.warning("jaxckpt: could not delete the conditional-write probe under %s "
                        "(%s); it may be deleted by hand", root, exc)
    failed = []
    if created != _REFUSED:
        failed.append(f"a create-only write over an existing object ({probe.create_only}) "
                      f"{created}")
    if replaced != _REFUSED:
        failed.append(f"a write conditional on a version the object is not at "
                      f"({probe.wrong_version}) {replaced}")
    if failed:
        raise ConditionalWritesError(_refusal(root, probe.endpoint, failed))


def _refusal(root: str, endpoint: str, failed: list[str]) -> str:
    return (
        f"refusing checkpoint root {root!r}: the object store at {endpoint} does not honour "
        f"conditional writes: {'; '.join(failed)}, where it must refuse with 412 "
        f"(precondition failed). jaxckpt's commit marker and root lease rely on those "
        f"refusals: without them a second job takes a root another job holds, and two "
        f"writers of one step both commit, the last one's data winning. Nothing was written "
        f"(the probe object was deleted). Fix: use a server that honours conditional writes "
        f"(AWS S3, Google Cloud Storage, or a newer version of this one); or, if only one "
        f"job will ever use this root at a time, skip the check with "
        f"storage_options={{{OPTION!r}: {UNSAFE_SKIP_CHECK!r}}} (CLI: --storage-option "
        f"{OPTION}={UNSAFE_SKIP_CHECK}), on your honour.")


def _probe_path(root: str) -> str:
    return f"{root.rstrip('/')}/{tmp_name('write-probe', uuid.uuid4().hex)}"


class _S3Probe:
    """The probe on S3: ``If-None-Match: *`` and ``If-Match`` with an ETag no object has."""

    create_only = "If-None-Match: *"
    wrong_version = "If-Match with another ETag"

    def __init__(self, storage: Storage, root: str):
        self.storage: S3Storage = storage  # type: ignore[assignment]
        self.key = self.storage.key(_probe_path(root))
        self.endpoint = str(self.storage.client.meta.endpoint_url)

    def _put(self, **condition: str) -> Any:
        return self.storage.client.put_object(Bucket=self.storage.bucket, Key=self.key,
                                              Body=_BODY, **condition)

    def put(self) -> str:
        return str(self._put()["ETag"])

    def _conditional(self, **condition: str) -> str:
        from jaxckpt.storage.s3.storage import is_precondition_failed

        try:
            self._put(**condition)
        except Exception as exc:
            if is_precondition_failed(exc):
                return _REFUSED
            response = getattr(exc, "response", None) or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (400, 501):  # the header itself is not supported
                return f"answered {status} {response.get('Error', {}).get('Code', '')}"
            raise
        return _OVERWROTE

    def create(self) -> str:
        return self._conditional(IfNoneMatch="*")

    def replace(self, version: str) -> str:
        wrong = '"' + ("1" if version.strip('"')[:1] == "0" else "0") * 32 + '"'
        return self._conditional(IfMatch=wrong)

    def delete(self) -> None:
        self.storage.client.delete_object(Bucket=self.storage.bucket, Key=self.key)


class _GCSProbe:
    """The probe on GCS: ``ifGenerationMatch=0`` and another generation than the object's."""

    create_only = "ifGenerationMatch=0"
    wrong_version = "ifGenerationMatch with another generation"

    def __init__(self, storage: Storage, root: str):
        self.storage: GCSStorage = storage  # type: ignore[assignment]
        self.path = _probe_path(root)
        self.name = self.storage.name(self.path)
        self.endpoint = str(self.storage.client.api_endpoint)
        self._generation = 0

    def put(self) -> str:
        self._generation = int(self.storage.upload(self.name, _BODY).generation)
        return str(self._generation)

    def _conditional(self, generation: int) -> str:
        from google.api_core.exceptions import GoogleAPICallError, PreconditionFailed

        try:
            blob = self.storage.upload(self.name, _BODY, if_generation_match=generation)
        except PreconditionFailed:
            return _REFUSED
        except GoogleAPICallError as exc:
            if exc.code in (400, 501):
                return f"answered {exc.code} {exc.message}"
            raise
        self._generation = int(blob.generation)
        return _OVERWROTE

    def create(self) -> str:
        return self._conditional(0)

    def replace(self, version: str) -> str:
        # The newest generation seen plus one: never the object's (a create that went
        # through has replaced the first one).
        return self._conditional(max(int(version), self._generation) + 1)

    def delete(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.storage.delete(self.path)
