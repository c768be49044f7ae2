"""The Hugging Face bridge against real transformers models (no mocks, no downloads).

Each tiny model is built from a config with every weight randomised (so biases and norm
scales are exercised, not left at 0 and 1), saved with ``save_pretrained``, imported with
``load_hf``, run in Flax and in torch on the same tokens, exported back with ``export_hf``
and compared tensor by tensor, bit for bit, with what transformers wrote.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import jaxckpt  # noqa: E402
import torch_bridge  # noqa: E402
from jaxckpt import llm  # noqa: E402
from jaxckpt.tools import hf_cli  # noqa: E402
from torch_bridge import hf  # noqa: E402

from support import paths  # noqa: E402
from support.models import HF_EXPORTED, HF_VOCAB, tiny_hf_config  # noqa: E402

REPO = str(paths.REPO)
VOCAB = HF_VOCAB
SEQ = 12

CONFIGS = {kind: functools.partial(tiny_hf_config, kind) for kind in HF_EXPORTED}
ARCH = {"llama": "llama", "llama_bias": "llama", "qwen2": "qwen2", "gpt2": "gpt2",
        "gpt2_untied": "gpt2"}


def _build(case: str, directory: str, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[case]())
    with torch.no_grad():
        for param in model.parameters():  # tied weights are one parameter: stay tied
            param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {case: _build(case, str(root / case)) for case in CONFIGS}


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, SEQ))


def _torch_logits(directory: str, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _flax_model(params, config, *, scan_layers: bool = False):
    model = llm.from_config(config, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    llm.load_params(model, params)
    return model


def _tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory (single file or sharded)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _assert_bit_exact(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype, name
        assert actual[name].shape == array.shape, name
        assert actual[name].tobytes() == array.tobytes(), name


def _assert_loads_cleanly(directory: str) -> None:
    _, info = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                               output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


# ---------------------------------------------------------------------- parity + export


@pytest.mark.parametrize("case", list(CONFIGS))
def test_flax_logits_match_transformers_and_export_is_bit_exact(case, hf_dirs, tmp_path):
    source = hf_dirs[case]
    params, config = hf.load_hf(source, arch=ARCH[case])
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree_util.tree_leaves(params))
    model = _flax_model(params, config)
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))),
                               _torch_logits(source, tokens), atol=1e-4, rtol=0)

    out = str(tmp_path / "export")
    written = hf.export_hf(llm.params_of(model), out, arch=ARCH[case], config=config)
    assert written == sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    _assert_bit_exact(_tensors(source), _tensors(out))
    with safe_open(os.path.join(out, "model.safetensors"), framework="np") as handle:
        assert handle.metadata() == {"format": "pt"}
    _assert_loads_cleanly(out)
    with open(os.path.join(out, "config.json")) as handle:
        written_config = json.load(handle)
    assert written_config["architectures"] == [hf.ARCHITECTURES[ARCH[case]].hf_class]
    assert written_config["model_type"] == config["model_type"]
    assert written_config["dtype"] == "float32" and "torch_dtype" not in written_config
    assert written_config["tie_word_embeddings"] == ("lm_head.weight" not in _tensors(source))


def test_untied_head_is_a_flax_param_and_tied_head_is_not(hf_dirs):
    llama, _ = hf.load_hf(hf_dirs["llama"], arch="llama")
    qwen2, _ = hf.load_hf(hf_dirs["qwen2"], arch="qwen2")
    untied, _ = hf.load_hf(hf_dirs["gpt2_untied"], arch="gpt2")
    assert llama["lm_head"]["kernel"].shape == (32, VOCAB)
    assert untied["lm_head"]["kernel"].shape == (32, VOCAB)
    assert "lm_head" not in qwen2
    assert qwen2["layers"][0]["attn"]["q_proj"]["bias"].shape == (32,)
    assert "bias" not in qwen2["layers"][0]["attn"]["o_proj"]


@pytest.mark.parametrize("case", ["llama", "gpt2"])
def test_scanned_model_imports_stacked_and_exports_bit_exact(case, hf_dirs, tmp_path):
    source = hf_dirs[case]
    params, config = hf.load_hf(source, arch=ARCH[case], stacked=True)
    first_kernel = params["layers"]["attn"]["q_proj"]["kernel"]
    assert first_kernel.shape[0] == 2  # the layer axis leads
    model = _flax_model(params, config, scan_layers=True)
    tokens = _tokens(1)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))),
                               _torch_logits(source, tokens), atol=1e-4, rtol=0)
    out = str(tmp_path / "export")
    hf.export_hf(nnx.state(model, nnx.Param), out, arch=ARCH[case], config=config)
    _assert_bit_exact(_tensors(source), _tensors(out))


def test_sharded_export_round_trips(hf_dirs, tmp_path):
    params, config = hf.load_hf(hf_dirs["llama"], arch="llama")
    out = str(tmp_path / "sharded")
    hf.export_hf(params, out, arch="llama", config=config, max_shard_bytes=20_000)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.safetensors" not in shards
    with open(os.path.join(out, "model.safetensors.index.json")) as handle:
        index = json.load(handle)
    assert set(index["weight_map"].values()) == set(shards)
    tensors = _tensors(out)
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for name in shards:  # a shard exceeds the limit only when it holds a single tensor
        with safe_open(os.path.join(out, name), framework="np") as handle:
            keys = list(handle.keys())
        assert len(keys) == 1 or os.path.getsize(os.path.join(out, name)) <= 20_000 + 4096
    _assert_bit_exact(_tensors(hf_dirs["llama"]), tensors)
    _assert_loads_cleanly(out)
    again, _ = hf.load_hf(out, arch="llama")
    jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)


def test_bf16_export_round_trips(hf_dirs, tmp_path):
    params, config = hf.load_hf(hf_dirs["qwen2"], arch="qwen2")
    out = str(tmp_path / "bf16")
    hf.export_hf(params, out, arch="qwen2", config=config, dtype="bfloat16",
                 max_shard_bytes=30_000)
    with open(os.path.join(out, "config.json")) as handle:
        assert json.load(handle)["dtype"] == "bfloat16"
    tensors = _tensors(out)
    assert {t.dtype for t in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    back, _ = hf.load_hf(out, arch="qwen2")
    expected = jax.tree_util.tree_map(lambda a: a.astype(ml_dtypes.bfloat16), params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(
        a.view(np.uint16), b.view(np.uint16)), back, expected)
    # transformers reads the bf16 files, and a second export of them is bit-identical.
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    _assert_loads_cleanly(out)
    out2 = str(tmp_path / "bf16-again")
    hf.export_hf(back, out2, arch="qwen2", config=config)
    _assert_bit_exact(tensors, _tensors(out2))


# --------------------------------------------------------------------------- tied heads


def _with_extra_head(source: str, directory: str, *, equal: bool) -> str:
    os.makedirs(directory)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.copy() if equal else (embed * 1.5 + 0.1).astype(embed.dtype)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        with (open(os.path.join(source, name)) as src,
              open(os.path.join(directory, name), "w") as dst):
            dst.write(src.read())
    return directory


def test_head_saved_equal_to_tied_embedding_loads_tied(hf_dirs, tmp_path):
    directory = _with_extra_head(hf_dirs["qwen2"], str(tmp_path / "equal"), equal=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxckpt.CheckpointWarning)
        params, config = hf.load_hf(directory, arch="qwen2")
    assert "lm_head" not in params and config["tie_word_embeddings"] is True


def test_head_that_differs_from_tied_embedding_loads_untied_like_transformers(hf_dirs, tmp_path):
    directory = _with_extra_head(hf_dirs["qwen2"], str(tmp_path / "differs"), equal=False)
    with pytest.warns(jaxckpt.CheckpointWarning, match="UNTIED"):
        params, config = hf.load_hf(directory, arch="qwen2")
    assert config["tie_word_embeddings"] is False
    assert params["lm_head"]["kernel"].shape == (32, VOCAB)
    model = _flax_model(params, config)
    tokens = _tokens(2)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))),
                               _torch_logits(directory, tokens), atol=1e-4, rtol=0)
    # Exported with the returned config, transformers sees an explicitly untied model.
    out = str(tmp_path / "export")
    hf.export_hf(params, out, arch="qwen2", config=config)
    _assert_loads_cleanly(out)
    np.testing.assert_allclose(_torch_logits(out, tokens), _torch_logits(directory, tokens),
                               atol=1e-6, rtol=0)


def test_export_refuses_a_head_the_config_does_not_have(hf_dirs, tmp_path):
    qwen2, qwen2_config = hf.load_hf(hf_dirs["qwen2"], arch="qwen2")
    qwen2["lm_head"] = {"kernel": np.zeros((32, VOCAB), np.float32)}
    with pytest.raises(hf.HFMismatchError,
                       match=r"unexpected lm_head\.kernel.*tie_word_embeddings=True"):
        hf.export_hf(qwen2, str(tmp_path / "a"), arch="qwen2", config=qwen2_config)
    llama, llama_config = hf.load_hf(hf_dirs["llama"], arch="llama")
    del llama["lm_head"]
    with pytest.raises(jaxckpt.TreeMismatchError,
                       match=r"missing lm_head\.kernel: expected \(32, 128\)"):
        hf.export_hf(llama, str(tmp_path / "b"), arch="llama", config=llama_config)
    assert not os.listdir(tmp_path)  # validation happens before any directory is made


# ------------------------------------------------------------------------------ errors


def test_wrong_arch_lists_every_missing_and_unexpected_tensor(hf_dirs):
    with pytest.raises(jaxckpt.TreeMismatchError) as caught:
        hf.load_hf(hf_dirs["gpt2"], arch="llama")
    message = str(caught.value)
    problems = caught.value.problems
    assert isinstance(caught.value, hf.HFMismatchError)
    assert sum(p.startswith("missing ") for p in problems) == 2 + 2 * 9  # embed, norm + 9/layer
    assert sum(p.startswith("unexpected ") for p in problems) == 2 + 2 * 12 + 2
    assert "missing model.embed_tokens.weight" in message
    assert "missing model.layers.1.self_attn.q_proj.weight" in message
    assert "unexpected transformer.wte.weight: found (128, 32)" in message
    assert "config.json says model_type 'gpt2'" in message and "pass arch='gpt2'" in message


def test_mis_shaped_tensors_are_listed_with_expected_and_found(hf_dirs, tmp_path):
    directory = str(tmp_path / "lying")
    os.makedirs(directory)
    for name in os.listdir(hf_dirs["llama"]):
        with open(os.path.join(hf_dirs["llama"], name), "rb") as src:
            data = src.read()
        if name == "config.json":
            body = json.loads(data)
            body["intermediate_size"] = 48
            data = json.dumps(body).encode()
        with open(os.path.join(directory, name), "wb") as dst:
            dst.write(data)
    with pytest.raises(hf.HFMismatchError) as caught:
        hf.load_hf(directory, arch="llama")
    assert len(caught.value.problems) == 2 * 3
    assert ("mis-shaped model.layers.0.mlp.gate_proj.weight: expected (48, 32), found (64, 32)"
            in str(caught.value))


def test_export_lists_every_bad_param_before_writing(hf_dirs, tmp_path):
    params, config = hf.load_hf(hf_dirs["llama"], arch="llama")
    del params["layers"][1]["attn"]["k_proj"]
    params["layers"][0]["attn"]["q_proj"]["kernel"] = np.zeros((3, 3), np.float32)
    params["stray"] = np.zeros(2, np.float32)
    with pytest.raises(hf.HFMismatchError) as caught:
        hf.export_hf(params, str(tmp_path / "out"), arch="llama", config=config)
    assert sorted(p.split(":")[0] for p in caught.value.problems) == sorted([
        "missing layers.1.attn.k_proj.kernel", "mis-shaped layers.0.attn.q_proj.kernel",
        "unexpected stray"])
    assert "expected (32, 32), found (3, 3)" in str(caught.value)
    assert not os.listdir(tmp_path)


def test_config_of_another_model_type_is_refused(hf_dirs, tmp_path):
    params, _ = hf.load_hf(hf_dirs["llama"], arch="llama")
    with pytest.raises(jaxckpt.ConfigError, match="model_type is 'gpt2'.*arch='gpt2'"):
        hf.export_hf(params, str(tmp_path / "x"), arch="llama", config=CONFIGS["gpt2"]())


def test_existing_out_dir_is_kept_unless_overwrite(hf_dirs, tmp_path):
    params, config = hf.load_hf(hf_dirs["gpt2"], arch="gpt2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        hf.export_hf(params, str(out), arch="gpt2", config=config)
    assert (out / "keep.txt").read_text() == "mine"
    hf.export_hf(params, str(out), arch="gpt2", config=config, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]


# ------------------------------------------------------------------ crash safety


def test_failed_export_leaves_no_directory(hf_dirs, tmp_path):
    params, config = hf.load_hf(hf_dirs["llama"], arch="llama")

    def fail_halfway(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hf.export_hf(params, str(tmp_path / "out"), arch="llama", config=config,
                     max_shard_bytes=10_000, progress=fail_halfway)
    assert os.listdir(tmp_path) == []


def test_killed_export_never_leaves_a_model_at_out_dir(hf_dirs, tmp_path):
    out = tmp_path / "out"
    started = tmp_path / "started"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from torch_bridge import hf
        params, config = hf.load_hf({hf_dirs['llama']!r}, arch="llama")
        def slow(done, total):
            open({str(started)!r}, "w").close()
            time.sleep(0.2)
        hf.export_hf(params, {str(out)!r}, arch="llama", config=config,
                     max_shard_bytes=10_000, progress=slow)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert process.poll() is None, "the export process exited early"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.5)  # a few shards in
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(10)
    assert not out.exists()
    leftovers = [n for n in os.listdir(tmp_path) if n not in ("started",)]
    assert all(n.startswith(".out.tmp-") for n in leftovers), leftovers
    # The partial temp directory holds some shards but never a loadable model.
    assert any(n.endswith(".safetensors") for d in leftovers for n in os.listdir(tmp_path / d))
    assert all("config.json" not in os.listdir(tmp_path / d) for d in leftovers)


def test_export_streams_a_tensor_at_a_time(tmp_path):
    """Peak extra host memory while exporting ~10 MiB of float32 params into ONE file (every
    Linear needs a transposed copy) stays at about two tensors (the one being written and
    the next, converted meanwhile), not a copy of the model."""
    config = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4}
    model = llm.Llama(config, rngs=nnx.Rngs(0))
    params = jax.tree_util.tree_map(np.asarray, llm.params_of(model))
    leaves = jax.tree_util.tree_leaves(params)
    model_bytes = sum(a.nbytes for a in leaves)
    largest = max(a.nbytes for a in leaves)
    tracemalloc.start()
    try:
        hf.export_hf(params, str(tmp_path / "out"), arch="llama", config=config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert os.listdir(tmp_path / "out").count("model.safetensors") == 1
    assert model_bytes > 8 * largest
    assert peak < 2 * largest + 256 * 1024, (peak, largest, model_bytes)


# ---------------------------------------------------------------- periodic exports


def _train_state(config):
    model = llm.from_config(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return model, optimizer


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_manager_exports_load_with_from_pretrained(mode, hf_dirs, tmp_path):
    params, config = hf.load_hf(hf_dirs["gpt2"], arch="gpt2")
    model, optimizer = _train_state(config)
    llm.load_params(model, params)
    exporter = hf.hf_exporter(arch="gpt2", config=config, params_of=lambda state: state[0],
                              generation_config=transformers.GenerationConfig(
                                  bos_token_id=1, eos_token_id=2, max_new_tokens=3))
    export = jaxckpt.ExportConfig(every=jaxckpt.Every(steps=2), exporter=exporter, mode=mode)
    snapshots = {}
    with jaxckpt.CheckpointManager(str(tmp_path / "run"), recover=jaxckpt.RecoverConfig(mode="off"),
                                   export=export) as manager:
        step = jaxckpt.StepInfo(0, 0, 0, steps_per_epoch=10)
        for _ in range(4):
            reports = manager.maybe_save(step, nnx.state((model, optimizer)))
            if reports:
                snapshots[step.global_step] = jax.tree_util.tree_map(np.array, llm.params_of(model))
            # "train": change every weight after the state was handed over
            llm.load_params(model, jax.tree_util.tree_map(lambda a: a * 1.01, llm.params_of(model)))
            step = step.next()
        manager.wait()
        assert all(r.bytes and r.bytes > 100_000 for r in reports)
    names = sorted(os.listdir(tmp_path / "run" / "export"))
    assert names == ["epoch0epochstep1globalstep1", "epoch0epochstep3globalstep3"]
    for name, global_step in zip(names, (1, 3), strict=True):
        directory = str(tmp_path / "run" / "export" / name)
        _assert_loads_cleanly(directory)
        loaded, _ = hf.load_hf(directory, arch="gpt2")
        jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, snapshots[global_step])
        with open(os.path.join(directory, hf.PROVENANCE_FILE)) as handle:
            provenance = json.load(handle)
        assert provenance["source"]["global_step"] == global_step
        assert provenance["arch"] == "gpt2" and provenance["jaxckpt_version"] == jaxckpt.__version__
        generation = transformers.GenerationConfig.from_pretrained(directory)
        assert generation.max_new_tokens == 3


# ------------------------------------------------------------------------------- CLI


def test_import_hf_then_restore_then_export_hf_round_trips(hf_dirs, tmp_path):
    root = str(tmp_path / "root")
    path = hf_cli.import_hf_to_checkpoint(hf_dirs["qwen2"], root, arch="qwen2", step=5,
                                          progress=False)
    assert path.endswith("step_00000005")
    params, config = hf.load_hf(hf_dirs["qwen2"], arch="qwen2")
    model = llm.from_config(config, rngs=nnx.Rngs(1))
    holder = hf_cli.HFConfigState()
    with jaxckpt.CheckpointManager(root) as manager:
        restored = manager.restore(llm.params_of(model), stateful={"hf_config": holder})
    assert restored.step_info.global_step == 5
    assert holder.arch == "qwen2" and holder.config["model_type"] == "qwen2"
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                           restored.state, params)
    # arch and config come from the checkpoint itself.
    out = str(tmp_path / "out")
    hf_cli.export_checkpoint_to_hf(root, out, progress=False)
    _assert_bit_exact(_tensors(hf_dirs["qwen2"]), _tensors(out))
    _assert_loads_cleanly(out)


def test_jaxckpt_import_hf_and_export_hf_commands(hf_dirs, tmp_path, capsys):
    from jaxckpt.tools import cli

    root, out = str(tmp_path / "root"), str(tmp_path / "out")
    assert cli.main(["import-hf", hf_dirs["gpt2"], root, "--arch", "gpt2", "--step", "7"]) == 0
    assert "step_00000007" in capsys.readouterr().out
    assert cli.main(["export-hf", root, out, "--max-shard-size", "20KB"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "export" in captured.err  # progress on stderr
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # sharded
    _assert_bit_exact(_tensors(hf_dirs["gpt2"]), _tensors(out))
    _assert_loads_cleanly(out)
    # Exporting onto an existing directory is refused without --overwrite.
    assert cli.main(["export-hf", root, out]) == 2
    assert "exists" in capsys.readouterr().err


def test_export_hf_finds_the_params_in_a_model_and_optimizer_state(hf_dirs, tmp_path, capsys):
    params, config = hf.load_hf(hf_dirs["llama"], arch="llama")
    model, optimizer = _train_state(config)
    llm.load_params(model, params)
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root) as manager:
        manager.save(jaxckpt.StepInfo(0, 3, 3), nnx.state((model, optimizer)))
    out = str(tmp_path / "out")
    hf_cli.export_checkpoint_to_hf(root, out, arch="llama", config=hf_dirs["llama"],
                                   dtype="bfloat16", progress=True)
    assert "export out" in capsys.readouterr().err  # a progress bar on stderr
    expected = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(hf_dirs["llama"]).items()}
    _assert_bit_exact(expected, _tensors(out))
    with open(os.path.join(out, hf.PROVENANCE_FILE)) as handle:
        source = json.load(handle)["source"]
    assert source["params_path"] == "0" and source["global_step"] == 3


def test_tokenizer_files_are_copied(hf_dirs, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    tokenizer_dir = str(tmp_path / "tok")
    tokenizer.save_pretrained(tokenizer_dir)
    params, config = hf.load_hf(hf_dirs["gpt2"], arch="gpt2")
    out = str(tmp_path / "out")
    hf.export_hf(params, out, arch="gpt2", config=config, tokenizer_dir=tokenizer_dir,
                 provenance={"checkpoint": "/ckpt/step_00000100", "step": 100})
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded("t5 t7")["input_ids"] == [5, 7]
    with open(os.path.join(out, hf.PROVENANCE_FILE)) as handle:
        provenance = json.load(handle)
    assert provenance["source"] == {"checkpoint": "/ckpt/step_00000100", "step": 100}
    assert "tokenizer.json" in provenance["files"]


def test_parse_size():
    assert hf_cli.parse_size("5GB") == 5 * 10**9
    assert hf_cli.parse_size("500MiB") == 500 * 2**20
    assert hf_cli.parse_size(123) == 123
    with pytest.raises(jaxckpt.ConfigError, match="not understood"):
        hf_cli.parse_size("5 parsecs")


@pytest.mark.parametrize("paths, problem", [
    ([""], "a leaf at the root"),
    (["['a']['x']", "['a'].b"], "mixes item and attribute keys"),
])
def test_export_hf_names_the_tree_file_of_an_unusable_tree_record(paths, problem, tmp_path):
    leaves = [{"path": path, "kind": "array", "shape": [2], "dtype": "float32"} for path in paths]
    (tmp_path / "tree.json").write_text(json.dumps(
        {"format": "jaxckpt.orbax.tree", "version": 1, "leaves": leaves}))
    with pytest.raises(jaxckpt.CheckpointCorruptError, match=problem) as caught:
        hf_cli._like_from_tree_json(str(tmp_path))
    assert str(tmp_path / "tree.json") in str(caught.value)


def test_hf_modules_do_not_import_jax():
    code = ("import sys; sys.path.insert(0, %r); import torch_bridge.hf, jaxckpt.tools.hf_cli; "
            "print(sorted(m for m in ('jax', 'flax', 'orbax') if m in sys.modules))" % REPO)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (130, 67), (2, 129, 257)])
@pytest.mark.parametrize("target", ["float32", "bfloat16"])
def test_tiled_transpose_matches_numpy_bit_for_bit(shape, target):
    """The export's tiled copy of a transposed view (sizes not a multiple of the tile edge,
    stacked layers, a cast on the way) equals numpy's plain transposed copy."""
    source = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    view = np.swapaxes(source, -1, -2)
    out = np.empty(view.shape, np.dtype(target))
    hf.safetensors_io._copy_in_tiles(out, view)
    expected = np.array(view, dtype=np.dtype(target), order="C")
    assert out.tobytes() == expected.tobytes()


