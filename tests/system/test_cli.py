"""``jaxckpt ls`` and ``jaxckpt verify`` on a tiny real checkpoint root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.tools import cli

from support.paths import REPO


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Committed checkpoints at steps 0 and 1, plus a partial one at step 2."""
    root = tmp_path / "run"
    state = {"w": np.arange(4096, dtype=np.float32), "b": np.ones((4, 4), np.int32)}
    with jaxckpt.CheckpointManager(root, recover=jaxckpt.RecoverConfig(keep_last_n=None),
                                   mode="sync") as mgr:
        for step in (0, 1):
            mgr.save(jaxckpt.StepInfo(0, step, step, 10), state)
    partial = root / "recover" / "step_00000002"
    partial.mkdir()
    (partial / "driver.json").write_text("{}")
    return root


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def step_dir(root: Path, step: int) -> Path:
    return root / "recover" / f"step_{step:08d}"


def a_data_file(checkpoint: Path) -> Path:
    """The largest file of a checkpoint other than the marker: the data of array "w"."""
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name != "COMMITTED"]
    return max(files, key=lambda p: p.stat().st_size)


def test_ls_lists_every_step_with_status_size_and_age(root, capsys):
    code, out = run_cli(capsys, "ls", str(root))
    assert code == 1  # the partial step 2
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "AGE", "DIRECTORY", "RETENTION"]
    rows = {int(line.split()[0]): line.split() for line in lines[1:]}
    assert rows[0][1] == rows[1][1] == "committed"
    assert rows[2][1] == "partial"
    # SIZE is "<number> <unit>" (two words), then AGE, then DIRECTORY.
    assert float(rows[0][2]) > 16 and rows[0][3] == "KiB"  # the 16 KiB array "w" and metadata
    assert rows[0][4].endswith("s")  # seconds old
    assert rows[0][5] == "step_00000000"
    assert rows[2][2:4] == ["2", "B"]  # a partial one is sized by walking it
    # keep_last_n=None, recorded in driver.json: every valid one is kept.
    assert [rows[step][6] for step in (0, 1, 2)] == ["last-N", "resume-point,last-N", "-"]


def test_ls_says_why_each_checkpoint_is_kept_and_which_goes_next(tmp_path, capsys):
    root = tmp_path / "run"
    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=1,
                                   keep_every=jaxckpt.Every(steps=4),
                                   keep_best=jaxckpt.KeepBest(metric="loss", mode="min"))
    state = {"w": np.arange(4096, dtype=np.float32)}
    with jaxckpt.CheckpointManager(root, recover=config, mode="sync") as mgr:
        for step in range(6):
            mgr.maybe_save(jaxckpt.StepInfo(0, step, step), state,
                           metrics={"loss": 0.1 if step == 1 else 1.0})
            if step == 2:
                mgr.pin(2)
        mgr.pin(5)
        mgr.unpin(2)  # nothing saved since: retention deletes it after the next save
    code, out = run_cli(capsys, "ls", str(root))
    assert code == 0
    why = {int(line.split()[0]): line.split()[-1] for line in out.splitlines()[1:]}
    assert why == {1: "best", 2: "delete-next", 3: "every-K",
                   5: "resume-point,pinned,last-N"}

    victim = a_data_file(step_dir(root, 5))
    victim.write_bytes(victim.read_bytes()[:-1])  # the newest is corrupt now
    code, out = run_cli(capsys, "ls", str(root))
    assert code == 1
    why = {int(line.split()[0]): line.split()[-1]
           for line in out.splitlines()[1:] if line[:1].isdigit()}
    assert why == {1: "best", 2: "delete-next", 3: "resume-point,last-N,every-K",
                   5: "pinned,unverified"}


def test_ls_shows_a_corrupt_checkpoint_and_why(root, capsys):
    victim = a_data_file(step_dir(root, 1))
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated
    code, out = run_cli(capsys, "ls", str(root))
    assert code == 1
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:] if line[:1].isdigit()}
    assert rows == {"0": "committed", "1": "corrupt", "2": "partial"}
    assert victim.relative_to(step_dir(root, 1)).as_posix() in out


def test_ls_of_a_root_without_checkpoints_says_so(tmp_path, capsys):
    jaxckpt.CheckpointManager(tmp_path / "run", mode="sync").close()  # opened, never saved
    code, out = run_cli(capsys, "ls", str(tmp_path / "run"))
    assert code == 0 and "no checkpoints" in out


