"""Reading checkpoint settings written for other frameworks: AReaL-style and torchtune configs.

Owns: translating those dicts (or YAML files) into jaxckpt's configs, as a ``ManagerSpec``
that builds a manager. Only fields that mean something here are read; a field that is known
but has no meaning here is reported in ``ManagerSpec.ignored``, and an unknown field in a
section this module reads is an error naming it (a typo must not silently disable saving).

AReaL-style (``recover`` and ``saver`` sections share ``freq_epochs``/``freq_steps``/
``freq_secs``, plus ``experiment_name``/``trial_name``/``fileroot``)::

    experiment_name: sft-llama
    trial_name: run-1
    cluster: {fileroot: /data}
    recover: {mode: auto, freq_steps: 500, freq_secs: 3600, retries: 3}
    saver: {freq_epochs: 1, mode: async}

torchtune (recipe-level keys, also accepted inside ``checkpointer``)::

    output_dir: /ckpt/run-1
    enable_async_checkpointing: true
    keep_last_n_checkpoints: 2
    save_every_n_steps: 1000

Must not import: jax, orbax, torch. PyYAML is imported only to read a YAML file.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any, cast

from .config import Every, ExportConfig, RecoverConfig, RecoverMode, SaveMode
from .errors import CheckpointWarning, ConfigError

__all__ = ["ManagerSpec", "load_config", "from_areal", "from_torchtune"]

_AREAL_MODES: dict[str, RecoverMode] = {
    "on": "on", "auto": "auto", "off": "off", "disabled": "disabled",
    # Older AReaL spellings. "fault" resumed only after a failure, which is what
    # resuming whenever a valid checkpoint exists amounts to for a fresh job.
    "fault": "auto", "resume": "on"}
_AREAL_TIMER = {"freq_epochs", "freq_steps", "freq_secs", "experiment_name", "trial_name",
                "fileroot"}
_AREAL_IGNORED = {"no_save_optim", "no_load_optim"}
_TORCHTUNE_KEYS = {"output_dir", "enable_async_checkpointing", "keep_last_n_checkpoints",
                   "save_every_n_steps", "save_every_n_epochs"}
_INTERPOLATION = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ManagerSpec:
    """Settings read from a foreign config, ready to build a manager."""

    root: str | None
    """Checkpoint root (None when the config does not say; pass one to ``manager``)."""
    recover: RecoverConfig
    """Recovery settings."""
    mode: SaveMode = "auto"
    """Save mode for recovery checkpoints."""
    export_every: Every | None = None
    """Cadence of model exports (AReaL's saver); needs an exporter to become an ExportConfig."""
    export_mode: SaveMode = "auto"
    """Save mode of exports."""
    ignored: tuple[str, ...] = ()
    """Known fields that have no meaning in jaxckpt (e.g. ``recover.no_save_optim``)."""

    def export(self, exporter: Any, *, keep_last_n: int | None = None) -> ExportConfig | None:
        """The ExportConfig for ``exporter`` on the config's cadence (None if it has none)."""
        if self.export_every is None:
            return None
        return ExportConfig(every=self.export_every, exporter=exporter, mode=self.export_mode,
                            keep_last_n=keep_last_n)

    def manager(self, root: str | None = None, *, exporter: Any = None, **kwargs: Any):
        """A CheckpointManager (JAX) built from these settings; ``kwargs`` pass through
        (e.g. ``backend=``). For torch use
        ``torch_bridge.DcpCheckpointManager(**spec.kwargs())``."""
        from .manager import CheckpointManager

        return CheckpointManager(**self.kwargs(root, exporter=exporter), **kwargs)

    def kwargs(self, root: str | None = None, *, exporter: Any = None) -> dict[str, Any]:
        """Constructor arguments shared by both managers."""
        root = root or self.root
        if root is None:
            raise ConfigError("the config names no checkpoint root (AReaL: cluster.fileroot + "
                              "experiment_name + trial_name; torchtune: output_dir); pass root=.")
        export = self.export(exporter) if exporter is not None else None
        return {"root": root, "recover": self.recover, "export": export, "mode": self.mode}


def _resolve(value: Any, top: Mapping[str, Any]) -> Any:
    """Resolve an OmegaConf-style ``${a.b}`` reference to a top-level key, as AReaL YAML uses."""
    if not isinstance(value, str):
        return value
    match = _INTERPOLATION.match(value)
    if not match:
        return value
    node: Any = top
    for part in match.group(1).split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(f"cannot resolve {value!r}: no key {match.group(1)!r} in the config.")
        node = node[part]
    return node


def _every(section: Mapping[str, Any], where: str, top: Mapping[str, Any]) -> Every:
    def get(name: str) -> Any:
        return _resolve(section.get(name), top)

    try:
        return Every(steps=get("freq_steps"), epochs=get("freq_epochs"), seconds=get("freq_secs"))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc} (from freq_steps/freq_epochs/freq_secs)") from None


