"""``jaxckpt ls``, ``verify`` and ``info`` for roots on object storage (``s3://``, ``gs://``).

Owns: the object-store side of those three commands, and the refusal (exit 2) that every other
command gives an object-store path. They ask the questions of ``jaxckpt.tools.cli`` through
``CheckpointStore`` over the ``Storage`` that ``jaxckpt.root_url.parse_root`` makes, and
print what the local commands print. The endpoint and credentials come from the standard
environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ... for S3; ``STORAGE_EMULATOR_HOST``,
``GOOGLE_APPLICATION_CREDENTIALS`` ... for GCS): the CLI takes no ``storage_options``.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["is_url", "refuse_url", "remote_info", "remote_ls", "remote_verify"]

EXIT_OK, EXIT_BAD_CHECKPOINT, EXIT_USAGE, EXIT_NOT_JAXCKPT = 0, 1, 2, 3


def is_url(path: str) -> bool:
    """Whether ``path`` is a ``scheme://`` URL rather than a local path."""
    from jaxckpt.root_url import is_url as url

    return url(path)


def refuse_url(command: str, path: str) -> int:
    """Exit 2 for a command that cannot use an object-store path yet, saying why."""
    from jaxckpt.errors import CheckpointRootError
    from jaxckpt.root_url import root_scheme

    try:
        root_scheme(path)
        message = (f"{path!r}: `jaxckpt {command}` does not take object-storage paths yet "
                   f"(`ls`, `verify` and `info` do, and jaxckpt.CheckpointManager writes "
                   f"s3:// roots). Copy the checkpoint to a local directory first (e.g. `aws "
                   f"s3 cp --recursive {path} DIR`: the layout is the same).")
    except CheckpointRootError as exc:
        message = str(exc)
    print(f"jaxckpt {command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def _open(command: str, url: str):
    """(store, [checkpoint paths]) for an object-store root or checkpoint URL, or an exit
    code after saying why not."""
    from jaxckpt.errors import CheckpointRootError
    from jaxckpt.layout import RECOVER, parse_step_dirname
    from jaxckpt.root_url import parse_root
    from jaxckpt.store import CheckpointStore

    url = url.rstrip("/")
    try:
        _, storage = parse_root(url)
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
# stacks for gs://.
_CLIENT_ERROR_MODULES = ("botocore", "google.", "requests", "urllib3")


def _is_client_error(exc: Exception) -> bool:
    return type(exc).__module__.startswith(_CLIENT_ERROR_MODULES)


def _environment_error(command: str, exc: Exception) -> int:
    print(f"jaxckpt {command}: object storage request failed: {exc} (check the endpoint "
          f"and the credentials: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID for s3://; "
          f"STORAGE_EMULATOR_HOST or GOOGLE_APPLICATION_CREDENTIALS for gs://)",
          file=sys.stderr)
    return EXIT_USAGE


def remote_ls(opts: argparse.Namespace) -> int:
    from .cli import _bad_if, _human_bytes, _print_table

    try:
        opened = _open("ls", opts.root)
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
    rows = [[str(entry.step), entry.status, _human_bytes(size), "-",
             entry.path.rsplit("/", 1)[-1]] for entry, size in zip(entries, sizes, strict=True)]
    _print_table(rows, ["STEP", "STATUS", "SIZE", "AGE", "DIRECTORY"], print)
    for entry in entries:
        for problem in entry.problems:
            print(f"  step {entry.step}: {problem}")
    return _bad_if(entries)


def remote_verify(opts: argparse.Namespace) -> int:
    try:
        opened = _open("verify", opts.path)
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
        opened = _open("info", opts.path)
        if isinstance(opened, int):
            return opened
        store, paths = opened
        if paths:
            return _info_checkpoint(paths[0], opts, store=store)
        return _info_root(store.root, opts, store=store)
    except Exception as exc:
        if type(exc).__module__.startswith("botocore"):
            return _environment_error("info", exc)
        raise
