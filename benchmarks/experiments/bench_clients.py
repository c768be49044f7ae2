"""``python benchmarks/experiments/bench_clients.py s3://BUCKET/PREFIX``: the S3 clients installed
here, side by side, on the same bytes.

Owns: the measurement behind the choice of client for the object-store byte path
(docs/cloud.md, "Which client"). Each round, for every client that imports, uploads then
downloads the same bytes as (a) a few big objects (``big_mib`` in objects of
``object_mib``) and (b) many small objects (``small_count`` of ``small_kib``); clients are
taken in turn within a round, so that the machine's load falls on all of them alike.
Reported: the median seconds per row over the rounds, with the lowest and highest.

The clients:
- ``boto3``: ``jaxckpt.storage.s3.storage.S3Storage`` as the library uses it (``write``: one PUT,
  multipart over 64 MiB on 4 threads; ``read``), ``S3Storage.concurrent_requests`` objects
  in flight on a thread pool;
- ``tensorstore``: tensorstore's ``s3`` kvstore driver (C++, its own HTTP stack and
  concurrency), every object's write or read issued at once and awaited;
- ``obstore`` (Rust ``object_store``) when importable: every object's put or get issued
  at once on an event loop and awaited; not a dependency of jaxckpt;
- ``s3fs`` (fsspec over aiobotocore) when importable: every object's put or get handed to
  one batched call (``pipe``, ``cat``) that runs them at once on its own event loop; not a
  dependency of jaxckpt. Its aiobotocore pins botocore to a few releases, which clashes with
  the boto3 the library's extras allow (the install trap issue 19 describes): measure it in
  a virtualenv of its own, with the boto3 release that matches its botocore (docs/cloud.md,
  "Which client").

Endpoint, region and credentials come from ``storage_options`` for boto3 and from the
same values passed to the other clients' own settings. Must not import: torch. Imports the
clients when run.

Concurrency contract: one thread; writes only below ``root``, under fresh prefixes that it
deletes at the end.

A one-off experiment, outside the wheel: run it as a script from a checkout, against the
installed package (``pip install -e .`` or the wheel), from the repository root.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["run_clients_bench", "format_clients"]

_MiB = 1 << 20
Transfer = Callable[[list[str], list[bytes]], None]


def _boto3(storage: Any) -> tuple[Transfer, Callable[[list[str]], None]]:
    threads = storage.concurrent_requests

    def put(names: list[str], blobs: list[bytes]) -> None:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(storage.write, [storage.url(n) for n in names], blobs))

    def get(names: list[str]) -> None:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(storage.read, [storage.url(n) for n in names]))

    return put, get


def _tensorstore(ts: Any, storage: Any, options: Mapping[str, Any]) -> tuple[Transfer, Any]:
    # tensorstore reads credentials from the environment, not from its spec.
    for option, variable in (("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
                             ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY")):
        if option in options:
            os.environ.setdefault(variable, str(options[option]))
    spec: dict[str, Any] = {"driver": "s3", "bucket": storage.bucket,
                            "aws_region": options.get("region_name", "us-east-1")}
    if "endpoint_url" in options:  # tensorstore ignores AWS_ENDPOINT_URL
        spec["endpoint"] = options["endpoint_url"]
    store = ts.KvStore.open(spec).result()

    def put(names: list[str], blobs: list[bytes]) -> None:
        for future in [store.write(n, b) for n, b in zip(names, blobs, strict=True)]:
            future.result()

    def get(names: list[str]) -> None:
        for future in [store.read(n) for n in names]:
            future.result()

    return put, get


def _clients(storage: Any, options: Mapping[str, Any],
             log: Callable[[str], None]) -> dict[str, tuple[Transfer, Any]]:
    clients = {"boto3": _boto3(storage)}
    try:  # orbax's dependency, so there with the jax extra; the row is skipped without it
        import tensorstore
    except ImportError:
        log("tensorstore: not installed, skipped")
    else:
        clients["tensorstore"] = _tensorstore(tensorstore, storage, options)
    try:  # not a dependency of ours: measured where the user installed it
        import obstore
        from obstore.store import S3Store
    except ImportError:
        log("obstore: not installed, skipped")
    else:
        clients["obstore"] = _obstore(obstore, S3Store, storage, options)
    try:  # not a dependency of ours either; see the module docstring
        import s3fs
    except ImportError:
        log("s3fs: not installed, skipped")
    else:
        clients["s3fs"] = _s3fs(s3fs, storage, options)
    return clients


def _s3fs(s3fs: Any, storage: Any, options: Mapping[str, Any]) -> tuple[Transfer, Any]:
    """s3fs: the objects of a row put by one ``pipe`` and fetched by one ``cat``, each of
    which sends its requests at once (in batches) on s3fs's own event loop."""
    settings: dict[str, Any] = {
        "client_kwargs": {"region_name": options.get("region_name", "us-east-1")}}
    for option, key in (("endpoint_url", "endpoint_url"), ("aws_access_key_id", "key"),
                        ("aws_secret_access_key", "secret")):
        if option in options:
            settings[key] = options[option]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **settings)

    def put(names: list[str], blobs: list[bytes]) -> None:
        fs.pipe({f"{storage.bucket}/{n}": b for n, b in zip(names, blobs, strict=True)})

    def get(names: list[str]) -> None:
        fs.cat([f"{storage.bucket}/{n}" for n in names])

    return put, get


