"""Reading checkpoint settings written for other frameworks: AReaL-style and torchtune configs.

Owns: translating those configs (dicts, OmegaConf ``DictConfig`` objects or YAML files)
into a ``ManagerSpec`` that builds a manager. They are read with OmegaConf itself, so
interpolations and ``???`` behave as in those tools; only the keys read here are resolved.
A known field with no meaning here is listed in ``ManagerSpec.ignored``; an unknown field in
a section read here is an error naming the nearest known name (a typo must not silently
disable saving). The dialects, with examples: docs/migration.md.

Must not import: jax, orbax, torch. OmegaConf (the ``compat`` extra) is imported when a
config is read.

Concurrency: functions without state; a ``ManagerSpec`` is frozen.
"""

from __future__ import annotations

import dataclasses
import difflib
import getpass
import os
import warnings
from collections.abc import Mapping
from typing import Any, cast

from .config import Every, ExportConfig, RecoverConfig, RecoverMode, SaveMode
from .core.extras import requires_extra
from .errors import CheckpointWarning, ConfigError

__all__ = ["ManagerSpec", "load_config", "from_areal", "from_torchtune"]

_FEATURE = "reading AReaL and torchtune configs (jaxckpt.compat)"
_AREAL_MODES: dict[str, RecoverMode] = {
    "on": "on", "auto": "auto", "off": "off", "disabled": "disabled",
    # Older AReaL spellings. "fault" resumed only after a failure, which is what
    # resuming whenever a valid checkpoint exists amounts to for a fresh job.
    "fault": "auto", "resume": "on"}
_AREAL_TIMER = {"freq_epochs", "freq_steps", "freq_secs", "experiment_name", "trial_name",
                "fileroot"}
_AREAL_IGNORED = {"no_save_optim", "no_load_optim"}
# Recipe-level keys read here. Earlier versions also documented them inside ``checkpointer``.
_TORCHTUNE_KEYS = {"output_dir", "enable_async_checkpointing", "keep_last_n_checkpoints",
                   "save_every_n_steps", "save_every_n_epochs", "resume_from_checkpoint"}
# The parameters of torchtune's checkpointers (FullModelHF/Meta/TorchTune, Distributed):
# anything else under ``checkpointer`` would make torchtune fail at instantiation too.
_TORCHTUNE_CHECKPOINTER = _TORCHTUNE_KEYS | {
    "_component_", "checkpoint_dir", "checkpoint_files", "model_type", "adapter_checkpoint",
    "recipe_checkpoint", "safe_serialization", "should_load_recipe_state", "enable_dcp",
    "process_group"}


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
        from jaxckpt.manager.manager import CheckpointManager

        return CheckpointManager(**self.kwargs(root, exporter=exporter), **kwargs)

    def kwargs(self, root: str | None = None, *, exporter: Any = None) -> dict[str, Any]:
        """Constructor arguments shared by both managers."""
        root = root or self.root
        if root is None:
            raise ConfigError("the config names no checkpoint root (AReaL: cluster.fileroot + "
                              "experiment_name + trial_name; torchtune: output_dir); pass root=.")
        if exporter is not None and self.export_every is None:
            raise ConfigError("exporter= was given, but the config names no export cadence "
                              "(torchtune configs have none; AReaL's is the saver section): "
                              "drop exporter= and pass export=jaxckpt.ExportConfig(every=..., "
                              "exporter=...) to the manager.")
        export = self.export(exporter) if exporter is not None else None
        return {"root": root, "recover": self.recover, "export": export, "mode": self.mode}


@dataclasses.dataclass(frozen=True)
class _Config:
    """A config as OmegaConf holds it, with where it came from (for messages)."""

    node: Any
    """The top-level ``DictConfig``."""
    origin: str
    """The file it was read from, or a description of the object given."""
    error: type[Exception]
    """OmegaConf's base exception (imported with OmegaConf)."""

    def section(self, parent: Any, name: str, where: str) -> Any:
        """``parent[name]`` as a mapping, or None when absent or null."""
        value = self.value(parent, name, where)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{self.origin}: {where} must be a mapping, got {value!r}.")
        return value

    def value(self, parent: Any, name: str, where: str) -> Any:
        """``parent[name]`` resolved (None when absent). A reference that does not resolve,
        or a mandatory value left ``???``, raises ``ConfigError`` naming the key."""
        if parent is None or name not in parent.keys():
            return None
        try:
            return parent[name]
        except self.error as exc:
            key = getattr(exc, "full_key", None) or where
            reason = str(exc).splitlines()[0]
            if "Missing mandatory value" in str(exc):  # itself, or what it refers to
                raise ConfigError(
                    f"{self.origin}: {key} needs a missing mandatory value ('???'): "
                    f"{reason}. Set it in the config (or as an override of the tool that "
                    f"reads it).") from exc
            raise ConfigError(
                f"{self.origin}: cannot resolve {key} ({_raw(parent, name)}): {reason}. "
                f"Define the key it refers to, or write the value itself.") from exc

    def check_known(self, section: Any, known: set[str], where: str) -> None:
        """``ConfigError`` naming every field of ``section`` outside ``known``, each with the
        nearest known name."""
        unknown = sorted(str(key) for key in section.keys() if key not in known)
        if not unknown:
            return
        names = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            names.append(f"{where}.{name}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError(f"{self.origin}: unknown field(s) {', '.join(names)}; {where} "
                          f"knows {sorted(known)}. Fix the spelling or remove them: an unknown "
                          f"field would otherwise be dropped silently.")


