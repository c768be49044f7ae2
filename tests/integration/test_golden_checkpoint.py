"""A checkpoint written by an earlier jaxckpt still verifies, parses to the same bytes and
restores: the on-disk format is a contract.

tests/data/golden_root was written on 2026-11-24 by the code of main at 6112882 (before the
store was split into layout / manifest / storage), with:

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
             "b": np.array([1.5, -2.0], dtype=np.float32), "count": 3}
    mgr.save(StepInfo(0, 3, 3, 10), state, stateful={"loader": Loader(pos=7)})

(Orbax backend, sync mode, keep_last_n=1; the root's .lock was not kept). Never regenerate it:
a change that makes this test fail changes the format that users' checkpoints are in.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER
from jaxckpt.core.manifest import Manifest

GOLDEN = Path(__file__).parent / "data" / "golden_root"
STEP_DIR = GOLDEN / "recover" / "step_00000003"


def test_golden_checkpoint_verifies_with_checksums():
    store = CheckpointStore(str(GOLDEN))
    assert store.verify(str(STEP_DIR), checksums=True) == []
    entry, skipped = store.latest_valid(checksums=True)
    assert entry.step == 3 and skipped == []


def test_golden_manifest_parses_and_serialises_to_the_same_bytes():
    data = (STEP_DIR / COMMIT_MARKER).read_bytes()
    manifest = Manifest.parse(data, str(STEP_DIR))
    assert manifest.step == 3
    assert manifest.total_bytes == 13075
    assert manifest.files["driver.json"] == {"crc32c": "06068fb4", "size": 10796}
    assert manifest.to_bytes() == data


class _Loader:
    # Not support.loaders.Loader: the golden checkpoint on disk stores this loader's state
    # under the key "pos", and that file must not change.
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, d):
        self.pos = d["pos"]


def test_golden_checkpoint_restores(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    import jaxckpt

    root = tmp_path / "root"
    shutil.copytree(GOLDEN, root)  # recovery takes the root lock: never write into tests/
    like = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32), "count": 0}
    loader = _Loader()
    with jaxckpt.CheckpointManager(str(root), preemption_signals=()) as mgr:
        got = mgr.recover(like, stateful={"loader": loader})
    assert got is not None and got.step_info.global_step == 3
    np.testing.assert_array_equal(np.asarray(got.state["w"]),
                                  np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(got.state["b"]), [1.5, -2.0])
    assert int(got.state["count"]) == 3
    assert loader.pos == 7
    assert sorted(os.listdir(root / "recover")) == ["step_00000003"]
