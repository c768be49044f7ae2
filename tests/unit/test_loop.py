"""jaxckpt.batches: an epoch loop's steps, resumed mid-epoch, with pure Python loaders.

A resume is simulated as the manager does it: the loop stops after step k (as a kill would),
the loader's ``state_dict()`` and the step taken at k stand for the checkpoint, a fresh loader
gets the state (stateful loaders only) and ``batches(start=...)`` goes on; the (step, batch)
pairs of the two pieces must be those of a run never interrupted.
"""

from __future__ import annotations

import dataclasses

import pytest

import jaxckpt
from jaxckpt import ConfigError, Every, IndexSampler, StepInfo
from jaxckpt.core.policy import due_reason


class Positioned:
    """Keeps its position like the README's Flax loader: ``iter`` yields the rest of the
    epoch, and at an epoch end the next ``iter`` starts the next one."""

    def __init__(self, n: int = 4):
        self.n, self.position = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while True:
            epoch, index = divmod(self.position, self.n)
            self.position += 1
            yield (epoch, index)
            if self.position % self.n == 0:
                return

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Spent:
    """Resumes like torchdata's ``StatefulDataLoader``: after ``load_state_dict`` the next
    ``iter`` continues the saved epoch, which is empty when it was saved at its end; every other
    ``iter`` starts a new epoch."""

    def __init__(self, n: int = 4):
        self.n, self.epoch, self.yielded, self.pending = n, -1, 0, False

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if not self.pending:
            self.epoch, self.yielded = self.epoch + 1, 0
        self.pending = False
        while self.yielded < self.n:
            self.yielded += 1
            yield (self.epoch, self.yielded - 1)

    def state_dict(self):
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state):
        self.epoch, self.yielded, self.pending = state["epoch"], state["yielded"], True


class ByEpoch:
    """A plain loader whose order is set by ``set_epoch`` (as a DistributedSampler's)."""

    def __init__(self, n: int = 4):
        self.n, self.epoch, self.calls = n, 0, []

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)
        self.epoch = epoch

    def __iter__(self):
        return iter([(self.epoch, (i * 3 + self.epoch) % self.n) for i in range(self.n)])


def pairs(iterable, stop_after=None):
    out = []
    for step, batch in iterable:
        out.append((step, batch))
        if step.global_step == stop_after:
            break
    return out


def test_a_fresh_run_numbers_steps_and_marks_epoch_ends():
    got = pairs(jaxckpt.batches(["a", "b", "c"], epochs=2))
    assert [b for _, b in got] == ["a", "b", "c"] * 2
    assert [s for s, _ in got] == [StepInfo(e, i, 3 * e + i, 3) for e in range(2) for i in range(3)]
    assert [s.global_step for s, _ in got if s.is_epoch_end] == [2, 5]
    fired = [s.global_step for s, _ in got
             if due_reason(Every(epochs=1), s, epoch_end=s.is_epoch_end, seconds_since_last=None)]
    assert fired == [2, 5]


def test_total_steps_and_epochs_stop_at_the_first_reached():
    assert len(pairs(jaxckpt.batches(range(4), total_steps=6))) == 6
    assert len(pairs(jaxckpt.batches(range(4), epochs=2, total_steps=100))) == 8
    assert len(pairs(jaxckpt.batches(range(4), epochs=5, total_steps=3))) == 3
    assert pairs(jaxckpt.batches(range(4), total_steps=0)) == []


def _resumes(make, *, stateful, **kwargs):
    """Every kill point of a 3-epoch run resumes into the uninterrupted run's pairs."""
    reference = pairs(jaxckpt.batches(make(), epochs=3, **kwargs))
    assert len(reference) == 12
    for kill in range(12):
        loader = make()
        first = pairs(jaxckpt.batches(loader, epochs=3, **kwargs), stop_after=kill)
        saved = first[-1][0]
        fresh = make()
        if stateful:
            fresh.load_state_dict(loader.state_dict())
        # What recover returns: anything with the saved step as `step_info`.
        recovered = dataclasses.make_dataclass("R", ["step_info"])(saved)
        rest = pairs(jaxckpt.batches(fresh, epochs=3, start=recovered, **kwargs))
        assert first + rest == reference, f"kill after step {kill}"


def test_a_plain_loader_resumes_by_skipping_the_trained_batches_once():
    _resumes(lambda: ["a", "b", "c", "d"], stateful=False)


def test_a_loader_ordered_by_set_epoch_resumes_by_skipping():
    _resumes(ByEpoch, stateful=False)
    loader = ByEpoch()
    pairs(jaxckpt.batches(loader, epochs=3, start=StepInfo(0, 1, 1, 4)))
    assert loader.calls == [0, 1, 2]


def test_a_positioned_loader_resumes_itself_and_is_not_skipped():
    _resumes(Positioned, stateful=True)


def test_a_loader_restored_at_an_epoch_end_with_an_empty_iterator_goes_on():
    _resumes(Spent, stateful=True)


def test_index_sampler_resumes_itself():
    def make():
        return IndexSampler(8, 2, seed=3)

    reference = [(s, b.tolist()) for s, b in jaxckpt.batches(make(), epochs=2)]
    for kill in (2, 3, 5):
        sampler = make()
        first = [(s, b.tolist()) for s, b in pairs(jaxckpt.batches(sampler, epochs=2),
                                                    stop_after=kill)]
        fresh = make()
        fresh.load_state_dict(sampler.state_dict())
        rest = [(s, b.tolist()) for s, b in jaxckpt.batches(fresh, epochs=2, start=first[-1][0])]
        assert first + rest == reference


def test_skip_false_with_a_plain_loader_does_not_skip():
    got = pairs(jaxckpt.batches(["c", "d"], epochs=1, start=StepInfo(0, 1, 1, 4),
                                steps_per_epoch=4, skip=False))
    assert [(s.epoch_step, b) for s, b in got] == [(2, "c"), (3, "d")]


def test_a_checkpoint_at_the_last_step_yields_nothing():
    assert pairs(jaxckpt.batches(range(4), epochs=2, start=StepInfo(1, 3, 7, 4))) == []


def test_unknown_length_needs_steps_per_epoch():
    def stream():
        yield from range(3)

    with pytest.raises(ConfigError, match="steps_per_epoch=N"):
        jaxckpt.batches(stream(), epochs=1)
    got = pairs(jaxckpt.batches(stream(), total_steps=3, steps_per_epoch=3))
    assert [s.global_step for s, _ in got] == [0, 1, 2]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "epochs=N or total_steps=N"),
    ({"epochs": 0}, "epochs must be an int >= 1"),
    ({"total_steps": -1}, "total_steps must be"),
    ({"epochs": 1, "skip": "yes"}, "skip must be True, False or None"),
    ({"epochs": 1, "start": 5}, "start must be what mgr.recover returned"),
    ({"epochs": 1, "start": StepInfo(0, 1, 1, 8)}, "saved with steps_per_epoch=8"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        jaxckpt.batches(range(4), **kwargs)


def test_a_loader_shorter_than_its_length_is_an_error():
    class Short(list):
        def __len__(self):
            return 5

    with pytest.raises(ConfigError, match="ended epoch 0 after 3 batches"):
        pairs(jaxckpt.batches(Short([1, 2, 3]), epochs=1))
    with pytest.raises(ConfigError, match="one-shot iterator"):
        pairs(jaxckpt.batches(iter(range(3)), epochs=2, steps_per_epoch=3))
    with pytest.raises(ConfigError, match="loader ended after 1 batches"):
        pairs(jaxckpt.batches(Short([1]), epochs=1, start=StepInfo(0, 1, 1, 5)))
