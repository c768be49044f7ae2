"""The logic behind ``jaxckpt export-hf`` and ``jaxckpt import-hf``.

Owns: a committed recovery checkpoint (Orbax backend) into a Hugging Face model directory,
and a Hugging Face directory into a recovery checkpoint, with their progress displays
(``tools.progress``); argument parsing is ``tools.cli``'s. Roots may be paths or URLs: a
checkpoint on a URL is read through its root's store, an export to a URL staged locally,
then uploaded and committed (``commit.object_steps.publish_export``). Reading never takes
the root's lock nor cleans up, and holds the store's read lock, so exporting while the
training job runs is safe.

Importing this module imports neither jax nor torch; the functions import jax/orbax when they
read or write a recovery checkpoint.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any, Literal

from jaxckpt.commit.object_steps import export_staging
from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError
from torch_bridge.hf import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    EXPORTER_RECORD_FORMAT,
    Architecture,
    arch_for_model_type,
    export_hf,
    load_hf,
    resolve_architecture,
)

from .hf_dcp import DCP_BACKEND, export_dcp_step
from .progress import make_progress

__all__ = [
    "export_checkpoint_to_hf",
    "import_hf_to_checkpoint",
    "HFConfigState",
    "HF_CONFIG_STATEFUL",
    "parse_size",
    "make_progress",
]

#: name of the stateful entry in which import-hf records the HF config.
HF_CONFIG_STATEFUL = "hf_config"


class HFConfigState:
    """Carries a Hugging Face config.json dict (and the arch) through a recovery checkpoint.

    ``import_hf_to_checkpoint`` saves one under ``stateful["hf_config"]``; pass
    ``stateful={"hf_config": HFConfigState()}`` to ``restore``/``recover`` to get it back (and
    to avoid the warning about unrestored state). Plain data; not shared across threads.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, *, arch: str | None = None):
        self.config = dict(config) if config is not None else None
        self.arch = arch

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config, "arch": self.arch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.config = state.get("config")
        self.arch = state.get("arch")


# ------------------------------------------------------------------------------ helpers

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"``, ``"500MiB"``, ``"1e9"`` or an int (as transformers'
    max_shard_size: decimal units, binary with an "i")."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match[2].lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise ConfigError(f"size {text!r} is not understood; write e.g. 5GB, 500MiB or 1000000.")
    try:
        value = float(match[1]) * _SIZE_UNITS[unit]
    except ValueError:
        raise ConfigError(f"size {text!r} is not understood; write e.g. 5GB.") from None
    if value < 1:
        raise ConfigError(f"size {text!r} must be at least one byte.")
    return int(value)


def _close(progress: Any) -> None:
    if progress is not None:
        progress.close()


# ------------------------------------------------------- reading an Orbax checkpoint

_TOKEN = re.compile(r"\[(?P<int>-?\d+)\]|\[(?P<str>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]"
                    r"|\.(?P<attr>[A-Za-z_][A-Za-z0-9_]*)")


def _parse_keystr(path: str) -> list[tuple[str, Any]]:
    """``"['a'][0].value"`` -> [("item", "a"), ("item", 0), ("attr", "value")]."""
    tokens: list[tuple[str, Any]] = []
    position = 0
    while position < len(path):
        match = _TOKEN.match(path, position)
        if not match:
            raise CheckpointCorruptError(f"cannot parse the tree path {path!r} at {position}")
        if match["int"] is not None:
            tokens.append(("item", int(match["int"])))
        elif match["str"] is not None:
            tokens.append(("item", ast.literal_eval(match["str"])))
        else:
            tokens.append(("attr", match["attr"]))
        position = match.end()
    return tokens


_ATTRS_REGISTERED = False


def _attrs_node() -> type:
    """A pytree node whose children are keyed by attribute name (GetAttrKey), so a like tree
    rebuilt from saved paths such as ``[0]['kernel'].value`` has the same key paths."""
    global _ATTRS_REGISTERED
    import jax

    if not _ATTRS_REGISTERED:
        jax.tree_util.register_pytree_with_keys(
            _Attrs,
            lambda node: ([(jax.tree_util.GetAttrKey(k), v) for k, v in node.children.items()],
                          tuple(node.children)),
            lambda names, values: _Attrs(dict(zip(names, values, strict=True))))
        _ATTRS_REGISTERED = True
    return _Attrs