def test_verify_accepts_an_intact_checkpoint(root, capsys):
    code, out = run_cli(capsys, "verify", str(step_dir(root, 0)))
    assert code == 0
    assert out.startswith("OK")


def test_verify_names_each_altered_file_and_exits_1(root, capsys):
    checkpoint = step_dir(root, 1)
    flipped = a_data_file(checkpoint)
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the checksum can tell
    flipped.write_bytes(bytes(data))
    removed = checkpoint / "driver.json"
    removed.unlink()
    code, out = run_cli(capsys, "verify", str(checkpoint))
    assert code == 1
    assert out.startswith("CORRUPT")
    assert f"{flipped.relative_to(checkpoint).as_posix()}: crc32" in out
    assert "driver.json: missing" in out
    # Sizes alone cannot see the flipped byte, but still see the missing file.
    code, out = run_cli(capsys, "verify", "--sizes-only", str(checkpoint))
    assert code == 1 and "crc32" not in out and "driver.json: missing" in out


def test_verify_of_a_partial_checkpoint_exits_1(root, capsys):
    code, out = run_cli(capsys, "verify", str(step_dir(root, 2)))
    assert code == 1
    assert "COMMITTED" in out and "not restorable" in out


def test_verify_of_a_root_checks_every_checkpoint(root, capsys):
    code, out = run_cli(capsys, "verify", str(root))
    assert code == 1  # the partial step 2
    assert [line.split()[0] for line in out.splitlines() if not line.startswith(" ")] == [
        "OK", "OK", "PARTIAL"]


def test_ls_and_verify_show_progress_on_stderr_only_when_asked(root, capsys):
    """A big root takes minutes to check: --progress draws on stderr while stdout keeps the
    report alone; without the flag progress shows only on a terminal (pytest's is not)."""
    code, out = run_cli(capsys, "ls", str(root))
    assert code == 1 and "checked" not in out
    code = cli.main(["ls", "--checksums", "--progress", str(root)])
    captured = capsys.readouterr()
    assert code == 1 and "checked" not in captured.out
    assert "ls: checkpoints checked" in captured.err and "3/3" in captured.err
    code = cli.main(["verify", "--progress", str(root)])
    captured = capsys.readouterr()
    assert [line.split()[0] for line in captured.out.splitlines()
            if not line.startswith(" ")] == ["OK", "OK", "PARTIAL"]
    for number, step in ((1, 0), (2, 1)):
        assert f"verify {number}/3 {step_dir(root, step).name}" in captured.err
    assert "100%" in captured.err or "100.0%" in captured.err  # tqdm, or the plain line


def test_verify_reports_the_bytes_checked_up_to_the_whole_checkpoint(root):
    from jaxckpt.commit.store import CheckpointStore

    store = CheckpointStore(root)
    checkpoint = str(step_dir(root, 1))
    seen: list[tuple[int, int]] = []
    assert store.verify(checkpoint, progress=lambda done, total: seen.append((done, total))) == []
    total = store.read_manifest(checkpoint).total_bytes
    assert len(seen) == len(store.read_manifest(checkpoint).files)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert seen[-1] == (total, total) and {t for _, t in seen} == {total}


def test_verify_of_a_missing_path_exits_3(tmp_path, capsys):
    code, out = run_cli(capsys, "verify", str(tmp_path / "nope"))
    assert code == 3 and "no such file or directory" in out


