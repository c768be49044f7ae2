"""Comparing a Hugging Face model directory with what ``save_pretrained`` wrote.

Shared by the torch export tests: same files (ours adds the provenance record), same tensors
bitwise in the same shard files, same index, config and generation config, and a directory
that ``from_pretrained`` loads into the same tensors and logits.
"""

from __future__ import annotations

import json
import os
from typing import Any

PROVENANCE_FILE = "jaxckpt_provenance.json"


def tensors_of(directory: Any) -> dict[str, tuple[str, Any, Any]]:
    """Every tensor of the directory's safetensors files: name -> (file, tensor, metadata)."""
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as handle:
                found.update({key: (name, handle.get_tensor(key), handle.metadata())
                              for key in handle.keys()})
    return found


def json_of(path: Any) -> Any:
    """A JSON file's content; a list ``target_modules`` (peft writes it from a set, in the
    set's order) sorted."""
    with open(path) as handle:
        body = json.load(handle)
    if isinstance(body, dict) and isinstance(body.get("target_modules"), list):
        body["target_modules"] = sorted(body["target_modules"])
    return body


def assert_same_directory(ours: Any, reference: Any, json_files: Any = None) -> None:
    """Same files (ours adds the provenance record), the same ``json_files`` (default: the
    config, generation config and index, where the reference has them), each tensor in the
    same file, bitwise equal, with the same metadata."""
    import torch

    assert sorted(os.listdir(ours)) == sorted(os.listdir(reference) + [PROVENANCE_FILE])
    if json_files is None:
        json_files = [name for name in ("config.json", "generation_config.json",
                                        "model.safetensors.index.json")
                      if os.path.exists(os.path.join(reference, name))]
    for name in json_files:
        assert json_of(os.path.join(ours, name)) == json_of(os.path.join(reference, name)), name
    mine, theirs = tensors_of(ours), tensors_of(reference)
    assert sorted(mine) == sorted(theirs) and mine
    for key, (file, tensor, metadata) in mine.items():
        ref_file, ref_tensor, ref_metadata = theirs[key]
        assert file == ref_file, key
        assert metadata == ref_metadata == {"format": "pt"}, key
        assert tensor.dtype == ref_tensor.dtype and torch.equal(tensor, ref_tensor), key


def assert_loads_as(model: Any, directory: Any, ids: Any) -> None:
    """``from_pretrained(directory)`` has ``model``'s class, tensors and logits on ``ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(loaded) is type(model)
    expected = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
