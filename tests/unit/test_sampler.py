"""IndexSampler: a data position that does not depend on the number of processes.

Tables: a run of P processes stopped after any number of global batches and resumed on Q
processes reads, in total, exactly what one uninterrupted process reads (each sample of an
epoch once, in the same order); epoch boundaries; the end-of-epoch rule; bad inputs; bad
states. The multi-process version with real processes and SIGKILL is
tests/system/test_sampler_processes.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxckpt
from jaxckpt import ConfigError, IndexSampler
from jaxckpt.manager import driver_state as drv

SAMPLES, GLOBAL_BATCH = 50, 12  # 4 global batches an epoch, 2 samples dropped; 12 = 1*2*3*4
BATCHES = SAMPLES // GLOBAL_BATCH


def make(count: int, **kwargs) -> list[IndexSampler]:
    kwargs = {"seed": 5, **kwargs}
    return [IndexSampler(SAMPLES, GLOBAL_BATCH, process_index=i, process_count=count, **kwargs)
            for i in range(count)]


def global_steps(samplers: list[IndexSampler], steps: int) -> list[list[int]]:
    """``steps`` global batches, each assembled from every process's slice in process order."""
    out = []
    for _ in range(steps):
        parts = [next(sampler) for sampler in samplers]
        assert {len(part) for part in parts} == {GLOBAL_BATCH // len(samplers)}
        out.append(np.concatenate(parts).tolist())
    return out


RESHARDS = [(4, 2), (2, 4), (3, 1), (1, 3), (4, 3)]


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in_order"])
@pytest.mark.parametrize("drop_last", [True, False], ids=["drop_last", "fill_up"])
@pytest.mark.parametrize("before,after", RESHARDS, ids=[f"{b}to{a}" for b, a in RESHARDS])
def test_resuming_on_another_process_count_reads_what_one_uninterrupted_run_reads(
        before, after, shuffle, drop_last):
    total = 2 * len(make(1, drop_last=drop_last)[0]) + 1  # two epochs and one batch of a third
    reference = global_steps(make(1, shuffle=shuffle, drop_last=drop_last), total)
    for stop in range(total + 1):  # every position, both epoch ends included
        old = make(before, shuffle=shuffle, drop_last=drop_last)
        seen = global_steps(old, stop)
        states = [sampler.state_dict() for sampler in old]
        assert all(state == states[0] for state in states), "state differs across processes"
        new = make(after, shuffle=shuffle, drop_last=drop_last)
        for sampler in new:
            sampler.load_state_dict(json.loads(json.dumps(states[0])))
        seen += global_steps(new, total - stop)
        assert seen == reference, f"{before} -> {after} processes after {stop} batches"


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_epoch_reads_each_kept_sample_once(shuffle):
    (sampler,) = make(1, shuffle=shuffle)
    epochs = [np.concatenate(list(sampler)) for _ in range(3)]
    for epoch in epochs:
        assert len(epoch) == BATCHES * GLOBAL_BATCH and len(set(epoch.tolist())) == len(epoch)
        assert set(epoch.tolist()) <= set(range(SAMPLES))
    if shuffle:  # a new order every epoch; the same seed gives the same orders
        assert len({tuple(epoch) for epoch in epochs}) == 3
        (again,) = make(1)
        assert np.array_equal(np.concatenate(list(again)), epochs[0])
        (other,) = make(1, seed=6)
        assert not np.array_equal(np.concatenate(list(other)), epochs[0])
    else:
        assert all(epoch.tolist() == list(range(BATCHES * GLOBAL_BATCH)) for epoch in epochs)


def test_fill_up_reads_every_sample_and_keeps_the_batch_shape():
    (sampler,) = make(1, drop_last=False)
    assert len(sampler) == 5
    batches = list(sampler)
    assert [len(batch) for batch in batches] == [GLOBAL_BATCH] * 5
    flat = np.concatenate(batches).tolist()
    assert set(flat) == set(range(SAMPLES))
    assert flat[SAMPLES:] == flat[:5 * GLOBAL_BATCH - SAMPLES]  # filled from the epoch's start


def test_next_crosses_epochs_and_iter_stops_at_the_epoch_end():
    (sampler,) = make(1)
    assert (sampler.epoch, sampler.position, sampler.upcoming) == (0, 0, (0, 0))
    first = [next(sampler) for _ in range(BATCHES - 1)]
    rest = list(sampler)  # the rest of epoch 0 only
    assert len(first) + len(rest) == BATCHES
    assert (sampler.epoch, sampler.position, sampler.upcoming) == (0, BATCHES, (1, 0))
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (0, BATCHES)
    batch = next(sampler)  # next() goes on into epoch 1
    assert (sampler.epoch, sampler.position) == (1, 1)
    assert np.array_equal(batch, sampler.batch_indices(1, 0))
    resumed = make(1)[0]
    resumed.load_state_dict(state)  # saved at the last batch of an epoch: resumes at the next
    assert np.array_equal(next(resumed), batch)


def test_iter_chooses_its_epoch_at_the_first_batch_not_when_called():
    (sampler,) = make(1)
    iterator = iter(sampler)
    for _ in range(BATCHES):
        next(sampler)
    assert len(list(iterator)) == BATCHES  # epoch 1, whole
    assert sampler.epoch == 1


def test_pure_lookups_do_not_move_the_position():
    samplers = make(4)
    whole = samplers[0].global_batch_indices(2, 3)
    parts = [sampler.batch_indices(2, 3) for sampler in samplers]
    assert np.array_equal(np.concatenate(parts), whole)
    assert all((sampler.epoch, sampler.position) == (0, 0) for sampler in samplers)


def test_the_order_is_pinned_across_versions():
    # jaxckpt computes the order itself so that upgrading NumPy (or jaxckpt) between a save and
    # a resume cannot reorder an epoch; a change here is a breaking change of every saved position.
    sampler = IndexSampler(10, 5, seed=0)
    assert [next(sampler).tolist() for _ in range(4)] == [
        [0, 1, 2, 9, 8], [3, 4, 7, 6, 5], [6, 5, 1, 0, 4], [7, 2, 9, 3, 8]]


def test_a_batch_costs_no_work_in_the_dataset_size():
    # No per-epoch table: 10**12 samples would need 8 TB as an int64 permutation.
    sampler = IndexSampler(10**12, 1024, seed=1, process_index=3, process_count=8)
    batch = next(sampler)
    assert batch.shape == (128,) and batch.dtype == np.int64
    assert 0 <= batch.min() and batch.max() < 10**12 and len(set(batch.tolist())) == 128


def test_state_is_json_and_passes_the_driver_codec_unchanged():
    samplers = make(2)
    global_steps(samplers, 3)
    state = samplers[1].state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {"format": "jaxckpt.index_sampler/1", "num_samples": SAMPLES,
                     "global_batch_size": GLOBAL_BATCH, "seed": 5, "shuffle": True,
                     "drop_last": True, "epoch": 0, "position": 3}
    saved = drv.capture_stateful({"data": samplers[1]})
    fresh = make(4)[2]
    drv.restore_stateful({"data": fresh}, saved, "step_2")
    assert (fresh.epoch, fresh.position) == (0, 3)


def test_driver_restores_global_state_from_the_primary_copy():
    primary, other = make(2)
    global_steps([primary, other], 2)
    saved_primary = drv.capture_stateful({"data": primary})
    stale = make(1)[0]  # what a per-process file could hold: not used for a global object
    saved_local = drv.capture_stateful({"data": stale})
    fresh = make(3)[1]
    drv.restore_stateful({"data": fresh}, saved_local, "step_1", primary=saved_primary)
    assert (fresh.epoch, fresh.position) == (0, 2)


BAD_ARGUMENTS = [
    ({"num_samples": 0}, "num_samples must be an int >= 1"),
    ({"num_samples": 10.0}, "num_samples must be an int"),
    ({"global_batch_size": 0}, "global_batch_size must be an int >= 1"),
    ({"global_batch_size": 10, "process_count": 4},
     "global_batch_size=10 is not divisible by process_count=4"),
    ({"process_index": 2, "process_count": 2}, "process_index=2 is out of range"),
    ({"process_count": 0}, "process_count must be an int >= 1"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"seed": 1 << 64}, "seed must fit in 64 bits"),
    ({"shuffle": 1}, "shuffle must be True or False"),
    ({"drop_last": None}, "drop_last must be True or False"),
    ({"num_samples": 8, "global_batch_size": 12}, "larger than num_samples=8"),
]


