"""Two JAX processes on localhost (jax.distributed, CPU devices) checkpointing one sharded state.

Each process writes its shards and its own local state; the primary commits and decides the
time-based trigger for both; a single process with another mesh restores what they wrote, and
two processes restore what a single one wrote.
"""

import json
import os
import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxckpt import CheckpointManager, CheckpointWarning, RecoverConfig, StepInfo

from support.loaders import Loader
from support.two_processes import jax_worker, run_two_workers

WORKER = jax_worker('''
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxckpt import CheckpointManager, RecoverConfig, ExportConfig, Every, StepInfo

        mesh = jax.make_mesh((4,), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        assert jax.device_count() == 4 and jax.local_device_count() == 2

        def weights(step):
            base = np.arange(32, dtype=np.float32).reshape(8, 4) + 1000 * step
            return jax.make_array_from_callback((8, 4), sharding, lambda idx: base[idx])

        class Loader:  # each process reads its own shard (worker source: no support import)
            def __init__(self):
                self.position = 0
            def state_dict(self):
                return {"position": self.position, "process": index}
            def load_state_dict(self, state):
                self.position = state["position"]

        now = [0.0]  # only the primary's clock ever moves: its decision must be shared
        def clock():
            return now[0]

        def exporter(state, out_dir):
            np.save(os.path.join(out_dir, "w.npy"), np.asarray(state["w"]), allow_pickle=False)

        loader = Loader()
        mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=4, seconds=50),
                                                            keep_last_n=None),
                                export=ExportConfig(every=Every(steps=4), exporter=exporter,
                                                    mode="sync"),
                                clock=clock, preemption_signals=(), items={"ref": Every(steps=2)})
        events = []
        step = StepInfo(0, 0, 0)
        for _ in range(6):
            loader.position += 1 + index  # processes advance differently
            if index == 0 and step.global_step == 1:
                now[0] += 100.0
            ref = {"w": weights(100 + (step.global_step + 1) // 2)}  # changes every 2 steps
            saved = {"w": weights(step.global_step), "n": step.global_step}
            for report in mgr.maybe_save(step, saved, stateful={"loader": loader},
                                         items={"ref": ref}):
                events.append([report.kind, report.step, report.reason])
            step = step.next()
        mgr.close()
        # Process 0 hosts the coordination service: nobody leaves before everybody is done.
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jaxckpt-test-end")
        print("EVENTS " + json.dumps(events), flush=True)
''')


@pytest.fixture(scope="module")
def two_process_root(tmp_path_factory):
    root, outputs = run_two_workers(WORKER, tmp_path_factory.mktemp("mp"))
    return root, [_events(out) for out in outputs]


def _events(output: str) -> list:
    # Found wherever it starts on its line: a log line that a C++ library writes to the same
    # stdout without its newline can precede it (one CI run found no line starting with it
    # while the worker had succeeded; the output now comes with the failure).
    found = [line[line.index("EVENTS ") + 7:] for line in output.splitlines()
             if "EVENTS " in line]
    assert found, f"no EVENTS line in the worker's output:\n{output[-6000:]}"
    return json.loads(found[-1])


def test_primary_decides_time_trigger_and_both_processes_agree(two_process_root):
    _, (events0, events1) = two_process_root
    assert events0 == events1
    assert ["recover", 1, "seconds"] in events0  # only process 0's clock moved
    assert ["recover", 3, "steps"] in events0 and ["export", 3, "steps"] in events0


def test_primary_commits_once_and_each_process_wrote_its_local_state(two_process_root):
    root, _ = two_process_root
    step_dir = os.path.join(root, "recover", "step_00000003")
    names = set(os.listdir(step_dir))
    assert {"COMMITTED", "driver.json", "driver.p00001.json", "done.p00001", "state"} <= names
    driver = json.load(open(os.path.join(step_dir, "driver.json")))
    assert driver["process_count"] == 2
    assert driver["local"]["stateful"]["loader"]["state"] == {"position": 4, "process": 0}
    local1 = json.load(open(os.path.join(step_dir, "driver.p00001.json")))
    assert local1["stateful"]["loader"]["state"] == {"position": 8, "process": 1}


def test_one_process_restores_on_another_mesh(two_process_root):
    root, _ = two_process_root
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P("b", "a"))
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding), "n": 0}

    loader = Loader()
    with CheckpointManager(root, recover=RecoverConfig(keep_last_n=None)) as mgr:
        with pytest.warns(CheckpointWarning, match="saved by 2 process"):
            result = mgr.recover(like, stateful={"loader": loader})
    assert result.step_info.global_step == 3 and result.state["n"] == 3
    assert result.item_versions == {"ref": 2}
    assert result.state["w"].sharding == sharding
    expected = np.arange(32, dtype=np.float32).reshape(8, 4) + 3000
    np.testing.assert_array_equal(np.asarray(result.state["w"]), expected)
    assert loader.position == 4  # process 0's local state