def _raw(parent: Any, name: str) -> str:
    """The text of an unresolved value (``'${output_dir}'``), for a message."""
    try:
        return repr(parent._get_node(name)._value())
    except Exception:  # OmegaConf internals: the message only loses a detail
        return "a reference"


def _open(source: Any, origin: str | None = None) -> _Config:
    """The config as an OmegaConf ``DictConfig``: a YAML path is loaded, a mapping wrapped."""
    with requires_extra("compat", _FEATURE):
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist.")
        try:
            node: Any = OmegaConf.load(path)
        except Exception as exc:  # YAML syntax, duplicate keys: what OmegaConf refuses
            raise ConfigError(f"{path}: OmegaConf cannot read this file: {exc}") from exc
        origin = origin or path
    elif isinstance(source, DictConfig):
        node = source
    elif isinstance(source, Mapping):
        try:
            node = OmegaConf.create(dict(source))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{origin or 'the config'}: OmegaConf cannot hold it: {exc}"
                              ) from exc
    else:
        raise ConfigError(f"a config must be a mapping, got {type(source).__name__}.")
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{origin or 'the config'}: a config must be a mapping, got "
                          f"{type(node).__name__}.")
    return _Config(node, origin or "the config", OmegaConfBaseException)


def _every(cfg: _Config, section: Any, where: str) -> Every:
    steps, epochs, seconds = (cfg.value(section, name, f"{where}.{name}")
                              for name in ("freq_steps", "freq_epochs", "freq_secs"))
    try:
        return Every(steps=steps, epochs=epochs, seconds=seconds)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.origin}: {where}: {exc} (from freq_steps/freq_epochs/"
                          f"freq_secs)") from None


def _areal_root(cfg: _Config, recover: Any) -> str | None:
    """AReaL's layout: ``{fileroot}/checkpoints/{user}/{experiment}/{trial}``."""
    top = cfg.node
    cluster = cfg.section(top, "cluster", "cluster")
    fileroot = (cfg.value(recover, "fileroot", "recover.fileroot")
                or cfg.value(cluster, "fileroot", "cluster.fileroot")
                or cfg.value(top, "fileroot", "fileroot"))
    experiment = (cfg.value(recover, "experiment_name", "recover.experiment_name")
                  or cfg.value(top, "experiment_name", "experiment_name"))
    trial = (cfg.value(recover, "trial_name", "recover.trial_name")
             or cfg.value(top, "trial_name", "trial_name"))
    if not (fileroot and experiment and trial):
        return None
    return os.path.join(str(fileroot), "checkpoints", getpass.getuser(), str(experiment),
                        str(trial))


def from_areal(config: Mapping[str, Any], *, origin: str | None = None) -> ManagerSpec:
    """Translate an AReaL-style config (top-level mapping with ``recover`` and/or ``saver``);
    ``origin`` names it in errors (a file's path)."""
    return _from_areal(_open(config, origin))


