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