def test_export_was_written_once_from_gathered_shards(two_process_root):
    root, _ = two_process_root
    exports = sorted(os.listdir(os.path.join(root, "export")))
    assert exports == ["epoch0epochstep3globalstep3"]
    w = np.load(os.path.join(root, "export", exports[0], "w.npy"))
    np.testing.assert_array_equal(w, np.arange(32, dtype=np.float32).reshape(8, 4) + 3000)


def test_sharded_item_written_by_both_processes_restores_in_one(two_process_root):
    root, _ = two_process_root
    item_dir = os.path.join(root, "recover", "items", "ref", "v000002")
    assert {"COMMITTED", "done.p00001", "state"} <= set(os.listdir(item_dir))
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    with CheckpointManager(root, recover=RecoverConfig(keep_last_n=None)) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            result = mgr.restore({**like, "n": 0}, step=3, items={"ref": like})
    expected = np.arange(32, dtype=np.float32).reshape(8, 4) + 1000 * 102
    np.testing.assert_array_equal(np.asarray(result.items["ref"]["w"]), expected)


# Both processes restore a checkpoint in which one bulk data file, read only by process 1,
# is damaged. Only the primary checks checksums (alongside the read); its verdict must make
# both processes fall back (recover) or raise (restore(step=...)) together.
DAMAGE_WORKER = jax_worker('''
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxckpt import (CheckpointCorruptError, CheckpointManager, RecoverConfig,
                             StepInfo)
        from jaxckpt.core.manifest import DEFER_CHECKSUMS_OVER

        mesh = jax.make_mesh((4,), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        shape = (4096, 512)  # 2 MiB per device shard: every chunk file is over the threshold

        def values(step):
            return np.random.default_rng(step).standard_normal(shape, dtype=np.float32)

        def weights(step):
            data = values(step)
            return jax.make_array_from_callback(shape, sharding, lambda idx: data[idx])

        class Loader:  # remembers what it was given (worker source: no support import)
            def __init__(self):
                self.position, self.loaded = -1, []
            def state_dict(self):
                return {"position": self.position}
            def load_state_dict(self, state):
                self.loaded.append(state["position"])
                self.position = state["position"]

        config = RecoverConfig(keep_last_n=None)
        loader = Loader()
        with CheckpointManager(root, recover=config, mode="sync", preemption_signals=()) as mgr:
            for step in (0, 1):
                loader.position = 10 * (index + 1) + step
                mgr.save(StepInfo(0, step, step), {"w": weights(step)},
                         stateful={"loader": loader})
        multihost_utils.sync_global_devices("saved")
        out = {}
        if index == 0:
            ckpt = os.path.join(root, "recover", "step_00000001")
            chunks = sorted(os.path.relpath(os.path.join(d, f), ckpt)
                            for d, _, files in os.walk(os.path.join(ckpt, "state", "arrays"))
                            for f in files if os.sep + "c" + os.sep in os.path.join(d, f))
            out["chunks"] = chunks
            rel = chunks[-1]  # the last rows: on process 1's devices
            with open(os.path.join(ckpt, rel), "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                assert size > DEFER_CHECKSUMS_OVER
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0x10]))
            out["damaged"] = rel
        multihost_utils.sync_global_devices("damaged")

        like = {"w": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)}
        fresh = Loader()
        with CheckpointManager(root, recover=config, preemption_signals=()) as mgr:
            try:
                mgr.restore(like, step=1, stateful={"loader": fresh})
                out["explicit"] = "restored"
            except CheckpointCorruptError as exc:
                out["explicit"] = str(exc)
            out["loaded_after_explicit"] = list(fresh.loaded)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = mgr.recover(like, stateful={"loader": fresh})
            out["step"] = result.step_info.global_step
            out["exact"] = all(np.array_equal(np.asarray(shard.data), values(0)[shard.index])
                               for shard in result.state["w"].addressable_shards)
            out["loaded"] = list(fresh.loaded)
            out["warnings"] = [str(w.message) for w in caught]
        multihost_utils.sync_global_devices("jaxckpt-test-end")
        print("RESULT " + json.dumps(out), flush=True)
''')


