"""Real data loaders as ``stateful`` objects, with no user glue: grain and torchdata."""

import jax
import jax.numpy as jnp
import pytest

from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo

STATE = {"w": jnp.zeros((4,), jnp.float32)}
LIKE = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}


def save_then_resume(tmp_path, make_iter, take):
    it = make_iter()
    consumed = [take(it) for _ in range(5)]
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 4, 4), STATE, stateful={"loader": it})
    expected = [take(it) for _ in range(6)]
    fresh = make_iter()
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(LIKE, stateful={"loader": fresh})
    resumed = [take(fresh) for _ in range(6)]
    return consumed, expected, resumed


def test_grain_dataset_iterator_resumes_exactly(tmp_path):
    grain = pytest.importorskip("grain")
    ds = grain.MapDataset.range(40).shuffle(seed=3).map(lambda x: x * 2).to_iter_dataset()
    _, expected, resumed = save_then_resume(tmp_path, lambda: iter(ds), next)
    assert resumed == expected


def test_grain_dataloader_iterator_with_bytes_state_resumes_exactly(tmp_path):
    grain = pytest.importorskip("grain")

    def make():
        sampler = grain.samplers.IndexSampler(30, shuffle=True, seed=1, num_epochs=1)
        return iter(grain.DataLoader(data_source=list(range(30)), sampler=sampler, worker_count=0))

    _, expected, resumed = save_then_resume(tmp_path, make, next)
    assert resumed == expected


def test_torchdata_stateful_dataloader_resumes_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.arange(64, dtype=torch.float32).reshape(32, 2)

    class Wrapper:
        """Holds the loader and its live iterator, as a training loop does."""

        def __init__(self):
            torch.manual_seed(0)
            gen = torch.Generator().manual_seed(5)
            self.loader = sdl.StatefulDataLoader(data, batch_size=3, shuffle=True, generator=gen)
            self.it = iter(self.loader)

        def state_dict(self):
            return self.loader.state_dict()

        def load_state_dict(self, state):
            self.loader.load_state_dict(state)
            self.it = iter(self.loader)

    def take(w):
        return next(w.it).tolist()

    _, expected, resumed = save_then_resume(tmp_path, Wrapper, take)
    assert resumed == expected


def test_torchdata_stateful_dataloader_directly_as_stateful(tmp_path):
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.arange(40)
    loader = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True,
                                    generator=torch.Generator().manual_seed(2))
    it = iter(loader)
    [next(it) for _ in range(3)]
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 2, 2), STATE, stateful={"loader": loader})
    expected = [next(it).tolist() for _ in range(4)]
    fresh = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True,
                                   generator=torch.Generator().manual_seed(99))
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(LIKE, stateful={"loader": fresh})
    it2 = iter(fresh)
    assert [next(it2).tolist() for _ in range(4)] == expected


def shuffled_batches(torch, loader, iterator, count):
    """``count`` batches from ``iterator``, a new epoch's iterator wherever one ends."""
    out = []
    while len(out) < count:
        batch = next(iterator, None)
        if batch is None:
            iterator = iter(loader)
            continue
        out.append(batch.tolist())
    return out, iterator


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own
@pytest.mark.parametrize("saved_at", [3, 5], ids=["mid-epoch", "epoch-end"])
def test_torchdata_loader_sharing_its_generator_with_shuffle_resumes_later_epochs(tmp_path,
                                                                                  saved_at):
    # shuffle=True hands the loader's generator to its RandomSampler: each epoch's iterator
    # draws the permutation and then the base seed from it. torchdata's own state replays
    # the permutation but not the base seed, so without the generator saved beside it every
    # later epoch was shuffled differently (README's PyTorch program, issue 28).
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    data = torch.arange(40)

    def make(seed):
        return sdl.StatefulDataLoader(data, batch_size=8, shuffle=True, drop_last=True,
                                      generator=torch.Generator().manual_seed(seed))

    loader = make(1)
    _, iterator = shuffled_batches(torch, loader, iter(loader), saved_at)
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, saved_at - 1, saved_at - 1), STATE, stateful={"loader": loader})
    expected, _ = shuffled_batches(torch, loader, iterator, 15)  # three more epochs

    fresh = make(99)
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(LIKE, stateful={"loader": fresh})
    resumed, _ = shuffled_batches(torch, fresh, iter(fresh), 15)
    assert resumed == expected
    assert torch.equal(fresh.generator.get_state(), loader.generator.get_state())


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_torchdata_loader_samplers_that_cannot_resume_exactly_are_refused(tmp_path):
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from jaxckpt import ConfigError

    data = torch.arange(40)
    torch_sampler = sdl.StatefulDataLoader(
        data, batch_size=4, sampler=torch.utils.data.RandomSampler(
            data, generator=torch.Generator().manual_seed(0)))
    shared = torch.Generator().manual_seed(1)
    replacement = sdl.StatefulDataLoader(
        data, batch_size=4, generator=shared,
        sampler=sdl.sampler.RandomSampler(data, replacement=True, generator=shared))
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        with pytest.raises(ConfigError, match=r"stateful\['loader'\].*torch.utils.data."
                                              r"RandomSampler.*shuffle=True"):
            mgr.recover(LIKE, stateful={"loader": torch_sampler})
        with pytest.raises(ConfigError, match=r"replacement=True.*its own generator"):
            mgr.save(StepInfo(), STATE, stateful={"loader": replacement})


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_torchdata_loader_over_distributed_sampler_resumes_after_set_epoch(tmp_path):
    # DistributedSampler orders an epoch by the epoch the loop sets (set_epoch) before
    # iter(loader): the restored iterator must be made by that iter(), not by recover().
    torch = pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from torch.utils.data.distributed import DistributedSampler

    data = torch.arange(40)

    def make():
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4)
        return sdl.StatefulDataLoader(data, batch_size=8, sampler=sampler,
                                      generator=torch.Generator().manual_seed(5))

    loader = make()
    loader.sampler.set_epoch(1)
    iterator = iter(loader)
    next(iterator)
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(1, 0, 5), STATE, stateful={"loader": loader})
    expected = [batch.tolist() for batch in iterator]

    fresh = make()
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(LIKE, stateful={"loader": fresh})
    fresh.sampler.set_epoch(1)
    assert [batch.tolist() for batch in iter(fresh)] == expected