# ------------------------------------------------- issue 17: what an outside user meets


def _llama_model(hf_dirs):
    """A Flax Llama holding the weights of the tiny transformers one, and its config."""
    params, config = hf.load_hf(hf_dirs["llama"], arch="llama")
    model = llm.from_config(config, rngs=nnx.Rngs(0))
    llm.load_params(model, params)
    return model, config


@pytest.mark.parametrize("kind", ["pure_dict", "nnx_state", "live_module"])
def test_exporter_picks_the_params_out_of_a_training_state_by_tree_path(kind, hf_dirs, tmp_path):
    model, config = _llama_model(hf_dirs)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    if kind == "pure_dict":  # params nested in a training state, moments beside them
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        state = {"model": {"params": params}, "opt": {"mu": params}, "step": np.int32(3)}
        params_of = "model/params"
    elif kind == "nnx_state":  # the tuple state of the Flax NNX tutorials
        state, params_of = nnx.state((model, optimizer)), "0"
    else:  # a live nnx.Module as a value of the state dict
        state, params_of = {"model": model, "optimizer": optimizer}, "model"
    exporter = torch_bridge.hf_exporter(arch="llama", config=config, params_of=params_of)
    export = jaxckpt.ExportConfig(every=jaxckpt.Every(steps=1), exporter=exporter, mode="sync")
    with jaxckpt.CheckpointManager(str(tmp_path / "run"), recover=jaxckpt.RecoverConfig(mode="off"),
                                   export=export) as manager:
        manager.export(jaxckpt.StepInfo(0, 3, 3), state)
    out = str(tmp_path / "run" / "export" / "epoch0epochstep3globalstep3")
    _assert_loads_cleanly(out)
    _assert_bit_exact(_tensors(hf_dirs["llama"]), _tensors(out))
    tokens = _tokens(3)
    np.testing.assert_allclose(_torch_logits(out, tokens), np.asarray(model(jnp.asarray(tokens))),
                               atol=1e-4, rtol=0)