def test_damaged_bulk_data_makes_every_process_fall_back_or_raise_together(tmp_path):
    root, outputs = run_two_workers(DAMAGE_WORKER, tmp_path)
    primary, other = [
        json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        for out in outputs]
    rel = primary["damaged"]
    assert len(primary["chunks"]) == 4, primary["chunks"]  # one file per device shard
    # restore(step=1): both raise; the primary names the file, the other points to it.
    assert f"{rel}: crc32" in primary["explicit"], primary["explicit"]
    assert "failed verification on the primary process" in other["explicit"], other["explicit"]
    assert primary["loaded_after_explicit"] == other["loaded_after_explicit"] == []
    # recover: both fall back to step 0, bit for bit, each with its own step-0 local state.
    assert primary["step"] == other["step"] == 0
    assert primary["exact"] and other["exact"]
    assert primary["loaded"] == [10] and other["loaded"] == [20]
    assert any("step_00000001" in m and f"{rel}: crc32" in m for m in primary["warnings"])
    superseded = os.listdir(os.path.join(root, "recover", "superseded"))
    assert [name.split(".")[0] for name in superseded] == ["step_00000001"]


# A checkpoint one process saved is restored by two: arrays reshard onto the 2-process mesh,
# process 0 takes the saved local state (loader position, Python and NumPy RNG), process 1
# has no counterpart and keeps its fresh local state with a warning; then the two save again.
ONE_TO_TWO_WORKER = jax_worker('''
        import random
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import multihost_utils
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxckpt import CheckpointManager, RecoverConfig, StepInfo

        mesh = jax.make_mesh((4,), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        replicated = NamedSharding(mesh, P())
        like = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=sharding),
                "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated),
                "n": 0}

        class Loader:  # worker source: no support import
            def __init__(self):
                self.position = -1
            def state_dict(self):
                return {"position": self.position}
            def load_state_dict(self, state):
                self.position = state["position"]

        loader = Loader()
        random.seed(1000 + index)
        np.random.seed(2000 + index)
        out = {}
        config = RecoverConfig(keep_last_n=None)
        with CheckpointManager(os.path.dirname(root) + "/one", recover=config, mode="sync",
                               preemption_signals=()) as mgr:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = mgr.recover(like, stateful={"loader": loader})
            out["warnings"] = [str(w.message) for w in caught]
            out["step"] = result.step_info.global_step
            out["n"] = result.state["n"]
            w = result.state["w"]
            out["shards"] = [[s.index[0].start, s.index[0].stop, np.asarray(s.data).tolist()]
                             for s in w.addressable_shards]
            out["key"] = np.asarray(jax.random.key_data(result.state["key"])).tolist()
            out["position"] = loader.position
            out["draws"] = [random.random(), float(np.random.random())]
            loader.position += 10
            step = result.step_info.next()
            mgr.maybe_save(step, {**result.state, "n": 6}, stateful={"loader": loader})
            mgr.save(step, {**result.state, "n": 6}, stateful={"loader": loader})
        multihost_utils.sync_global_devices("jaxckpt-test-end")
        print("RESULT " + json.dumps(out), flush=True)
''')


def test_one_process_checkpoint_restores_in_two_processes(tmp_path):
    one = tmp_path / "one"
    w = np.arange(64, dtype=np.float32).reshape(16, 4)
    mesh = jax.make_mesh((8,), ("x",))
    state = {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "key": jax.random.key(9),
             "n": 5}
    saved_rng = random.getstate(), np.random.get_state()
    try:
        random.seed(3)
        np.random.seed(4)
        with CheckpointManager(one, recover=RecoverConfig(keep_last_n=None), mode="sync",
                               preemption_signals=()) as mgr:
            mgr.save(StepInfo(0, 5, 5), state, stateful={"loader": Loader(5)})
        expected_draws = [random.random(), float(np.random.random())]
    finally:
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])

    _, outputs = run_two_workers(ONE_TO_TWO_WORKER, tmp_path)
    primary, other = [
        json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        for out in outputs]
    key_data = np.asarray(jax.random.key_data(state["key"])).tolist()
    for result in (primary, other):
        assert result["step"] == 5 and result["n"] == 5 and result["key"] == key_data
        assert len(result["shards"]) == 2  # this process's half of the rows
        for start, stop, data in result["shards"]:
            np.testing.assert_array_equal(np.asarray(data, np.float32), w[start:stop])
        assert any("saved by 1 process(es) and is restored by 2" in m
                   for m in result["warnings"]), result["warnings"]
    assert primary["position"] == 5 and primary["draws"] == expected_draws
    assert other["position"] == -1  # no saved counterpart: its fresh state
    assert any("no local state for process 1" in m for m in other["warnings"]), other["warnings"]
    # The two processes then saved together: a committed 2-process checkpoint of step 6.
    step6 = one / "recover" / "step_00000006"
    assert {"COMMITTED", "driver.p00001.json", "done.p00001"} <= set(os.listdir(step6))
    assert json.loads((step6 / "driver.json").read_text())["process_count"] == 2


