"""The command line on object storage (``s3://``, ``gs://``).

Owns: the object-store side of ``jaxckpt ls``, ``verify`` and ``info`` (they ask the
questions of ``jaxckpt.tools.cli`` through ``CheckpointStore`` over the ``Storage`` that
``jaxckpt.storage.url.parse_root`` makes, and print what the local commands print); the
``--storage-option KEY=VALUE`` flag every command that takes a path has, and the checks
and error mapping the other commands share for URLs (an unsupported scheme and a client
that cannot reach the store are usage/environment errors: exit 2). The endpoint and
credentials come from the standard environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``
... for S3; ``STORAGE_EMULATOR_HOST``, ``GOOGLE_APPLICATION_CREDENTIALS`` ... for GCS),
and ``--storage-option`` adds or overrides ``storage_options`` keys (lease settings,
retries, an endpoint).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["add_storage_option_argument", "check_paths", "client_errors", "is_url",
           "refuse_url", "remote_info", "remote_ls", "remote_verify", "storage_options"]

EXIT_OK, EXIT_BAD_CHECKPOINT, EXIT_USAGE, EXIT_NOT_JAXCKPT = 0, 1, 2, 3


def _storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): a JSON number or boolean becomes one, anything else
    stays the string (``endpoint_url=http://127.0.0.1:9000``, ``lease_s=60``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=VALUE, e.g. "
                                         f"endpoint_url=http://127.0.0.1:9000 or lease_s=60")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed if isinstance(parsed, (bool, int, float)) else value


def add_storage_option_argument(parser: argparse.ArgumentParser) -> None:
    """The repeated ``--storage-option KEY=VALUE`` flag (object-store paths only)."""
    parser.add_argument("--storage-option", dest="storage_option", action="append",
                        type=_storage_option, default=[], metavar="KEY=VALUE",
                        help="a storage_options entry for s3:// and gs:// paths (repeat it): "
                             "endpoint_url, region_name, lease_s, heartbeat_s, max_attempts, "
                             "...; endpoint and credentials otherwise come from the standard "
                             "environment (AWS_*, STORAGE_EMULATOR_HOST)")


def storage_options(opts: argparse.Namespace) -> dict[str, Any] | None:
    """The ``--storage-option`` entries as a ``storage_options`` dict (None: none given)."""
    return dict(getattr(opts, "storage_option", None) or ()) or None


def check_paths(command: str, opts: argparse.Namespace, *paths: str) -> int | None:
    """Exit 2, saying why, when one of ``paths`` is a URL of a scheme jaxckpt does not take
    or ``--storage-option`` was given with no URL among them; None when they are fine."""
    from jaxckpt.errors import CheckpointRootError
    from jaxckpt.storage.url import root_scheme

    try:
        kinds = [root_scheme(path) for path in paths]
    except CheckpointRootError as exc:
        print(f"jaxckpt {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if storage_options(opts) and all(kind == "local" for kind in kinds):
        given = (f"{', '.join(map(repr, paths))} {'is' if len(paths) == 1 else 'are'} local"
                 if paths else "this command names no object-storage path")
        print(f"jaxckpt {command}: --storage-option applies to s3:// and gs:// paths only; "
              f"{given}", file=sys.stderr)
        return EXIT_USAGE
    return None


@contextlib.contextmanager
def client_errors(command: str, codes: list[int]) -> Iterator[None]:
    """Turn an object-store client's failure (endpoint unreachable, no credentials, access
    refused) and bad ``storage_options`` into exit 2 with the environment to check, appended
    to ``codes``; anything else propagates."""
    try:
        yield
    except Exception as exc:
        if _is_client_error(exc):
            codes.append(_environment_error(command, exc))
        elif isinstance(exc, ValueError) and "storage_options" in str(exc):
            print(f"jaxckpt {command}: {exc}", file=sys.stderr)
            codes.append(EXIT_USAGE)
        else:
            raise


def is_url(path: str) -> bool:
    """Whether ``path`` is a ``scheme://`` URL rather than a local path."""
    from jaxckpt.storage.url import is_url as url

    return url(path)