def test_exporter_given_a_whole_training_state_names_params_of_and_the_keys(hf_dirs, tmp_path):
    model, config = _llama_model(hf_dirs)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = {"model": {"params": params}, "optimizer": {"mu": params}}
    exporter = torch_bridge.hf_exporter(arch="llama", config=config)
    export = jaxckpt.ExportConfig(every=jaxckpt.Every(steps=1), exporter=exporter, mode="sync")
    with jaxckpt.CheckpointManager(str(tmp_path / "run"), recover=jaxckpt.RecoverConfig(mode="off"),
                                   export=export) as manager:
        with pytest.raises(jaxckpt.CheckpointWriteError) as caught:
            manager.export(jaxckpt.StepInfo(0, 1, 1), state)
    cause = caught.value.__cause__
    assert isinstance(cause, jaxckpt.ConfigError), cause
    message = str(cause)
    assert "top-level keys ['model', 'optimizer']" in message
    assert "params_of=" in message and "params_of='model/params'" in message
    # A path that names nothing says where it stopped and what is there.
    with pytest.raises(jaxckpt.ConfigError, match=r"no key 'weights' at model .*\['params'\]"):
        torch_bridge.hf_exporter(arch="llama", config=config, params_of="model/weights")(
            state, str(tmp_path / "x"))
    with pytest.raises(jaxckpt.ConfigError, match="empty key"):
        torch_bridge.hf_exporter(arch="llama", config=config, params_of="model//params")


