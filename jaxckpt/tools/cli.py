"""The ``jaxckpt`` command line.

Owns: argument parsing and the human-readable output of the subcommands. Each subcommand is
one ``_Command`` entry in ``COMMANDS`` (name, help, a function adding its arguments, a
handler returning the exit code), so adding one (export-hf, import-hf, bench, run) is one
entry and two small functions. Handlers import what they need lazily: ``jaxckpt ls`` and
``jaxckpt verify`` never import jax, orbax or torch.

Exit codes (docs/configuration.md, "Command line"): 0 success; 1 a checkpoint is partial or
corrupt (or the demo found a difference); 2 bad usage or environment (bad flags, a missing
extra); 3 the path is not a jaxckpt checkpoint or root (missing, a file, an empty directory,
or another tool's files).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .progress import make_progress, wanted

__all__ = ["main", "build_parser", "COMMANDS"]

EXIT_OK = 0
EXIT_BAD_CHECKPOINT = 1
EXIT_USAGE = 2
EXIT_NOT_JAXCKPT = 3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Command:
    name: str
    """The subcommand, as typed."""
    help: str
    """One line for ``jaxckpt --help``."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's own arguments."""
    handler: Callable[[argparse.Namespace], int]
    """Runs it; returns the exit code."""


# ------------------------------------------------------------------------------ helpers


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for limit, unit, div in ((120, "s", 1), (7200, "m", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{int(seconds // div)}{unit}"
    return f"{int(seconds // 86400)}d"


def _dir_bytes(path: str) -> int:
    """Bytes under a directory that has no manifest (a partial checkpoint)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _print_table(rows: list[list[str]], header: list[str], out: Callable[[str], None]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        out("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())


# ------------------------------------------------------------------- ls, verify, info


def _locate(command: str, path: str) -> tuple[str, str] | int:
    """(absolute path, "root" or "checkpoint"), or, for anything else (missing, a file, an
    empty directory, another tool's directory), the exit code after saying what it is."""
    from jaxckpt.commit.ownership import classify_path

    from .remote_cli import is_url, refuse_url

    if is_url(path):  # never taken for a relative path (a directory named "s3:")
        return refuse_url(command, path)
    full = os.path.abspath(path)
    if os.path.basename(full) == "recover" and classify_path(os.path.dirname(full))[0] == "root":
        full = os.path.dirname(full)  # ROOT/recover given for ROOT
    kind, sentence = classify_path(full)
    if kind in ("root", "checkpoint"):
        return full, kind
    print(f"jaxckpt {command}: {sentence}", file=sys.stderr)
    return EXIT_USAGE if kind == "unreadable" else EXIT_NOT_JAXCKPT  # permissions: environment


def _ls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="checkpoint root (the directory holding recover/), or one "
                                     "checkpoint directory")
    parser.add_argument("--checksums", action="store_true",
                        help="re-read every file against its checksum (slower; default: sizes)")
    _progress_argument(parser)
    _storage_option_argument(parser)


def _storage_option_argument(parser: argparse.ArgumentParser) -> None:
    from .remote_cli import add_storage_option_argument

    add_storage_option_argument(parser)


def _progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show progress on stderr (default: when stderr is a terminal)")


def _ls(opts: argparse.Namespace) -> int:
    from jaxckpt.commit.store import CheckpointStore

    from .remote_cli import is_url, remote_ls

    if is_url(opts.root):
        return remote_ls(opts)
    located = _locate("ls", opts.root)
    if isinstance(located, int):
        return located
    path, kind = located
    if kind == "checkpoint":
        entries = [_store_of(path).entry(path, checksums=opts.checksums)]
    else:
        store = CheckpointStore(path)
        bar = make_progress("ls: checkpoints checked", wanted(opts.progress), unit="count")
        try:
            entries = store.entries(checksums=opts.checksums, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        if not entries:
            print(f"no checkpoints under {store.recover_dir}")
            return EXIT_OK
    why, note = ({}, None) if kind == "checkpoint" else _retention_column(store, entries)
    now = time.time()
    rows = []
    referenced = _referenced_column(entries)
    for entry in entries:
        if entry.manifest is not None:
            size: int | None = entry.manifest.total_bytes
            created: float | None = entry.manifest.created
        else:
            size = _dir_bytes(entry.path)
            try:
                created = os.stat(entry.path).st_mtime
            except OSError:
                created = None
        rows.append([str(entry.step), entry.status, _human_bytes(size),
                     *referenced.get(entry.step, []),
                     _human_age(None if created is None else now - created),
                     os.path.basename(entry.path), why.get(entry.step, "-")])
    _print_table(rows, ["STEP", "STATUS", "SIZE", *(["REFERENCED"] if referenced else []),
                        "AGE", "DIRECTORY", "RETENTION"], print)
    for entry in entries:
        for problem in entry.problems:
            print(f"  step {entry.step}: {problem}")
    if note:
        print(note)
    return _bad_if(entries)


def _store_of(path: str) -> Any:
    """The store of checkpoint directory ``path``: its root's when it is a step directory
    under ``recover/`` (so that the files it refers to are found), else its parent's."""
    from jaxckpt.commit.store import CheckpointStore
    from jaxckpt.core.layout import RECOVER

    parent = os.path.dirname(os.path.abspath(path))
    return CheckpointStore(os.path.dirname(parent) if os.path.basename(parent) == RECOVER
                           else parent)


def _referenced_column(entries: Sequence[Any]) -> dict[int, list[str]]:
    """The REFERENCED cell of each checkpoint (bytes of earlier checkpoints' files it uses
    without having written them; SIZE is what it wrote), or {} when no checkpoint listed
    refers to any: the table then keeps its plain columns."""
    if not any(entry.manifest is not None and entry.manifest.refs for entry in entries):
        return {}
    return {entry.step: [_human_bytes(entry.manifest.referenced_bytes
                                      if entry.manifest is not None else None)]
            for entry in entries}


def _retention_column(store: Any, entries: Sequence[Any]) -> tuple[dict[int, str], str | None]:
    """Why retention keeps each checkpoint of a root ("resume-point,last-N", ...), or
    "delete-next" for those the next save's retention deletes, by the same pure rule the
    manager applies (``jaxckpt.core.retention.decide``) with the rules the newest checkpoint
    recorded in its driver.json. Partial directories get no entry (start-up removes them).
    Also returns a note to print when the rules or the pins could not be read. The CLI cannot
    see restores in progress, so "being-read" never shows here."""
    from jaxckpt.commit.pins import Pins
    from jaxckpt.core.retention import CheckpointFacts, RetentionRules, decide
    from jaxckpt.errors import CheckpointError
    from jaxckpt.manager.driver_state import read_driver

    notes = []
    try:
        pinned = Pins(store, primary=False).read()
    except CheckpointError as exc:
        pinned, notes = set(), [f"  pins: {exc}"]
    facts, rules = [], None
    for entry in sorted(entries, key=lambda e: e.step, reverse=True):
        if entry.status == "partial":
            continue
        try:
            driver = read_driver(store, entry.path)
        except (OSError, CheckpointError):
            driver = {}
        if rules is None and entry.status == "committed":
            rules = RetentionRules.from_json(driver.get("retention"))
        metrics = driver.get("metrics")
        facts.append(CheckpointFacts(step=entry.step, status=entry.status,
                                     metrics=metrics if isinstance(metrics, dict) else None,
                                     pinned=entry.step in pinned))
    rules = rules if rules is not None else RetentionRules(known=False)
    if not rules.known:
        notes.append("  retention: the newest checkpoint recorded no retention rules; only "
                     "pins, the resume point and unverified checkpoints are shown")
    unknown = "?" if not rules.known else "delete-next"
    why = {v.step: ",".join(v.reasons) or unknown for v in decide(facts, rules)}
    return why, "\n".join(notes) or None


def _bad_if(entries: Sequence[Any]) -> int:
    """EXIT_BAD_CHECKPOINT when any of these store entries is partial or corrupt."""
    bad = [entry for entry in entries if entry.status != "committed"]
    return EXIT_BAD_CHECKPOINT if bad else EXIT_OK


# -------------------------------------------------------------------------- verify


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a checkpoint directory (recover/step_N), or a root to "
                                     "verify every checkpoint under it")
    parser.add_argument("--sizes-only", action="store_true",
                        help="compare file sizes only, skip checksums")
    _progress_argument(parser)
    _storage_option_argument(parser)


def _verify(opts: argparse.Namespace) -> int:
    from jaxckpt.commit.store import CheckpointStore, Memo
    from jaxckpt.core.layout import COMMIT_MARKER
    from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError

    from .remote_cli import is_url, remote_verify

    if is_url(opts.path):
        return remote_verify(opts)
    located = _locate("verify", opts.path)
    if isinstance(located, int):
        return located
    path, kind = located
    memo = None
    if kind == "checkpoint":
        targets = [path]
    else:
        store = CheckpointStore(path)
        targets = [entry.path for entry in store.entries()]
        memo = Memo()  # a file several checkpoints use: read once, reported under each
        if not targets:
            print(f"no checkpoints under {store.recover_dir} (nothing to verify)")
            return EXIT_OK
    bad = 0
    show = wanted(opts.progress)
    memo = Memo()  # a file several checkpoints refer to is read once, named under each
    for number, target in enumerate(targets, 1):
        if not os.path.exists(os.path.join(target, COMMIT_MARKER)):
            bad += 1
            print(f"PARTIAL {target}")
            print(f"  no {COMMIT_MARKER} marker: this checkpoint never finished committing "
                  f"(the job stopped while saving, or is saving now); it is not restorable")
            continue
        bar = make_progress(f"verify {number}/{len(targets)} {os.path.basename(target)}", show)
        try:
            problems = _store_of(target).verify(
                target, checksums=not opts.sizes_only, progress=bar, memo=memo)
        except CheckpointNotFoundError:  # deleted meanwhile (retention of a running job)
            print(f"GONE    {target} (deleted while this command ran)")
            continue
        except CheckpointCorruptError as exc:
            problems = [str(exc)]
        finally:
            if bar is not None:
                bar.close()
        if problems:
            bad += 1
            print(f"CORRUPT {target}")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"OK      {target}")
    return EXIT_BAD_CHECKPOINT if bad else EXIT_OK


# ---------------------------------------------------------------------------- demo


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import add_demo_arguments  # numpy only; jax is imported by the worker

    add_demo_arguments(parser)


def _demo(opts: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(steps=opts.steps, save_every=opts.save_every, seed=opts.seed,
                    mode=opts.mode)


# ---------------------------------------------------------------------------- info


def _info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a checkpoint directory (recover/step_N), or a root for a "
                                     "summary of its checkpoints")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--leaves", type=int, default=40,
                        help="array leaves to list (default 40; 0 for all)")
    parser.add_argument("--tree", action="store_true",
                        help="list every saved tree path with shape, dtype and bytes (from "
                             "the checkpoint's metadata; no array data is read)")
    _storage_option_argument(parser)


def _info(opts: argparse.Namespace) -> int:
    from .remote_cli import is_url, remote_info

    if is_url(opts.path):
        return remote_info(opts)
    located = _locate("info", opts.path)
    if isinstance(located, int):
        return located
    path, kind = located
    return _info_root(path, opts) if kind == "root" else _info_checkpoint(path, opts)


def _info_root(path: str, opts: argparse.Namespace, store: Any = None) -> int:
    """A root: how many checkpoints in which state, the latest valid one, where to look next
    (sizes checked, not checksums: as ``ls``). ``store``: the root's (object stores)."""
    import json

    from jaxckpt.commit.store import CheckpointStore

    store = CheckpointStore(path) if store is None else store
    entries = store.entries()
    counts = {status: sum(e.status == status for e in entries)
              for status in ("committed", "partial", "corrupt")}
    latest = next((e for e in reversed(entries) if e.status == "committed"), None)
    info: dict[str, Any] = {"path": path, "kind": "root", "checkpoints": len(entries), **counts,
            "latest_valid": None if latest is None else {"step": latest.step, "path": latest.path},
            "exports": len(store.export_entries()), "items": store.item_names()}
    if opts.json:
        print(json.dumps(info, indent=1))
        return _bad_if(entries)
    print(f"{'path':14} {path}")
    print(f"{'kind':14} checkpoint root")
    print(f"{'checkpoints':14} {len(entries)} ({counts['committed']} committed, "
          f"{counts['partial']} partial, {counts['corrupt']} corrupt)")
    print(f"{'latest valid':14} " + ("none" if latest is None
                                     else f"step {latest.step} ({latest.path})"))
    if info["exports"] or info["items"]:
        print(f"{'exports':14} {info['exports']}; items: {', '.join(info['items']) or '-'}")
    print(f"details: `jaxckpt ls {path}` lists every checkpoint, `jaxckpt info "
          f"{latest.path if latest else store.step_path(0)}` shows one")
    return _bad_if(entries)


def _info_checkpoint(path: str, opts: argparse.Namespace, store: Any = None) -> int:
    """What a checkpoint holds, read from its JSON files only (never from array data, and
    never from a backend's own binary metadata); file sizes are checked against the manifest.
    ``store``: the one holding ``path`` (object stores)."""
    import json

    from jaxckpt.core.layout import DRIVER_FILE
    from jaxckpt.errors import CheckpointCorruptError, CheckpointError
    from jaxckpt.manager.driver_state import read_driver

    store = _store_of(path) if store is None else store
    info: dict = {"path": path}
    try:
        manifest = store.read_manifest(path)
        problems = store.verify(path, checksums=False) if manifest else []
    except CheckpointCorruptError as exc:
        manifest, problems = None, [str(exc)]
    info["status"] = "corrupt" if problems else ("committed" if manifest else "partial")
    if problems:
        info["manifest_error"] = "; ".join(problems)
    elif manifest is None:
        info["manifest_error"] = ("no COMMITTED marker: this checkpoint never finished "
                                  "committing; it is not restorable")
    if manifest:
        info["files"], info["bytes"] = len(manifest.files), manifest.total_bytes
    try:
        driver = read_driver(store, path)
        for key in ("kind", "reason", "backend", "process_count", "step_info", "metrics",
                    "versions"):
            info[key] = driver.get(key)
        info["saved_at"] = time.strftime("%Y-%m-%d %H:%M:%S",
                                         time.localtime(driver.get("saved_at", 0)))
        local = driver.get("local") or {}
        info["stateful"] = sorted((local.get("stateful") or {}).keys())
        info["rng"] = _rng_names(local, driver.get("backend"))
    except (OSError, ValueError, AttributeError, CheckpointError) as exc:
        info["driver_error"] = f"{DRIVER_FILE}: {exc}"
    _add_leaves(info, path, store.storage)
    if info.get("backend") == "dcp":
        _add_dcp_owners(info.get("leaves") or [], path, store.storage, manifest)
    else:
        _add_data_owners(info.get("leaves") or [], manifest)
    if opts.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        _print_info(info, 0 if opts.tree else opts.leaves, with_bytes=opts.tree)
    return EXIT_OK if info["status"] == "committed" else EXIT_BAD_CHECKPOINT


# The framework whose global generators a backend saves (driver.json's local.backend_rng).
_BACKEND_RNG_FRAMEWORK = {"dcp": "torch"}


def _rng_names(local: dict, backend: Any) -> list[str]:
    """The RNG states a checkpoint holds: Python's and NumPy's (``local.rng``), then the
    backend's own generators (``local.backend_rng``: torch's CPU one and the CUDA devices')."""
    names = sorted((local.get("rng") or {}).keys())
    backend_rng = local.get("backend_rng")
    if isinstance(backend_rng, dict):
        prefix = _BACKEND_RNG_FRAMEWORK.get(str(backend), str(backend))
        for key, value in backend_rng.items():
            devices = f" ({len(value)} devices)" if isinstance(value, list) else ""
            names.append(f"{prefix}.{key}{devices}")
    return names


def _add_leaves(info: dict, path: str, storage: Any) -> None:
    from jaxckpt.core.layout import OBJECTS_FILE, STATE_DIR, TREE_FILE
    from jaxckpt.core.tree_record import leaf_nbytes, parse_tree_record
    from jaxckpt.errors import CheckpointError

    state_dir = os.path.join(path, STATE_DIR)
    if info.get("backend") == "dcp" or storage.exists(os.path.join(state_dir, OBJECTS_FILE)):
        _add_dcp_tensors(info, state_dir, storage)
    elif storage.exists(os.path.join(state_dir, TREE_FILE)):
        try:
            text = storage.read(os.path.join(state_dir, TREE_FILE))
            leaves = parse_tree_record(text, state_dir)["leaves"]
            info["leaves"] = [{"path": leaf.get("path"), "shape": leaf.get("shape"),
                               "dtype": leaf.get("dtype"), "bytes": leaf_nbytes(leaf),
                               "name": leaf.get("name")} for leaf in leaves]
        except (OSError, CheckpointError, AttributeError) as exc:
            info["tree_error"] = f"{STATE_DIR}/{TREE_FILE}: {exc}"


def _add_data_owners(leaves: list[dict], manifest: Any) -> None:
    """Where each Orbax leaf's data lives (``"data"``), for a checkpoint that refers to
    files of earlier ones (its manifest's refs, whose keys keep each file's path inside its
    checkpoint): "stored" in this checkpoint, or "referenced from step N". Drops the
    storage names ``_add_leaves`` kept for this."""
    from jaxckpt.core.layout import STATE_DIR, parse_ref_key

    names = [leaf.pop("name", None) for leaf in leaves]
    if manifest is None or not manifest.refs:
        return
    prefix = f"{STATE_DIR}/arrays/"
    owners: dict[str, set[int]] = {}
    for key in manifest.refs:
        parsed = parse_ref_key(key)
        if parsed is not None and parsed[1].startswith(prefix):
            owners.setdefault(parsed[1][len(prefix):].split("/", 1)[0], set()).add(parsed[0])
    own = {rel[len(prefix):].split("/", 1)[0] for rel in manifest.files
           if rel.startswith(prefix) and "/c" in rel[len(prefix):]}
    for leaf, name in zip(leaves, names, strict=True):
        steps = sorted(owners.get(name, ()))
        where = "referenced from step " + ", ".join(map(str, steps)) if steps else "stored"
        leaf["data"] = f"{where} (partly stored)" if steps and name in own else where


# torch_bridge's per-checkpoint record of where each DCP tensor record lies (its
# torch_bridge.dcp.incremental.CONTENT_FILE; read here as JSON, without importing torch).
_DCP_CONTENT_FILE = "content.json"


def _add_dcp_owners(leaves: list[dict], path: str, storage: Any, manifest: Any) -> None:
    """Where each DCP tensor's data lives (``"data"``), for a checkpoint that refers to files
    of earlier ones: from ``content.json``, whose records name either a data file of this
    checkpoint or ``../../step_N/state/<file>`` of an earlier one. A checkpoint without
    refs, or without a readable record, gets no column."""
    import json
    import posixpath

    from jaxckpt.core.layout import STATE_DIR, parse_ref_key

    if manifest is None or not manifest.refs or not leaves:
        return
    rel_dir = f"{os.path.basename(path.rstrip('/'))}/{STATE_DIR}"
    try:
        body = json.loads(storage.read(os.path.join(path, STATE_DIR, _DCP_CONTENT_FILE)))
        records = body["records"]
        owners: dict[str, set[int]] = {}
        for record in records:
            relative = str(record["path"])
            parsed = parse_ref_key(posixpath.normpath(f"{rel_dir}/{relative}")) \
                if "/" in relative else None
            owners.setdefault(str(record["fqn"]), set()).add(
                -1 if parsed is None else parsed[0])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    for leaf in leaves:
        found = owners.get(leaf["path"])
        if not found:
            continue
        earlier = sorted(step for step in found if step >= 0)
        where = "referenced from step " + ", ".join(map(str, earlier)) if earlier \
            else "stored"
        leaf["data"] = f"{where} (partly stored)" if earlier and -1 in found else where


def _add_dcp_tensors(info: dict, state_dir: str, storage: Any) -> None:
    """The tensors of a DCP checkpoint (``DcpCheckpointManager``), by their DCP key, from
    ``objects.json``: the backend records there the key, shape and dtype of every tensor it
    hands DCP. It is read instead of DCP's ``.metadata``, which is a pickle (only
    torch_bridge's restricted unpickler may open it, and only with torch installed): so
    ``info`` lists a torch checkpoint with neither torch nor any array data."""
    import json

    from jaxckpt.core.layout import OBJECTS_FILE, STATE_DIR
    from jaxckpt.core.tree_record import leaf_nbytes

    where = f"{STATE_DIR}/{OBJECTS_FILE}"
    try:
        body = json.loads(storage.read(os.path.join(state_dir, OBJECTS_FILE)))
        if body.get("format") != "jaxckpt.dcp.objects":
            raise ValueError(f"format {body.get('format')!r} is not jaxckpt.dcp.objects")
        tensors = [tensor for entry in body["entries"].values() for tensor in entry["tensors"]]
        info["leaves"] = [{"path": t["key"], "shape": t["shape"], "dtype": t["dtype"],
                           "bytes": leaf_nbytes({"shape": t["shape"], "dtype": t["dtype"]})}
                          for t in tensors]
    except FileNotFoundError:
        info["tree_error"] = (f"{where} is missing, so the saved tensors cannot be listed "
                              f"(DCP's own .metadata is a pickle, which info does not open)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        info["tree_error"] = f"{where}: {exc}"


def _print_info(info: dict, max_leaves: int, *, with_bytes: bool = False) -> None:
    import json

    for key in ("path", "status", "kind", "reason", "backend", "process_count", "saved_at"):
        if key in info:
            print(f"{key:14} {info[key]}")
    if "bytes" in info:
        print(f"{'size':14} {_human_bytes(info['bytes'])} in {info['files']} files")
    for key in ("step_info", "metrics", "stateful", "rng", "versions"):
        if info.get(key):
            print(f"{key:14} {json.dumps(info[key], default=str)}")
    for key in ("manifest_error", "driver_error", "tree_error"):
        if key in info:
            print(f"{'problem':14} {info[key]}")
    leaves = info.get("leaves") or []
    if leaves:
        shown = leaves if max_leaves == 0 else leaves[:max_leaves]
        print(f"arrays ({len(leaves)} leaves):")
        owners = with_bytes and any("data" in leaf for leaf in shown)
        rows = [[leaf["path"], str(tuple(leaf["shape"] or ())), str(leaf["dtype"])]
                + ([_bytes_cell(leaf["bytes"])] if with_bytes else [])
                + ([leaf.get("data", "")] if owners else []) for leaf in shown]
        _print_table(rows, ["PATH", "SHAPE", "DTYPE"] + (["BYTES"] if with_bytes else [])
                     + (["DATA"] if owners else []), print)
        if len(shown) < len(leaves):
            print(f"  ... {len(leaves) - len(shown)} more (--leaves 0 lists all)")


def _bytes_cell(nbytes: int | None) -> str:
    return "?" if nbytes is None else str(nbytes)


# ----------------------------------------------------------------------- HF bridge
# The architecture choices are spelled out here: importing torch_bridge.hf to list them would
# make every `jaxckpt` command (ls, verify) pay for it.


def _export_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint",
                        help="checkpoint root (latest valid step) or a recover/step_N directory")
    parser.add_argument("out_dir", help="Hugging Face model directory to write")
    parser.add_argument("--arch", choices=("llama", "qwen2", "gpt2"),
                        help="architecture table (default: the one the checkpoint records, "
                             "written by hf_exporter or import-hf)")
    parser.add_argument("--config", help="config.json or HF model directory (default: the one "
                                         "the checkpoint records)")
    parser.add_argument("--step", type=int, help="global step to export (default: latest valid)")
    parser.add_argument("--params-path", "--params-of", dest="params_path",
                        help="tree path of the params in the saved state, e.g. model/params "
                             "or 0; for a DCP root the model's entry, e.g. model (default: "
                             "recorded, else found)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="cast every tensor")
    parser.add_argument("--max-shard-size", help="e.g. 5GiB, 500MB (default 5GiB; on a DCP "
                                                 "root the exporter's, else 50GB as "
                                                 "save_pretrained)")
    parser.add_argument("--tokenizer-dir", help="directory whose tokenizer files are copied")
    parser.add_argument("--generation-config", help="generation_config.json (or its directory)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    parser.add_argument("--sizes-only", action="store_true", help="verify sizes, skip checksums")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _storage_option_argument(parser)


def _export_hf(opts: argparse.Namespace) -> int:
    from jaxckpt.errors import CheckpointError

    from .hf_cli import export_checkpoint_to_hf, parse_size
    from .remote_cli import _open, client_errors, is_url, storage_options

    options = storage_options(opts)
    codes: list[int] = []
    with client_errors("export-hf", codes):
        located = (_open("export-hf", opts.checkpoint, options) if is_url(opts.checkpoint)
                   else _locate("export-hf", opts.checkpoint))
        if isinstance(located, int):
            return located  # missing, empty or another tool's directory: 3 (unreadable: 2)
        try:
            written = export_checkpoint_to_hf(
                opts.checkpoint, opts.out_dir, arch=opts.arch, config=opts.config,
                step=opts.step, params_path=opts.params_path, dtype=opts.dtype,
                max_shard_bytes=(None if opts.max_shard_size is None
                                 else parse_size(opts.max_shard_size)),
                tokenizer_dir=opts.tokenizer_dir, generation_config=opts.generation_config,
                overwrite=opts.overwrite, verify="sizes" if opts.sizes_only else "checksums",
                progress=not opts.no_progress, storage_options=options)
        except (FileNotFoundError, FileExistsError, ValueError) as exc:
            # not found, exists, config, mismatch
            print(f"jaxckpt export-hf: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except CheckpointError as exc:  # corrupt checkpoint
            print(f"jaxckpt export-hf: {exc}", file=sys.stderr)
            return EXIT_BAD_CHECKPOINT
        print(f"wrote {opts.out_dir} ({_human_bytes(written)})")
        return EXIT_OK
    return codes[0]

def _root_error_code(exc: Exception) -> int:
    """Exit code of a refused root: 3 when it is not a jaxckpt root (another tool's files, a
    step already there), 2 when it could not be listed or created (permissions, an object
    store that cannot be reached: the error it wraps says which) or its object store does
    not honour conditional writes (the environment, not the root)."""
    from jaxckpt.errors import ConditionalWritesError

    environment = exc.__cause__ is not None or isinstance(exc, ConditionalWritesError)
    return EXIT_USAGE if environment else EXIT_NOT_JAXCKPT


def _import_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("root", help="checkpoint root to write recover/step_N into")
    parser.add_argument("--arch", required=True, choices=("llama", "qwen2", "gpt2"))
    parser.add_argument("--step", type=int, default=0, help="global step to record (default 0)")
    parser.add_argument("--stacked", action="store_true",
                        help="stack layers on a leading axis (models built with scan_layers=True)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="cast every tensor")
    parser.add_argument("--state-key", help="nest the params under this key of the saved state")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _storage_option_argument(parser)


def _import_hf(opts: argparse.Namespace) -> int:
    from jaxckpt.errors import CheckpointRootError

    from .hf_cli import import_hf_to_checkpoint
    from .remote_cli import client_errors, is_url, refuse_url, storage_options

    if is_url(opts.hf_dir):
        return refuse_url("import-hf", opts.hf_dir, "HF_DIR")
    codes: list[int] = []
    with client_errors("import-hf", codes):
        try:
            path = import_hf_to_checkpoint(
                opts.hf_dir, opts.root, arch=opts.arch, step=opts.step, stacked=opts.stacked,
                dtype=opts.dtype, state_key=opts.state_key, progress=not opts.no_progress,
                storage_options=storage_options(opts))
        except CheckpointRootError as exc:  # ROOT holds another tool's files, or unusable
            print(f"jaxckpt import-hf: {exc}", file=sys.stderr)
            return _root_error_code(exc)
        except (FileNotFoundError, ValueError) as exc:  # no HF dir, arch mismatch listing
            print(f"jaxckpt import-hf: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"wrote {path}")
        return EXIT_OK
    return codes[0]

# ---------------------------------------------------------------------- import-orbax


def _import_orbax_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="an Orbax checkpoint: a CheckpointManager directory (step "
                                    "directories 0/, 100/, ...), one step directory, or one "
                                    "PyTree/StandardCheckpointer directory; never changed")
    parser.add_argument("root", help="jaxckpt checkpoint root to write recover/step_N into "
                                     "(new, empty, or a jaxckpt root)")
    parser.add_argument("--step", type=int, default=None,
                        help="Orbax step to import (default: the latest); it becomes the "
                             "global step of the jaxckpt checkpoint")
    _storage_option_argument(parser)


def _import_orbax(opts: argparse.Namespace) -> int:
    from jaxckpt.errors import (
        CheckpointCorruptError,
        CheckpointNotFoundError,
        CheckpointRootError,
        ConfigError,
    )

    from .remote_cli import client_errors, is_url, refuse_url, storage_options

    if is_url(opts.src):
        return refuse_url("import-orbax", opts.src, "SRC")
    codes: list[int] = []
    with client_errors("import-orbax", codes):
        try:
            from jaxckpt.backends.orbax.import_orbax import import_orbax

            path = import_orbax(opts.src, opts.root, step=opts.step,
                                storage_options=storage_options(opts))
        except ImportError as exc:  # a missing extra
            print(f"jaxckpt import-orbax: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ConfigError as exc:  # no such step in SRC, ROOT inside SRC
            print(f"jaxckpt import-orbax: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except (CheckpointNotFoundError, CheckpointRootError) as exc:  # SRC or ROOT refused
            print(f"jaxckpt import-orbax: {exc}", file=sys.stderr)
            return _root_error_code(exc)
        except CheckpointCorruptError as exc:  # the written checkpoint failed verification
            print(f"jaxckpt import-orbax: {exc}", file=sys.stderr)
            return EXIT_BAD_CHECKPOINT
        print(f"wrote {path}")
        return EXIT_OK
    return codes[0]

# ----------------------------------------------------------------------------- run


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retries", type=int, default=3,
                        help="restarts after the first attempt (default 3)")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help="seconds before the first restart, doubling each time (default 1)")
    parser.add_argument("--max-backoff", type=float, default=60.0,
                        help="cap on the wait between restarts (default 60)")
    parser.add_argument("--final-exit-codes",
                        type=lambda s: tuple(int(c) for c in s.split(",") if c),
                        default=(2, 78), help="comma-separated exit codes never retried "
                                              "(default 2,78: usage and configuration errors)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the training command, after '--'")


def _run(opts: argparse.Namespace) -> int:
    import logging

    from jaxckpt.errors import ConfigError
    from jaxckpt.retry import RetryPolicy, run_command

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = list(opts.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        policy = RetryPolicy(retries=opts.retries, backoff_s=opts.backoff,
                             max_backoff_s=opts.max_backoff, final_exit_codes=opts.final_exit_codes)
        return run_command(command, policy)
    except ConfigError as exc:
        print(f"jaxckpt run: {exc}", file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------------------- bench


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench import SECTIONS, BenchConfig  # numpy only; jax is imported by run_bench

    default = BenchConfig()
    parser.add_argument("--dir", default=None,
                        help="where to write (default: the system temp directory); point it "
                             "at the disk your checkpoints go to")
    parser.add_argument("--size-mb", type=int, default=None,
                        help=f"state size in MiB (default {default.size_mb})")
    parser.add_argument("--leaves", type=int, default=None,
                        help=f"leaves of the state (default {default.leaves})")
    parser.add_argument("--many-leaves", type=int, default=None,
                        help=f"leaves of the many-leaves variant, 0 to skip "
                             f"(default {default.many_leaves})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"rounds; figures are medians (default {default.repeats})")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--leaves-mb", type=int, default=None,
                        help=f"state size of the leaf-count comparison (8 vs 2,048 vs 10,000 "
                             f"leaves), MiB (default {default.leaves_mb})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one round: checks that every row runs (CI)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--root", default=None,
                        help="an s3://BUCKET/PREFIX or gs://BUCKET/PREFIX to measure "
                             "instead: save and restore against a raw upload and download "
                             "through the same client (endpoint and credentials from the "
                             "standard environment, or --storage-option)")
    _storage_option_argument(parser)
    parser.add_argument("--scale", action="store_true",
                        help="instead: states from 128 MiB doubling up to --max-mb (or what "
                             "memory and disk allow): save/restore time per GiB, blocking "
                             "time, peak extra memory; then --saves consecutive saves")
    parser.add_argument("--trainers", action="store_true",
                        help="instead: the loop time transformers' Trainer, Lightning and "
                             "Keras lose to their own checkpointing vs to jaxckpt's "
                             "integration, side by side (those installed)")
    parser.add_argument("--max-mb", type=int, default=None,
                        help="--scale: the largest state, MiB (default 8192)")
    parser.add_argument("--saves", type=int, default=None,
                        help="--scale: consecutive async saves followed for flat memory and "
                             "time, 0 to skip (default 50)")


def _bench(opts: argparse.Namespace) -> int:
    import json

    if opts.root is not None:
        from .bench.remote import bench_command

        return bench_command(opts)

    from .bench import BenchConfig, format_table, run_bench

    if opts.dir is not None:
        try:  # a --dir that does not exist yet is made, as a checkpoint root would be
            os.makedirs(opts.dir, exist_ok=True)
        except OSError as exc:
            print(f"jaxckpt bench: --dir {opts.dir!r} cannot be created ({exc}); "
                  "pass a writable directory", file=sys.stderr)
            return EXIT_USAGE
    if opts.scale:
        return _bench_scale(opts)
    if opts.trainers:
        from .bench.trainers import format_trainers, run_trainers

        report = run_trainers(directory=opts.dir, quick=opts.quick)
        print(json.dumps(report, indent=1, default=str) if opts.json
              else format_trainers(report))
        return EXIT_OK
    changes: dict[str, Any] = {name: value for name, value in (
        ("directory", opts.dir), ("size_mb", opts.size_mb), ("leaves", opts.leaves),
        ("many_leaves", opts.many_leaves), ("repeats", opts.repeats),
        ("leaves_mb", opts.leaves_mb),
        ("sections", tuple(s for s in (opts.sections or "").split(",") if s) or None))
        if value is not None}
    try:
        config = BenchConfig.quick(**changes) if opts.quick else BenchConfig(**changes)
    except ValueError as exc:
        print(f"jaxckpt bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = run_bench(config)
    print(json.dumps(result.to_json(), indent=1, default=str) if opts.json
          else format_table(result))
    return EXIT_OK


def _bench_scale(opts: argparse.Namespace) -> int:
    """``jaxckpt bench --scale`` (``jaxckpt.tools.bench.scale``)."""
    import json

    from .bench.scale import ScaleConfig, format_scale, run_scale

    changes = {name: value for name, value in (
        ("directory", opts.dir), ("repeats", opts.repeats), ("max_mb", opts.max_mb),
        ("saves", opts.saves)) if value is not None}
    try:
        config = ScaleConfig.quick(**changes) if opts.quick else ScaleConfig(**changes)
    except ValueError as exc:
        print(f"jaxckpt bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = run_scale(config)
    print(json.dumps(result, indent=1, default=str) if opts.json else format_scale(result))
    return EXIT_OK


COMMANDS: tuple[_Command, ...] = (
    _Command(name="demo", help="crash a small training run twice, resume it, show the result "
                               "is bit-identical to an uninterrupted run",
             add_arguments=_demo_arguments, handler=_demo),
    _Command(name="ls", help="list the checkpoints under a root: step, status, size, age, and "
                                 "why retention keeps each (or deletes it next)",
             add_arguments=_ls_arguments, handler=_ls),
    _Command(name="verify", help="check a checkpoint (or every one under a root) against its "
                                 "commit manifest; exit 1 if any is partial or corrupt",
             add_arguments=_verify_arguments, handler=_verify),
    _Command(name="export-hf", help="export a recovery checkpoint's model params as a Hugging "
                                    "Face directory (config.json + safetensors)",
             add_arguments=_export_hf_arguments, handler=_export_hf),
    _Command(name="import-hf", help="turn a Hugging Face directory into a recovery checkpoint",
             add_arguments=_import_hf_arguments, handler=_import_hf),
    _Command(name="import-orbax", help="turn an Orbax checkpoint into a verified recovery "
                                       "checkpoint, leaving the Orbax one unchanged",
             add_arguments=_import_orbax_arguments, handler=_import_orbax),
    _Command(name="info", help="show what one checkpoint holds: step, metrics, versions, "
                               "stateful objects, array leaves (for a root: a summary)",
             add_arguments=_info_arguments, handler=_info),
    _Command(name="bench", help="measure save/restore cost on this machine against the "
                                "disk, Orbax, torch and safetensors, in one run",
             add_arguments=_bench_arguments, handler=_bench),
    _Command(name="run", help="run a training command, restarting it from its latest "
                              "checkpoint when it crashes: "
                              "jaxckpt run --retries 3 -- python train.py",
             add_arguments=_run_arguments, handler=_run),
)


#: The arguments that name a checkpoint root, a checkpoint, or a directory to write: checked
#: for their scheme (and against a --storage-option with no URL) before any command runs.
_PATH_ARGUMENTS = ("root", "path", "checkpoint", "out_dir", "src", "hf_dir")


def build_parser() -> argparse.ArgumentParser:
    from jaxckpt import __version__

    parser = argparse.ArgumentParser(
        prog="jaxckpt", description="Inspect jaxckpt checkpoints and run the demo.")
    parser.add_argument("--version", action="version", version=f"jaxckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxckpt`` console script; returns the exit code."""
    from jaxckpt.errors import MissingExtraError

    from .remote_cli import check_paths

    opts = build_parser().parse_args(None if argv is None else list(argv))
    if hasattr(opts, "storage_option"):  # the commands that take a path or a URL
        paths = [value for value in (getattr(opts, name, None) for name in _PATH_ARGUMENTS)
                 if isinstance(value, str)]
        refused = check_paths(opts.command, opts, *paths)
        if refused is not None:
            return refused
    try:
        return opts.handler(opts)
    except MissingExtraError as exc:  # the environment lacks an extra: usage, not corruption
        print(f"jaxckpt {opts.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