@pytest.mark.parametrize("overrides,message", BAD_ARGUMENTS, ids=[m for _, m in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_by_name(overrides, message):
    arguments = {"num_samples": SAMPLES, "global_batch_size": GLOBAL_BATCH, **overrides}
    with pytest.raises(ConfigError, match=message):
        IndexSampler(arguments.pop("num_samples"), arguments.pop("global_batch_size"), **arguments)


def test_fill_up_allows_a_batch_larger_than_the_dataset():
    sampler = IndexSampler(3, 8, drop_last=False, shuffle=False)
    assert next(sampler).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


MISMATCHES = [("num_samples", 51), ("seed", 6), ("global_batch_size", 24), ("shuffle", False),
              ("drop_last", False)]


@pytest.mark.parametrize("field,value", MISMATCHES, ids=[f for f, _ in MISMATCHES])
def test_a_state_of_another_order_is_refused_naming_the_field(field, value):
    state = make(1)[0].state_dict()
    arguments = {"num_samples": SAMPLES, "global_batch_size": GLOBAL_BATCH, "seed": 5, field: value}
    sampler = IndexSampler(arguments.pop("num_samples"), arguments.pop("global_batch_size"),
                           **arguments)
    with pytest.raises(ConfigError, match=f"the saved {field} is .* but this sampler has "
                                          f"{field}={value!r}"):
        sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.position) == (0, 0)


BAD_STATES = [
    ({"format": "grain"}, "expected a state with format"),
    ({"epoch": -1}, r"state\['epoch'\] must be an int >= 0"),
    ({"position": 5}, "position=5 is past the end of an epoch"),
    ({"position": "2"}, r"state\['position'\] must be an int"),
]


@pytest.mark.parametrize("change,message", BAD_STATES, ids=[m for _, m in BAD_STATES])
def test_a_damaged_state_is_refused(change, message):
    (sampler,) = make(1)
    with pytest.raises(ConfigError, match=message):
        sampler.load_state_dict({**sampler.state_dict(), **change})


def test_it_is_exported_and_declares_its_state_global():
    assert jaxckpt.IndexSampler is IndexSampler
    assert drv.has_global_state(make(1)[0])
    assert "IndexSampler(num_samples=50, global_batch_size=12, seed=5" in repr(make(1)[0])
