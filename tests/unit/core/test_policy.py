"""Table tests for the pure rules: triggers, retention, modes, config validation."""

import pytest

from jaxckpt import ConfigError, Every, ExportConfig, RecoverConfig, StepInfo
from jaxckpt.core.policy import (
    SaveTrigger,
    due_reason,
    resolve_mode,
    steps_to_delete,
    writes_periodic,
)


def step(global_step, epoch=0, epoch_step=None, spe=None):
    return StepInfo(epoch, global_step if epoch_step is None else epoch_step, global_step, spe)


@pytest.mark.parametrize(
    "every, info, epoch_end, since, expected",
    [
        (Every(), step(9), True, 1e9, None),  # all None: never
        (Every(steps=10), step(9), False, None, "steps"),  # 10 steps completed
        (Every(steps=10), step(10), False, None, None),
        (Every(steps=10), step(19), False, None, "steps"),
        (Every(steps=1), step(0), False, None, "steps"),
        (Every(epochs=1), step(9), False, None, None),  # epochs fire only at epoch end
        (Every(epochs=1), step(9), True, None, "epochs"),
        (Every(epochs=2), StepInfo(0, 4, 4, 5), True, None, None),  # end of epoch 0 (1st)
        (Every(epochs=2), StepInfo(1, 4, 9, 5), True, None, "epochs"),  # end of 2nd epoch
        (Every(seconds=60), step(3), False, 59.9, None),
        (Every(seconds=60), step(3), False, 60.0, "seconds"),
        (Every(seconds=60), step(3), False, None, None),  # clock not started
        (Every(steps=10, seconds=60), step(3), False, 61.0, "seconds"),  # any-of
        (Every(steps=10, seconds=60), step(9), False, 1.0, "steps"),
        (Every(steps=7, epochs=1), step(4), True, None, "epochs"),
        (Every(steps=5, epochs=1, seconds=1.0), step(4), True, 2.0, "steps"),  # first named wins
    ],
)
def test_due_reason_table(every, info, epoch_end, since, expected):
    assert due_reason(every, info, epoch_end=epoch_end, seconds_since_last=since) == expected


def test_seconds_trigger_counts_from_last_save_of_its_kind():
    now = [100.0]
    trigger = SaveTrigger(Every(seconds=10), clock=lambda: now[0])
    assert trigger.due(step(0), epoch_end=False) is None
    now[0] = 110.0
    assert trigger.due(step(1), epoch_end=False) == "seconds"
    trigger.mark_saved()
    now[0] = 115.0
    assert trigger.due(step(2), epoch_end=False) is None
    now[0] = 120.0
    assert trigger.due(step(3), epoch_end=False) == "seconds"


@pytest.mark.parametrize(
    "committed, keep, protected, expected",
    [
        ([1, 2, 3], None, (), []),  # None keeps all
        ([1, 2, 3], 1, (), [1, 2]),
        ([3, 1, 2], 2, (), [1]),  # order of input does not matter
        ([1, 2, 3], 3, (), []),
        ([1, 2, 3], 5, (), []),
        ([1, 2, 3], 0, (), [1, 2]),  # 0: forced saves only, latest kept
        ([5], 1, (), []),
        ([], 1, (), []),
        ([1, 2, 3], 1, (1,), [2]),  # a checkpoint being read is skipped
        ([1, 2, 3], 1, (3,), [1, 2]),  # protecting the newest changes nothing
    ],
)
def test_retention_table(committed, keep, protected, expected):
    assert steps_to_delete(committed, keep, protected=protected) == expected


@pytest.mark.parametrize("keep, periodic", [(None, True), (0, False), (1, True), (7, True)])
def test_keep_last_zero_writes_no_intermediate_checkpoints(keep, periodic):
    assert writes_periodic(keep) is periodic


@pytest.mark.parametrize(
    "mode, supports_async, expected",
    [("auto", True, "async"), ("auto", False, "sync"), ("sync", True, "sync"),
     ("async", True, "async"), ("sync", False, "sync")],
)
def test_resolve_mode_table(mode, supports_async, expected):
    assert resolve_mode(mode, supports_async=supports_async) == expected


def test_async_where_unsupported_is_an_error_not_a_downgrade():
    with pytest.raises(ConfigError, match="async"):
        resolve_mode("async", supports_async=False)


@pytest.mark.parametrize("mode, enabled", [("on", True), ("auto", True), ("off", False),
                                           ("disabled", False)])
def test_recover_modes(mode, enabled):
    assert RecoverConfig(mode=mode).enabled is enabled


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Every(steps=0), "Every.steps"),
        (lambda: Every(steps=-3), "Every.steps"),
        (lambda: Every(steps=2.5), "Every.steps"),
        (lambda: Every(steps=True), "Every.steps"),
        (lambda: Every(epochs=0), "Every.epochs"),
        (lambda: Every(seconds=0), "Every.seconds"),
        (lambda: Every(seconds=float("inf")), "Every.seconds"),
        (lambda: Every(seconds="60"), "Every.seconds"),
        (lambda: RecoverConfig(mode="always"), "RecoverConfig.mode"),
        (lambda: RecoverConfig(keep_last_n=-1), "RecoverConfig.keep_last_n"),
        (lambda: RecoverConfig(keep_last_n=1.0), "RecoverConfig.keep_last_n"),
        (lambda: RecoverConfig(retries=-1), "RecoverConfig.retries"),
        (lambda: RecoverConfig(resume="no"), "RecoverConfig.resume must be True or False"),
        (lambda: RecoverConfig(every={"steps": 10}), "RecoverConfig.every"),
        (lambda: RecoverConfig(verify="md5"), "RecoverConfig.verify"),
        (lambda: ExportConfig(exporter=None), "ExportConfig.exporter"),
        (lambda: ExportConfig(exporter=print, mode="later"), "ExportConfig.mode"),
        (lambda: ExportConfig(exporter=print, keep_last_n=-2), "ExportConfig.keep_last_n"),
        (lambda: StepInfo(-1, 0, 0), "StepInfo.epoch"),
        (lambda: StepInfo(0, 5, 5, 5), "StepInfo.epoch_step"),
        (lambda: StepInfo(0, 0, 0, 0), "StepInfo.steps_per_epoch"),
        (lambda: StepInfo(0, 0, 0, counters={"x": "a"}), "StepInfo.counters"),
    ],
)
def test_bad_config_names_field_and_value(make, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        make()
    assert isinstance(info.value, ValueError)


def test_step_info_next_rolls_over_epochs_and_counts_tokens():
    info = StepInfo(0, 0, 0, 3)
    seen = []
    for _ in range(7):
        seen.append((info.epoch, info.epoch_step, info.global_step, info.is_epoch_end))
        info = info.next(tokens=10)
    assert seen == [(0, 0, 0, False), (0, 1, 1, False), (0, 2, 2, True), (1, 0, 3, False),
                    (1, 1, 4, False), (1, 2, 5, True), (2, 0, 6, False)]
    assert info.tokens_seen == 70


def test_step_info_json_round_trip_and_old_format_defaults():
    info = StepInfo(2, 1, 9, 4, tokens_seen=123, counters={"rollouts": 5})
    assert StepInfo.from_json(info.to_json()) == info
    old = {"epoch": 1, "epoch_step": 0, "global_step": 4, "steps_per_epoch": 4}
    assert StepInfo.from_json(old) == StepInfo(1, 0, 4, 4)


def test_step_info_counters_are_copied():
    counters = {"a": 1}
    info = StepInfo(0, 0, 0, counters=counters)
    counters["a"] = 2
    assert info.counters == {"a": 1}
