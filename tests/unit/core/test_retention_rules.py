"""Table tests for the retention engine (``jaxckpt.core.retention.decide``): no filesystem."""

import math

import pytest

from jaxckpt import ConfigError, Every, KeepBest, RecoverConfig
from jaxckpt.core.retention import CheckpointFacts, RetentionRules, decide


def ck(step, *, status="committed", loss=None, metrics=None, pinned=False, reading=False):
    if metrics is None and loss is not None:
        metrics = {"loss": loss}
    return CheckpointFacts(step=step, status=status, metrics=metrics, pinned=pinned,
                           reading=reading)


def kept(checkpoints, **rules):
    """{step: reasons} of the kept checkpoints; the deleted ones are left out."""
    verdicts = decide(checkpoints, RetentionRules(**rules))
    return {v.step: v.reasons for v in verdicts if v.keep}


BEST_LOSS = KeepBest(metric="loss", mode="min", n=1)


@pytest.mark.parametrize(
    "checkpoints, rules, expected",
    [
        # keep_last_n alone behaves as steps_to_delete: the newest N.
        ([ck(0), ck(1), ck(2)], dict(keep_last_n=1), {2: ("resume-point", "last-N")}),
        ([ck(0), ck(1), ck(2)], dict(keep_last_n=2),
         {1: ("last-N",), 2: ("resume-point", "last-N")}),
        # None keeps every valid one; 0 keeps the latest forced save, as 1 does.
        ([ck(0), ck(1)], dict(keep_last_n=None), {0: ("last-N",), 1: ("resume-point", "last-N")}),
        ([ck(4), ck(9)], dict(keep_last_n=0), {9: ("resume-point", "last-N")}),
        # every-K keeps (step + 1) % K == 0, the steps an Every(steps=K) trigger saves.
        ([ck(s) for s in (99, 149, 199, 249)], dict(keep_last_n=1, keep_every=Every(steps=100)),
         {99: ("every-K",), 199: ("every-K",), 249: ("resume-point", "last-N")}),
        # best by min loss; a checkpoint without the metric is not eligible (and no crash).
        ([ck(0, loss=0.5), ck(1, loss=0.2), ck(2), ck(3, loss=0.9)],
         dict(keep_last_n=1, keep_best=BEST_LOSS),
         {1: ("best",), 3: ("resume-point", "last-N")}),
        ([ck(0, loss=0.5), ck(1, loss=0.2), ck(2, loss=0.4)],
         dict(keep_last_n=1, keep_best=KeepBest(metric="loss", mode="max", n=2)),
         {0: ("best",), 2: ("resume-point", "last-N", "best")}),
        # Ties: the newer step ranks first.
        ([ck(0, loss=0.1), ck(1, loss=0.1), ck(2, loss=0.3)],
         dict(keep_last_n=1, keep_best=BEST_LOSS), {1: ("best",), 2: ("resume-point", "last-N")}),
        # Not a finite number (NaN, bool, string, other metric only): not eligible.
        ([ck(0, metrics={"loss": math.nan}), ck(1, metrics={"loss": True}),
          ck(2, metrics={"loss": "low"}), ck(3, metrics={"acc": 1.0}), ck(4)],
         dict(keep_last_n=1, keep_best=BEST_LOSS), {4: ("resume-point", "last-N")}),
        # A restart between saves changes nothing: the decision depends on the list alone
        # (metrics come from each checkpoint, not from this run's memory).
        ([ck(0, loss=0.1), ck(5, loss=0.7), ck(6, loss=0.6)],
         dict(keep_last_n=1, keep_best=BEST_LOSS), {0: ("best",), 6: ("resume-point", "last-N")}),
        # Pins keep anything, even with keep_last_n=1.
        ([ck(0, pinned=True), ck(1), ck(2)], dict(keep_last_n=1),
         {0: ("pinned",), 2: ("resume-point", "last-N")}),
        # Being read: kept, and does not count towards last-N.
        ([ck(0), ck(1, reading=True), ck(2)], dict(keep_last_n=1),
         {1: ("being-read",), 2: ("resume-point", "last-N")}),
        ([ck(0), ck(1), ck(2, reading=True)], dict(keep_last_n=2),
         {1: ("last-N",), 2: ("resume-point", "being-read", "last-N")}),
    ],
)
def test_decide_keeps_what_any_rule_keeps(checkpoints, rules, expected):
    assert kept(checkpoints, **rules) == expected