def test_each_process_wrote_its_own_shards_in_orbaxs_layout(two_process_root):
    """The native writer ran in both processes: Orbax's own files (``_sharding``,
    ``array_metadatas``) are absent, every shard is one chunk file of a [2, 4] grid, process
    1's chunk checksums reached the manifest through its done marker, plain Orbax restores
    the arrays, and one process reads every chunk natively (each file claimed)."""
    import orbax.checkpoint as ocp

    from jaxckpt.backends.orbax.backend import OrbaxBackend
    from jaxckpt.commit.deferred_checks import DeferredChecks
    from jaxckpt.core.checksum import default_algorithm

    root, _ = two_process_root
    step_dir = os.path.join(root, "recover", "step_00000003")
    arrays = os.path.join(step_dir, "state", "arrays")
    assert not {"_sharding", "array_metadatas"} & set(os.listdir(arrays))
    tree = json.load(open(os.path.join(step_dir, "state", "tree.json")))
    name = next(leaf["name"] for leaf in tree["leaves"] if leaf["path"] == "['w']")
    grid = json.load(open(os.path.join(arrays, name, "zarr.json")))["chunk_grid"]
    assert grid["configuration"]["chunk_shape"] == [2, 4]
    chunks = {f"state/arrays/{name}/c/{i}/0" for i in range(4)}
    manifest = json.load(open(os.path.join(step_dir, "COMMITTED")))["files"]
    assert chunks <= set(manifest)
    carried = json.load(open(os.path.join(step_dir, "done.p00001")))
    assert set(carried) & chunks and all(manifest[rel] == carried[rel] for rel in carried)

    restored = ocp.PyTreeCheckpointer().restore(arrays)
    expected = np.arange(32, dtype=np.float32).reshape(8, 4) + 3000
    np.testing.assert_array_equal(np.asarray(restored[name]), expected)

    claims = DeferredChecks()
    state_dir = os.path.join(step_dir, "state")
    offered = [(rel[len("state/"):], info) for rel, info in manifest.items()
               if rel.startswith(f"state/arrays/{name}/c/")]
    claims.offer(state_dir, offered)
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32), "n": 0}
    backend = OrbaxBackend()
    try:
        result = backend.read(state_dir, like, claims=claims)
    finally:
        backend.close()
    np.testing.assert_array_equal(np.asarray(result["w"]), expected)
    assert claims.unclaimed(state_dir) == [] and claims.problems(state_dir) == []
    assert default_algorithm() in manifest[sorted(chunks)[0]]


NATIVE_READER = jax_worker('''
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxckpt.backends.orbax.backend import OrbaxBackend
        from jaxckpt.commit.deferred_checks import DeferredChecks

        state_dir = root
        manifest = json.load(open(os.path.join(os.path.dirname(root), "COMMITTED")))["files"]
        tree = json.load(open(os.path.join(root, "tree.json")))
        name = next(leaf["name"] for leaf in tree["leaves"] if leaf["path"] == "['w']")
        offered = [(rel[len("state/"):], info) for rel, info in manifest.items()
                   if rel.startswith(f"state/arrays/{name}/c/")]
        claims = DeferredChecks()
        claims.offer(state_dir, offered)
        sharding = NamedSharding(jax.make_mesh((4,), ("x",)), P("x"))
        like = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharding), "n": 0}
        backend = OrbaxBackend()
        result = backend.read(state_dir, like, claims=claims)
        backend.close()
        expected = np.arange(32, dtype=np.float32).reshape(8, 4) + 3000
        mine = set()
        for shard in result["w"].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
            mine.add(f"arrays/{name}/c/{shard.index[0].start // 2}/0")
        unclaimed = {rel for rel, _ in claims.unclaimed(state_dir)}
        assert len(mine) == 2 and unclaimed == {rel for rel, _ in offered} - mine, unclaimed
        assert claims.problems(state_dir) == []
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jaxckpt-test-end")
''')


def test_each_process_reads_only_the_chunks_under_its_own_devices(two_process_root,
                                                                   tmp_path):
    """Two processes restore a checkpoint two wrote natively: each reads (and checksums)
    the chunk files of its own shards, and leaves the other process's unread."""
    root, _ = two_process_root
    state_dir = os.path.join(root, "recover", "step_00000003", "state")
    run_two_workers(NATIVE_READER, tmp_path, dirname=state_dir)


LAGGING_END = jax_worker('''
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jaxckpt-test-end")
        if index == 1:
            threading.Event().wait(2.0)  # still connected, and 2 s behind process 0
''')


def test_a_process_finishing_after_process_0_still_exits_cleanly(tmp_path):
    """Process 0 hosts jax.distributed's coordination service: a process still connected
    when process 0 exits aborts with SIGABRT once it lags by more than about 0.1 s (a
    loaded 2-core machine can stall one that long between the last barrier and its exit).
    Both leave through ``jax.distributed.shutdown()``, which waits for the slower one."""
    run_two_workers(LAGGING_END, tmp_path)