class _Attrs:
    __slots__ = ("children",)

    def __init__(self, children: dict[str, Any]):
        self.children = children


def _tree_document(store: Any, state_dir: str) -> dict[str, Any]:
    """The backend's tree.json of ``state_dir``, read through ``store``'s storage (a local
    directory or an object-store prefix); export-hf reads Orbax-backend checkpoints only."""
    from jaxckpt.core.layout import TREE_FILE
    from jaxckpt.core.tree_record import parse_tree_record, read_tree_record
    from jaxckpt.storage.posix import PosixStorage

    if isinstance(store.storage, PosixStorage):
        return read_tree_record(state_dir)
    try:
        text = store.storage.read(os.path.join(state_dir, TREE_FILE))
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{state_dir} has no {TREE_FILE}: it was not written by jaxckpt's Orbax backend "
            f"(jaxckpt.CheckpointManager), or its write did not finish.") from None
    return parse_tree_record(text, state_dir)


def _like_from_tree_json(state_dir: str, document: Mapping[str, Any] | None = None
                         ) -> tuple[Any, dict[str, dict[str, Any]]]:
    """An abstract ``like`` with exactly the saved tree paths, from the backend's tree.json
    (``document``, as ``_tree_document`` read it; None: read from the local ``state_dir``)."""
    import jax
    import jax.numpy as jnp

    from jaxckpt.core.layout import TREE_FILE
    from jaxckpt.core.tree_record import read_tree_record

    tree_file = os.path.join(state_dir, TREE_FILE)  # named in the errors below
    if document is None:
        document = read_tree_record(state_dir)
    attrs = _attrs_node()
    root: dict[Any, Any] = {}
    kinds: dict[int, str] = {}  # id(container) -> "item" | "attr"
    entries = {}
    for entry in document["leaves"]:
        entries[entry["path"]] = entry
        tokens = _parse_keystr(entry["path"])
        if not tokens:
            raise CheckpointCorruptError(f"{tree_file}: a leaf at the root is not supported")
        leaf: Any
        if entry["kind"] == "key":
            leaf = jax.ShapeDtypeStruct(tuple(entry["shape"]),
                                        jax.random.key(0, impl=entry["impl"]).dtype)
        elif entry["kind"] == "scalar":
            leaf = {"bool": False, "int": 0, "float": 0.0}[entry["python_type"]]
        else:
            leaf = jax.ShapeDtypeStruct(tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
        node = root
        for depth, (kind, key) in enumerate(tokens):
            if kinds.setdefault(id(node), kind) != kind:
                raise CheckpointCorruptError(
                    f"{tree_file}: {entry['path']} mixes item and attribute keys at one level")
            if depth == len(tokens) - 1:
                node[key] = leaf
            else:
                node = node.setdefault(key, {})

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        children = {key: build(child) for key, child in node.items()}
        return attrs(children) if kinds.get(id(node)) == "attr" else children

    return build(root), entries


def _read_checkpoint(step_dir: str, store: Any
                     ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every leaf of a recovery checkpoint's array state, by saved tree path, read through
    ``store`` (the backend is handed an object-store root's storage)."""
    from jaxckpt.core.extras import requires_extra
    from jaxckpt.core.layout import STATE_DIR

    with requires_extra("jax", "jaxckpt export-hf (it reads the checkpoint with Orbax)"):
        import jax

    from jaxckpt.backends.orbax.backend import OrbaxBackend
    from jaxckpt.manager.root import attach_backend

    state_dir = os.path.join(step_dir, STATE_DIR)
    like, entries = _like_from_tree_json(state_dir, _tree_document(store, state_dir))
    backend = OrbaxBackend()
    try:
        attach_backend(store, backend)
        state = backend.read(state_dir, like)
    finally:
        backend.close()
    leaves = {jax.tree_util.keystr(path): leaf
              for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    return leaves, entries


def _dotted(path: str) -> str:
    """Saved tree path -> dotted param path; nnx Variables' trailing ``.value`` dropped."""
    tokens = _parse_keystr(path)
    while tokens and tokens[-1] == ("attr", "value"):
        tokens.pop()
    return ".".join(str(key) for _, key in tokens)


def _select_params(leaves: Mapping[str, Any], entries: Mapping[str, Mapping[str, Any]],
                   table: Architecture, params_path: str | None,
                   hint: str = "") -> tuple[dict[str, Any], str]:
    """The param subtree of a training state: under ``params_path`` ('/'-separated keys as
    hf_exporter's params_of, or dotted), or found by looking for the table's first param
    (e.g. ``embed.embedding``) at the shallowest depth (optimizer moments repeat the param
    tree deeper down). Returns the params and their path, '/'-separated."""
    dotted = {path: _dotted(path) for path in leaves}
    if params_path is not None:
        params_path = params_path.strip("/").replace("/", ".")
    else:
        anchor = next(p for row in table.tensors for p in row.parts if not row.per_layer)
        candidates = sorted({d[: -len(anchor)].rstrip(".") for d in dotted.values()
                             if d == anchor or d.endswith("." + anchor)},
                            key=lambda p: (p.count(".") + (p != ""), p))
        if not candidates:
            sample = sorted(dotted.values())[:8]
            raise ConfigError(
                f"no {anchor!r} param found in the checkpoint for arch={table.name!r} (paths "
                f"look like {sample}). Pass params_path= (--params-path) naming the subtree "
                f"that holds the model params, e.g. 'model/params' or '0'.{hint}")
        depth = lambda p: p.count(".") + (p != "")  # noqa: E731
        best = [c for c in candidates if depth(c) == depth(candidates[0])]
        if len(best) > 1:
            raise ConfigError(f"several subtrees look like model params: "
                              f"{[b.replace('.', '/') for b in best]}; pass params_path= "
                              f"(--params-path) to pick one.{hint}")
        params_path = best[0]
    prefix = f"{params_path}." if params_path else ""
    flat = {}
    for path, name in dotted.items():
        if name.startswith(prefix):
            entry = entries[path]
            # RNG keys and counters of an nnx model are state, not weights.
            if entry["kind"] != "array" or not (entry["dtype"].startswith(("float", "bfloat"))):
                continue
            flat[name[len(prefix):]] = leaves[path]
    if not flat:
        raise ConfigError(f"params_path {params_path.replace('.', '/')!r} holds no float "
                          f"arrays in the checkpoint.{hint}")
    return flat, params_path.replace(".", "/")


def _open_checkpoint(checkpoint: str, storage_options: Mapping[str, Any] | None
                     ) -> tuple[Any, str | None]:
    """(the store of the root that ``checkpoint`` names, the committed step directory it
    names or None for a root): a local path, or an ``s3://`` / ``gs://`` URL of a root or of
    one ``ROOT/recover/step_N`` (its storage made from ``storage_options`` and the
    environment, ``jaxckpt.storage.url.parse_root``). Nothing is created anywhere."""
    from jaxckpt.commit.store import CheckpointStore
    from jaxckpt.core.layout import COMMIT_MARKER, RECOVER, parse_step_dirname
    from jaxckpt.storage.url import is_url, parse_root

    if not is_url(checkpoint):
        path = os.path.abspath(checkpoint)
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"no checkpoint root or step directory at {checkpoint!r}")
        if os.path.exists(os.path.join(path, COMMIT_MARKER)):  # a step directory itself
            return CheckpointStore(os.path.dirname(os.path.dirname(path))), path
        return CheckpointStore(path), None
    url = checkpoint.rstrip("/")
    parent, _, name = url.rpartition("/")
    names_step = parse_step_dirname(name) is not None and parent.endswith("/" + RECOVER)
    root = parent.rpartition("/")[0] if names_step else url
    _, storage = parse_root(root, storage_options)
    assert not isinstance(storage, str)  # a URL, so never a local path
    store = CheckpointStore(root, storage=storage)
    if names_step and storage.exists(os.path.join(url, COMMIT_MARKER)):
        return store, url
    if not names_step and storage.is_prefix(store.recover_dir):
        return store, None
    raise CheckpointNotFoundError(f"no committed checkpoint or checkpoint root at {url!r} "
                                  f"(nothing under {store.recover_dir if not names_step else url}"
                                  f" that jaxckpt committed)")


def _locate(checkpoint: str, step: int | None, verify: Literal["checksums", "sizes"],
            storage_options: Mapping[str, Any] | None = None) -> tuple[str, Any]:
    """The committed step directory to read, and the store that owns it."""
    store, named = _open_checkpoint(checkpoint, storage_options)
    checksums = verify == "checksums"
    if named is not None:
        step_dir = named
    else:
        if step is None:
            entry, skipped = store.latest_valid(checksums=checksums)
            if entry is None:
                why = "; ".join(f"{e.path}: {e.status}" for e in skipped) or "none committed"
                raise CheckpointNotFoundError(
                    f"no valid recovery checkpoint under {store.recover_dir} ({why}).")
            return entry.path, store
        step_dir = store.step_path(step)
    problems = store.verify(step_dir, checksums=checksums)
    if problems:
        raise CheckpointCorruptError(f"{step_dir} failed verification: " + "; ".join(problems))
    return step_dir, store




def _read_config(config: Any) -> Any:
    """A config given as an argument: a config.json path, an HF directory, or an object."""
    if isinstance(config, (str, os.PathLike)):
        file = os.fspath(config)
        if os.path.isdir(file):
            file = os.path.join(file, CONFIG_FILE)
        try:
            with open(file, encoding="utf-8") as handle:
                return json.load(handle)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no config file at {file!r}") from None
    return config


def _recorded(driver: Mapping[str, Any], step_dir: str) -> dict[str, Any]:
    """What the checkpoint says about its model: from the HF exporter of the manager that
    wrote it (driver.json "export"), else from import-hf (the "hf_config" stateful entry).
    Keys: arch, config, params_path (each may be missing), source (for messages)."""
    export = driver.get("export")
    if isinstance(export, Mapping) and export.get("format") == EXPORTER_RECORD_FORMAT:
        recorded = {"source": "hf_exporter", "config": export.get("config"),
                    "params_of": export.get("params_of")}
        if export.get("arch_known", True):
            recorded["arch"] = export.get("arch")
        else:
            recorded["custom_arch"] = export.get("arch")
        if export.get("params_path"):
            recorded["params_path"] = export["params_path"]
        return recorded
    saved = ((driver.get("local") or {}).get("stateful") or {}).get(HF_CONFIG_STATEFUL)
    if saved is not None:
        from jaxckpt.manager.driver_state import restore_stateful

        holder = HFConfigState()
        restore_stateful({HF_CONFIG_STATEFUL: holder}, {HF_CONFIG_STATEFUL: saved}, step_dir)
        return {"source": "import-hf", "config": holder.config, "arch": holder.arch}
    return {"source": None}


def _missing_flags_error(step_dir: str, recorded: Mapping[str, Any], *, need_arch: bool,
                         need_config: bool) -> ConfigError:
    flags = []
    if need_arch:
        flags.append("--arch llama")
    if need_config:
        flags.append("--config path/to/config.json")
    if recorded.get("custom_arch"):
        why = (f"its exporter used a custom Architecture table {recorded['custom_arch']!r}, "
               f"which the command line cannot name (call export_checkpoint_to_hf(..., "
               f"arch=<the table>) from Python)")
    elif recorded["source"] is None:
        why = ("it was written neither by a CheckpointManager whose ExportConfig exporter is "
               "torch_bridge.hf_exporter(...) nor by `jaxckpt import-hf`, so it records no "
               "architecture or config")
    else:
        why = f"what {recorded['source']} recorded lacks the " + (
            "architecture" if need_arch else "config")
    return ConfigError(
        f"{step_dir}: cannot tell which Hugging Face model this is: {why}. Add "
        f"{' '.join(flags)} (--arch one of llama, qwen2, gpt2; --config the model's "
        f"config.json or its HF directory), and --params-path model/params if the params are "
        f"not found on their own (the tree path of the model params in the saved state).")


def _export_spec(driver: Mapping[str, Any], step_dir: str, *, arch: Any, config: Any,
                 params_path: str | None) -> tuple[Architecture, Any, str | None, str]:
    """(table, config, params path, hint for a failed params search): the arguments win,
    then what the checkpoint recorded; a config's model_type names the arch when known."""
    recorded = _recorded(driver, step_dir)
    config = _read_config(config) if config is not None else recorded.get("config")
    if arch is None:
        arch = recorded.get("arch")
    if arch is None and isinstance(config, Mapping):
        arch = arch_for_model_type(config.get("model_type"))
    if arch is None or config is None:
        raise _missing_flags_error(step_dir, recorded, need_arch=arch is None,
                                   need_config=config is None)
    if params_path is None:
        params_path = recorded.get("params_path")
    hint = ("" if recorded.get("params_of") != "callable" else
            " The exporter that wrote this checkpoint picked the params with a callable "
            "params_of=, which cannot be recorded: pass --params-path (params_path=), or give "
            "hf_exporter a tree path such as params_of='model/params' so it is recorded.")
    return resolve_architecture(arch), config, params_path, hint


def _export_target(out_dir: str, overwrite: bool,
                   storage_options: Mapping[str, Any] | None) -> Any:
    """For an object-store ``out_dir``: its storage, after refusing (``ExportExistsError``)
    a prefix that already holds objects unless ``overwrite``; None for a local ``out_dir``
    (``export_hf`` checks it). Checked before the checkpoint is read."""
    from jaxckpt.storage.url import is_url, parse_root
    from torch_bridge.hf import ExportExistsError

    if not is_url(out_dir):
        return None
    _, storage = parse_root(out_dir, storage_options)
    assert not isinstance(storage, str)  # a URL, so never a local path
    if not overwrite and storage.is_prefix(out_dir):
        raise ExportExistsError(f"{out_dir} already holds objects; pass overwrite=True "
                                f"(--overwrite) to replace them, or another out_dir.")
    return storage


def _publish(storage: Any, local_dir: str, out_url: str) -> None:
    """Upload the export written in ``local_dir`` below ``out_url`` (replacing what is there)
    and commit it as jaxckpt commits exports on object roots: a ``COMMITTED`` manifest
    written create-only, last (``jaxckpt.commit.object_steps.publish_export``; ``from_pretrained``
    ignores the extra file). ``local_dir`` is removed."""
    from jaxckpt.commit.object_steps import publish_export
    from jaxckpt.commit.store import CheckpointStore

    publish_export(CheckpointStore(out_url.rpartition("/")[0], storage=storage), local_dir,
                   out_url)


# ------------------------------------------------------------------------ the commands


def export_checkpoint_to_hf(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                            arch: str | Architecture | None = None, config: Any = None,
                            step: int | None = None, params_path: str | None = None,
                            dtype: Any = None, max_shard_bytes: int | None = None,
                            tokenizer_dir: Any = None, generation_config: Any = None,
                            overwrite: bool = False,
                            verify: Literal["checksums", "sizes"] = "checksums",
                            progress: bool = True,
                            storage_options: Mapping[str, Any] | None = None) -> int:
    """Export the model params of a recovery checkpoint as a Hugging Face directory.

    Args:
      checkpoint: a checkpoint root (the latest valid step is used unless ``step``) or one
        ``recover/step_N`` directory; a local path or an ``s3://`` / ``gs://`` URL. A
        DcpCheckpointManager's step is written as save_pretrained writes its model (hf_dcp).
      out_dir: the HF directory to write (atomically, see ``export_hf``). An ``s3://`` /
        ``gs://`` URL: written locally in a temporary directory, uploaded below it, then
        committed with a ``COMMITTED`` manifest written last, as exports on object roots.
      arch: table name; None uses the arch the checkpoint records (written by a manager
        whose exporter is ``hf_exporter``, or by ``import-hf``), else the config's
        ``model_type``.
      config: config.json path, HF directory, dict or transformers config; None uses the
        config the checkpoint records. With neither, ``ConfigError`` says which to pass.
      params_path: tree path of the param subtree in the saved state (a DCP step's: its
        model entry, "model"), '/'-separated as ``hf_exporter``'s ``params_of`` ("0" for
        ``nnx.state((model, optimizer))``); None uses the one recorded by ``hf_exporter``,
        else finds it.
      verify: check the checkpoint against its manifest with checksums or sizes first.
      max_shard_bytes: shard size limit; None: 5 GiB for Flax params; for a DCP checkpoint
        the exporter's recorded limit, else save_pretrained's 50 GB.
      dtype, tokenizer_dir, generation_config, overwrite: as ``export_hf``.
      progress: show a progress bar on stderr.
      storage_options: the client's settings for URLs (``jaxckpt.storage.url.parse_root``);
        None takes endpoint and credentials from the standard environment.

    Returns the bytes written. The whole array state is restored to host memory (optimizer
    state included); only the params are converted and written, one shard at a time.
    """
    from jaxckpt.manager.driver_state import read_driver

    out_dir = os.fspath(out_dir).rstrip("/") or "/"
    target = _export_target(out_dir, overwrite, storage_options)
    step_dir, store = _locate(os.fspath(checkpoint), step, verify, storage_options)
    with store.reading(step_dir):
        driver = read_driver(store, step_dir)
        if driver.get("backend") == DCP_BACKEND:  # a DcpCheckpointManager's step
            return export_dcp_step(store, step_dir, driver, out_dir, target=target, config=config,
                                   params_of=params_path, dtype=dtype, progress=progress,
                                   max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                                   generation_config=generation_config)
        table, config, params_path, hint = _export_spec(driver, step_dir, arch=arch,
                                                        config=config, params_path=params_path)
        leaves, entries = _read_checkpoint(step_dir, store)
    flat, chosen = _select_params(leaves, entries, table, params_path, hint)
    step_info = driver.get("step_info") or {}

    def write(local_dir: str, bar: Any) -> int:
        return export_hf(flat, local_dir, arch=table, config=config, dtype=dtype,
                         max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                         tokenizer_dir=tokenizer_dir,
                         generation_config=generation_config, overwrite=overwrite,
                         provenance={"checkpoint": step_dir, "params_path": chosen,
                                     **{k: step_info[k] for k in ("epoch", "epoch_step",
                                                                  "global_step")
                                        if k in step_info}},
                         progress=bar)
    return _write_out(out_dir, target, progress, write)


def _write_out(out_dir: str, target: Any, progress: bool,
               write: Callable[[str, Any], int]) -> int:
    """Run ``write(local_dir, progress_bar)`` into ``out_dir``, or, for an object-store
    ``target``, into a local staging directory then uploaded and committed; the staging is
    removed either way. Returns the bytes written."""
    staging = None if target is None else export_staging(os.path.basename(out_dir))
    bar = make_progress(f"export {os.path.basename(out_dir)}", progress)
    try:
        written = write(out_dir if staging is None else os.path.join(staging, "model"), bar)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _close(bar)
    if staging is not None:
        try:
            _publish(target, os.path.join(staging, "model"), out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return written


def import_hf_to_checkpoint(hf_dir: str | os.PathLike[str], root: str | os.PathLike[str], *,
                            arch: str | Architecture, step: int = 0, stacked: bool = False,
                            dtype: Any = None, state_key: str | None = None,
                            record_config: bool = True, progress: bool = True,
                            storage_options: Mapping[str, Any] | None = None) -> str:
    """Write an HF directory's weights as a committed recovery checkpoint under ``root``
    (a local path, or an ``s3://`` / ``gs://`` URL whose client ``storage_options`` or the
    standard environment configure, as ``CheckpointManager``'s).

    The saved state is the param tree of ``load_hf`` (numpy leaves; nested under
    ``state_key`` when given), so ``CheckpointManager(root).restore(like)`` restores it with
    ``like = jaxckpt.llm.params_of(model)`` (or ``{state_key: ...}``) of a model built from
    the same config. ``record_config`` also stores config.json and the arch as the stateful
    entry "hf_config" (restore it with ``stateful={"hf_config": HFConfigState()}``), which
    lets ``export_checkpoint_to_hf`` run without ``config``/``arch``. Existing checkpoints in
    ``root`` are kept. Returns the checkpoint directory.
    """
    from jaxckpt import CheckpointManager, RecoverConfig, StepInfo

    table = resolve_architecture(arch)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be an int >= 0, got {step!r}.")
    bar = make_progress(f"import {os.path.basename(os.path.abspath(os.fspath(hf_dir)))}",
                        progress)
    try:
        params, config = load_hf(hf_dir, arch=table, stacked=stacked, dtype=dtype, progress=bar)
    finally:
        _close(bar)
    state = params if state_key is None else {state_key: params}
    stateful = ({HF_CONFIG_STATEFUL: HFConfigState(config, arch=table.name)}
                if record_config else None)
    with CheckpointManager(root, recover=RecoverConfig(mode="on", keep_last_n=None),
                           mode="sync", storage_options=storage_options) as manager:
        report = manager.save(StepInfo(0, 0, step), state, stateful=stateful, mode="sync")
    return report.path
