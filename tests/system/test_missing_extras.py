"""A feature whose extra is not installed says which extra to install, and the command line
exits with its usage/environment code (2), never the corruption one (1).

Each case runs in a fresh interpreter whose import system refuses the extra's modules (a
``sys.meta_path`` finder installed before jaxckpt is imported), as on a machine where they
were never installed, even though this environment has them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO, TESTS

GOLDEN_ROOT = TESTS / "integration" / "data" / "golden_root"

# Installed first in each interpreter: refuses every module of the named top-level packages.
BLOCKER = """\
import sys

class _NotInstalled:
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled({blocked!r}))
"""

JAX = ("jax", "jaxlib", "orbax", "flax", "optax")
TORCH = ("torch", "torchdata")
HF = ("safetensors",)


def run_without(blocked: tuple[str, ...], code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    program = BLOCKER.format(blocked=list(blocked)) + code
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


RAISES = """
import os
try:
{call}
except ImportError as exc:
    print("TYPE", type(exc).__name__, isinstance(exc, ModuleNotFoundError))
    print("MESSAGE", exc)
    print("EXTRA", getattr(exc, "extra", None))
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize(("blocked", "call", "extra", "feature"), [
    pytest.param(JAX,
                 "    import jaxckpt; jaxckpt.CheckpointManager(os.path.join(os.getcwd(), 'run'))",
                 "jax", "Orbax backend", id="CheckpointManager-without-jax"),
    pytest.param(JAX, "    import jaxckpt.models", "jax", "Flax reference",
                 id="models-without-jax"),
    pytest.param(TORCH, "    from torch_bridge import DcpCheckpointManager", "torch",
                 "DcpCheckpointManager", id="DcpCheckpointManager-without-torch"),
    pytest.param(TORCH, "    import torch_bridge; torch_bridge.DcpBackend", "torch",
                 "DcpBackend", id="DcpBackend-without-torch"),
    pytest.param(HF, "    import torch_bridge; torch_bridge.export_hf", "hf", "export_hf",
                 id="export_hf-without-safetensors"),
    pytest.param(HF, "    from torch_bridge import load_hf", "hf", "load_hf",
                 id="load_hf-without-safetensors"),
    pytest.param(("omegaconf",), "    from jaxckpt.compat import load_config\n"
                 "    load_config({'save_every_n_steps': 10})", "compat", "torchtune configs",
                 id="load_config-without-omegaconf"),
    pytest.param(("keras",), "    os.environ['KERAS_BACKEND'] = 'jax'\n"
                 "    import jaxckpt.integrations.keras", "keras", "jaxckpt.integrations.keras",
                 id="keras-integration-without-keras"),
    pytest.param(("lightning",), "    from torch_bridge.integrations.lightning import "
                 "JaxckptCheckpointIO", "lightning", "torch_bridge.integrations.lightning",
                 id="JaxckptCheckpointIO-without-lightning"),
])
def test_first_use_without_its_extra_names_the_extra(blocked, call, extra, feature, tmp_path):
    out = run_without(blocked, RAISES.format(call=call), tmp_path)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "NO ERROR" not in out.stdout
    assert lines["TYPE"] == "MissingExtraError True"  # still a ModuleNotFoundError
    assert f"pip install 'jaxckpt[{extra}]'" in lines["MESSAGE"]
    assert feature in lines["MESSAGE"]
    assert repr(blocked[0]) in lines["MESSAGE"]  # and which module is missing
    assert lines["EXTRA"] == extra


CLI = "\nfrom jaxckpt.tools.cli import main\nsys.exit(main({argv!r}))\n"
LLAMA_CONFIG = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1}


@pytest.mark.parametrize(("blocked", "argv", "extra"), [
    pytest.param(JAX, ["demo", "--steps", "40", "--save-every", "10"], "jax", id="demo"),
    pytest.param(JAX, ["bench", "--quick"], "jax", id="bench"),
    pytest.param(HF, ["export-hf", str(GOLDEN_ROOT), "out"], "hf", id="export-hf"),
    # With the hf extra but not jax: export-hf gets as far as reading the arrays.
    pytest.param(JAX, ["export-hf", str(GOLDEN_ROOT), "out", "--arch", "llama", "--config",
                       "{config}"], "jax", id="export-hf-without-jax"),
])
def test_cli_without_an_extra_exits_2_naming_it(blocked, argv, extra, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    work = tmp_path / "work"
    work.mkdir()
    argv = [arg.format(config=config) for arg in argv]
    out = run_without(blocked, CLI.format(argv=argv), work)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert f"jaxckpt {argv[0]}: " in out.stderr
    assert f"pip install 'jaxckpt[{extra}]'" in out.stderr
    assert "Traceback" not in out.stderr
    assert list(work.iterdir()) == []  # refused before writing anything