def refuse_url(command: str, path: str, role: str | None = None) -> int:
    """Exit 2 for a URL where a command takes a local path only (``role``: the argument, e.g.
    "SRC", which must be a local directory), saying why."""
    from jaxckpt.errors import CheckpointRootError
    from jaxckpt.storage.url import root_scheme

    try:
        root_scheme(path)
        if role is not None:
            message = (f"{path!r}: {role} must be a local directory (it is read with local "
                       f"file I/O); copy it to one first (e.g. `aws s3 cp --recursive` or "
                       f"`gcloud storage cp -r`). The checkpoint root may be s3:// or gs://.")
        else:
            message = (f"{path!r}: `jaxckpt {command}` takes a local path here, not an "
                       f"object-storage URL.")
    except CheckpointRootError as exc:
        message = str(exc)
    print(f"jaxckpt {command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def _open(command: str, url: str, options: dict[str, Any] | None = None):
    """(store, [checkpoint paths]) for an object-store root or checkpoint URL, or an exit
    code after saying why not. ``options``: the ``storage_options``."""
    from jaxckpt.commit.store import CheckpointStore
    from jaxckpt.core.layout import RECOVER, parse_step_dirname
    from jaxckpt.errors import CheckpointRootError
    from jaxckpt.storage.url import parse_root

    url = url.rstrip("/")
    try:
        _, storage = parse_root(url, options)
    except (CheckpointRootError, ImportError, ValueError) as exc:
        print(f"jaxckpt {command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # no credentials found (google.auth), before any request
        if _is_client_error(exc):
            return _environment_error(command, exc)
        raise
    assert not isinstance(storage, str)  # a URL (is_url sent it here), so never a local path
    parent, _, name = url.rpartition("/")
    if name == RECOVER:
        url, parent, name = parent, *parent.rpartition("/")[::2]
    if parse_step_dirname(name) is not None and storage.is_prefix(url):
        store = CheckpointStore(parent.rpartition("/")[0], storage=storage)
        return store, [url]
    store = CheckpointStore(url, storage=storage)
    if not storage.is_prefix(store.recover_dir):
        print(f"jaxckpt {command}: {url} is not a jaxckpt checkpoint root (nothing under "
              f"{store.recover_dir})", file=sys.stderr)
        return EXIT_NOT_JAXCKPT
    return store, None


# The modules whose errors mean "the store could not be reached or refused us" (endpoint,
# credentials, permissions) rather than a bug: botocore for s3://, the google and requests
# stacks for gs://; and a ``TimeoutError``, a server that stopped answering (the storages'
# request deadline).
_CLIENT_ERROR_MODULES = ("botocore", "google.", "requests", "urllib3")


def _is_client_error(exc: Exception) -> bool:
    """The client's own errors, jaxckpt's ``ObjectStoreError`` (a request the server failed
    after its retries, named with the server and the request) and a request's deadline
    passing with no answer (``TimeoutError``)."""
    from jaxckpt.errors import ObjectStoreError

    return isinstance(exc, (ObjectStoreError, TimeoutError)) or \
        type(exc).__module__.startswith(_CLIENT_ERROR_MODULES)


def _environment_error(command: str, exc: Exception) -> int:
    print(f"jaxckpt {command}: object storage request failed: {exc} (check the endpoint "
          f"and the credentials: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID for s3://; "
          f"STORAGE_EMULATOR_HOST or GOOGLE_APPLICATION_CREDENTIALS for gs://)",
          file=sys.stderr)
    return EXIT_USAGE


def remote_ls(opts: argparse.Namespace) -> int:
    from .cli import _bad_if, _human_bytes, _print_table, _referenced_column

    try:
        opened = _open("ls", opts.root, storage_options(opts))
        if isinstance(opened, int):
            return opened
        store, paths = opened
        entries = ([store.entry(path, checksums=opts.checksums) for path in paths] if paths
                   else store.entries(checksums=opts.checksums))
        sizes = [entry.manifest.total_bytes if entry.manifest is not None
                 else store.size_of(entry.path) for entry in entries]
    except Exception as exc:  # the client's errors: unreachable endpoint, no credentials
        if _is_client_error(exc):
            return _environment_error("ls", exc)
        raise
    if not entries:
        print(f"no checkpoints under {store.recover_dir}")
        return EXIT_OK
    referenced = _referenced_column(entries)
    rows = [[str(entry.step), entry.status, _human_bytes(size), *referenced.get(entry.step, []),
             "-", entry.path.rsplit("/", 1)[-1]]
            for entry, size in zip(entries, sizes, strict=True)]
    _print_table(rows, ["STEP", "STATUS", "SIZE", *(["REFERENCED"] if referenced else []),
                        "AGE", "DIRECTORY"], print)
    for entry in entries:
        for problem in entry.problems:
            print(f"  step {entry.step}: {problem}")
    return _bad_if(entries)


def remote_verify(opts: argparse.Namespace) -> int:
    try:
        opened = _open("verify", opts.path, storage_options(opts))
        if isinstance(opened, int):
            return opened
        store, paths = opened
        entries = ([store.entry(path, checksums=not opts.sizes_only) for path in paths]
                   if paths else store.entries(checksums=not opts.sizes_only))
    except Exception as exc:
        if _is_client_error(exc):
            return _environment_error("verify", exc)
        raise
    if not entries:
        print(f"no checkpoints under {store.recover_dir} (nothing to verify)")
        return EXIT_OK
    for entry in entries:
        label = {"committed": "OK     ", "partial": "PARTIAL", "corrupt": "CORRUPT"}
        print(f"{label[entry.status]} {entry.path}")
        if entry.status == "partial":
            print("  no COMMITTED marker: this checkpoint never finished committing (the job "
                  "stopped while saving, or is saving now); it is not restorable")
        for problem in entry.problems:
            print(f"  {problem}")
    return EXIT_BAD_CHECKPOINT if any(e.status != "committed" for e in entries) else EXIT_OK


def remote_info(opts: argparse.Namespace) -> int:
    from .cli import _info_checkpoint, _info_root

    try:
        opened = _open("info", opts.path, storage_options(opts))
        if isinstance(opened, int):
            return opened
        store, paths = opened
        if paths:
            return _info_checkpoint(paths[0], opts, store=store)
        return _info_root(store.root, opts, store=store)
    except Exception as exc:
        if _is_client_error(exc):
            return _environment_error("info", exc)
        raise
