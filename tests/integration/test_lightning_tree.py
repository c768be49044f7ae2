"""The split of Lightning's checkpoint dict into tensors and a JSON skeleton (no Lightning
needed): what round-trips, and the error for a value that is neither."""

from __future__ import annotations

import pytest
import torch

from jaxckpt import ConfigError
from jaxckpt.core import codec
from torch_bridge.integrations import lightning_tree


def test_split_and_join_round_trip_through_json():
    checkpoint = {"global_step": 3, "state_dict": {"w": torch.arange(6.0).reshape(2, 3)},
                  "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}},
                                        "param_groups": [{"betas": (0.9, 0.999), "lr": 0.01}]}],
                  "callbacks": {"ModelCheckpoint{}": {"best_model_path": "", "score": None}}}
    skeleton, tensors = lightning_tree.split(checkpoint)
    stored = codec.loads(codec.dumps(skeleton))  # what objects.json gives back
    loaded = lightning_tree.empty_like_saved(stored)
    assert {key: (t.shape, t.dtype) for key, t in loaded.items()} == {
        key: (t.shape, t.dtype) for key, t in tensors.items()}
    for key, tensor in tensors.items():
        loaded[key].copy_(tensor)
    again = lightning_tree.join(stored, loaded)
    assert torch.equal(again["state_dict"]["w"], checkpoint["state_dict"]["w"])
    assert again["optimizer_states"][0]["param_groups"] == [{"betas": (0.9, 0.999), "lr": 0.01}]
    assert torch.equal(again["optimizer_states"][0]["state"][0]["step"], torch.tensor(3.0))
    assert again["callbacks"] == checkpoint["callbacks"]


def test_an_object_that_is_neither_tensor_nor_json_is_refused_naming_its_key():
    class Tracker:
        pass

    checkpoint = {"callbacks": {"MyCallback": {"tracker": Tracker()}}}
    with pytest.raises(ConfigError, match=r"checkpoint\['callbacks'\]\['MyCallback'\]"
                                          r"\['tracker'\] holds a .*Tracker.*never pickle.*Fix"):
        lightning_tree.split(checkpoint)