def _check_known(section: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown field(s) {unknown}; known: {sorted(known)}. "
                          f"Fix the spelling or remove them.")


def from_areal(config: Mapping[str, Any]) -> ManagerSpec:
    """Translate an AReaL-style config (top-level dict with ``recover`` and/or ``saver``)."""
    recover = config.get("recover") or {}
    saver = config.get("saver")
    if not isinstance(recover, Mapping) or (saver is not None and not isinstance(saver, Mapping)):
        raise ConfigError("recover and saver must be mappings in an AReaL-style config.")
    _check_known(recover, _AREAL_TIMER | _AREAL_IGNORED | {"mode", "retries"}, "recover")
    raw_mode = str(_resolve(recover.get("mode", "disabled"), config))
    if raw_mode not in _AREAL_MODES:
        raise ConfigError(f"recover.mode={raw_mode!r} is not an AReaL recover mode; use one of "
                          f"{sorted(_AREAL_MODES)}.")
    retries = _resolve(recover.get("retries", 3), config)
    recover_config = RecoverConfig(mode=_AREAL_MODES[raw_mode],
                                   every=_every(recover, "recover", config),
                                   keep_last_n=1, retries=retries)
    export_every: Every | None = None
    export_mode: SaveMode = "auto"
    if saver is not None:
        _check_known(saver, _AREAL_TIMER | {"mode"}, "saver")
        export_every = _every(saver, "saver", config)
        raw_export_mode = str(_resolve(saver.get("mode", "auto"), config))
        if raw_export_mode not in ("auto", "sync", "async"):
            raise ConfigError(f"saver.mode={raw_export_mode!r}: use 'auto', 'sync' or 'async'.")
        export_mode = cast(SaveMode, raw_export_mode)
    fileroot = _resolve(recover.get("fileroot") or (config.get("cluster") or {}).get("fileroot")
                        or config.get("fileroot"), config)
    experiment = _resolve(recover.get("experiment_name") or config.get("experiment_name"), config)
    trial = _resolve(recover.get("trial_name") or config.get("trial_name"), config)
    root = None
    if fileroot and experiment and trial:
        # AReaL's layout: {fileroot}/checkpoints/{user}/{experiment}/{trial}
        root = os.path.join(str(fileroot), "checkpoints", getpass.getuser(), str(experiment),
                            str(trial))
    ignored = tuple(f"recover.{k}" for k in sorted(_AREAL_IGNORED & set(recover)))
    return ManagerSpec(root=root, recover=recover_config, mode="auto", export_every=export_every,
                       export_mode=export_mode, ignored=ignored)


def from_torchtune(config: Mapping[str, Any]) -> ManagerSpec:
    """Translate torchtune recipe keys (top level, or inside ``checkpointer``)."""
    merged: dict[str, Any] = {}
    checkpointer = config.get("checkpointer") or {}
    for source in (checkpointer, config):  # recipe-level keys win
        if isinstance(source, Mapping):
            merged.update({k: v for k, v in source.items() if k in _TORCHTUNE_KEYS})
    keep = merged.get("keep_last_n_checkpoints")
    async_on = merged.get("enable_async_checkpointing", False)
    if not isinstance(async_on, bool):
        raise ConfigError(f"enable_async_checkpointing must be true or false, got {async_on!r}.")
    try:
        every = Every(steps=merged.get("save_every_n_steps"),
                      epochs=merged.get("save_every_n_epochs",
                                        None if merged.get("save_every_n_steps") else 1))
        recover = RecoverConfig(mode="auto", every=every, keep_last_n=keep)
    except ConfigError as exc:
        raise ConfigError(f"torchtune config: {exc} (from keep_last_n_checkpoints / "
                          f"save_every_n_steps / save_every_n_epochs)") from None
    return ManagerSpec(root=merged.get("output_dir"), recover=recover,
                       mode="async" if async_on else "sync")


def load_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> ManagerSpec:
    """Read an AReaL-style or torchtune config (a dict, or a path to a YAML file)."""
    if isinstance(source, (str, os.PathLike)):
        import yaml  # only needed for files

        path = os.fspath(source)
        try:
            with open(path) as handle:
                source = yaml.safe_load(handle) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist.") from None
    if not isinstance(source, Mapping):
        raise ConfigError(f"a config must be a mapping, got {type(source).__name__}.")
    if "recover" in source or "saver" in source:
        spec = from_areal(source)
    elif set(source) & _TORCHTUNE_KEYS or "checkpointer" in source:
        spec = from_torchtune(source)
    else:
        raise ConfigError("this config has neither AReaL sections (recover/saver) nor torchtune "
                          f"keys ({sorted(_TORCHTUNE_KEYS)}); nothing to translate.")
    if spec.ignored:
        warnings.warn(f"ignored settings with no meaning in jaxckpt: {list(spec.ignored)}",
                      CheckpointWarning, stacklevel=2)
    return spec
