"""Migration: AReaL-style and torchtune configs become jaxckpt settings directly.

The files under data/configs are real ones: torchtune's recipes/configs/dev/
qwen3B_async_grpo.yaml and llama3_2/1B_full_single_device.yaml (pytorch/torchtune at
bd2a0fc7), and AReaL's examples/math/gsm8k_grpo.yaml (inclusionAI/AReaL at 00d07c04)."""

import getpass
import os

import pytest

from jaxckpt import CheckpointWarning, ConfigError, Every
from jaxckpt.compat import load_config

from support.paths import TESTS

CONFIGS = TESTS / "integration" / "data" / "configs"
ASYNC_GRPO = CONFIGS / "torchtune_dev_qwen3B_async_grpo.yaml"
LLAMA_FULL = CONFIGS / "torchtune_llama3_2_1B_full_single_device.yaml"
AREAL_GRPO = CONFIGS / "areal_math_gsm8k_grpo.yaml"


def edited(source, tmp_path, old, new):
    """A copy of a real config with one line changed (the change must apply)."""
    text = source.read_text()
    assert old in text
    path = tmp_path / source.name
    path.write_text(text.replace(old, new))
    return path

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
        ({"recover": {"freq_step": 10}},
         r"unknown field\(s\) recover.freq_step \(did you mean freq_steps\?\)"),
        ({"recover": {"freq_steps": 0}}, "recover: Every.steps"),
        ({"saver": {"freq_secs": -5}}, "saver: Every.seconds"),
        ({"saver": {"mode": "later"}}, "saver.mode='later'"),
        ({"recover": {"freq_steps": "${nope}"}}, "cannot resolve recover.freq_steps"),
        ({"recover": {"freq_steps": "???"}}, "recover.freq_steps needs a missing mandatory"),
        ({"resume_from_checkpoint": "no"}, "resume_from_checkpoint must be true or false"),
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
    with pytest.raises(ConfigError, match="names no export cadence"):
        spec.kwargs(exporter=lambda state, out_dir: 0)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_real_areal_file_resolves_nested_references():
    spec = load_config(AREAL_GRPO)
    assert spec.recover.mode == "disabled"
    assert spec.recover.every == Every(epochs=1, seconds=3600)
    assert spec.export_every == Every(epochs=1)
    # recover.fileroot is ${cluster.fileroot}
    assert spec.root == os.path.join("/tmp/areal/experiments", "checkpoints", getpass.getuser(),
                                     "gsm8k-grpo", "trial0")


def test_real_torchtune_async_grpo_file_resolves_references_and_training_keys():
    # output_dir is /tmp/checkpoints/${name}; the checkpointer and save_every_n_steps live
    # under training:, and the file holds ${eval:...} references only torchtune resolves.
    spec = load_config(ASYNC_GRPO)
    assert spec.root == "/tmp/checkpoints/grpo_async_qwen3b"
    assert spec.recover.every == Every(steps=250)
    assert spec.recover.keep_last_n is None and spec.mode == "sync"
    assert spec.recover.resume
    from omegaconf import OmegaConf  # a recipe's own DictConfig reads the same

    assert load_config(OmegaConf.load(ASYNC_GRPO)) == spec


def test_a_reference_to_a_removed_key_is_an_error_naming_it(tmp_path):
    path = edited(ASYNC_GRPO, tmp_path, "output_dir: /tmp/checkpoints/${name}\n", "")
    expected = (r"cannot resolve training\.checkpointer\.output_dir \('\$\{output_dir\}'\)"
                r".*'output_dir' not found")
    with pytest.raises(ConfigError, match=expected) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    assert not (tmp_path / "${output_dir}").exists()


def test_a_missing_mandatory_value_is_an_error_naming_the_key(tmp_path):
    path = edited(LLAMA_FULL, tmp_path, "output_dir: /tmp/torchtune/llama3_2_1B/full_single_device",
                  "output_dir: ???")
    with pytest.raises(ConfigError, match=r"checkpointer\.output_dir needs a missing mandatory "
                                          r"value.*output_dir"):
        load_config(path)


def test_a_typo_in_the_checkpointer_names_the_field_the_nearest_name_and_the_file(tmp_path):
    path = edited(LLAMA_FULL, tmp_path, "  keep_last_n_checkpoints: 2",
                  "  keep_last_n_checkpoint: 2")
    with pytest.raises(ConfigError, match=r"checkpointer\.keep_last_n_checkpoint \(did you mean "
                                          r"keep_last_n_checkpoints\?\)") as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_resume_from_checkpoint_false_starts_fresh_and_says_so(tmp_path):
    import jax.numpy as jnp

    from jaxckpt import CheckpointManager, RecoverConfig, StepInfo

    spec = load_config(LLAMA_FULL)  # the stock file: resume_from_checkpoint: False
    assert spec.recover.keep_last_n == 2 and spec.recover.every == Every(epochs=1)
    assert spec.recover.resume is False and spec.recover.mode == "auto"
    root = str(tmp_path / "run")
    with CheckpointManager(root, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 4, 4), {"w": jnp.ones(2)})
    with spec.manager(root) as mgr:
        with pytest.warns(CheckpointWarning, match=r"not resuming.*resume_from_checkpoint: "
                                                   r"False.*step_00000004"):
            assert mgr.recover({"w": jnp.zeros(2)}) is None
        assert mgr.committed_steps() == []  # moved aside: the new run's saves are the latest
        assert len(os.listdir(os.path.join(root, "recover", "superseded"))) == 1
        mgr.save(StepInfo(0, 0, 0), {"w": jnp.zeros(2)})
        assert mgr.committed_steps() == [0]
    resumed = load_config(edited(LLAMA_FULL, tmp_path, "resume_from_checkpoint: False",
                                 "resume_from_checkpoint: True"))
    assert resumed.recover.resume is True
    with resumed.manager(root) as mgr:
        assert mgr.recover({"w": jnp.ones(2)}).step_info.global_step == 0