def _from_areal(cfg: _Config) -> ManagerSpec:
    recover = cfg.section(cfg.node, "recover", "recover")
    saver = cfg.section(cfg.node, "saver", "saver")
    if recover is not None:
        cfg.check_known(recover, _AREAL_TIMER | _AREAL_IGNORED | {"mode", "retries"}, "recover")
    raw_mode = str(cfg.value(recover, "mode", "recover.mode") or "disabled")
    if raw_mode not in _AREAL_MODES:
        raise ConfigError(f"{cfg.origin}: recover.mode={raw_mode!r} is not an AReaL recover "
                          f"mode; use one of {sorted(_AREAL_MODES)}.")
    retries = cfg.value(recover, "retries", "recover.retries")
    recover_config = RecoverConfig(mode=_AREAL_MODES[raw_mode],
                                   every=_every(cfg, recover, "recover"),
                                   keep_last_n=1, retries=3 if retries is None else retries)
    export_every: Every | None = None
    export_mode: SaveMode = "auto"
    if saver is not None:
        cfg.check_known(saver, _AREAL_TIMER | {"mode"}, "saver")
        export_every = _every(cfg, saver, "saver")
        raw_export_mode = str(cfg.value(saver, "mode", "saver.mode") or "auto")
        if raw_export_mode not in ("auto", "sync", "async"):
            raise ConfigError(f"{cfg.origin}: saver.mode={raw_export_mode!r}: use 'auto', "
                              f"'sync' or 'async'.")
        export_mode = cast(SaveMode, raw_export_mode)
    ignored = tuple(f"recover.{k}" for k in sorted(_AREAL_IGNORED & set(recover or ())))
    return ManagerSpec(root=_areal_root(cfg, recover), recover=recover_config, mode="auto",
                       export_every=export_every, export_mode=export_mode, ignored=ignored)


def _flag(cfg: _Config, value: Any, key: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{cfg.origin}: {key} must be true or false, got {value!r}.")
    return value


def _torchtune_places(cfg: _Config) -> list[tuple[str, Any]]:
    """Where torchtune recipes keep the keys read here, first match wins: the recipe's top
    level, the async GRPO recipe's ``training`` section, then the checkpointer's section
    (which is checked for unknown fields)."""
    top = cfg.node
    training = cfg.section(top, "training", "training")
    places: list[tuple[str, Any]] = [("", top)]
    if training is not None:
        places.append(("training.", training))
    checkpointer, where = cfg.section(top, "checkpointer", "checkpointer"), "checkpointer"
    if checkpointer is None and training is not None:
        checkpointer = cfg.section(training, "checkpointer", "training.checkpointer")
        where = "training.checkpointer"
    if checkpointer is not None:
        cfg.check_known(checkpointer, _TORCHTUNE_CHECKPOINTER, where)
        places.append((where + ".", checkpointer))
    return places


def from_torchtune(config: Mapping[str, Any], *, origin: str | None = None) -> ManagerSpec:
    """Translate torchtune recipe keys (top level, the async GRPO recipe's ``training``
    section, or the ``checkpointer`` section); ``origin`` names the config in errors."""
    return _from_torchtune(_open(config, origin))


def _from_torchtune(cfg: _Config) -> ManagerSpec:
    places = _torchtune_places(cfg)

    def pick(name: str, *, root: bool = False) -> tuple[Any, str]:
        # The root is where the checkpointer writes: its own output_dir first.
        for prefix, node in (reversed(places) if root else places):
            if name in node.keys():
                return cfg.value(node, name, prefix + name), prefix + name
        return None, name

    keep, _ = pick("keep_last_n_checkpoints")
    async_on = _flag(cfg, *pick("enable_async_checkpointing"), False)
    resume = _flag(cfg, *pick("resume_from_checkpoint"), True)
    steps, steps_key = pick("save_every_n_steps")
    epochs, epochs_key = pick("save_every_n_epochs")
    root, _ = pick("output_dir", root=True)
    try:
        # torchtune without save_every_n_steps saves once per epoch.
        every = Every(steps=steps, epochs=epochs if epochs is not None or steps else 1)
        recover = RecoverConfig(mode="auto", every=every, keep_last_n=keep, resume=resume)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.origin}: {exc} (from keep_last_n_checkpoints / {steps_key} / "
                          f"{epochs_key})") from None
    return ManagerSpec(root=None if root is None else str(root), recover=recover,
                       mode="async" if async_on else "sync")


def load_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> ManagerSpec:
    """Read an AReaL-style or torchtune config (a dict, an OmegaConf ``DictConfig``, or a path
    to a YAML file)."""
    cfg = _open(source)
    keys = set(cfg.node.keys())
    training = cfg.node.get("training") if "training" in keys else None
    if "recover" in keys or "saver" in keys:
        spec = _from_areal(cfg)
    elif keys & _TORCHTUNE_KEYS or "checkpointer" in keys or (
            isinstance(training, Mapping) and "checkpointer" in training.keys()):
        spec = _from_torchtune(cfg)
    else:
        raise ConfigError(f"{cfg.origin} has neither AReaL sections (recover/saver) nor "
                          f"torchtune keys ({sorted(_TORCHTUNE_KEYS)} or a checkpointer "
                          f"section); nothing to translate.")
    if spec.ignored:
        warnings.warn(f"ignored settings with no meaning in jaxckpt: {list(spec.ignored)}",
                      CheckpointWarning, stacklevel=2)
    return spec
