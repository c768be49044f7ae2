"""Versioned auxiliary items (a GRPO-style reference policy on its own cadence)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import (
    CheckpointManager,
    CheckpointWarning,
    ConfigError,
    Every,
    RecoverConfig,
    StepInfo,
    Versioned,
)

LIKE = {"w": jax.ShapeDtypeStruct((64,), jnp.float32)}
REF_EVERY = 4


def policy(step):
    return {"w": jnp.full((64,), float(step), jnp.float32)}


def train(mgr, steps, start=0, ref=None):
    """Actor changes every step; the reference copies the actor every REF_EVERY steps."""
    ref = policy(-1) if ref is None else ref
    reports = []
    info = StepInfo(0, start, start)
    for g in range(start, start + steps):
        actor = policy(g)
        if (g + 1) % REF_EVERY == 0:
            ref = actor  # reference update at the end of this step
        reports += mgr.maybe_save(info, actor, items={"ref": ref})
        info = info.next()
    mgr.wait()
    return reports


def ref_value_at(step):
    """What the reference holds after step `step` completed."""
    updates = (step + 1) // REF_EVERY
    return -1.0 if updates == 0 else float(updates * REF_EVERY - 1)


def versions_on_disk(root):
    return sorted(os.listdir(os.path.join(root, "recover", "items", "ref")))


def test_reference_is_written_only_when_it_changed_and_every_checkpoint_restores_its_version(
        tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2), keep_last_n=None),
                           items={"ref": Every(steps=REF_EVERY)}) as mgr:
        reports = train(mgr, 12)
    # checkpoints at steps 1,3,5,7,9,11 refer to versions 0,1,1,2,2,3: four distinct versions
    assert versions_on_disk(tmp_path) == ["v000000", "v000001", "v000002", "v000003"]
    sizes = {r.step: r.bytes for r in reports}
    manifest = json.load(open(tmp_path / "recover" / "items" / "ref" / "v000001" / "COMMITTED"))
    # Step 3 wrote version 1 and counts its bytes; step 5 reused it and wrote none of them
    # (driver.json sizes differ by a byte or two: its timestamp).
    assert abs((sizes[3] - sizes[5]) - manifest["total_bytes"]) < 16
    assert manifest["total_bytes"] > 64 * 4 and abs(sizes[5] - sizes[9]) < 16
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 3, 5, 7, 9, 11):
            r = mgr.restore(LIKE, step=step, items={"ref": LIKE})
            assert r.item_versions == {"ref": (step + 1) // REF_EVERY}
            np.testing.assert_array_equal(r.items["ref"]["w"], np.full(64, ref_value_at(step)))
            np.testing.assert_array_equal(r.state["w"], np.full(64, float(step)))


def test_unchanged_item_is_never_rewritten_even_across_restarts(tmp_path):
    mgr = CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1)),
                            items={"ref": Every(steps=100)})
    train(mgr, 3)
    mgr.close()
    marker = tmp_path / "recover" / "items" / "ref" / "v000000" / "COMMITTED"
    before = marker.stat().st_mtime_ns
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1)),
                           items={"ref": Every(steps=100)}) as mgr:
        r = mgr.recover(LIKE, items={"ref": LIKE})
        train(mgr, 3, start=r.step_info.global_step + 1, ref=r.items["ref"])
    assert marker.stat().st_mtime_ns == before
    assert versions_on_disk(tmp_path) == ["v000000"]


def test_retention_prunes_versions_no_checkpoint_refers_to_but_keeps_the_newest(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2), keep_last_n=1),
                           items={"ref": Every(steps=REF_EVERY)}) as mgr:
        train(mgr, 12)
        assert mgr.committed_steps() == [11]
    assert versions_on_disk(tmp_path) == ["v000003"]


def test_explicit_versions(tmp_path):
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(steps=1), keep_last_n=None)) as mgr:
        mgr.maybe_save(StepInfo(0, 0, 0), policy(0), items={"ref": Versioned(7, policy(70))})
        mgr.maybe_save(StepInfo(0, 1, 1), policy(1), items={"ref": Versioned(7, policy(999))})
        mgr.wait()
        r = mgr.restore(LIKE, step=1, items={"ref": LIKE})
    assert r.item_versions == {"ref": 7}
    # version 7 as first written
    np.testing.assert_array_equal(r.items["ref"]["w"], np.full(64, 70.0))


def test_damaged_item_makes_its_checkpoints_fall_back(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2), keep_last_n=None),
                           items={"ref": Every(steps=REF_EVERY)}) as mgr:
        train(mgr, 8)  # checkpoints 1,3,5,7 -> versions 0,1,1,2
    v2 = tmp_path / "recover" / "items" / "ref" / "v000002" / "state"
    victim = max((p for p in v2.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=None)) as mgr:
        with pytest.warns(CheckpointWarning, match=r"step_00000007.*item 'ref' v2"):
            r = mgr.recover(LIKE, items={"ref": LIKE})
    assert r.step_info.global_step == 5 and r.item_versions == {"ref": 1}
    np.testing.assert_array_equal(r.items["ref"]["w"], np.full(64, 3.0))


def test_item_requested_but_never_saved_warns(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(StepInfo(), policy(0))
        with pytest.warns(CheckpointWarning, match="no version of item 'ref'"):
            r = mgr.restore(LIKE, items={"ref": LIKE})
    assert r.items == {}


@pytest.mark.parametrize(
    "items, message",
    [
        ({"ref": Every(seconds=60)}, r"items\['ref'\]=Every\(.*seconds=60.*RecoverConfig.every"),
        ({"ref": Every()}, r"items\['ref'\].*inconsistent"),
        ({"ref": Every(steps=4, epochs=1)}, r"items\['ref'\].*exactly one"),
        ({"ref": 4}, r"items\['ref'\] must be a jaxckpt.Every"),
        ({"../ref": Every(steps=1)}, "names a directory"),
    ],
)
def test_inconsistent_item_cadences_are_rejected_at_construction(tmp_path, items, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=10)), items=items)


def test_undeclared_item_without_a_version_is_refused(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match=r"items\['ref'\] has no version"):
            mgr.save(StepInfo(), policy(0), items={"ref": policy(0)})


def test_driver_records_the_version_each_checkpoint_needs(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2), keep_last_n=None),
                           items={"ref": Every(steps=REF_EVERY)}) as mgr:
        train(mgr, 6)
    body = json.load(open(tmp_path / "recover" / "step_00000005" / "driver.json"))
    assert body["items"] == {"ref": {"version": 1}}
