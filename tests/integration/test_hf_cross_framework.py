"""One policy in two frameworks: models trained in torch, exported, read into jaxckpt.llm.

Llama, Qwen2 and GPT-2 (tied embeddings), each from a tiny config, take two AdamW steps in
torch, are exported with ``torch_bridge.export_hf`` and read back with ``load_hf`` into
``llm.from_config``. The Flax model must hold the torch tensors bit for bit and compute the
torch logits; written back from Flax, transformers loads the very same model. The other
direction for every table (Flax params exported, loaded by transformers) is test_hf.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt import llm  # noqa: E402

from support.models import HF_VOCAB, tiny_hf_config  # noqa: E402

# float32 on both sides. Not bitwise: torch and XLA run different matmul and reduction
# kernels, which add in different orders (measured: at most 2.4e-7 on logits of size ~1).
ATOL = 1e-5
TOKENS = np.random.default_rng(0).integers(0, HF_VOCAB, (2, 12))
# Where the token embedding sits in each Flax model (a spot check by name, beside the
# full tensor-by-tensor comparison).
EMBEDDING = {"llama": "embed", "qwen2": "embed", "gpt2": "wte"}


def _train_in_torch(kind: str, steps: int = 2):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(TOKENS)
    model.train()
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(not torch.equal(p, initial[n]) for n, p in model.named_parameters()), (
        "every weight must have moved, or the comparisons below could pass on init values")
    return model.eval()


@pytest.fixture(scope="module", params=sorted(EMBEDDING))
def trained(request, tmp_path_factory):
    """(arch, the torch model after training, its export, the Flax model read from it)."""
    kind = request.param
    model = _train_in_torch(kind)
    export = tmp_path_factory.mktemp(kind) / "hf"
    torch_bridge.export_hf(model, export)
    params, config = torch_bridge.load_hf(export, arch=kind)
    flax_model = llm.from_config(config, rngs=nnx.Rngs(0))
    llm.load_params(flax_model, params)
    return kind, model, export, flax_model


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def test_flax_model_computes_the_torch_logits(trained):
    _, model, _, flax_model = trained
    expected = _torch_logits(model)
    got = np.asarray(flax_model(jnp.asarray(TOKENS)))
    assert got.dtype == expected.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_flax_params_are_the_torch_tensors_bit_for_bit(trained, tmp_path):
    kind, model, export, flax_model = trained
    params = llm.params_of(flax_model)
    embedding = np.asarray(params[EMBEDDING[kind]]["embedding"])
    assert embedding.tobytes() == model.get_input_embeddings().weight.detach().numpy().tobytes()

    # Every param, written back in torch layout from the Flax model, is the torch tensor.
    back = tmp_path / "back"
    torch_bridge.export_hf(params, back, arch=kind, config=model.config.to_dict())
    written = load_file(back / "model.safetensors")
    torch_written = load_file(export / "model.safetensors")
    assert sorted(written) == sorted(torch_written)
    expected = model.state_dict()
    for name, array in written.items():
        tensor = expected[name].numpy()
        assert array.dtype == tensor.dtype and array.shape == tensor.shape, name
        assert array.tobytes() == tensor.tobytes(), name
    if kind != "llama":  # tied: the head is the embedding, written once, as transformers does
        assert "lm_head.weight" not in written and model.config.tie_word_embeddings


def test_flax_export_loads_into_torch_as_the_same_model(trained, tmp_path):
    kind, model, _, flax_model = trained
    back = tmp_path / "back"
    torch_bridge.export_hf(llm.params_of(flax_model), back, arch=kind,
                           config=model.config.to_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(loaded) is type(model)
    # Same tensors, same torch kernels: the logits are equal bit for bit.
    assert np.array_equal(_torch_logits(loaded), _torch_logits(model))
