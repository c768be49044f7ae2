"""Every name jaxckpt writes, and its parsing: format and parse are inverse, and a name of
another kind (or another tool's) parses to None. Pure: no filesystem."""

import pytest

from jaxckpt.core import layout

# (format function, its arguments, the name on disk, parse function, what parsing gives back)
FORMATS = [
    (layout.step_dirname, (0,), "step_00000000", layout.parse_step_dirname, 0),
    (layout.step_dirname, (1234,), "step_00001234", layout.parse_step_dirname, 1234),
    (layout.step_dirname, (123456789,), "step_123456789", layout.parse_step_dirname, 123456789),
    (layout.version_dirname, (7,), "v000007", layout.parse_version_dirname, 7),
    (layout.version_dirname, (1234567,), "v1234567", layout.parse_version_dirname, 1234567),
    (layout.export_dirname, (2, 15, 415), "epoch2epochstep15globalstep415",
     layout.parse_export_dirname, (2, 15, 415)),
    (layout.local_driver_filename, (1,), "driver.p00001.json",
     layout.parse_local_driver_filename, 1),
    (layout.done_marker_name, (3,), "done.p00003", layout.parse_done_marker_name, 3),
]


@pytest.mark.parametrize("fmt, args, name, parse, parsed", FORMATS,
                         ids=[row[2] for row in FORMATS])
def test_format_and_parse_are_inverse(fmt, args, name, parse, parsed):
    assert fmt(*args) == name
    assert parse(name) == parsed


# (parse function, a name that is not of its kind)
NOT_OF_THE_KIND = [
    (layout.parse_step_dirname, "step_1234"),           # fewer than 8 digits
    (layout.parse_step_dirname, "step_0000001a"),
    (layout.parse_step_dirname, "checkpoint_00000001"),
    (layout.parse_step_dirname, "step_00000001.corrupt.1700000000.abcdef"),  # superseded
    (layout.parse_step_dirname, ".tmp-step_00000001.abcd"),
    (layout.parse_step_dirname, "1000"),                  # an Orbax step directory
    (layout.parse_version_dirname, "v12"),
    (layout.parse_version_dirname, "version000001"),
    (layout.parse_export_dirname, "epoch1epochstep2"),
    (layout.parse_export_dirname, "hf_model"),
    (layout.parse_export_dirname, ".tmp-epoch1epochstep2globalstep3.1234abcd"),
    (layout.parse_local_driver_filename, "driver.json"),
    (layout.parse_local_driver_filename, "driver.p1.json"),
    (layout.parse_done_marker_name, "done"),
    (layout.parse_done_marker_name, "done.p00001.json"),
]


@pytest.mark.parametrize("parse, name", NOT_OF_THE_KIND, ids=[row[1] for row in NOT_OF_THE_KIND])
def test_names_of_another_kind_parse_to_none(parse, name):
    assert parse(name) is None


@pytest.mark.parametrize("name, allowed", [
    ("ref", True), ("ref_policy.v2-a", True), ("A" * 128, True),
    ("", False), (".hidden", False), ("-dash", False), ("a/b", False), ("A" * 129, False),
])
def test_item_directory_names(name, allowed):
    assert layout.is_item_dirname(name) is allowed


@pytest.mark.parametrize("name, recover, export", [
    ("step_00000005", True, False),
    ("items", True, False),
    ("superseded", True, False),
    ("epoch0epochstep5globalstep5", False, True),
    ("checkpoint_5", False, False),
    ("hf_model", False, False),
    (".tmp-anything", False, False),  # temporary entries are allowed apart, by prefix
])
def test_what_may_live_under_recover_and_export(name, recover, export):
    assert layout.allowed_in_recover(name) is recover
    assert layout.allowed_in_export(name) is export


def test_temporary_and_superseded_names():
    assert layout.tmp_name("COMMITTED", "ab12") == ".tmp-COMMITTED.ab12"
    assert layout.is_tmp_name(layout.tmp_name("x", "1"))
    assert not layout.is_tmp_name("step_00000001")
    assert (layout.superseded_name("step_00000004", "corrupt", 1700000000, "abcdef")
            == "step_00000004.corrupt.1700000000.abcdef")


def test_fixed_names_are_the_on_disk_format():
    # Renaming any of these orphans every checkpoint written so far.
    assert (layout.RECOVER, layout.EXPORT, layout.ITEMS, layout.SUPERSEDED) == (
        "recover", "export", "items", "superseded")
    assert (layout.COMMIT_MARKER, layout.DRIVER_FILE, layout.STATE_DIR, layout.LOCK_FILE) == (
        "COMMITTED", "driver.json", "state", ".lock")
    assert (layout.TREE_FILE, layout.OBJECTS_FILE, layout.TMP_PREFIX) == (
        "tree.json", "objects.json", ".tmp-")
    assert layout.PINS_FILE == "pins.json"
    assert layout.TIER_FILE == "tier.json"  # a local tier's root only (jaxckpt.manager.local_tier)
    assert layout.ROOT_NAMES == {"recover", "export", ".lock", "pins.json", "tier.json"}


def test_other_modules_use_the_layout_names():
    from jaxckpt.commit import store
    from jaxckpt.manager import driver_state as driver, restore as recovery, save as saving

    assert driver.local_filename(2) == layout.local_driver_filename(2)
    assert saving.STATE_DIR is recovery.STATE_DIR is layout.STATE_DIR
    s = store.CheckpointStore("/r")
    assert s.step_path(5) == "/r/recover/step_00000005"
    assert s.item_path("ref", 3) == "/r/recover/items/ref/v000003"
    assert s.export_dir == "/r/export"
