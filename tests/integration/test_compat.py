"""Migration: AReaL-style and torchtune configs become jaxckpt settings directly."""

import getpass
import os

import pytest

from jaxckpt import CheckpointWarning, ConfigError, Every
from jaxckpt.compat import load_config

AREAL_YAML = """
experiment_name: sft-llama
trial_name: run-1
cluster:
  fileroot: {root}
recover:
  mode: auto
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  freq_steps: 500
  freq_secs: 3600
  retries: 5
saver:
  freq_epochs: 1
  mode: sync
"""


def test_areal_yaml_file_with_interpolations(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(AREAL_YAML.format(root=tmp_path))
    spec = load_config(path)
    assert spec.recover.every == Every(steps=500, seconds=3600)
    assert spec.recover.mode == "auto" and spec.recover.retries == 5
    assert spec.export_every == Every(epochs=1) and spec.export_mode == "sync"
    assert spec.root == os.path.join(str(tmp_path), "checkpoints", getpass.getuser(), "sft-llama",
                                     "run-1")
    export = spec.export(lambda state, out: None)
    assert export.every == Every(epochs=1) and export.mode == "sync"


@pytest.mark.parametrize("mode, expected", [("disabled", "disabled"), ("off", "off"), ("on", "on"),
                                            ("fault", "auto"), ("resume", "on")])
def test_areal_modes(mode, expected):
    assert load_config({"recover": {"mode": mode}}).recover.mode == expected


def test_areal_known_but_meaningless_fields_are_reported():
    with pytest.warns(CheckpointWarning, match="recover.no_save_optim"):
        spec = load_config({"recover": {"mode": "auto", "freq_steps": 10, "no_save_optim": True}})
    assert spec.ignored == ("recover.no_save_optim",)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"recover": {"mode": "sometimes"}}, "recover.mode='sometimes'"),
        ({"recover": {"freq_step": 10}}, r"unknown field\(s\) \['freq_step'\]"),
        ({"recover": {"freq_steps": 0}}, "recover: Every.steps"),
        ({"saver": {"freq_secs": -5}}, "saver: Every.seconds"),
        ({"saver": {"mode": "later"}}, "saver.mode='later'"),
        ({"recover": {"freq_steps": "${nope}"}}, "cannot resolve"),
        ({"keep_last_n_checkpoints": -1}, "keep_last_n"),
        ({"enable_async_checkpointing": "yes"}, "enable_async_checkpointing"),
        ({"model": {}}, "nothing to translate"),
    ],
)
def test_bad_foreign_configs_name_the_field(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_torchtune_keys_top_level_and_in_checkpointer(tmp_path):
    spec = load_config({"output_dir": str(tmp_path), "enable_async_checkpointing": True,
                        "checkpointer": {"keep_last_n_checkpoints": 2}})
    assert spec.root == str(tmp_path) and spec.mode == "async"
    assert spec.recover.keep_last_n == 2 and spec.recover.every == Every(epochs=1)
    spec = load_config({"output_dir": "x", "save_every_n_steps": 100, "keep_last_n_checkpoints": 1})
    assert spec.recover.every == Every(steps=100) and spec.mode == "sync"


def test_spec_builds_a_working_manager(tmp_path):
    import jax.numpy as jnp

    from jaxckpt import StepInfo

    spec = load_config({"output_dir": str(tmp_path), "save_every_n_steps": 2,
                        "keep_last_n_checkpoints": 1})
    with spec.manager() as mgr:
        for g in range(4):
            mgr.maybe_save(StepInfo(0, g, g), {"w": jnp.ones(2)})
        mgr.wait()
        assert mgr.committed_steps() == [3]
    with pytest.raises(ConfigError, match="names no checkpoint root"):
        load_config({"recover": {"mode": "auto"}}).kwargs()
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