def test_a_corrupt_newest_checkpoint_keeps_the_previous_valid_one_and_itself():
    # Nothing newer than the corrupt one committed: it is kept as unverified evidence, and
    # the newest valid one stays the resume point even with keep_last_n=1.
    checkpoints = [ck(0), ck(1), ck(2, status="corrupt")]
    assert kept(checkpoints, keep_last_n=1) == {1: ("resume-point", "last-N"),
                                                2: ("unverified",)}


def test_a_corrupt_checkpoint_goes_once_a_newer_one_committed():
    checkpoints = [ck(0, status="corrupt", loss=0.0), ck(1, loss=0.5)]
    assert kept(checkpoints, keep_last_n=None, keep_every=Every(steps=1),
                keep_best=BEST_LOSS) == {1: ("resume-point", "last-N", "every-K", "best")}
    # ...unless it is pinned or being read.
    checkpoints = [ck(0, status="corrupt", pinned=True), ck(1, status="corrupt", reading=True),
                   ck(2)]
    assert kept(checkpoints, keep_last_n=1) == {0: ("pinned",), 1: ("being-read",),
                                                2: ("resume-point", "last-N")}


def test_nothing_valid_keeps_everything():
    checkpoints = [ck(0, status="corrupt"), ck(1, status="corrupt")]
    assert kept(checkpoints, keep_last_n=1) == {0: ("unverified",), 1: ("unverified",)}


def test_last_n_counts_valid_checkpoints_only():
    checkpoints = [ck(0), ck(1), ck(2, status="corrupt"), ck(3)]
    assert kept(checkpoints, keep_last_n=2) == {1: ("last-N",), 3: ("resume-point", "last-N")}


def test_unknown_rules_decide_only_what_needs_no_configuration():
    checkpoints = [ck(0, pinned=True), ck(1), ck(2)]
    verdicts = decide(checkpoints, RetentionRules(known=False))
    assert [(v.step, v.reasons) for v in verdicts] == [
        (0, ("pinned",)), (1, ()), (2, ("resume-point",))]


def test_decide_returns_oldest_first_whatever_the_input_order():
    assert [v.step for v in decide([ck(5), ck(1), ck(3)], RetentionRules())] == [1, 3, 5]


def test_rules_round_trip_through_their_driver_record():
    rules = RetentionRules.of(RecoverConfig(keep_last_n=2, keep_every=Every(steps=1000),
                                            keep_best=KeepBest(metric="loss", mode="max", n=3)))
    assert RetentionRules.from_json(rules.to_json()) == rules
    assert RetentionRules.from_json(RetentionRules().to_json()) == RetentionRules()
    assert RetentionRules.from_json(None).known is False
    assert RetentionRules.from_json({"keep_best": {"metric": ""}}).known is False
    assert RetentionRules.from_json({"keep_last_n": "2"}).known is False
    assert RetentionRules.from_json({"keep_every": {"steps": 0}}).known is False


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: KeepBest(metric=""), "KeepBest.metric"),
        (lambda: KeepBest(metric=3), "KeepBest.metric"),
        (lambda: KeepBest(metric="loss", mode="lowest"), "KeepBest.mode"),
        (lambda: KeepBest(metric="loss", n=0), "KeepBest.n"),
        (lambda: KeepBest(metric="loss", n=True), "KeepBest.n"),
        (lambda: RecoverConfig(keep_every=Every(epochs=1)), "RecoverConfig.keep_every"),
        (lambda: RecoverConfig(keep_every=Every(seconds=60)), "RecoverConfig.keep_every"),
        (lambda: RecoverConfig(keep_every=Every(steps=10, epochs=1)), "RecoverConfig.keep_every"),
        (lambda: RecoverConfig(keep_every=Every()), "RecoverConfig.keep_every"),
        (lambda: RecoverConfig(keep_every=100), "RecoverConfig.keep_every"),
        (lambda: RecoverConfig(keep_best="loss"), "RecoverConfig.keep_best"),
    ],
)
def test_bad_retention_settings_name_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_keep_best_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        KeepBest("loss")  # noqa
    best = KeepBest(metric="loss")
    with pytest.raises(AttributeError):
        best.n = 2  # frozen
