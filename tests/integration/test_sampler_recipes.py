"""The data-position recipes of docs/recipes.md ("Data position across world sizes"): the
IndexSampler as a ``stateful=`` object of both managers, as the ``batch_sampler`` of
torchdata's StatefulDataLoader, and the grain and torchdata behaviours the page states about
a changed process count (pinned here so the page stays true when those libraries change).
The page's code blocks themselves run in tests/system/test_doc_blocks.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import jaxckpt
from jaxckpt import Every, IndexSampler, RecoverConfig, StepInfo

from support.harness import repo_env

grain = pytest.importorskip("grain")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader


def sampler(**kwargs) -> IndexSampler:
    return IndexSampler(40, 8, seed=3, **kwargs)


def save_then_recover(manager_class, root, state, like):
    """Save after 3 batches with one manager, recover into a fresh sampler with another."""
    trained = sampler()
    for _ in range(3):
        next(trained)
    config = RecoverConfig(every=Every(steps=1000))
    with manager_class(root, recover=config) as mgr:
        mgr.save(StepInfo(0, 2, 2, len(trained)), state, stateful={"data": trained})
    fresh = sampler()
    with manager_class(root, recover=config) as mgr:
        recovered = mgr.recover(like, stateful={"data": fresh})
    assert recovered is not None and recovered.step_info.global_step == 2
    assert np.array_equal(next(fresh), next(trained))


def test_the_sampler_is_a_stateful_object_of_the_jax_manager(tmp_path):
    state = {"w": np.arange(4, dtype=np.float32)}
    save_then_recover(jaxckpt.CheckpointManager, tmp_path / "jax", state, state)


def test_the_sampler_is_a_stateful_object_of_the_torch_manager(tmp_path):
    from torch_bridge import DcpCheckpointManager

    save_then_recover(DcpCheckpointManager, tmp_path / "torch", {"w": torch.arange(4.0)},
                      {"w": torch.zeros(4)})


# Run in a fresh interpreter: DataLoader workers fork, and a fork of a process that has
# started jax's threads (other tests here do) may deadlock.
_WORKER_CHECKS = """
from torchdata.stateful_dataloader import StatefulDataLoader
from jaxckpt import IndexSampler

def sampler():
    return IndexSampler(40, 8, seed=3)

if __name__ == "__main__":
    dataset = list(range(40))
    # Same world size and worker count: torchdata snapshots the sampler's state with each
    # batch it yields, so what the workers read ahead is not lost.
    reference = [b.tolist() for b in StatefulDataLoader(dataset, batch_sampler=sampler())]
    loader = StatefulDataLoader(dataset, batch_sampler=sampler(), num_workers=2)
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(2)]
    state = loader.state_dict()
    del iterator
    resumed = StatefulDataLoader(dataset, batch_sampler=sampler(), num_workers=2)
    resumed.load_state_dict(state)
    assert first + [b.tolist() for b in resumed] == reference, "not resumed exactly"
    # Another worker count: refused when the iterator is made.
    other = StatefulDataLoader(dataset, batch_sampler=sampler(), num_workers=1)
    other.load_state_dict(state)
    try:
        next(iter(other))
    except AssertionError:
        print("worker count refused")
"""


def test_stateful_data_loader_resumes_an_index_sampler_with_workers_and_refuses_another_count(
        tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(_WORKER_CHECKS)
    result = subprocess.run([sys.executable, str(script)], check=False, env=repo_env(),
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines() == ["worker count refused"], result.stdout


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2)], ids=["grows", "shrinks"])
def test_stateful_distributed_sampler_loads_a_count_of_another_world_size_silently(before, after):
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    dataset = list(range(24))

    def loaders(world):
        return [StatefulDataLoader(dataset, batch_size=2, sampler=StatefulDistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)) for rank in range(world)]

    old = loaders(before)
    iterators = [iter(loader) for loader in old]
    seen = [index for it in iterators for index in next(it).tolist()]  # one batch a rank
    states = [loader.state_dict() for loader in old]
    assert {state["_sampler_iter_state"]["sampler_state"]["yielded"] for state in states} == {2}
    new = loaders(after)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning
        for rank, loader in enumerate(new):  # a new rank borrows a state: no error either
            loader.load_state_dict(states[rank % before])
    rest = [index for loader in new for batch in loader for index in batch.tolist()]
    never = set(dataset) - set(seen) - set(rest)
    twice = set(seen) & set(rest)
    if after > before:  # each new rank skips 2 of its own deal: more than the world read
        assert len(rest) < len(dataset) - len(seen) and never and not twice
    else:
        assert len(rest) > len(dataset) - len(seen) and twice and not never


def grain_loader(shard_index, shard_count, worker_count=0):
    options = grain.sharding.ShardOptions(shard_index=shard_index, shard_count=shard_count,
                                          drop_remainder=True)
    index_sampler = grain.samplers.IndexSampler(num_records=20, shard_options=options,
                                                shuffle=True, seed=3, num_epochs=1)
    return grain.DataLoader(data_source=list(range(20)), sampler=index_sampler,
                            worker_count=worker_count)


def test_grain_shards_before_it_shuffles():
    # Process 1 of 2 reads only the second contiguous half of the records.
    assert sorted(grain_loader(1, 2)) == list(range(10, 20))


def test_grain_data_loader_refuses_a_state_of_another_process_count():
    iterator = iter(grain_loader(1, 2))
    next(iterator)
    state = iterator.get_state()
    with pytest.raises(ValueError, match="Sampler in checkpoint does not match"):
        iter(grain_loader(1, 4)).set_state(state)


def test_grain_data_loader_refuses_a_state_of_another_worker_count():
    iterator = iter(grain_loader(0, 1))
    next(iterator)
    state = iterator.get_state()
    with pytest.raises(ValueError, match="Worker count in checkpoint does not match"):
        grain_loader(0, 1, worker_count=1)._validate_state(  # what set_state checks first
            json.loads(state))


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2)], ids=["grows", "shrinks"])
def test_grain_dataset_iterator_state_loads_under_another_slicing_silently(before, after):
    dataset = grain.MapDataset.source(list(range(40))).shuffle(seed=3)
    order = list(dataset)
    old = [iter(dataset[rank::before].to_iter_dataset()) for rank in range(before)]
    for iterator in old:
        for _ in range(3):
            next(iterator)
    states = [iterator.get_state() for iterator in old]
    assert states == [{"next_index": 3}] * before  # no trace of the process count
    new = [iter(dataset[rank::after].to_iter_dataset()) for rank in range(after)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning
        for rank, iterator in enumerate(new):
            iterator.set_state(states[rank % before])
    following = [next(iterator) for iterator in new]
    # The old processes read order[:3 * before]; the new ones go on at order[3 * after].
    assert following == order[3 * after:3 * after + after]
    seen = set(order[:3 * before])
    rest = following + [element for iterator in new for element in iterator]
    if after > before:
        assert set(order) - seen - set(rest) == set(order[3 * before:3 * after])  # never read
    else:
        assert seen & set(rest) == set(order[3 * after:3 * before])  # read twice
