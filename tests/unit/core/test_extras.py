"""The table of extras and the missing-extra error, without any framework (the refusals of
real features in a fresh interpreter are in tests/system/test_missing_extras.py)."""

from __future__ import annotations

import pytest
import tomllib

from jaxckpt.core.extras import EXTRA_MODULES, check_extra, requires_extra
from jaxckpt.errors import CheckpointError, MissingExtraError

from support.paths import REPO


def test_every_extra_of_the_table_is_declared_in_pyproject():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(EXTRA_MODULES) <= set(declared)


def test_a_missing_submodule_of_an_extra_names_the_extra():
    with pytest.raises(MissingExtraError, match=r"pip install 'jaxckpt\[jax\]'") as caught:
        with requires_extra("jax", "the feature"):
            raise ModuleNotFoundError("No module named 'orbax.checkpoint'",
                                      name="orbax.checkpoint")
    assert caught.value.extra == "jax" and caught.value.name == "orbax.checkpoint"
    assert "the feature" in str(caught.value) and "'orbax'" in str(caught.value)
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    assert not isinstance(caught.value, CheckpointError)  # the environment, not a checkpoint


@pytest.mark.parametrize("missing", ["yaml", "torch", None])
def test_a_module_that_no_extra_of_the_block_brings_stays_the_bare_error(missing):
    """A base dependency (yaml), another extra's module (torch), an error without a name:
    naming the block's extra would send the user to install the wrong thing."""
    with pytest.raises(ModuleNotFoundError) as caught:
        with requires_extra("jax", "the feature"):
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
    assert type(caught.value) is ModuleNotFoundError


def test_check_extra_finds_without_importing_and_refuses_what_is_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "torchdata" else object())
    check_extra("torch", "the feature", ("torch",))
    with pytest.raises(MissingExtraError, match=r"'torchdata'.*pip install 'jaxckpt\[torch\]'"):
        check_extra("torch", "the feature", ("torch", "torchdata"))
    with pytest.raises(ValueError, match="numpy"):
        check_extra("torch", "the feature", ("numpy",))
