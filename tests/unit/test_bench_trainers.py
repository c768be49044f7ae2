"""``jaxckpt bench --trainers``: the lost-time targets and the table, from given rows (the rows
themselves are measured by the integrations' own bench modules, minutes of trainer imports)."""

from __future__ import annotations

import pytest

from jaxckpt.tools.bench.trainers import format_trainers, run_trainers, trainer_targets


def test_each_integration_row_gives_its_ratio_against_the_target():
    rows = {"transformers": {"lost_s": {"trainer": 0.5, "jaxckpt": 0.05}},
            "lightning": {"lost_s": {"torch_io": 0.4, "jaxckpt": 0.2}},
            "keras": {"lost_s": {"keras": 1.0, "jaxckpt": -0.01}},
            "missing": {"unavailable": "not installed: x"},
            "accelerate": {"lost_s": {"accelerate": 0.8, "jaxckpt": 0.08}},
            "transformers-large": {"steady_save_s": {"trainer": 2.0, "jaxckpt": 0.3}},
            "lightning-large": {"lost_s": {"torch_io": 9.0, "jaxckpt": 9.0},
                                "steady_save_s": {"torch_io": 0.4, "jaxckpt": 0.02}},
            "keras-large": {"lost_s": {"keras": 9.0, "jaxckpt": 9.0},
                            "lost_per_save_s": {"keras": 1.0, "jaxckpt": 0.1}}}
    targets = {t["trainer"]: t for t in trainer_targets(rows)}
    assert sorted(targets) == ["accelerate", "keras", "keras-large", "lightning",
                               "lightning-large", "transformers", "transformers-large"]
    assert targets["accelerate"]["ratio"] == pytest.approx(0.1)
    assert targets["transformers-large"]["ratio"] == pytest.approx(0.15)
    assert targets["lightning-large"]["ratio"] == pytest.approx(0.05)
    assert targets["keras-large"]["ratio"] == pytest.approx(0.1)  # per save
    assert targets["transformers"]["ratio"] == pytest.approx(0.1)
    assert targets["transformers"]["met"] is True
    assert targets["lightning"]["ratio"] == pytest.approx(0.5)
    assert targets["lightning"]["met"] is False
    # A loss under the noise floor (negative) counts as none, not as a negative ratio.
    assert targets["keras"]["ratio"] == 0.0 and targets["keras"]["met"] is True
    table = format_trainers({"quick": False, "rows": rows, "targets": list(targets.values())})
    lines = table.splitlines()
    assert lines[1].split()[:5] == ["transformers", "0.500", "s", "0.050", "s"]
    assert lines[2].endswith("NO") and "not installed: x" in lines[4]


def test_a_trainer_that_lost_nothing_gives_no_ratio():
    targets = trainer_targets({"keras": {"lost_s": {"keras": 0.0, "jaxckpt": 0.1}}})
    assert targets[0]["ratio"] is None and targets[0]["met"] is None


def test_unknown_trainer_names_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        run_trainers(only=("deepspeed",))


def test_the_steady_save_time_leaves_out_the_first_and_last_saves():
    from jaxckpt.tools.bench.rows_trainers import _steady_per_save

    # 4 saves (every 2 of 8 steps): the second and third count, over the plain run's steps.
    run = {"calls_s": [0.0, 9.0, 0.1, 0.5, 0.1, 0.7, 0.1, 9.0]}
    plain = {"calls_s": [0.1] * 8}
    assert _steady_per_save([run], [plain], 8, 2) == pytest.approx(0.5)
    assert _steady_per_save([run], [plain], 4, 2) is None
