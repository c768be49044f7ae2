"""``jaxckpt bench --trainers``: the lost-time targets and the table, from given rows (the rows
themselves are measured by the integrations' own bench modules, minutes of trainer imports)."""

from __future__ import annotations

import os
import threading

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


def test_cpu_per_save_is_split_between_the_training_thread_and_the_others():
    from jaxckpt.tools.bench.rows_trainers import _cpu_per_save

    # 2 saves: 1.0 s more CPU in all and 0.4 s more on the training thread than without.
    runs = [{"cpu_s": 3.0, "train_cpu_s": 1.4}]
    plain = [{"cpu_s": 2.0, "train_cpu_s": 1.0}]
    split = _cpu_per_save(runs, plain, 2)
    assert split["total"] == pytest.approx(0.5)
    assert split["training_thread"] == pytest.approx(0.2)
    assert split["other_threads"] == pytest.approx(0.3)
    rows = {"lightning": {"lost_s": {"torch_io": 0.4, "jaxckpt": 0.2},
                          "cpu_per_save_s": {"torch_io": {"total": 0.1, "training_thread": 0.1},
                                             "jaxckpt": split}}}
    target = trainer_targets(rows)[0]
    assert target["jaxckpt_cpu_per_save_s"] is split
    table = format_trainers({"quick": False, "rows": rows, "targets": [target]})
    assert table.splitlines()[-1].split() == ["lightning", "0.100", "/", "-", "/", "-",
                                              "0.500", "/", "-", "/", "-"]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is Linux's")
def test_threads_started_under_lowered_threads_take_the_nice_value():
    from jaxckpt.tools.bench.timing import _lowered_threads

    def nice_of_new_thread() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        thread.start()
        thread.join()
        return seen[0]

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with _lowered_threads(19) as threads:
        assert nice_of_new_thread() == 19
        burner = threading.Thread(target=lambda: sum(range(3_000_000)))
        burner.start()
        burner.join()
        assert threads.spent() > 0.02  # the ended threads' CPU is counted
    assert nice_of_new_thread() == mine  # the switch is undone; this thread never changed
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