def test_module_entry_point_runs_without_importing_jax(root):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    probe = ("import sys, runpy; sys.argv = ['jaxckpt', 'ls', sys.argv[1]]\n"
             "try:\n    runpy.run_module('jaxckpt.tools.cli', run_name='__main__')\n"
             "except SystemExit as exit:\n    code = exit.code\n"
             "print('IMPORTED', sorted(m for m in ('jax', 'orbax', 'torch') if m in sys.modules))\n"
             "sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", probe, str(root)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr  # the fixture's partial step 2
    assert "committed" in result.stdout
    assert "IMPORTED []" in result.stdout


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


def test_info_shows_step_versions_and_leaves(root, capsys):
    code, out = run_cli(capsys, "info", str(step_dir(root, 1)))
    assert code == 0, out
    assert "committed" in out and '"global_step": 1' in out and '"jaxckpt"' in out
    assert "['w']" in out and "(4096,)" in out and "float32" in out


def test_info_json_and_partial_checkpoint(root, capsys):
    import json

    code, out = run_cli(capsys, "info", "--json", str(step_dir(root, 1)))
    body = json.loads(out)
    assert code == 0 and body["backend"] == "orbax" and body["step_info"]["global_step"] == 1
    assert {leaf["path"] for leaf in body["leaves"]} == {"['w']", "['b']"}
    code, out = run_cli(capsys, "info", str(step_dir(root, 2)))
    assert code == 1 and "partial" in out


# ------------------------------------------------------- what each kind of path exits with


@pytest.fixture(scope="module")
def clean_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two committed checkpoints, nothing else: copied by the cases that alter a root."""
    root = tmp_path_factory.mktemp("clean") / "run"
    state = {"w": np.arange(4096, dtype=np.float32), "b": np.ones((4, 4), np.int32)}
    with jaxckpt.CheckpointManager(root, recover=jaxckpt.RecoverConfig(keep_last_n=None),
                                   mode="sync") as mgr:
        for step in (0, 1):
            mgr.save(jaxckpt.StepInfo(0, step, step, 10), state)
    return root


def _missing(base: Path, clean: Path) -> Path:
    return base / "nope"


def _a_file(base: Path, clean: Path) -> Path:
    (base / "notes.txt").write_text("hello")
    return base / "notes.txt"


def _empty(base: Path, clean: Path) -> Path:
    (base / "empty").mkdir()
    return base / "empty"


def _random_files(base: Path, clean: Path) -> Path:
    junk = base / "junk"
    (junk / "sub").mkdir(parents=True)
    (junk / "data.bin").write_bytes(os.urandom(100))
    (junk / "sub" / "x").write_bytes(os.urandom(10))
    return junk


def _valid_root(base: Path, clean: Path) -> Path:
    import shutil

    shutil.copytree(clean, base / "run")
    return base / "run"


def _corrupt_root(base: Path, clean: Path) -> Path:
    root = _valid_root(base, clean)
    victim = a_data_file(step_dir(root, 1))
    victim.write_bytes(victim.read_bytes()[:-1])
    return root


def _recover_dir_of_a_root(base: Path, clean: Path) -> Path:
    return _valid_root(base, clean) / "recover"  # taken for its root


def _valid_checkpoint(base: Path, clean: Path) -> Path:
    return step_dir(_valid_root(base, clean), 1)


def _partial_checkpoint(base: Path, clean: Path) -> Path:
    partial = step_dir(_valid_root(base, clean), 2)
    partial.mkdir()  # a job killed right after creating it
    return partial


def _partial_with_files(base: Path, clean: Path) -> Path:
    path = _valid_checkpoint(base, clean)
    (path / "COMMITTED").unlink()  # killed before the commit
    return path


# (case, exit codes of ls, verify and info, words (or one word for all three) that each
# command's output must contain, case aside)
EXIT_CASES = [
    (_missing, (3, 3, 3), "no such file or directory"),
    (_a_file, (3, 3, 3), "is a file"),
    (_empty, (3, 3, 3), "empty directory"),
    (_random_files, (3, 3, 3), "never writes: data.bin, sub/"),
    (_valid_root, (0, 0, 0), ("committed", "ok", "2 committed")),
    (_corrupt_root, (1, 1, 1), "corrupt"),
    (_recover_dir_of_a_root, (0, 0, 0), ("committed", "ok", "2 committed")),
    (_valid_checkpoint, (0, 0, 0), ("committed", "ok", "committed")),
    (_partial_checkpoint, (1, 1, 1), "partial"),
    (_partial_with_files, (1, 1, 1), "partial"),
]


@pytest.mark.parametrize("make, codes, words", EXIT_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_ls_verify_info_exit_codes(make, codes, words, clean_root, tmp_path, capsys):
    path = make(tmp_path, clean_root)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for command, expected in zip(("ls", "verify", "info"), codes, strict=True):
        code, out = run_cli(capsys, command, str(path))
        assert code == expected, (command, out)
        word = words if isinstance(words, str) else words[("ls", "verify", "info").index(command)]
        assert word.lower() in out.lower(), (command, out)
        if expected == 3:
            assert "not a jaxckpt checkpoint or root" in out or "no such file" in out, out
            assert "CORRUPT" not in out and "stopped while saving" not in out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # read only


def test_info_of_a_root_summarises_it_and_points_to_ls(clean_root, capsys):
    code, out = run_cli(capsys, "info", str(clean_root))
    assert code == 0, out
    assert "checkpoint root" in out and "partial" not in out.split("checkpoints")[0]
    assert "2 (2 committed, 0 partial, 0 corrupt)" in out
    assert "latest valid   step 1" in out and f"jaxckpt ls {clean_root}" in out



def test_export_hf_of_a_path_that_is_not_a_jaxckpt_root_exits_3(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.bin").write_bytes(b"\0" * 8)
    for name in ("missing", "empty", "other"):
        code, out = run_cli(capsys, "export-hf", str(tmp_path / name), str(tmp_path / "out"))
        assert code == 3, (name, out)
        assert not (tmp_path / "out").exists()


def test_info_tree_lists_every_saved_path_with_bytes_from_metadata_alone(tmp_path, capsys):
    import shutil

    import jax
    import ml_dtypes

    import jaxckpt

    state = {"w": np.ones((3, 4), ml_dtypes.bfloat16), "key": jax.random.key(0),
             "empty": np.zeros((0, 2), np.float32), "nibbles": np.zeros(5, ml_dtypes.uint4),
             "deep": {"b": np.arange(50, dtype=np.int64)}}
    with jaxckpt.CheckpointManager(tmp_path / "root", preemption_signals=()) as mgr:
        mgr.save(jaxckpt.StepInfo(), state, mode="sync")
    step = step_dir(tmp_path / "root", 0)
    # No array data at all: the listing must come from the metadata alone.
    shutil.rmtree(step / "state" / "arrays")
    code, out = run_cli(capsys, "info", str(step), "--tree", "--leaves", "1")
    assert code == 1  # the files the manifest lists are gone: corrupt, and said so
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("[")}
    assert rows["['w']"][-2:] == ["bfloat16", "24"]
    assert rows["['key']"][-2:] == ["key<fry>", "8"]
    assert rows["['empty']"][-1] == "0" and rows["['nibbles']"][-1] == "5"
    assert rows["['deep']['b']"][-2:] == ["int64", "400"]
    assert "more (--leaves 0" not in out  # --tree lists every path


# ---------------------------------------------------------------- a PyTorch (DCP) checkpoint


@pytest.fixture(scope="module")
def torch_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed DcpCheckpointManager checkpoint: a module, its AdamW state (one step
    taken) and a bfloat16 tensor; torch's RNG is saved with it. One per module: importing
    torch.distributed.checkpoint is the slow part."""
    import torch

    import torch_bridge

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    root = tmp_path_factory.mktemp("dcp") / "run"
    with torch_bridge.DcpCheckpointManager(root, preemption_signals=()) as mgr:
        mgr.save(jaxckpt.StepInfo(0, 2, 2), {"model": model, "optimizer": optimizer,
                                             "t": torch.arange(4, dtype=torch.bfloat16)})
    return step_dir(root, 2)


def test_info_tree_of_a_torch_checkpoint_lists_its_tensors_without_torch(torch_step, tmp_path):
    # In a fresh interpreter where torch cannot be imported, and with DCP's data and its
    # pickled .metadata gone: the listing comes from the backend's objects.json alone.
    import shutil

    copy = tmp_path / "step"
    shutil.copytree(torch_step, copy)
    for name in (".metadata", "__0_0.distcp"):
        (copy / "state" / name).unlink()
    program = ("import sys; sys.modules['torch'] = None\n"
               "from jaxckpt.tools.cli import main\n"
               f"code = main(['info', {str(copy)!r}, '--tree'])\n"
               "print('TORCH', 'torch' in sys.modules and sys.modules['torch'] is not None)\n"
               "sys.exit(code)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1, out.stderr  # the manifest's files are gone: said so
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    assert rows["model/weight"] == ["(2,", "3)", "float32", "24"]
    assert rows["model/bias"] == ["(2,)", "float32", "8"]
    assert rows["optimizer/state/weight/exp_avg_sq"] == ["(2,", "3)", "float32", "24"]
    assert rows["optimizer/state/bias/step"] == ["()", "float32", "4"]
    assert rows["t"] == ["(4,)", "bfloat16", "8"]
    assert "arrays (9 leaves):" in out.stdout and "TORCH False" in out.stdout


def test_info_of_a_torch_checkpoint_lists_torch_rng_and_its_tensors(torch_step, capsys):
    import json

    code, out = run_cli(capsys, "info", "--json", str(torch_step))
    body = json.loads(out)
    assert code == 0 and body["backend"] == "dcp"
    assert body["rng"] == ["numpy", "python", "torch.cpu"]
    assert [leaf["path"] for leaf in body["leaves"]][:2] == ["model/weight", "model/bias"]
    code, out = run_cli(capsys, "info", str(torch_step), "--tree")
    assert code == 0
    assert 'rng            ["numpy", "python", "torch.cpu"]' in out
    assert "PATH" in out and "BYTES" in out and "model/weight" in out