def _save_with_exporter(root: str, config, state, params_of) -> str:
    """A recovery checkpoint and an export, written by one manager; returns the export."""
    exporter = torch_bridge.hf_exporter(arch="llama", config=config, params_of=params_of)
    export = jaxckpt.ExportConfig(every=jaxckpt.Every(steps=1000), exporter=exporter, mode="sync")
    with jaxckpt.CheckpointManager(root, export=export, mode="sync") as manager:
        step = jaxckpt.StepInfo(0, 4, 4)
        manager.save(step, state)
        manager.export(step, state)
    return os.path.join(root, "export", "epoch0epochstep4globalstep4")


def test_export_hf_needs_no_flags_for_a_checkpoint_written_with_hf_exporter(hf_dirs, tmp_path,
                                                                             capsys):
    from jaxckpt.tools import cli

    model, config = _llama_model(hf_dirs)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    root = str(tmp_path / "root")
    # Two subtrees look like params: only the recorded params_of says which one is the model.
    state = {"student": {"params": params},
             "teacher": {"params": jax.tree_util.tree_map(lambda a: a * 0, params)}}
    exported = _save_with_exporter(root, config, state, "student/params")
    with open(os.path.join(root, "recover", "step_00000004", "driver.json")) as handle:
        record = json.load(handle)["export"]
    assert record["arch"] == "llama" and record["params_path"] == "student/params"
    assert record["config"]["model_type"] == "llama"
    out = str(tmp_path / "out")
    assert cli.main(["export-hf", root, out, "--no-progress"]) == 0, capsys.readouterr().err
    _assert_bit_exact(_tensors(exported), _tensors(out))
    _assert_bit_exact(_tensors(hf_dirs["llama"]), _tensors(out))
    _assert_loads_cleanly(out)


