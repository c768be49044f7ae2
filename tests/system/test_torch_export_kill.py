"""A SIGKILL in the middle of an async Hugging Face export of a torch model (issue 30).

A transformers Llama trains under DcpCheckpointManager with
``hf_exporter(params_of="model")`` exporting every 2 steps in the background
(tests/support/hf_export_worker.py). The export of step 5 pauses after its first tensor and
announces it; the process is SIGKILLed there, with part of the files on disk. Then: the
manager's list of exports holds only the export that finished, no directory under an
export's name is half written, and a rerun on the same root resumes, clears the debris and
exports again; its last export loads with ``from_pretrained`` equal to the trained model.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxckpt.commit.store import CheckpointStore  # noqa: E402
from jaxckpt.core.layout import export_dirname, is_tmp_name  # noqa: E402

from support.harness import Worker, repo_env  # noqa: E402
from support.paths import HF_EXPORT_WORKER, REPO  # noqa: E402

KILL_AT = 5  # exports at steps 1, 3, 5, ... (every 2 steps); 1 and 3 land first


def test_sigkill_mid_export_lists_no_partial_export_and_the_rerun_exports_on(tmp_path):
    root = str(tmp_path / "root")
    worker = Worker([sys.executable, str(HF_EXPORT_WORKER), root, "8", str(KILL_AT)],
                    env=repo_env(), cwd=REPO, timeout_s=180)
    code = worker.run(kill_at=lambda line: line.startswith("WRITING"), drain=False)
    assert worker.killed and code == -signal.SIGKILL, (code, worker.lines, worker.stderr())
    ((step, partial),) = [line.split(" ", 1) for line in worker.tagged("WRITING")]
    assert int(step) == KILL_AT

    # Killed mid-write: the export's temporary directory holds some of its tensor files,
    # never its config.json, and nothing is listed or named as that export.
    store = CheckpointStore(root)
    assert is_tmp_name(os.path.basename(partial)) and os.path.dirname(partial) == store.export_dir
    files = os.listdir(partial)
    assert any(name.endswith(".safetensors") for name in files) and "config.json" not in files
    assert [s for s, _ in store.export_entries()] == [1, 3]
    named = [name for name in os.listdir(store.export_dir) if not is_tmp_name(name)]
    assert sorted(named) == [export_dirname(0, s, s) for s in (1, 3)]

    # The rerun on the same root: resumes, removes the debris, and its exports land.
    from support import hf_export_worker

    model = hf_export_worker.train(root, 10)
    store = CheckpointStore(root)
    steps = [s for s, _ in store.export_entries()]
    assert steps[:2] == [1, 3] and KILL_AT < steps[2] and steps[-1] == 9, steps
    assert not [name for name in os.listdir(store.export_dir) if is_tmp_name(name)]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(store.export_entries()[-1][1])
    trained = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