def _obstore(obstore: Any, store_class: Any, storage: Any,
             options: Mapping[str, Any]) -> tuple[Transfer, Any]:
    """obstore (Rust ``object_store`` under Python): every object's put or get issued at
    once on its own event loop and awaited, as tensorstore's are."""
    import asyncio

    settings: dict[str, Any] = {"region": options.get("region_name", "us-east-1")}
    for option, key in (("endpoint_url", "endpoint"), ("aws_access_key_id", "access_key_id"),
                        ("aws_secret_access_key", "secret_access_key")):
        if option in options:
            settings[key] = options[option]
    store = store_class(storage.bucket, client_options={"allow_http": True}, **settings)

    async def put_all(names: list[str], blobs: list[bytes]) -> None:
        await asyncio.gather(*(obstore.put_async(store, n, b)
                               for n, b in zip(names, blobs, strict=True)))

    async def get_all(names: list[str]) -> None:
        async def one(name: str) -> None:
            result = await obstore.get_async(store, name)
            await result.bytes_async()
        await asyncio.gather(*(one(n) for n in names))

    def put(names: list[str], blobs: list[bytes]) -> None:
        asyncio.run(put_all(names, blobs))

    def get(names: list[str]) -> None:
        asyncio.run(get_all(names))

    return put, get


def run_clients_bench(root: str, storage_options: Mapping[str, Any] | None = None, *,
                      big_mib: int = 256, object_mib: int = 64, small_count: int = 2048,
                      small_kib: int = 16, repeats: int = 3,
                      log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Seconds per client and row (``big_put``, ``big_get``, ``small_put``, ``small_get``)
    for every round, and their median, lowest and highest."""
    from jaxckpt.storage.s3.storage import S3Storage
    from jaxckpt.storage.url import parse_root

    options = dict(storage_options or {})
    _, storage = parse_root(root, options)
    if not isinstance(storage, S3Storage):
        raise ValueError(f"{root!r} is not an s3:// root")
    big = [os.urandom(object_mib * _MiB) for _ in range(max(1, big_mib // object_mib))]
    small = [os.urandom(small_kib << 10) for _ in range(small_count)]
    clients = _clients(storage, options, log)
    seconds: dict[str, dict[str, list[float]]] = {
        name: {row: [] for row in ("big_put", "big_get", "small_put", "small_get")}
        for name in clients}
    for round_index in range(repeats):
        log(f"bench_clients: round {round_index + 1} of {repeats}")
        for name, (put, get) in clients.items():
            prefix = f"{storage.prefix}/clients-{name}-{uuid.uuid4().hex[:8]}"
            try:
                for row, blobs in (("big", big), ("small", small)):
                    names = [f"{prefix}/{row}/{i}" for i in range(len(blobs))]
                    start = time.perf_counter()
                    put(names, blobs)
                    seconds[name][f"{row}_put"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    get(names)
                    seconds[name][f"{row}_get"].append(time.perf_counter() - start)
            finally:
                storage.delete_prefix(storage.url(prefix))
    return {"root": root, "big_bytes": sum(map(len, big)), "big_objects": len(big),
            "small_bytes": sum(map(len, small)), "small_objects": len(small),
            "repeats": repeats, "seconds": seconds,
            "summary": {name: {row: {"median": statistics.median(v), "min": min(v),
                                     "max": max(v)} for row, v in rows.items()}
                        for name, rows in seconds.items()}}


def format_clients(result: dict[str, Any]) -> str:
    """One line per client and row: median seconds [lowest, highest] and MiB/s."""
    lines = [f"S3 clients on {result['root']}: {result['big_bytes'] / _MiB:.0f} MiB in "
             f"{result['big_objects']} objects, {result['small_objects']} objects of "
             f"{result['small_bytes'] // result['small_objects'] >> 10} KiB, "
             f"{result['repeats']} rounds (median s [lowest, highest])"]
    for name, rows in result["summary"].items():
        for row, figures in rows.items():
            nbytes = result["big_bytes" if row.startswith("big") else "small_bytes"]
            lines.append(f"  {name:12} {row:10} {figures['median']:7.3f} s "
                         f"[{figures['min']:.3f}, {figures['max']:.3f}]  "
                         f"{nbytes / _MiB / figures['median']:7.1f} MiB/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/experiments/bench_clients.py s3://BUCKET/PREFIX [--big-mib N]
    [--object-mib N] [--small N] [--small-kib N] [--repeats N]``; endpoint and credentials
    from the standard environment (``AWS_ENDPOINT_URL``...)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python benchmarks/experiments/bench_clients.py")
    parser.add_argument("root")
    parser.add_argument("--big-mib", type=int, default=256)
    parser.add_argument("--object-mib", type=int, default=64, help="size of a big object")
    parser.add_argument("--small", type=int, default=2048, help="small objects")
    parser.add_argument("--small-kib", type=int, default=16, help="size of a small object")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args(argv)
    options = {key: value for key, value in (
        ("endpoint_url", os.environ.get("AWS_ENDPOINT_URL")),
        ("region_name", os.environ.get("AWS_REGION")),
        ("aws_access_key_id", os.environ.get("AWS_ACCESS_KEY_ID")),
        ("aws_secret_access_key", os.environ.get("AWS_SECRET_ACCESS_KEY"))) if value}
    result = run_clients_bench(opts.root.rstrip("/"), options, big_mib=opts.big_mib,
                               object_mib=opts.object_mib, small_count=opts.small,
                               small_kib=opts.small_kib, repeats=opts.repeats,
                               log=lambda line: print(line, file=sys.stderr))
    print(format_clients(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
