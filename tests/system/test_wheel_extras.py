"""The wheel installed as users install it, one fresh virtual environment per extra set, with
pip resolving every dependency from the package index (nothing borrowed from this
interpreter): a dependency the package uses but does not declare fails here.

Each environment runs a smoke program of its extra: the imports, the one thing the extra is
for (a save and a restore, or an export and an import), and the frameworks it must not load.
The base install has no array backend, so it checks what it does have: the pure tools work
on a committed root and a backend's first use names the extra to install.

Installing four environments takes minutes (jax and torch wheels unpacked each time), so
this runs in CI (``.ci/run`` sets ``JAXCKPT_WHEELS=1``) and not in ``make test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import REPO

pytestmark = [
    pytest.mark.wheels,
    pytest.mark.skipif(os.environ.get("JAXCKPT_WHEELS") != "1",
                       reason="wheel installs per extra: set JAXCKPT_WHEELS=1 (.ci/run does)"),
]

GOLDEN = REPO / "tests" / "integration" / "data" / "golden_root"

BASE = """\
import subprocess, sys
import jaxckpt, torch_bridge
assert not {"jax", "torch", "safetensors", "orbax"} & set(sys.modules)
try:
    jaxckpt.CheckpointManager(sys.argv[2])
except jaxckpt.MissingExtraError as error:
    assert "pip install 'jaxckpt[jax]'" in str(error), error
else:
    raise AssertionError("CheckpointManager worked without the jax extra")
for args, code in ((["verify", sys.argv[1]], 0), (["ls", sys.argv[1]], 0),
                   (["export-hf", sys.argv[1], sys.argv[2] + "/hf"], 2)):
    done = subprocess.run([sys.prefix + "/bin/jaxckpt", *args], capture_output=True, text=True)
    assert done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
print("base ok")
"""

JAX = """\
import sys
import numpy as np
import jax, jax.numpy as jnp
import jaxckpt

class Position:
    def __init__(self): self.n = 0
    def state_dict(self): return {"n": self.n}
    def load_state_dict(self, d): self.n = d["n"]

root = sys.argv[2]
state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(5, jnp.bfloat16)}
loader = Position(); loader.n = 7
config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=2)
with jaxckpt.CheckpointManager(root, recover=config) as mgr:
    mgr.save(jaxckpt.StepInfo(epoch=0, epoch_step=3, global_step=3), state,
             stateful={"loader": loader})
fresh = Position()
like = {"w": jnp.zeros((3, 4), jnp.float32), "b": jnp.zeros(5, jnp.bfloat16)}
with jaxckpt.CheckpointManager(root, recover=config) as mgr:
    r = mgr.recover(like, stateful={"loader": fresh})
assert r.step_info.global_step == 3 and fresh.n == 7
for key in state:
    assert np.array_equal(np.asarray(r.state[key]), np.asarray(state[key])), key
assert "torch" not in sys.modules
print("jax ok")
"""

TORCH = """\
import sys
import torch
import torch_bridge, jaxckpt

root = sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward(); opt.step()
config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=2)
with torch_bridge.DcpCheckpointManager(root, recover=config) as mgr:
    mgr.save(jaxckpt.StepInfo(epoch=0, epoch_step=1, global_step=1),
             {"model": model, "optimizer": opt})
model2 = torch.nn.Linear(4, 3)
opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
with torch_bridge.DcpCheckpointManager(root, recover=config) as mgr:
    r = mgr.recover({"model": model2, "optimizer": opt2})
assert r.step_info.global_step == 1
for a, b in zip(model.parameters(), model2.parameters()):
    assert torch.equal(a, b)
assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
assert "jax" not in sys.modules
print("torch ok")
"""

HF = """\
import os, sys
from safetensors.numpy import load_file
import numpy as np
import torch_bridge

source, out = sys.argv[1], sys.argv[2] + "/export"
params, config = torch_bridge.load_hf(source, arch="llama")
torch_bridge.export_hf(params, out, arch="llama", config=config)
def tensors(directory):
    found = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            found.update(load_file(os.path.join(directory, name)))
    return found
before, after = tensors(source), tensors(out)
assert before.keys() == after.keys(), sorted(before.keys() ^ after.keys())
for key in before:
    assert before[key].dtype == after[key].dtype and np.array_equal(before[key], after[key]), key
assert not {"jax", "torch"} & set(sys.modules)
print("hf ok")
"""


def run(*args: str | Path, cwd: Path, timeout: int = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, f"{args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--no-index", "-q", "-w", out, REPO, cwd=out)
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama saved by transformers' own ``save_pretrained`` (in this interpreter)."""
    import torch
    import transformers

    from support.models import tiny_hf_config

    directory = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).save_pretrained(
        directory)
    return directory


CASES = {
    # extra set: (what pip installs first, the smoke program)
    "base": ((), BASE),
    "jax": ((), JAX),
    # As the Makefile does: the CPU build first, so the extra's range is already satisfied.
    "torch": (("torch==2.13.0",), TORCH),
    "hf": ((), HF),
}


@pytest.mark.parametrize("extra", list(CASES))
def test_the_wheel_with_each_extra_installs_alone_and_works(extra, wheel, hf_source, tmp_path):
    first, program = CASES[extra]
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    if first:
        run(*pip, *first, cwd=tmp_path)
    run(*pip, f"{wheel}" if extra == "base" else f"{wheel}[{extra}]", cwd=tmp_path)
    source = hf_source if extra == "hf" else GOLDEN
    (tmp_path / "work").mkdir()
    script = tmp_path / "smoke.py"
    script.write_text(program)
    out = run(venv / "bin" / "python", script, source, tmp_path / "work", cwd=tmp_path)
    assert out.strip().endswith(f"{extra} ok"), out
