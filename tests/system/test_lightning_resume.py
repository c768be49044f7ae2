"""Lightning with JaxckptCheckpointIO, SIGKILLed at three points and rerun with
``ckpt_path="last"``, ends bitwise where an uninterrupted run with Lightning's own
checkpointing ends: weights, Adam state and the loss of every step.

Lightning's own resume restores no RNG and no loader generator (lightning#18780), so its
dropout masks and shuffle order restart from the seed; the plugin saves the global RNGs
(Python, NumPy, torch) with each checkpoint and Lightning saves the StatefulDataLoader's
position, so this resume is exact mid-epoch and across the epoch boundary.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from jaxckpt import CheckpointWarning

from support.harness import Worker, repo_env
from support.paths import SUPPORT

WORKER = SUPPORT / "lightning_worker.py"
pytest.importorskip("lightning")


def _run(directory: Path, *args: str, kill_at=None) -> Worker:
    worker = Worker([sys.executable, str(WORKER), str(directory), *args], env=repo_env(),
                    timeout_s=180)
    status = worker.run(kill_at)
    if kill_at is None:
        assert status == 0, worker.stderr()
    else:
        assert status == -signal.SIGKILL, (worker.lines, worker.stderr())
    return worker


def _after(*needed: str):
    """Kill at the first line by which every one of ``needed`` has been printed."""
    seen: set[str] = set()

    def at(line: str) -> bool:
        seen.add(line)
        return seen.issuperset(needed)
    return at


def _losses(directory: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in (directory / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]  # a rerun step: the last one counts
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list[list[str]], Worker]:
    """One child chain on one root: killed at three points, then run to the end; the last
    child then makes the uninterrupted reference run with Lightning's own checkpointing."""
    directory = tmp_path_factory.mktemp("lightning")
    reference = directory / "reference"
    reference.mkdir()
    starts = []
    # mid-epoch (step 3 committed, step 5 done)
    starts.append(_run(directory, kill_at=_after("COMMITTED 3", "STEP 5")).tagged("START"))
    # at the epoch end (step 6 committed, epoch 0 over)
    starts.append(_run(directory, kill_at=_after("COMMITTED 6", "EPOCH_END 0")).tagged("START"))
    # while the save of step 9 is in flight (its write held 5 s)
    starts.append(_run(directory, "--hold-s", "5", kill_at="SAVED 9").tagged("START"))
    final = _run(directory, "--reference", str(reference))
    starts.append(final.tagged("START"))
    return directory, starts, final


def test_sigkilled_lightning_run_resumes_bit_exactly(chain):
    directory, starts, final = chain
    reference = directory / "reference"
    # resumed from: nothing, step 3, step 6, step 6 again (step 9 never committed); then
    # the reference starts from nothing
    assert starts == [["0"], ["3"], ["6"], ["6", "0"]]
    assert "COMMITTED 12" in final.lines
    assert _losses(directory) == _losses(reference)
    assert sorted(_losses(reference)) == list(range(12))
    got = load_file(directory / "final.safetensors")
    want = load_file(reference / "final.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name


def test_corrupt_newest_checkpoint_loads_the_one_before_with_a_warning(chain, tmp_path):
    from torch_bridge.integrations.lightning import JaxckptCheckpointIO

    folder = tmp_path / "ckpt"
    shutil.copytree(chain[0] / "ckpt", folder)
    data = next((folder / "jaxckpt" / "recover" / "step_00000012" / "state").glob("*.distcp"))
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    plugin = JaxckptCheckpointIO()
    try:
        with pytest.warns(CheckpointWarning, match="step 12 .* step 9"):
            checkpoint = plugin.load_checkpoint(folder / "last.ckpt")
    finally:
        plugin.teardown()
    assert checkpoint["global_step"] == 9
    assert set(checkpoint["state_dict"]) == {"net.0.weight", "net.0.bias", "net.3.weight",
                                             "net.3.bias"}


def test_remove_checkpoint_deletes_a_step_once_no_path_names_it(chain, tmp_path):
    from torch_bridge.integrations.lightning import JaxckptCheckpointIO

    folder = tmp_path / "ckpt"
    shutil.copytree(chain[0] / "ckpt", folder)
    steps = folder / "jaxckpt" / "recover"
    plugin = JaxckptCheckpointIO()
    try:
        plugin.remove_checkpoint(folder / "epoch=0-step=3.ckpt")
        plugin.remove_checkpoint(folder / "epoch=1-step=12.ckpt")  # last.ckpt still names 12
    finally:
        plugin.teardown()
    assert not (folder / "epoch=0-step=3.ckpt").exists()
    assert not (steps / "step_00000003").exists()
    assert (steps / "step_00000012" / "COMMITTED").exists()
    assert not (folder / "epoch=1-step=12.ckpt").exists()


@pytest.mark.parametrize("buffers", [False, True], ids=["weights", "batchnorm"])
def test_a_save_overlapping_the_next_step_holds_the_state_before_that_step(tmp_path, buffers):
    """The save of step 3 stages on the backend's worker (slowed down here) while step 4's
    forward and backward run; step 4's update waits for the copy (after Lightning's closure,
    so the forward and backward did overlap it), and with a BatchNorm its forward waits
    (it updates the running statistics), so the checkpoint holds step 3's weights, buffers
    and Adam state bit for bit."""
    import time

    import lightning as L
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from torch_bridge import DcpBackend
    from torch_bridge.integrations.lightning import JaxckptCheckpointIO

    class SlowStager(DefaultStager):
        def stage(self, state_dict, **kwargs):
            time.sleep(0.5)
            events.append("staged")
            return super().stage(state_dict, **kwargs)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            norm = [torch.nn.BatchNorm1d(16)] if buffers else []
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), *norm, torch.nn.ReLU(),
                                           torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            events.append("closure")
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_post_hook(lambda *_: events.append("step"))

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 3:
                state = trainer.optimizers[0].state_dict()["state"]
                saved.update({f"state_dict.{k}": v.clone()
                              for k, v in pl_module.state_dict().items()})
                saved.update({f"adam.{i}.{k}": v.clone() for i, s in state.items()
                              for k, v in s.items()})

    events: list[str] = []
    saved: dict[str, torch.Tensor] = {}
    backend = DcpBackend(async_checkpointer="thread")
    backend._stager = SlowStager(StagingOptions(False, False, False, False))
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    model = Model()
    # the root elsewhere: the plugin makes the folder for the pointer files itself
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt",
                                                      every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record(), checkpoints],
                        plugins=[JaxckptCheckpointIO(tmp_path / "root", backend=backend)])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    # step 4's forward and backward ran while the copy was made; its update waited for it
    assert events == ["closure", "step"] * 3 + ["closure", "staged", "step"]
    plugin = JaxckptCheckpointIO()
    try:
        checkpoint = plugin.load_checkpoint(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    finally:
        plugin.teardown()
    state = checkpoint["optimizer_states"][0]["state"]
    got = {f"state_dict.{k}": v for k, v in checkpoint["state_dict"].items()}
    got.update({f"adam.{i}.{k}": v for i, s in state.items() for k, v in s.items()})
    assert sorted(got) == sorted(saved) and any("running_mean" in k for k in got) == buffers
    for key, value in saved.items():
        assert torch.equal(got[key], value), f"{key} is not step 3's"
    assert any(not torch.equal(p, saved[f"state_dict.{k}"])
               for k, p in model.state_dict().items())