def test_export_hf_after_a_callable_params_of_asks_for_params_path(hf_dirs, tmp_path, capsys):
    from jaxckpt.tools import cli

    model, config = _llama_model(hf_dirs)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    root = str(tmp_path / "root")
    state = {"student": params, "teacher": jax.tree_util.tree_map(lambda a: a * 0, params)}
    _save_with_exporter(root, config, state, lambda s: s["student"])
    out = str(tmp_path / "out")
    assert cli.main(["export-hf", root, out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "callable" in err and "--params-path" in err
    # arch and config still come from the checkpoint.
    assert cli.main(["export-hf", root, out, "--params-path", "student", "--no-progress"]) == 0
    _assert_bit_exact(_tensors(hf_dirs["llama"]), _tensors(out))


def test_export_hf_without_a_record_says_exactly_which_flags_to_add(hf_dirs, tmp_path, capsys):
    from jaxckpt.tools import cli

    model, _ = _llama_model(hf_dirs)
    root = str(tmp_path / "root")
    with jaxckpt.CheckpointManager(root, mode="sync") as manager:
        manager.save(jaxckpt.StepInfo(0, 2, 2), {"params": llm.params_of(model)})
    out = str(tmp_path / "out")
    assert cli.main(["export-hf", root, out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "add --arch llama --config path/to/config.json" in err.lower()
    assert "--params-path" in err and "hf_exporter" in err and "import-hf" in err
    assert not os.path.exists(out)
    # --config alone is enough: config.json's model_type names the arch.
    assert cli.main(["export-hf", root, out, "--config", hf_dirs["llama"], "--no-progress"]) == 0
    _assert_bit_exact(_tensors(hf_dirs["llama"]), _tensors(out))


@pytest.mark.parametrize("case", ["llama", "llama_bias", "qwen2", "gpt2", "gpt2_untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_writes_the_config_files_save_pretrained_writes(case, dtype, hf_dirs, tmp_path):
    # The reference: the same tiny model built from its config and saved by transformers.
    reference = str(tmp_path / "reference")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[case]())
    model.to(getattr(torch, dtype)).save_pretrained(reference)
    params, loaded_config = hf.load_hf(reference, arch=ARCH[case])
    # Exported with the config object, and with the config dict load_hf returns.
    for label, config in (("object", CONFIGS[case]()), ("dict", loaded_config)):
        out = str(tmp_path / f"export_{label}")
        hf.export_hf(params, out, arch=ARCH[case], config=config)
        for name in ("config.json", "generation_config.json"):
            with open(os.path.join(reference, name)) as handle:
                expected = json.load(handle)
            with open(os.path.join(out, name)) as handle:
                written = json.load(handle)
            # Nothing is ignored: transformers_version is the installed one on both sides.
            assert written == expected, (label, name)
        _assert_loads_cleanly(out)
        _assert_bit_exact(_tensors(reference), _tensors(out))
        tokens = _tokens(4)
        np.testing.assert_allclose(_torch_logits(out, tokens), _torch_logits(reference, tokens),
                                   atol=0, rtol=0)


def _foreign_model(kind: str, directory: str) -> str:
    config = tiny_hf_config(kind)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("kind", ["mistral", "gemma"])
def test_load_hf_refuses_a_model_of_another_type_with_the_same_tensor_names(kind, tmp_path):
    directory = _foreign_model(kind, str(tmp_path / kind))
    with pytest.raises(torch_bridge.HFMismatchError) as caught:
        hf.load_hf(directory, arch="llama")
    error = caught.value
    assert isinstance(error, jaxckpt.CheckpointError) and isinstance(error, ValueError)
    message = str(error)
    assert f"arch='llama' was asked for, but config.json says model_type '{kind}'" in message
    assert "tensor names all fit the 'llama' table" in message  # why it is refused anyway
    assert "unsupported" in message and "arch='qwen2'" in message  # the fix: what is known
    assert error.problems[0] == f"model_type: expected 'llama', found '{kind}'"
    # The same through import-hf: nothing is written.
    root = str(tmp_path / "root")
    with pytest.raises(torch_bridge.HFMismatchError):
        hf_cli.import_hf_to_checkpoint(directory, root, arch="llama", progress=False)
    assert not os.path.exists(os.path.join(root, "recover"))


def test_load_hf_names_the_arch_to_pass_for_a_known_model_type(hf_dirs):
    with pytest.raises(torch_bridge.HFMismatchError,
                       match=r"arch='qwen2' was asked for, but config\.json says model_type "
                             r"'llama'(.|\n)*Fix: pass arch='llama'"):
        hf.load_hf(hf_dirs["llama"], arch="qwen2")
